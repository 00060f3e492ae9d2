"""Recycled segments: segments that carried a copy, kept for the next send.

Sending an array that is not in shared memory copies it into a new segment (see
``_reductions``). For a large array, making that segment costs more than the copy: the
kernel allocates and zeroes every page as the copy first touches it, and frees them all
once the receiver drops the array. So the segment a send made is kept by the process that
made it once every holder everywhere has let go, and the next send of a fitting size
copies into it, its pages already in place.

Who else holds it? That is a strategy's question (``Kind.nobody_else``):

* ``file_descriptor``: the kernel knows. For a memfd it counts the files open for writing
  (``i_writecount``): the file ``memfd_create`` returns is not counted, a reopen through
  ``/proc/self/fd`` is. A recycled memfd is kept through one reopened file of its maker's;
  every message that carries it carries a reopen of its own, which the message holds
  while in flight and each receiver while it maps it (a mapping holds its file; receivers
  pass on what they received). A write lease (``F_SETLEASE``) is granted only when the
  counted files are exactly the caller's own: that is the test that no message and no
  process still holds the segment. It cannot be fooled by a receiver killed with SIGKILL,
  or by a message that is never read: the kernel drops their files. A self-test at first
  use checks these semantics on the running kernel, and recycling stays off if any differs.
* ``file_system``: the segment's table of holders knows (see ``daemon._table``). The
  maker stays a holder of the name while it keeps it for reuse (so the daemon frees it if the
  maker dies), and it is free when, under the table's lock, the maker is its only holder:
  every receiver adds itself before it maps and takes itself out after it unmaps (the
  daemon does that for one that was killed), and every message holds a slot of its own.

A fork copies the maker's mappings without a file or a slot of their own, so a segment
alive at a fork is never reused.

Memory kept on purpose is explicit, bounded, visible and trimmable:

* only segments made to carry a copy at a send are kept, never one the user holds an array
  over (``sharing.zeros``, ``share_memory_``), and none smaller than 256 KiB (those go in
  slabs);
* at most ``PROCSPAWN_POOL_BYTES`` bytes (default: a sixteenth of the memory this process
  may use, at most 1 GiB; 0 turns recycling off) in at most 64 segments, counting those
  still held elsewhere; of these, ``file_system`` segments (which live in /dev/shm, 64 MiB
  in a default container) at most a quarter of /dev/shm;
* a segment nobody reused for ``PROCSPAWN_POOL_IDLE`` seconds (default 5) is given back:
  a one-off large send keeps nothing for long;
* a kept segment is mapped ``PROT_NONE``: ``---s`` in ``/proc/<pid>/maps``, which is how
  ``procspawn info`` shows it (and a stray pointer into it faults instead of writing);
* ``procspawn.sharing.trim()`` gives everything back, and so does running short of memory
  or descriptors when a segment is made (then the allocation is tried once more).
"""

from __future__ import annotations

import collections
import fcntl
import functools
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import util

from ... import _settings
from ..._late import late_import
from ._segment import Segment, map_fd

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

MIN_BYTES = 256 * 1024
MAX_SEGMENTS = 64
_PROT_NONE = 0
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)

_libc: Any = None  # libc's mprotect and munmap, through ctypes: see _lib()


def _lib() -> Any:
    """libc, loaded at the first use (ctypes is ~1.5 ms of the start of a process that
    may never recycle a segment)."""
    global _libc
    if _libc is None:
        ctypes = late_import("ctypes")  # (from any thread: see _late)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


