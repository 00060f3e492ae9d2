"""Ordering: a receiver sees every write the sender's stream had queued before the send.

At each send of a GPU array the sender records an interprocess event on its current
stream (on the array's device) and sends the event's handle; at each receipt the receiver
makes its current stream wait for it, every time, not only the first (a receiver that
maps the memory already still waits for the new send's event).

An event is recorded again only once its previous record has completed, so a receiver
that opens an old handle late waits for a later point of the sender's work, never an
earlier one. Past ``_MOST`` events in flight the sender synchronises its stream instead
and sends no event. A receiver opens each handle once (a cache), and waits on its own
events when a message comes back to the process that sent it.
"""

from __future__ import annotations

import collections
import os
import threading

import cupy

from ..._late import renew_lock_in_child

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

_MOST = 4096  # events per device in flight at once
_lock = threading.Lock()
renew_lock_in_child(globals())
# device -> (event, its handle), oldest record first
_ring: dict[int, collections.deque[tuple[Any, bytes]]] = {}
_count: dict[int, int] = {}
_mine: dict[bytes, Any] = {}  # handle -> this process' own event
_opened: dict[tuple[int, int, bytes], int] = {}  # (sender pid, device, handle) -> event


def _reset_after_fork() -> None:
    # a forked child has no CUDA of its own from its parent: nothing here is its own
    _ring.clear()
    _count.clear()
    _mine.clear()
    _opened.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def record(device: int) -> tuple[int, bytes] | None:
    """An event recorded now on the current stream of ``device`` (the current device):
    ``(this pid, its handle)``, or None after synchronising the stream (too many in
    flight)."""
    stream = cupy.cuda.get_current_stream()
    with _lock:
        ring = _ring.setdefault(device, collections.deque())
        if ring and ring[0][0].done:
            entry = ring.popleft()
        elif _count.get(device, 0) < _MOST:
            event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
            entry = (event, bytes(cupy.cuda.runtime.ipcGetEventHandle(event.ptr)))
            _count[device] = _count.get(device, 0) + 1
            _mine[entry[1]] = event
        else:
            entry = None
        if entry is not None:
            entry[0].record(stream)
            ring.append(entry)
    if entry is None:
        stream.synchronize()
        return None
    return os.getpid(), entry[1]


def wait(sent: tuple[int, bytes] | None, device: int) -> None:
    """Make the current stream of ``device`` (the current device) wait for the sender's
    event ``sent`` (what ``record`` returned there)."""
    if sent is None:
        return  # the sender synchronised its stream before sending
    pid, handle = sent
    stream = cupy.cuda.get_current_stream()
    if pid == os.getpid():
        event = _mine.get(handle)
        if event is not None:
            stream.wait_event(event)
        return
    key = (pid, device, handle)
    with _lock:
        pointer = _opened.get(key)
    if pointer is None:
        try:
            pointer = cupy.cuda.runtime.ipcOpenEventHandle(handle)
        except cupy.cuda.runtime.CUDARuntimeError:
            # The sender exited: its context is gone, and with it the work it had queued
            # (the memory of a cuda_fd segment stays, with what was written to it).
            return
        with _lock:
            _opened[key] = pointer
    cupy.cuda.runtime.streamWaitEvent(stream.ptr, pointer, 0)
