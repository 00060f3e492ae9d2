"""Array layout over segments: new arrays in fresh segments, arrays over handles."""

from __future__ import annotations

import errno
import os
import threading
import weakref
from typing import Any, Literal

import numpy as np

from . import _recycled, _slabs, _strategy
from ._segment import Block, Segment, populate


def dtype_code(dtype: np.dtype) -> str | np.dtype:
    """``dtype.str`` when it names the dtype exactly (numbers, bools, dates, strings: a
    few bytes, fast to read back), else the dtype itself (structured, subarray, metadata,
    user-defined)."""
    if dtype.metadata is None and (dtype.isbuiltin == 1 or dtype.kind in "MmSU"):
        code: str = dtype.str
        return code
    return dtype


def layout(array: np.ndarray, offset: int, block: tuple[int, int] | None) -> tuple[Any, ...]:
    """What a receiver needs besides the segment: offset, shape, strides, dtype, writeable,
    and the slab block the array lies in (or None)."""
    return (
        offset,
        array.shape,
        array.strides,
        dtype_code(array.dtype),
        array.flags.writeable,
        block,
    )


def array_over(
    segment: Segment,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: str | np.dtype,
    writeable: bool,
    block: tuple[int, int] | None = None,
) -> np.ndarray:
    """The array a handle describes, over ``segment`` of this process (over its own block
    of a slab, so that it reaches no neighbour there either)."""
    if block is None:
        buffer = bytes_of(segment)
    else:
        buffer = np.asarray(Block(segment, *block))
        offset -= block[0]
    array: np.ndarray = np.ndarray(shape, dtype, buffer=buffer, offset=offset, strides=strides)
    if not writeable:
        array.flags.writeable = False
    return array


def bytes_of(segment: Segment) -> np.ndarray:
    """A uint8 array over all of ``segment`` whose ``.base`` is the segment; the same one
    for as long as any array built on it lives (it is held weakly)."""
    ref = segment.view
    view = ref() if ref is not None else None
    if view is None:
        view = np.asarray(segment)
        segment.view = weakref.ref(view)
    return view


def empty_like_in_segment(
    shape: Any, dtype: Any, order: Literal["C", "F"] = "C", for_copy: bool = False
) -> np.ndarray:
    """A new array in shared memory of the current strategy: a block of a slab when it is
    small, else a segment of its own. Its bytes are zero, unless ``for_copy`` (a send
    fills it at once: it may be a recycled segment, reused)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    block = _slabs.carve(nbytes)
    array: np.ndarray
    if block is not None:
        array = np.ndarray(shape, dtype, buffer=np.asarray(block), order=order)
        return array
    segment = _strategy.allocate(nbytes, for_copy)
    array = np.ndarray(shape, dtype, buffer=bytes_of(segment), order=order)
    return array


def copy_to_segment(array: np.ndarray, for_send: bool = False) -> np.ndarray:
    """A copy of ``array`` in shared memory, Fortran order kept, read-only kept.

    ``for_send``: the copy only carries ``array`` in a message (nobody here holds it
    after the send), so its segment may come from and go back to the recycled segments.
    """
    order: Literal["C", "F"] = (
        "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    )
    shared = empty_like_in_segment(array.shape, array.dtype, order, for_send)
    segment = getattr(shared.base, "base", None)
    if not isinstance(segment, Segment):  # a block of a slab
        _copy(shared, array)
    elif segment.reused:
        _copy(shared, array, map_first=_recycled.map_before_copy(segment))
    elif not _write(segment, shared, array):
        _copy(shared, array, map_first=True)
    if not array.flags.writeable:
        shared.flags.writeable = False
    return shared


# How a large array gets into shared memory (8 MiB, on this 2-core VM, in ms):
# * A new segment has no pages yet. Written with pwrite(2), the kernel allocates each page
#   in the file and copies into it, none of them mapped here: 1.8. Through the mapping, each
#   page is also mapped here (and unmapped again when the sender lets go), which costs more
#   than the copy itself: 5.2 faulting page by page, 2.9 faulted in first with one madvise
#   per thread (MADV_POPULATE_WRITE) and copied by two threads. pwrite holds the file's lock,
#   so a second thread gains nothing there; from 64 MiB up both ways take the same time,
#   pwrite on one core.
# * A reused recycled segment has its pages in the file: a copy through the mapping is
#   bound by memory bandwidth (0.7, two threads 0.65; pwrite 1.2), once they are mapped
#   here. A pwrite filled it when it was new, so the first reuse maps them all with one
#   madvise first (1.6; faulting one by one, 5.2), and later ones find them mapped.
# np.copyto and os.pwrite release the GIL.
WRITE_BYTES = 256 << 10
SPLIT_BYTES = 8 << 20
POPULATE_BYTES = 1 << 20
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _write(segment: Segment, dst: np.ndarray, src: np.ndarray) -> bool:
    """Copy ``src`` into ``dst``, which lies in a new ``segment``, by writing its file
    (see above); False, having written nothing, when that cannot be done (small, not
    contiguous alike, no file to write: then the copy goes through the mapping)."""
    if dst.nbytes < WRITE_BYTES:
        return False
    if src.flags.c_contiguous and dst.flags.c_contiguous:
        flat = src.reshape(-1)
    elif src.flags.f_contiguous and dst.flags.f_contiguous:
        flat = src.T.reshape(-1)
    else:
        return False
    fd, own = segment.fd, False
    if fd < 0:
        fd = _strategy.open_file(segment)
        own = fd >= 0
        if not own:
            return False
    try:
        data = memoryview(flat.view(np.uint8).data)  # a 1-D uint8 array's buffer: bytes
        start = segment.header + (dst.ctypes.data - segment.address)
        try:
            done = os.pwrite(fd, data, start)
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.EINVAL, errno.ESPIPE):
                return False  # not a file this process may write: through the mapping
            raise
        while done < len(data):  # a signal, or more than one call may write
            done += os.pwrite(fd, data[done:], start + done)
        return True
    finally:
        if own:
            os.close(fd)


def _fill(dst: np.ndarray, src: np.ndarray, map_first: bool) -> None:
    """``np.copyto(dst, src)``; ``map_first``: ``dst``'s pages are mapped first, in one
    call, when it is large (see above)."""
    if map_first and dst.nbytes >= POPULATE_BYTES and dst.flags.contiguous:
        populate(dst.ctypes.data, dst.nbytes)
    np.copyto(dst, src, casting="no")


def _copy(dst: np.ndarray, src: np.ndarray, map_first: bool = False) -> None:
    """``np.copyto(dst, src)``, split in two threads when it is large (see above);
    ``map_first``: ``dst`` lies in a segment whose pages may not be mapped here yet."""
    if dst.flags.f_contiguous and not dst.flags.c_contiguous:
        dst, src = dst.T, src.T  # split along the slowest axis
    if dst.nbytes < SPLIT_BYTES or _CPUS < 2 or dst.ndim == 0 or dst.shape[0] < 2:
        _fill(dst, src, map_first)
        return
    half = dst.shape[0] // 2
    failed: list[BaseException] = []

    def copy_second_half() -> None:
        try:
            _fill(dst[half:], src[half:], map_first)
        except BaseException as exc:  # re-raised by the caller's thread
            failed.append(exc)

    other = threading.Thread(target=copy_second_half, name="procspawn-copy", daemon=True)
    try:
        other.start()
    except RuntimeError:  # no thread to be had (at interpreter shutdown, say): one does it
        _fill(dst, src, map_first)
        return
    try:
        _fill(dst[:half], src[:half], map_first)
    finally:
        other.join()
    if failed:
        raise failed[0]
