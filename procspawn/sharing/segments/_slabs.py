"""Slabs: small arrays carved out of larger segments.

A segment costs a descriptor (file_descriptor) and a mapping in every process that maps
it, so a consumer holding 100,000 small shared arrays would need 100,000 of each. Arrays
under ``PROCSPAWN_SLAB_THRESHOLD`` bytes (default 262144; 0 turns slabs off) are instead
carved, 64-byte aligned, out of a slab: a segment made by the current built-in strategy.
A receiver maps each slab once, like any segment, so 100,000 live 256-byte arrays cost a
few slabs: a few descriptors and mappings.

A process's first slab is just large enough for its first small array (whole pages), and
each slab that fills makes the next twice as large, up to ``PROCSPAWN_SLAB_BYTES``
(default 4 MiB, at least four times the threshold); a slab let go before it filled is
followed by one of the same size. So a process that sends one small array and ends (a
pool worker with ``maxtasksperchild=1``, a short-lived rank) leaves its receiver a
segment the size of that array, not 4 MiB (``file_system`` reserves a segment's whole
size in /dev/shm), and a producer of many small arrays reaches the full size after a
dozen slabs.

Space in a slab is handed out once, front to back, and never reused: every array starts
on zeroed memory, and no two arrays overlap. A slab is an ordinary segment under the
lifetime rule: it is held by the arrays over it (in any process) and by messages in
flight. The allocator holds the slab it is filling for as long as arrays keep being
carved, and for ``PROCSPAWN_SLAB_LINGER`` seconds (default 1) after the last: a producer
that makes, sends and drops small arrays in a loop fills one slab instead of making one
per array (which would cost its consumer a descriptor and a mapping per array again).
Then it holds it only weakly, so once no array in a slab is alive anywhere, its memory
goes back within a second or so, whether or not it was full. Each array is built over a
``Block`` of its own bytes, so it, its views and its ``.base`` never reach a neighbour.

Per process: a child made by fork starts with no slab (carving on from the parent's
would hand out the same bytes twice).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref

from ... import _settings
from . import _strategy
from ._segment import Block, Segment

_ALIGN = 64


def threshold() -> int:
    """Arrays under this many bytes are carved from slabs (``PROCSPAWN_SLAB_THRESHOLD``)."""
    return int(_settings.get("PROCSPAWN_SLAB_THRESHOLD"))


def _slab_bytes() -> int:
    return max(int(_settings.get("PROCSPAWN_SLAB_BYTES")), 4 * threshold())


def _linger() -> float:
    return float(_settings.get("PROCSPAWN_SLAB_LINGER"))


# strategy name -> (the slab being filled, held weakly; the next free offset in it)
_filling: dict[str, tuple[weakref.ref[Segment], int]] = {}
_size: dict[str, int] = {}  # strategy name -> the size of this process's next slab
_lock = threading.Lock()
_held: dict[
    str, Segment
] = {}  # the same slabs, held until PROCSPAWN_SLAB_LINGER after the last carve
_last_carve = 0.0
_keeper: threading.Thread | None = None


def carve(nbytes: int) -> Block | None:
    """A Block of ``nbytes`` zeroed bytes in a slab, or None when the array should get a
    segment of its own (too large, empty, slabs off, or a strategy not built in)."""
    global _last_carve, _keeper
    if not 0 < nbytes < threshold():
        return None
    name = _strategy.get_sharing_strategy()
    if name not in _strategy.BUILTIN:
        return None  # a custom strategy's segments are its own business
    with _lock:
        slab, free = None, 0
        entry = _filling.get(name)
        if entry is not None:
            slab, free = entry[0](), entry[1]
        if slab is None or free + nbytes > slab.size:
            slab, free = _strategy.allocate(_next_size(name, slab, nbytes)), 0
        _filling[name] = (weakref.ref(slab), -(-(free + nbytes) // _ALIGN) * _ALIGN)
        _held[name] = slab
        _last_carve = time.monotonic()
        if _keeper is None:
            _keeper = threading.Thread(target=_let_go_when_idle, name="procspawn-slabs")
            _keeper.daemon = True
            _keeper.start()
        return Block(slab, free, nbytes)


def _next_size(name: str, full: Segment | None, nbytes: int) -> int:
    """The size of the next slab for ``nbytes``: twice the last one's when it is ``full``
    (up to PROCSPAWN_SLAB_BYTES), the same when it was let go; at least ``nbytes``, in
    whole pages. Called under the lock."""
    size = _size.get(name, 0)
    if full is not None:
        size = min(2 * full.size, _slab_bytes())
    size = max(size, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    _size[name] = size
    return size


def _let_go_when_idle() -> None:
    """Hold the slabs being filled until PROCSPAWN_SLAB_LINGER passed without a carve, then stop."""
    global _keeper
    while True:
        with _lock:
            idle = time.monotonic() - _last_carve
            if idle >= _linger():
                released = list(_held.values())
                _held.clear()
                _keeper = None
                break
        time.sleep(_linger() - idle + 0.01)
    del released  # outside the lock: the last reference may unmap the slab


def trim() -> None:
    """Let go of the slabs being filled now (``sharing.trim``)."""
    with _lock:
        released = list(_held.values())
        _held.clear()
    del released


def _reset_after_fork() -> None:
    global _lock, _keeper
    _filling.clear()
    _held.clear()
    _size.clear()  # a new process starts small again
    _lock = threading.Lock()
    _keeper = None


os.register_at_fork(after_in_child=_reset_after_fork)
