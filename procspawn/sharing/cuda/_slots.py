"""Who holds a block of device memory that procspawn did not allocate (``cuda_ipc``):
seed 002's counters, in host shared memory, with deaths seen.

A producer that sends an array over memory it allocated with ``cudaMalloc`` (CuPy's pool)
cannot give that memory a lifetime of the kernel's, as ``cuda_fd`` does: the memory is its
own, and must stay allocated while any receiver maps it. So:

* **blocks**: the producer keeps what holds the memory (CuPy's chunk object) under a block
  number per allocation, for as long as a slot names the block;
* **slots**: each send takes a slot (``SENT``) in a slab, a small memfd segment of
  ``SLOTS`` rows ``(state, block, holder pid, holder start time)``, which travels with the
  message as any host segment does; the receiver writes itself in (``HELD``) and frees
  the slot (``FREE``) once it has closed its mapping. One slot has one writer at a time,
  so plain stores suffice; slots are taken under a POSIX record lock on the slab, so a
  process that forwards a received array takes one in the producer's own slab;
* **limbo and sweep**: a block whose arrays the producer dropped stays while a slot names
  it; ``sweep()`` frees slots whose holder died (its pid gone, or reused: the start time
  differs), then lets go of every block no slot names. It runs at sends, every second from
  a thread while blocks are kept, and at ``sharing.cuda.collect()``. Once no block is
  kept, the slabs go too.

What no sweep can see: a message sent and never received (its slot stays ``SENT``, as in
torch) until the producer exits. Standard library and NumPy only: no CUDA here, so all of
it is tested without a GPU.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Hashable

import numpy as np

from ..daemon._table import start_time
from ..segments import _mapcache, _strategy
from ..segments._segment import Segment

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

SLOTS = 4096
FREE, SENT, HELD = 0, 1, 2
STATE, BLOCK, PID, TICKS = 0, 1, 2, 3
SWEEP_EVERY = 1.0  # seconds, while blocks are kept

_lock = threading.RLock()
_own: list[Segment] = []  # this process' slabs
_blocks: dict[int, dict[int, Any]] = {}  # block -> {id(keepalive): keepalive}
_block_of: dict[Hashable, int] = {}  # allocation -> its block, while kept
_next_block = 1
_sweeper: threading.Thread | None = None
_me: tuple[int, int] | None = None  # (pid, start time) of this process


def view(slab: Segment) -> np.ndarray:
    """The slots of ``slab`` as an int64 array of ``(SLOTS, 4)``."""
    slots: np.ndarray = np.ndarray((SLOTS, 4), np.int64, buffer=np.asarray(slab))
    return slots


def identity() -> tuple[int, int]:
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, start_time(pid) or 0)
    return _me


class _Locked:
    """The slab's record lock (per process, so it excludes every other process that maps
    the slab, whatever descriptor it has) inside this process' own lock (per thread)."""

    def __init__(self, slab: Segment) -> None:
        self.fd = slab.fd

    def __enter__(self) -> None:
        _lock.acquire()
        fcntl.lockf(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)
        _lock.release()


def new_slab() -> Segment:
    """A new slab of this process (all slots FREE)."""
    strategy = _strategy.strategy_named("file_descriptor")
    assert strategy is not None
    slab = strategy.allocate(SLOTS * 4 * 8)
    with _mapcache.lock():
        _mapcache.remember(slab)
    return slab


def keep(allocation: Hashable, keepalive: Any) -> int:
    """Keep ``keepalive`` (what holds the memory) under the block of ``allocation`` until no
    slot names it; returns the block. Call with ``lock()`` held, and take the send's slot
    before letting go of it (a sweep in between would let go of a block no slot names)."""
    global _next_block
    block = _block_of.get(allocation)
    if block is None or block not in _blocks:
        block = _next_block
        _next_block += 1
        _block_of[allocation] = block
        _blocks[block] = {}
    _blocks[block][id(keepalive)] = keepalive
    _start_sweeper()
    return block


def keepalives(block: int) -> dict[int, Any] | None:
    """What keeps the memory of ``block`` (this process' own), or None if it was let go:
    an array rebuilt over that memory holds it."""
    with _lock:
        return _blocks.get(block)


def lock() -> threading.RLock:
    """Held around ``keep`` and the ``take`` of the same send."""
    return _lock


