"""The public helpers of ``procspawn.sharing.cuda``: shareable GPU arrays."""

from __future__ import annotations

import gc
from typing import Any, TypeVar

import cupy
import numpy as np

from ..segments import _arrays as _host_arrays
from . import _cupy, _fd, _ipc, _slots

_T = TypeVar("_T")


def empty(shape: Any, dtype: Any = np.float32) -> Any:
    """A new CuPy array in shareable device memory on the current device.

    Its contents are zero (fresh shareable memory is zeroed, as ``sharing.empty``'s is).

    Args:
        shape: an int or a sequence of ints.
        dtype: anything ``numpy.dtype()`` takes (default float32); not Python objects.

    Returns:
        A C-ordered ``cupy.ndarray``: passed to ``spawn``, a Pool or a procspawn Queue,
        the receivers get the same device memory, not a copy.

    Raises:
        TypeError: ``dtype`` holds Python objects.
        procspawn.sharing.cuda.CudaError: the GPU cannot share memory (MIG, WSL2, an
            old driver: the message says), or it is out of memory.
    """
    dtype = np.dtype(dtype)
    _host_arrays._check_dtype(dtype, "procspawn.sharing.cuda cannot share this array")
    shape = tuple(int(n) for n in (shape if np.iterable(shape) else (shape,)))
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimensions are not allowed, got shape {shape}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return cupy.empty(shape, dtype)  # no memory to share
    device = cupy.cuda.runtime.getDevice()
    place = _fd.carve(nbytes, device)
    if place is None:
        segment = _fd.strategy().allocate(nbytes)
        assert isinstance(segment, _fd.DeviceSegment)
        place = (segment, 0)
    return _cupy._array_over(place[0], place[1], shape, None, dtype)


def zeros(shape: Any, dtype: Any = np.float32) -> Any:
    """A new zero-filled CuPy array in shareable device memory on the current device.

    What the ranks write to it, the parent and every other rank see (once the writer's
    stream is synchronised, or through the ordering a send gives: see the GPU arrays
    page). Its memory goes back when the last array over it, in any process, is gone,
    SIGKILLed processes included.

    Args:
        shape: an int or a sequence of ints.
        dtype: anything ``numpy.dtype()`` takes (default float32).

    Returns:
        A C-ordered, zero-filled ``cupy.ndarray``.

    Raises:
        TypeError: ``dtype`` holds Python objects.
        procspawn.sharing.cuda.CudaError: as for :func:`empty`.
    """
    return empty(shape, dtype)


def _check(array: Any, where: str) -> None:
    """CuPy arrays have no object dtype: every one can be shared."""


def _share_together(arrays: list[Any]) -> dict[int, Any]:
    """Shared replacements by id(array): arrays over one allocation (views of one base)
    are copied together, and stay views of one shared block."""
    groups: dict[int, list[Any]] = {}
    for array in arrays:
        if array.size and not _cupy.is_shared(array):
            groups.setdefault(id(array.data.mem), []).append(array)
    out: dict[int, Any] = {}
    for group in groups.values():
        spans = [_span(array) for array in group]
        low = min(span[0] for span in spans)
        high = max(span[1] for span in spans)
        base = group[0]
        with cupy.cuda.Device(base.device.id):
            block = empty(high - low, np.uint8)
            block.data.copy_from_device_async(
                base.data + (low - base.data.ptr), high - low, cupy.cuda.get_current_stream()
            )
            for array in group:
                out[id(array)] = cupy.ndarray(
                    array.shape, array.dtype, block.data + (array.data.ptr - low), array.strides
                )
    return out


def _span(array: Any) -> tuple[int, int]:
    """The device addresses ``[low, high)`` an array's elements lie in."""
    low = high = array.data.ptr
    for n, stride in zip(array.shape, array.strides, strict=True):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + array.itemsize


def share_memory_(obj: _T) -> _T:
    """Move CuPy arrays into shareable device memory, as ``sharing.share_memory_`` moves
    NumPy arrays into shared memory.

    Args:
        obj: a ``cupy.ndarray`` (a shareable copy is returned, ``obj`` is unchanged); or a
            dict, a list, or an object with attributes, whose CuPy arrays are replaced in
            place by shareable copies, at any depth (as ``sharing.share_memory_`` searches).
            Arrays that were views of one allocation stay views of one shareable block;
            arrays already shareable are left as they are.

    Returns:
        The shareable copy for an array; ``obj`` itself otherwise.

    Raises:
        TypeError: ``obj`` is a tuple or has nothing to search, or an array sits where it
            cannot be replaced.
        procspawn.sharing.cuda.CudaError: as for :func:`empty`.
    """
    if isinstance(obj, cupy.ndarray):
        if obj.size == 0 or _cupy.is_shared(obj):
            return obj
        moved = _share_together([obj])
        return moved[id(obj)]  # type: ignore[no-any-return]
    if isinstance(obj, tuple) or not _host_arrays._searchable(obj):
        raise TypeError(
            f"share_memory_ takes a cupy.ndarray, a dict, a list or an object with array "
            f"attributes (changed in place), got {type(obj).__name__}"
        )
    arrays = _host_arrays._collect(obj, cupy.ndarray, _check)
    _host_arrays._replace(obj, _share_together(arrays), cupy.ndarray)
    return obj


def collect() -> int:
    """Give back, now, the device memory this process no longer needs, and say how much
    of what it shares it still maps.

    What it gives back: the mappings of memory received from other processes that only
    the linger keeps (``PROCSPAWN_GPU_LINGER``), arrays caught in reference cycles
    (Python's garbage collector runs), and, of this process' own CuPy memory sent by CUDA
    IPC, what no receiver holds any more: the memory of receivers that exited or were
    killed included (``torch.cuda.ipc_collect``'s job; a sweep also runs every second).

    Returns:
        The bytes of device memory this process maps for sharing (cuda_fd memory made
        here or received, allocations received by cuda_ipc) after the collection.
    """
    _fd.release_lingering()
    gc.collect()
    _slots.sweep()
    return _fd.held() + _ipc.opened_bytes()


def is_shared(array: Any) -> bool:
    """Whether a CuPy array lies in shareable device memory (it is sent as the same
    memory, not copied); False for anything else."""
    return _cupy.is_shared(array)


def set_ipc(enabled: bool) -> None:
    """Share GPU arrays of CuPy's pool (any ``cudaMalloc`` memory) by CUDA IPC handle, or
    copy them into shareable memory at each send (the default).

    Off (unless ``PROCSPAWN_GPU_IPC=1``), such an array is copied into ``cuda_fd`` memory
    at the send, as a NumPy array outside shared memory is copied into a segment: the
    receiver's writes reach the copy. On (``cuda_ipc``), it is sent as the same memory:
    the receiver's writes are seen, and the memory stays allocated in this process while a
    receiver holds it (a receiver that dies gives it back within a second). It lives only
    as long as this process, so results of ranks and workers, read after they may have
    exited, are copied anyway. ``cuda_ipc`` has its tests (tests/gpu) but has not yet run
    on a GPU: it is off until it has.

    Args:
        enabled: True to share by IPC handle, False to copy; for this process (children
            read ``PROCSPAWN_GPU_IPC``).
    """
    _cupy.set_ipc(enabled)