@functools.cache
def _default_limit() -> int:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            memory = min(memory, int(f.read()))
    except (OSError, ValueError):  # no cgroup v2 limit ("max")
        pass
    return min(1 << 30, memory // 16)


def limit() -> int:
    """The most bytes a process keeps (``PROCSPAWN_POOL_BYTES``, read at first use)."""
    value = _settings.get("PROCSPAWN_POOL_BYTES")
    return _default_limit() if value is None else int(value)


def idle() -> float:
    """Seconds a segment nobody reuses is kept (``PROCSPAWN_POOL_IDLE``)."""
    return float(_settings.get("PROCSPAWN_POOL_IDLE"))


class Kind:
    """What recycling needs of a strategy's segments (one instance per strategy)."""

    name = ""

    def limit(self) -> int:
        """Most bytes of this kind to keep."""
        return limit()

    def make(self, capacity: int) -> Kept:
        """A new segment of ``capacity`` usable bytes, mapped read-write."""
        raise NotImplementedError

    def nobody_else(self, kept: Kept) -> bool:
        """True when no process and no message but this process' recycled-segment cache holds it."""
        raise NotImplementedError

    def give_back(self, kept: Kept) -> None:
        """Unmap it and let go of it for good (the cache no longer keeps it)."""
        raise NotImplementedError

    def at_exit(self, kept: Kept) -> None:
        """This process exits keeping it: let go of what others would see."""

    def forget_in_child(self, kept: Kept) -> None:
        """A forked child inherited it: unmap, close, touch nothing shared."""
        unmap(kept.address, kept.length)
        if kept.fd >= 0:
            os.close(kept.fd)

    def on_release(self, kept: Kept) -> Callable[[], Any] | None:
        """What the Segment runs when it is released for good (at exit, say)."""
        return None


class Kept:
    """One recycled segment: its mapping, and what its strategy needs to know it by."""

    __slots__ = ("kind", "address", "length", "header", "fd", "key", "name", "since", "mapped")

    def __init__(
        self,
        kind: Kind,
        address: int,
        length: int,
        header: int,
        key: Any,
        fd: int = -1,
        name: str | None = None,
    ) -> None:
        self.kind, self.address, self.length, self.header = kind, address, length, header
        self.key, self.fd, self.name = key, fd, name
        self.since = 0.0
        self.mapped = False  # its pages are mapped here (a pwrite fills a new one unmapped)

    @property
    def capacity(self) -> int:
        return self.length - self.header


_lock = threading.Lock()
_kept: dict[int, Kept] = {}  # map address -> a segment kept for reuse, oldest first
_kept_bytes: collections.Counter[str] = collections.Counter()  # kind name -> bytes kept
_out: dict[int, Kept] = {}  # map address -> a recycled segment in use in this process
_returned: collections.deque[int] = collections.deque()  # from GC callbacks: addresses
_poisoned: set[int] = set()  # map addresses of segments alive at a fork: never reused
_keeper: threading.Thread | None = None


def capacity_for(nbytes: int) -> int:
    """The size class ``nbytes`` falls in: steps of an eighth of a power of two, whole
    pages (a steady stream of one size reuses exactly; at most 1/8 is spare)."""
    step = max(mmap.PAGESIZE, 1 << max(0, (nbytes - 1).bit_length() - 3))
    return -(-nbytes // step) * step


def take(nbytes: int, kind: Kind) -> Segment | None:
    """A segment of at least ``nbytes`` for a copy to be sent (its old bytes are left as
    they are): a kept one when one fits and nobody holds it, else a new one that will be
    kept. None when recycling is off for ``kind``, ``nbytes`` is small, or it is too big."""
    if nbytes < MIN_BYTES:
        return None
    capacity = capacity_for(nbytes)
    if capacity > kind.limit():
        return None
    with _lock:
        _take_returned()
        kept = _reuse(capacity, kind)
        if kept is not None:
            if _lib().mprotect(kept.address, kept.length, mmap.PROT_READ | mmap.PROT_WRITE):
                kind.give_back(kept)
                kept = None
            else:
                segment = _segment(kept)
                segment.reused = True  # its pages are in place
                return segment
    kept = kind.make(capacity)
    with _lock:
        _watch()
        return _segment(kept)


def _watch() -> None:
    """Start the thread that gives back idle segments, unless it runs (with _lock held;
    never from a GC callback, which may fire inside the threading module's own locks)."""
    global _keeper
    if _keeper is None and idle() > 0:
        _keeper = threading.Thread(target=_give_back_idle, name="procspawn-recycled", daemon=True)
        _keeper.start()


def _segment(kept: Kept) -> Segment:
    # with _lock held: a fork in between must see it out (and poison it)
    _lib()  # loaded now: _recycle (a weakref callback) must not import it
    segment = Segment(
        address=kept.address + kept.header,
        size=kept.capacity,
        strategy=kept.kind.name,
        key=kept.key,
        map_address=kept.address,
        map_length=kept.length,
        fd=kept.fd,
        name=kept.name,
        on_release=kept.kind.on_release(kept),
        recycle=_recycle,
    )
    _out[kept.address] = kept
    return segment


def map_before_copy(segment: Segment) -> bool:
    """Whether a copy into ``segment``, a reused recycled segment, should map its pages
    first: they are in the file but were never mapped here (a pwrite filled it when it
    was new). From then on they stay mapped."""
    kept = _out.get(segment.address - segment.header)
    if kept is None or kept.mapped:
        return False
    kept.mapped = True
    return True


def is_recycled(segment: Segment) -> bool:
    """Whether ``segment`` is one of this process' recycled segments (mapped at its start)."""
    kept = _out.get(segment.address)
    return kept is not None and kept.kind is MEMFDS


def unmap(address: int, length: int) -> None:
    _lib().munmap(address, length)


def _recycle(address: int, length: int, fd: int) -> None:
    # A weak-reference callback: it may run inside any code, this module's locked
    # sections included, so it queues, and keeps at once only if the lock is free.
    try:
        _returned.append(address)
        if _lock.acquire(blocking=False):
            try:
                _take_returned()
            finally:
                _lock.release()
    except Exception:  # interpreter teardown: the pages go with the process
        pass


def _take_returned() -> None:
    """Keep what came back since the last call, while there is room (with _lock held)."""
    while _returned:
        address = _returned.popleft()
        kept = _out.pop(address, None)
        if kept is None:
            continue
        if address in _poisoned or not _room(kept):
            _poisoned.discard(address)
            kept.kind.give_back(kept)
            continue
        _lib().mprotect(kept.address, kept.length, _PROT_NONE)
        kept.since = time.monotonic()
        _kept[address] = kept
        _kept_bytes[kept.kind.name] += kept.length


def _room(kept: Kept) -> bool:
    """Make room for ``kept``, dropping the oldest kept first; False if it cannot fit."""
    most = kept.kind.limit()
    if kept.length > most:
        return False
    name = kept.kind.name
    total = limit()
    while _kept and (sum(_kept_bytes.values()) + kept.length > total or len(_kept) >= MAX_SEGMENTS):
        _drop(next(iter(_kept)))
    while _kept_bytes[name] + kept.length > most:
        _drop(next(a for a, k in _kept.items() if k.kind.name == name))
    return True


_CHECKS = 8  # holder checks per take at most: a consumer may keep many for a long time


def _reuse(capacity: int, kind: Kind) -> Kept | None:
    """The oldest kept segment of ``kind`` and ``capacity`` that nobody else holds, taken
    out of the cache (with _lock held). One found still held goes to the back of the line,
    so segments a consumer keeps for long do not stand in front of free ones."""
    busy = []
    try:
        for address, kept in _kept.items():
            if kept.kind is not kind or kept.capacity != capacity:
                continue
            if kind.nobody_else(kept):
                del _kept[address]
                _kept_bytes[kind.name] -= kept.length
                return kept
            busy.append(address)
            if len(busy) == _CHECKS:
                break
        return None
    finally:
        for address in busy:
            _kept[address] = _kept.pop(address)


def _drop(address: int) -> None:
    kept = _kept.pop(address)
    _kept_bytes[kept.kind.name] -= kept.length
    kept.kind.give_back(kept)


def _give_back_idle() -> None:
    """Give back what nobody reused for PROCSPAWN_POOL_IDLE seconds; stop once nothing is
    kept or out."""
    global _keeper
    while True:
        with _lock:
            _take_returned()
            now = time.monotonic()
            keep_for = idle()
            for address in [a for a, k in _kept.items() if now - k.since >= keep_for]:
                _drop(address)
            if not _kept and not _out:  # nothing kept, nothing out that may come back
                _keeper = None
                return
            oldest = min((k.since for k in _kept.values()), default=now)
        time.sleep(max(oldest + keep_for - now, 0.0) + 0.01)


def trim() -> int:
    """Give back every recycled segment kept; returns how many bytes they were."""
    with _lock:
        _take_returned()
        kept = sum(_kept_bytes.values())
        while _kept:
            _drop(next(iter(_kept)))
    return kept


def kept_bytes() -> int:
    """How many bytes of recycled segments are kept now (``procspawn info``, tests)."""
    with _lock:
        _take_returned()
        return sum(_kept_bytes.values())


# -- file_descriptor: memfds ----------------------------------------------------------


def _reopen(fd: int) -> int:
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def _nobody_else(fd: int) -> bool:
    """True when no file of this memfd but ``fd``'s own is open for writing anywhere."""
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False
    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
    return True


def _self_test() -> bool:
    """Do leases count holders here as recycling needs? (kernel, /proc, sysctl)"""
    try:
        first = os.memfd_create("procspawn-recycled-test", os.MFD_CLOEXEC)
        try:
            os.ftruncate(first, mmap.PAGESIZE)
            fd = _reopen(first)
        finally:
            os.close(first)
    except OSError:
        return False
    try:
        if not _nobody_else(fd):
            return False
        other = _reopen(fd)
        address = map_fd(other, mmap.PAGESIZE)
        os.close(other)
        mapped_elsewhere = not _nobody_else(fd)
        _lib().munmap(address, mmap.PAGESIZE)
        if not (mapped_elsewhere and _nobody_else(fd)):
            return False
        a, b = socket.socketpair(socket.AF_UNIX)
        with a, b:
            other = _reopen(fd)
            socket.send_fds(a, [b"x"], [other])
            os.close(other)
            in_flight = not _nobody_else(fd)
            _, fds, _, _ = socket.recv_fds(b, 1, 1)
            for received in fds:
                os.close(received)
        return in_flight and _nobody_else(fd)
    except OSError:
        return False
    finally:
        os.close(fd)


class _Memfds(Kind):
    name = "file_descriptor"
    _usable: bool | None = None

    def limit(self) -> int:
        if self._usable is None:
            self._usable = limit() > 0 and _self_test()
        return limit() if self._usable else 0

    def make(self, capacity: int) -> Kept:
        first = os.memfd_create("procspawn", os.MFD_CLOEXEC)
        try:
            os.ftruncate(first, capacity)
            st = os.fstat(first)
            fd = _reopen(first)
        finally:
            os.close(first)
        try:
            address = map_fd(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        return Kept(self, address, capacity, 0, (st.st_dev, st.st_ino), fd=fd)

    def nobody_else(self, kept: Kept) -> bool:
        return _nobody_else(kept.fd)

    def give_back(self, kept: Kept) -> None:
        unmap(kept.address, kept.length)
        os.close(kept.fd)


MEMFDS = _Memfds()


def usable() -> bool:
    """Whether this process recycles memfds (a limit above 0 and a kernel that passes)."""
    return MEMFDS.limit() > 0


def file_to_send(segment: Segment) -> int:
    """A new file of a recycled memfd for one message, which the message owns."""
    return _reopen(segment.fd)


# -- per process ----------------------------------------------------------------------


def _at_exit() -> None:
    # Threads may still run: the lock is taken if it can be, and the mappings stay (an
    # array may still be read during teardown; the pages go with the process).
    locked = _lock.acquire(timeout=1.0)
    try:
        for kept in list(_kept.values()):
            try:
                kept.kind.at_exit(kept)
            except Exception:
                pass
        _kept.clear()
        _kept_bytes.clear()
    finally:
        if locked:
            _lock.release()


def _register_exit() -> None:
    util.Finalize(None, _at_exit, exitpriority=-100)


class _AfterFork:
    pass


_after_fork_anchor = _AfterFork()
_register_exit()
util.register_after_fork(_after_fork_anchor, lambda _: _register_exit())


def _poison_live() -> None:
    # No lock (a thread holding it may wait for one a forking thread holds): a segment
    # taken out of the cache at this very moment is in neither table, which costs the child
    # one stray mapping it has no array over, and the parent nothing.
    _poisoned.update(_out)


def _reset_after_fork() -> None:
    # The child got copies of the parent's kept mappings (and memfd files): it gives them
    # back, touching nothing shared (they are the parent's to reuse), and starts empty.
    global _lock, _keeper
    _lock = threading.Lock()
    _keeper = None
    for kept in _kept.values():
        kept.kind.forget_in_child(kept)
    while _returned:  # dead already, not kept yet
        dead = _out.get(_returned.popleft())
        if dead is not None:
            dead.kind.forget_in_child(dead)
    _kept.clear()
    _kept_bytes.clear()
    _out.clear()
    _poisoned.clear()


os.register_at_fork(before=_poison_live, after_in_child=_reset_after_fork)
