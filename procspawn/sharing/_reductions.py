"""NumPy arrays on the wire: a handle into a shared segment instead of the bytes.

An array is sent as ``(segment, byte offset, shape, strides, dtype, writeable)``. The
segment is pickled once per message (pickle's memo), so many arrays over one segment
cost one handle, and the receiver rebuilds them over one mapping: views stay views.

* memory already in a Segment: the handle only, no copy;
* any other array of at least ``PROCSPAWN_INLINE_BYTES`` bytes (default 65536): copied
  once into a new segment (C or Fortran order, as the source), the sender's array
  untouched;
* smaller ones, zero-size ones and object dtypes: pickled as NumPy pickles them.
"""

from __future__ import annotations

import os
import pickle
import weakref
from typing import Any, Literal

import numpy as np

from . import _pickler, _strategy
from ._segment import Segment, segment_of

INLINE_BYTES = int(os.environ.get("PROCSPAWN_INLINE_BYTES", 65536))


# -- ndarray ------------------------------------------------------------------------------


def _reduce_ndarray(array: np.ndarray) -> Any:
    found = segment_of(array)
    if found is None:
        if array.dtype.hasobject or array.size == 0 or array.nbytes < INLINE_BYTES:
            return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        array = copy_to_segment(array)
        found = segment_of(array)
        assert found is not None
    segment, offset = found
    return (
        _rebuild_ndarray,
        (
            _strategy.segment_handle(segment),
            offset,
            array.shape,
            array.strides,
            dtype_code(array.dtype),
            array.flags.writeable,
        ),
    )


def dtype_code(dtype: np.dtype) -> str | np.dtype:
    """``dtype.str`` when it names the dtype exactly (numbers, bools, dates, strings: a
    few bytes, fast to read back), else the dtype itself (structured, subarray, metadata,
    user-defined)."""
    if dtype.metadata is None and (dtype.isbuiltin == 1 or dtype.kind in "MmSU"):
        return dtype.str
    return dtype


def _rebuild_ndarray(handle: Any, *layout: Any) -> np.ndarray:
    """The received array: ``layout`` as ``array_over`` takes it, over the handle's segment."""
    return array_over(_strategy.segment_from_handle(handle), *layout)


def array_over(
    segment: Segment,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: str | np.dtype,
    writeable: bool,
) -> np.ndarray:
    """The array a handle describes, over ``segment`` of this process."""
    array = np.ndarray(shape, dtype, buffer=bytes_of(segment), offset=offset, strides=strides)
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


def empty_like_in_segment(shape: Any, dtype: Any, order: Literal["C", "F"] = "C") -> np.ndarray:
    """A new array in a fresh segment of the current strategy (its bytes are zero)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    segment = _strategy.allocate(nbytes)
    return np.ndarray(shape, dtype, buffer=bytes_of(segment), order=order)


def copy_to_segment(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` in a fresh segment, Fortran order kept, read-only kept."""
    order: Literal["C", "F"] = (
        "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    )
    shared = empty_like_in_segment(array.shape, array.dtype, order)
    np.copyto(shared, array, casting="no")
    if not array.flags.writeable:
        shared.flags.writeable = False
    return shared


_pickler.register(np.ndarray, _reduce_ndarray)

# multiprocessing's own channels: arrays in segments go as handles there too (DupFd)
from . import _mp_channels  # noqa: E402

_mp_channels.install()