def take(block: int, slab: Segment | None = None) -> tuple[Segment, int] | None:
    """A slot ``SENT`` for ``block``: in ``slab`` (a forwarder, in the producer's slab;
    None when it is full), or in one of this process' slabs (a new one if all are
    full)."""
    if slab is not None:
        index = _take_in(slab, block)
        return None if index is None else (slab, index)
    with _lock:
        for own in _own:
            index = _take_in(own, block)
            if index is not None:
                return own, index
        slab = new_slab()
        _own.append(slab)
        index = _take_in(slab, block)
        assert index is not None
        return slab, index


def _take_in(slab: Segment, block: int) -> int | None:
    with _Locked(slab):
        slots = view(slab)
        free = np.flatnonzero(slots[:, STATE] == FREE)
        if not len(free):
            return None
        index = int(free[0])
        slots[index, BLOCK] = block
        slots[index, PID] = os.getpid()
        slots[index, TICKS] = 0
        slots[index, STATE] = SENT
        return index


def hold(slab: Segment, index: int) -> None:
    """The receiver of a slot's message writes itself in (then ``HELD``)."""
    pid, ticks = identity()
    slots = view(slab)
    slots[index, PID] = pid
    slots[index, TICKS] = ticks
    slots[index, STATE] = HELD


def free(slab: Segment, index: int) -> None:
    """Its holder (or the sender of a message never received) lets go of a slot."""
    view(slab)[index, STATE] = FREE


def sweep() -> int:
    """Free the slots of dead holders in this process' slabs, then let go of every block
    no slot names; returns how many blocks were let go."""
    alive: dict[int, int | None] = {}
    with _lock:
        if not _blocks:
            return 0
        named: set[int] = set()
        for slab in _own:
            with _Locked(slab):
                slots = view(slab)
                for index in np.flatnonzero(slots[:, STATE] == HELD):
                    pid = int(slots[index, PID])
                    if pid not in alive:
                        alive[pid] = start_time(pid)
                    if alive[pid] != slots[index, TICKS]:
                        slots[index, STATE] = FREE  # its holder died: the driver closed it
                named.update(slots[slots[:, STATE] != FREE, BLOCK].tolist())
        gone = [block for block in _blocks if block not in named]
        dropped: list[Any] = [_blocks.pop(block) for block in gone]
        for allocation in [a for a, block in _block_of.items() if block in gone]:
            del _block_of[allocation]
        if not _blocks:  # every slot is free: the slabs go too (the next send makes one)
            dropped.append(list(_own))
            _own.clear()
    del dropped  # (outside the lock: letting go may free memory)
    return len(gone)


def counts() -> dict[str, int]:
    """Slots of this process' slabs by state, and the blocks kept (for ``procspawn info``)."""
    with _lock:
        out = {"sent": 0, "held": 0, "blocks": len(_blocks)}
        for slab in _own:
            states = view(slab)[:, STATE]
            out["sent"] += int((states == SENT).sum())
            out["held"] += int((states == HELD).sum())
        return out


def _start_sweeper() -> None:
    global _sweeper
    if _sweeper is None or not _sweeper.is_alive():
        _sweeper = threading.Thread(
            target=_sweep_while_kept, args=(_generation,), name="procspawn-gpu-sweep"
        )
        _sweeper.daemon = True
        _sweeper.start()


def _sweep_while_kept(generation: int) -> None:
    global _sweeper
    stop = threading.Event()
    while not stop.wait(SWEEP_EVERY):
        if generation != _generation:
            return  # everything was reset: a new sweeper serves what comes
        sweep()
        with _lock:
            if not _blocks and generation == _generation:
                _sweeper = None
                return


_generation = 0  # bumped by every reset: a sweeper of an earlier one stops


def reset() -> None:
    """Forget this process' slabs and blocks (under the lock: a sweep in progress finishes
    first). For a fresh start within a process; a forked child gets ``_reset_after_fork``."""
    global _sweeper, _next_block, _generation
    with _lock:
        _own.clear()
        _blocks.clear()
        _block_of.clear()
        _sweeper = None
        _next_block = 1
        _generation += 1


def _reset_after_fork() -> None:
    # the parent's slabs and blocks are the parent's: a forked child sends its own (its
    # lock is new: another thread of the parent may have held the old one)
    global _lock
    _lock = threading.RLock()
    reset()


os.register_at_fork(after_in_child=_reset_after_fork)
