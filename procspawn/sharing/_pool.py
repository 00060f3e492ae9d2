"""Level 2: the producer-side pool: memfd segments that carried a copy, kept for the next.

Sending an array that is not in shared memory copies it into a new segment (see
``_reductions``). For a large array, making that segment costs more than the copy: the
kernel allocates and zeroes every page as the copy first touches it, and frees them all
once the receiver drops the array. Under ``file_descriptor``, the segment a send made is
kept by the process that made it once every holder everywhere has let go, and the next
send of a fitting size copies into it, its pages already in place.

Who else holds it? The kernel knows. For a memfd it counts the files open for writing
(``i_writecount``): the file ``memfd_create`` returns is not counted, a reopen through
``/proc/self/fd`` is. A pooled segment is kept through one reopened file of its maker's;
every message that carries it carries a reopen of its own, which the message holds while
in flight and each receiver while it maps it (a mapping holds its file; receivers pass on
what they received). A write lease (``F_SETLEASE``) is granted only when the counted files
are exactly the caller's own: that is the test that no message and no process still holds
the segment. It cannot be fooled by a receiver killed with SIGKILL, or by a message that
is never read: the kernel drops their files. A self-test at first use checks these
semantics on the running kernel, and the pool stays off if any differs. A fork copies the
maker's mappings without a file of their own, so a segment alive at a fork is never
reused.

Memory kept on purpose is explicit, bounded, visible and trimmable:

* only segments made to carry a copy at a send are kept, never one the user holds an array
  over (``sharing.zeros``, ``share_memory_``), and none smaller than 256 KiB (those go in
  slabs);
* at most ``PROCSPAWN_POOL_BYTES`` bytes (default: an eighth of the memory this process
  may use, at most 2 GiB; 0 turns the pool off) in at most 64 segments, counting those
  still held elsewhere;
* a kept segment is mapped ``PROT_NONE``: ``---s`` in ``/proc/<pid>/maps``, which is how
  ``procspawn info`` shows it (and a stray pointer into it faults instead of writing);
* ``procspawn.sharing.trim()`` gives everything back, and so does running short of memory
  when a segment is made (then the allocation is tried once more).
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import mmap
import os
import socket
import threading
import weakref
from typing import Any

from ._segment import Segment, map_fd

MIN_BYTES = 256 * 1024
MAX_SEGMENTS = 64
_PROT_NONE = 0
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _default_limit() -> int:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            memory = min(memory, int(f.read()))
    except (OSError, ValueError):  # no cgroup v2 limit ("max")
        pass
    return min(2 << 30, memory // 8)


def _limit_from_env() -> int:
    value = os.environ.get("PROCSPAWN_POOL_BYTES")
    if value is None or value == "":
        return _default_limit()
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(
            f"PROCSPAWN_POOL_BYTES={value!r} is not a number of bytes (0 turns the "
            f"producer-side pool off)"
        ) from None


LIMIT = _limit_from_env()


class _Kept:
    __slots__ = ("fd", "address", "capacity", "key")

    def __init__(self, fd: int, address: int, capacity: int, key: Any) -> None:
        self.fd, self.address, self.capacity, self.key = fd, address, capacity, key


_lock = threading.Lock()
_kept: dict[int, _Kept] = {}  # fd -> a segment the pool keeps, oldest first
_kept_bytes = 0
_returned: collections.deque[tuple[int, int, int]] = collections.deque()  # from GC callbacks
_keys: dict[int, Any] = {}  # fd -> key, for segments of ours in use
_live: weakref.WeakSet[Segment] = weakref.WeakSet()  # segments of ours in use
_poisoned: set[int] = set()  # fds of segments alive at a fork: never reused
_usable: bool | None = None


def capacity_for(nbytes: int) -> int:
    """The size class ``nbytes`` falls in: steps of an eighth of a power of two, whole
    pages (a steady stream of one size reuses exactly; at most 1/8 is spare)."""
    step = max(mmap.PAGESIZE, 1 << max(0, (nbytes - 1).bit_length() - 3))
    return -(-nbytes // step) * step


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
    """Do leases count holders here as the pool needs? (kernel, /proc, sysctl)"""
    try:
        first = os.memfd_create("procspawn-pool-test", os.MFD_CLOEXEC)
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
        _libc.munmap(address, mmap.PAGESIZE)
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


def usable() -> bool:
    """Whether this process pools (a limit above 0 and a kernel that passes the test)."""
    global _usable
    if _usable is None:
        _usable = LIMIT > 0 and _self_test()
    return _usable


def take(nbytes: int) -> Segment | None:
    """A segment of at least ``nbytes`` for a copy to be sent (its old bytes are left as
    they are): a kept one when one fits and nobody holds it, else a new one the pool will
    keep. None when the pool is off, ``nbytes`` is small, or the pool is full."""
    if nbytes < MIN_BYTES or not usable():
        return None
    capacity = capacity_for(nbytes)
    if capacity > LIMIT:
        return None
    with _lock:
        _take_returned()
        kept = _reuse(capacity)
    if _returned:  # a collection ran while the lock was held
        with _lock:
            _take_returned()
    if kept is not None:
        if _libc.mprotect(kept.address, capacity, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            _unmap(kept.address, capacity, kept.fd)
            return None
        return _segment(kept)
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
    return _segment(_Kept(fd, address, capacity, (st.st_dev, st.st_ino)))


def _segment(kept: _Kept) -> Segment:
    segment = Segment(
        address=kept.address,
        size=kept.capacity,
        strategy="file_descriptor",
        key=kept.key,
        map_address=kept.address,
        map_length=kept.capacity,
        fd=kept.fd,
        recycle=_recycle,
    )
    _keys[kept.fd] = kept.key
    _live.add(segment)
    return segment


def is_pooled(segment: Segment) -> bool:
    """Whether ``segment`` is one of this process' pool segments (sent as a reopen)."""
    return segment in _live


