"""Segment, one mapped shared region, released when the last array over it goes.

Mapping is done with libc ``mmap`` through ctypes, not ``mmap.mmap``: before Python 3.13
(``trackfd=False``) ``mmap.mmap`` keeps a private duplicate of the descriptor for as long
as the mapping lives, one extra fd per segment. A Segment holds no descriptor unless its
strategy asks it to keep one (file_descriptor keeps the memfd, to send it on).

A Segment exposes ``__array_interface__``, so ``np.asarray(segment)`` is a uint8 array
whose ``.base`` is the segment; every array built on it keeps it alive, and the region is
unmapped when the last one is gone, by a plain weak-reference callback (much cheaper than
a ``util.Finalize``: this is on every received message). A strategy's ``on_release`` (the
file_system holder table) also runs at exit for the segments still alive then, through
one ``util.Finalize`` (so fork/forkserver children, which skip ``atexit``, run it too),
but never in a forked child that merely inherited the Segment.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import sys
import weakref
from collections.abc import Callable, Hashable
from multiprocessing import util

from ..._late import late_import

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

_libc: Any = None  # libc's mmap, munmap and madvise, through ctypes: see _lib()
_munmap: list[Any] = []  # libc's munmap once loaded, for _collected
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_populate_works = sys.platform.startswith("linux")
_MAP_FAILED = (1 << (8 * struct.calcsize("P"))) - 1  # (void *) -1

# weak reference -> (pid, map address, map length, fd, on_release, recycle) of every live
# Segment
_pending: dict[weakref.ref[Any], tuple[Any, ...]] = {}


def _release_at_exit() -> None:
    # Arrays may still be read during interpreter teardown: give back only what the
    # strategy holds for other processes to see (the pages go with the process).
    me = os.getpid()
    for ref, args in list(_pending.items()):
        pid, _, _, _, on_release, _ = args
        if on_release is not None and pid == me and _pending.pop(ref, None) is not None:
            on_release()


def _register_exit() -> None:
    util.Finalize(None, _release_at_exit, exitpriority=-100)


class _AfterFork:
    pass


_after_fork_anchor = _AfterFork()
_register_exit()
util.register_after_fork(_after_fork_anchor, lambda _: _register_exit())


def _lib() -> Any:
    """libc, loaded at the first mapping (ctypes is ~1.5 ms of the start of a process
    that may never map a segment: a pool whose tasks move no array)."""
    global _libc
    if _libc is None:
        ctypes = late_import("ctypes")  # (from any thread: see _late)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _munmap[:] = [libc.munmap]
        _libc = libc
    return _libc


def _errno() -> int:
    return int(late_import("ctypes").get_errno())  # (loaded by _lib() already)


def map_fd(fd: int, length: int, offset: int = 0) -> int:
    """mmap ``length`` bytes of ``fd`` shared read-write; returns the address."""
    address = _lib().mmap(
        None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset
    )
    if address is None or address == _MAP_FAILED:
        err = _errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}{_hint(err)}")
    return int(address)


def populate(address: int, length: int) -> None:
    """Fault in the pages of ``[address, address + length)`` for writing, in one call
    (``MADV_POPULATE_WRITE``), before a copy fills them: the kernel allocates a fresh
    segment's pages in a batch instead of one fault at a time. Pages already in place
    cost a page-table walk. Does nothing where the kernel does not know the advice."""
    global _populate_works
    if not _populate_works or length <= 0:
        return
    start = address & ~(mmap.PAGESIZE - 1)
    if _lib().madvise(start, length + (address - start), _MADV_POPULATE_WRITE) != 0:
        if _errno() == errno.EINVAL:
            _populate_works = False  # an older kernel: the copy faults them in itself


def _hint(err: int) -> str:
    if err != errno.ENOMEM:
        return ""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        maps = sum(1 for _ in open("/proc/self/maps"))
    except (OSError, ValueError):
        return ""
    if maps < limit - 16:
        return " (this process is out of memory)"
    return (
        f" (this process holds {maps} memory mappings, the kernel's limit "
        f"vm.max_map_count is {limit}: every live shared segment is one mapping. Keep fewer "
        f"arrays alive, batch small arrays into one larger array, or raise the limit: "
        f"`sysctl -w vm.max_map_count={limit * 4}`)"
    )


def _collected(
    ref: weakref.ref[Any],
    pending: dict[Any, Any] = _pending,
    getpid: Callable[[], int] = os.getpid,
    munmap: list[Any] = _munmap,  # filled by _lib(), which mapped the segment
    close: Callable[[int], None] = os.close,
) -> None:
    # Everything it uses is bound here: a segment that lives until the interpreter's
    # teardown is released after module globals may have been cleared.
    args = pending.pop(ref, None)
    if args is not None:
        pid, address, length, fd, on_release, recycle = args
        if getpid() == pid:  # not a forked child that merely inherited it
            if recycle is not None:
                recycle(address, length, fd)  # kept for reuse, or let go by the cache itself
                return
            munmap[0](address, length)
            if fd >= 0:
                close(fd)
            if on_release is not None:
                on_release()


class Segment:
    """One mapped shared-memory region made by a sharing strategy.

    A strategy makes one with :meth:`Segment.map`; the region is unmapped (and
    ``on_release`` run) when the Segment is garbage-collected, that is when the last
    array over it in this process is gone.

    Args:
        address: where the usable bytes start in this process.
        size: how many usable bytes there are.
        strategy: the name of the strategy that made it.
        key: the segment's identity across processes (a receiver maps each key once).
        map_address: where the whole mapping starts (unmapped on release).
        map_length: the whole mapping's length in bytes.
        fd: a descriptor the segment owns and closes on release, or -1.
        name: the file name of a named segment, or None.
        on_release: called once when the Segment is released (or at exit), in the
            process that made it only.
        recycle: called as ``recycle(map_address, map_length, fd)`` instead of unmapping,
            to keep the mapping for reuse.

    Attributes:
        address: where the usable bytes start in this process.
        size: how many usable bytes there are.
        strategy: the name of the strategy that made it.
        key: the segment's identity across processes (memfd inode, file name, ...).
        fd: a descriptor the segment keeps open (file_descriptor), or -1.
        name: the file name of a named segment (file_system), or None.
        header: the file offset of the usable bytes (every mapping starts at offset 0).
    """

    __slots__ = (
        "address",
        "size",
        "strategy",
        "key",
        "fd",
        "name",
        "view",
        "reused",
        "recycled",
        "header",
        "__array_interface__",
        "_finalizer",
        "__weakref__",
    )

    def __init__(
        self,
        *,
        address: int,
        size: int,
        strategy: str,
        key: Hashable,
        map_address: int,
        map_length: int,
        fd: int = -1,
        name: str | None = None,
        on_release: Callable[[], object] | None = None,
        recycle: Callable[[int, int, int], object] | None = None,
    ) -> None:
        self.address = address
        self.size = size
        self.strategy = strategy
        self.key = key
        self.fd = fd
        self.name = name
        self.view: Any = None  # a weak reference to a uint8 array over it (see _reductions)
        self.reused = False  # a recycled segment handed out again: its pages are in place
        self.recycled = recycle is not None  # made to carry copies, kept for the next send
        # every mapping starts at the file's offset 0: the usable bytes start here in the file
        self.header = address - map_address
        # np.asarray(segment): a uint8 array over the usable bytes whose .base is the segment
        self.__array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }
        _lib()  # (loaded by the mapping, mostly): _collected unmaps with it
        self._finalizer = weakref.ref(self, _collected)
        _pending[self._finalizer] = (
            os.getpid(),
            map_address,
            map_length,
            fd,
            on_release,
            recycle,
        )

    @classmethod
    def map(
        cls,
        fd: int,
        size: int,
        *,
        strategy: str,
        key: Hashable,
        header: int = 0,
        keep_fd: bool = False,
        on_release: Callable[[], object] | None = None,
    ) -> Segment:
        """Map ``header + size`` bytes of ``fd`` shared; the usable bytes start after ``header``.

        With ``keep_fd`` the Segment owns ``fd`` and closes it on release; otherwise the
        caller may close ``fd`` at once (the mapping needs no descriptor). ``on_release``
        runs once when the Segment is released in the process that made it.

        Args:
            fd: a descriptor of the shared memory (a memfd, a file in /dev/shm), open
                for reading and writing.
            size: how many usable bytes to map.
            strategy: the name of the strategy making it (``self.name`` in a strategy).
            key: the segment's identity across processes: the same for every process
                mapping it, different for every other segment (``(st_dev, st_ino)``).
            header: bytes at the start of ``fd`` that are not the segment's.
            keep_fd: the Segment owns ``fd`` (a strategy that sends it on needs it).
            on_release: called once when the Segment is released.

        Returns:
            The Segment; ``np.asarray(segment)`` is a uint8 array over its usable bytes.

        Raises:
            OSError: the mapping failed (out of memory, or of mappings: the message
                says which limit and how to raise it).
        """
        length = max(header + size, 1)
        address = map_fd(fd, length)
        return cls(
            address=address + header,
            size=size,
            strategy=strategy,
            key=key,
            map_address=address,
            map_length=length,
            fd=fd if keep_fd else -1,
            on_release=on_release,
        )

    def __repr__(self) -> str:
        return f"<procspawn Segment {self.strategy} key={self.key!r} size={self.size}>"


def _data_pointer_reader() -> Callable[[Any], int] | None:
    """A fast reader of an ndarray's data pointer, or None.

    On CPython an ndarray's first field after the object header is its data pointer, and
    ``id()`` is the object's address: reading it costs a tenth of building
    ``__array_interface__``. It is used only if it reads the right pointer here.
    """
    try:
        import numpy as np

        ctypes = late_import("ctypes")
        offset = object.__basicsize__
        read = ctypes.c_void_p.from_address
        probe = np.arange(64, dtype=np.uint8)
        for view in (probe, probe[3:], probe[::-2]):
            if read(id(view) + offset).value != view.__array_interface__["data"][0]:
                return None
    except Exception:
        return None
    return lambda array: read(id(array) + offset).value or 0


_data_pointer: Callable[[Any], int] | None = None


class Block:
    """The part of a Segment (a slab, see ``_slabs``) that one small array owns.

    An array carved out of a slab is built over ``np.asarray(block)``, a uint8 array of
    exactly its own bytes: the array, its views and the ndarrays on its ``.base`` chain
    span only the block, never a neighbour that shares the slab. The chain goes on to the
    Block and, through ``Block.base``, to the slab's Segment (which it keeps alive):
    ``np.asarray`` of that Segment, like that of any buffer's owner, spans the whole slab.
    """

    __slots__ = ("base", "start", "length", "__array_interface__", "__weakref__")

    def __init__(self, segment: Segment, start: int, length: int) -> None:
        self.base = segment
        self.start = start
        self.length = length
        self.__array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (segment.address + start, False),
            "version": 3,
        }


def segment_of(array: Any) -> tuple[Segment, int, tuple[int, int] | None] | None:
    """Where an array's memory lies in a Segment, or None when it does not.

    Returns:
        (segment, byte offset of the array's first element in it, block), where block
        is ``(start, length)`` of the slab Block the array was carved from, else None.
    """
    global _data_pointer
    block = None
    base = array.base
    while base is not None and not isinstance(base, Segment):
        if isinstance(base, Block):
            block = (base.start, base.length)
        base = getattr(base, "base", None)
    if base is None:
        return None
    if _data_pointer is None:
        _data_pointer = _data_pointer_reader() or (lambda a: a.__array_interface__["data"][0])
    return base, _data_pointer(array) - base.address, block
