"""Array layout over segments: new arrays in fresh segments, arrays over handles."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Literal

import numpy as np

from . import _slabs, _strategy
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
    fresh = isinstance(segment, Segment) and not segment.reused
    _copy(shared, array, fresh)
    if not array.flags.writeable:
        shared.flags.writeable = False
    return shared


# A copy into a fresh segment is bound by page faults (the kernel allocates and zeroes each
# page as the copy first touches it), which two threads take in parallel: 64 MiB took 74 ms
# with one thread and 48 ms with two here. Faulting them in first with one madvise per
# thread (MADV_POPULATE_WRITE) saves the trap per page: an 8 MiB copy into a new memfd
# took 9.0 ms faulting and 8.1 ms populated first, one thread, on this 2-core VM. A copy
# into pages already in place (a reused recycled segment) is bound by memory bandwidth
# and gains nothing, but loses nothing either.
# np.copyto releases the GIL for plain dtypes.
SPLIT_BYTES = 8 << 20
POPULATE_BYTES = 1 << 20
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fill(dst: np.ndarray, src: np.ndarray, fresh: bool) -> None:
    """``np.copyto(dst, src)``; ``fresh``: ``dst``'s pages are faulted in first, in one
    call, when it is large (see above)."""
    if fresh and dst.nbytes >= POPULATE_BYTES and dst.flags.contiguous:
        populate(dst.ctypes.data, dst.nbytes)
    np.copyto(dst, src, casting="no")


def _copy(dst: np.ndarray, src: np.ndarray, fresh: bool = False) -> None:
    """``np.copyto(dst, src)``, split in two threads when it is large (see above);
    ``fresh``: ``dst`` lies in a segment whose pages are not in place yet."""
    if dst.flags.f_contiguous and not dst.flags.c_contiguous:
        dst, src = dst.T, src.T  # split along the slowest axis
    if dst.nbytes < SPLIT_BYTES or _CPUS < 2 or dst.ndim == 0 or dst.shape[0] < 2:
        _fill(dst, src, fresh)
        return
    half = dst.shape[0] // 2
    failed: list[BaseException] = []

    def copy_second_half() -> None:
        try:
            _fill(dst[half:], src[half:], fresh)
        except BaseException as exc:  # re-raised by the caller's thread
            failed.append(exc)

    other = threading.Thread(target=copy_second_half, name="procspawn-copy", daemon=True)
    try:
        other.start()
    except RuntimeError:  # no thread to be had (at interpreter shutdown, say): one does it
        _fill(dst, src, fresh)
        return
    try:
        _fill(dst[:half], src[:half], fresh)
    finally:
        other.join()
    if failed:
        raise failed[0]