def file_to_send(segment: Segment) -> int:
    """A new file of a pool segment for one message, which the message owns."""
    return _reopen(segment.fd)


def _recycle(address: int, length: int, fd: int) -> None:
    # A weak-reference callback: it may run inside any code, this module's locked
    # sections included, so it queues, and keeps at once only if the lock is free.
    _returned.append((address, length, fd))
    if _lock.acquire(blocking=False):
        try:
            _take_returned()
        finally:
            _lock.release()


def _take_returned() -> None:
    """Keep what came back since the last call, while there is room (with _lock held)."""
    global _kept_bytes
    while _returned:
        address, capacity, fd = _returned.popleft()
        key = _keys.pop(fd, None)
        if fd in _poisoned or key is None or not _room(capacity):
            _poisoned.discard(fd)
            _unmap(address, capacity, fd)
            continue
        _libc.mprotect(address, capacity, _PROT_NONE)
        _kept[fd] = _Kept(fd, address, capacity, key)
        _kept_bytes += capacity


def _room(capacity: int) -> bool:
    """Make room for ``capacity`` more bytes kept, dropping the oldest kept first."""
    while _kept and (_kept_bytes + capacity > LIMIT or len(_kept) >= MAX_SEGMENTS):
        _drop(next(iter(_kept)))
    return capacity <= LIMIT


def _reuse(capacity: int) -> _Kept | None:
    """The oldest kept segment of ``capacity`` that nobody else holds, taken out of the
    pool (with _lock held)."""
    global _kept_bytes
    for fd, kept in _kept.items():
        if kept.capacity == capacity and _nobody_else(fd):
            del _kept[fd]
            _kept_bytes -= capacity
            return kept
    return None


def _drop(fd: int) -> None:
    global _kept_bytes
    kept = _kept.pop(fd)
    _kept_bytes -= kept.capacity
    _unmap(kept.address, kept.capacity, kept.fd)


def _unmap(address: int, length: int, fd: int) -> None:
    _libc.munmap(address, length)
    os.close(fd)


def trim() -> int:
    """Give back every segment the pool keeps; returns how many bytes it kept."""
    with _lock:
        _take_returned()
        kept = _kept_bytes
        while _kept:
            _drop(next(iter(_kept)))
    return kept


def _poison_live() -> None:
    for segment in list(_live):
        _poisoned.add(segment.fd)


def _reset_after_fork() -> None:
    # The child got copies of the parent's kept mappings and files: it gives them back
    # (they are the parent's to reuse) and starts with an empty pool.
    global _lock, _kept_bytes
    _lock = threading.Lock()
    for kept in _kept.values():
        _unmap(kept.address, kept.capacity, kept.fd)
    _kept.clear()
    while _returned:
        _unmap(*_returned.popleft())
    _kept_bytes = 0
    _keys.clear()
    _live.clear()
    _poisoned.clear()


os.register_at_fork(before=_poison_live, after_in_child=_reset_after_fork)
