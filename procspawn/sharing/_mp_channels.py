"""Shared arrays through multiprocessing's own channels (the fallback for stdlib queues).

procspawn's channels carry descriptors inside each message. A stdlib ``multiprocessing``
channel (its Queue, Pipe, Pool, ``Process(args=...)``, ``concurrent.futures``) cannot, so
an array in a procspawn segment that goes through one of those is sent the way
``multiprocessing`` sends descriptors, with ``multiprocessing.reduction.DupFd``:

* while a process is being started (its arguments), the descriptor is handed to the new
  process by the start method itself;
* at any other time, multiprocessing's ``resource_sharer`` thread in the sender keeps a
  duplicate until the receiver connects back for it: the sender must still be alive
  when the array is received (procspawn's own channels do not have that limit).

``file_system`` segments need no descriptor: the handle is the name, and the message
holds a reference of its own, which the receiver adopts (one that is never received is
freed when the process tree's cleanup daemon exits). Arrays of custom strategies are
copied, as NumPy pickles them.

This is installed with multiprocessing's documented hook, ``ForkingPickler.register``,
for ``numpy.ndarray``; every array outside procspawn's segments pickles exactly as NumPy
pickles it.
"""

from __future__ import annotations

import os
import weakref
from multiprocessing.context import get_spawning_popen  # type: ignore[attr-defined]
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import numpy as np

from . import _pickler, _strategy
from ._segment import Segment, cache_lock, cached, segment_of

_NUMPY_PROTOCOL = 4  # what ForkingPickler's default protocol gets from NumPy on 3.10-3.13


def _reduce(array: np.ndarray) -> Any:
    found = segment_of(array)
    handle = _handle(found[0]) if found is not None else None
    if handle is None:
        return array.__reduce_ex__(_NUMPY_PROTOCOL)
    from . import _reductions  # not at the top: _reductions installs this module

    return (
        _rebuild,
        (
            handle,
            found[1],  # type: ignore[index]
            array.shape,
            array.strides,
            _reductions.dtype_code(array.dtype),
            array.flags.writeable,
        ),
    )


def _handle(segment: Segment) -> tuple[str, Any, Any, Any] | None:
    """(strategy, key, the strategy's handle, DupFd or None), or None to copy."""
    if segment.strategy not in ("file_descriptor", "file_system"):
        return None
    strategy = _strategy.strategy_named(segment.strategy)
    assert strategy is not None
    state = _pickler._SendState(inflight=True)
    previous = getattr(_pickler._local, "send", None)
    _pickler._local.send = state
    try:
        handle = strategy.reduce(segment)
    finally:
        _pickler._local.send = previous
    dupfd = _dupfd(state.fds[0]) if state.fds else None
    return (segment.strategy, segment.key, handle, dupfd)


# While a process starts, one DupFd per descriptor: the start method hands each one it is
# given to the child, and refuses the same descriptor twice (two views of one segment).
_starting: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


def _dupfd(fd: int) -> Any:
    popen = get_spawning_popen()
    if popen is None:
        return DupFd(fd)  # resource_sharer: a duplicate of its own each time
    given = _starting.setdefault(popen, {})
    if fd not in given:
        given[fd] = DupFd(fd)
    return given[fd]


def _rebuild(handle: tuple[str, Any, Any, Any], *layout: Any) -> np.ndarray:
    """The received array: ``layout`` as ``_reductions.array_over`` takes it."""
    name, key, strategy_handle, dupfd = handle
    fds = [_detach(dupfd)] if dupfd is not None else []
    with cache_lock():
        live = cached(name, key)
        if live is not None and fds and live.fd == fds[0]:
            # spawn hands a descriptor to the child under its own number, once per array
            # that refers to it: this one is the descriptor the live segment owns already
            fds.clear()
    state = _pickler._RecvState(fds)
    previous = getattr(_pickler._local, "recv", None)
    _pickler._local.recv = state
    try:
        segment = _strategy._rebuild_segment(name, None, key, strategy_handle)
    finally:
        _pickler._local.recv = previous
        for fd in fds:
            if fd >= 0:  # not taken by the segment
                os.close(fd)
    from . import _reductions

    return _reductions.array_over(segment, *layout)


def _detach(dupfd: Any) -> int:
    try:
        fd: int = dupfd.detach()
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"a shared array came through a multiprocessing (stdlib) channel, but its "
            f"shared-memory descriptor could not be fetched from the process that sent it "
            f"({exc}): that process has probably exited. Over stdlib channels the sender "
            f"must live until the array is received; procspawn's own channels "
            f"(procspawn.Queue, Pipe, SimpleQueue, Pool) carry the descriptor inside the "
            f"message and have no such limit.",
        ) from exc
    return fd


def install() -> None:
    """Make multiprocessing's pickler send arrays in procspawn segments as handles."""
    ForkingPickler.register(np.ndarray, _reduce)
