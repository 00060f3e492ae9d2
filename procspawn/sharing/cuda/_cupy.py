"""CuPy arrays on the wire: the same device memory on the other side, not a copy.

The CuPy plug-in (``_registry.PLUGINS``): loaded when a process that has imported CuPy
first pickles a message. A ``cupy.ndarray`` is sent as ``(segment handle, byte offset,
shape, strides, dtype, event)``:

* memory in a ``cuda_fd`` segment (``sharing.cuda.zeros``/``empty``/``share_memory_``,
  or received): the handle only, no copy; views keep their offset and strides;
* any other array of at least ``PROCSPAWN_GPU_INLINE_BYTES``: copied device to device
  into a new ``cuda_fd`` segment at the send (C or Fortran order, as the source), the
  sender's array untouched: the receiver's writes reach that copy, not the array sent,
  exactly as for a NumPy array outside shared memory;
* smaller ones: by value (a host copy), rebuilt on the same GPU;
* a GPU that cannot export memory: an error that names the cause, unless
  ``PROCSPAWN_GPU_HOST_COPY=1`` allows a host copy.

Each send records an event on the sender's current stream, which the receiver's current
stream waits for (``_events``). The receiver builds the array on the GPU with the
sender's UUID, whatever its ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import cupy
import numpy as np

from ... import _settings
from .. import _message, _registry
from ..segments._segment import Segment
from ..wire import _handles
from . import _driver, _events, _fd, _ipc, _slots

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any


def _array_over(
    segment: _fd.DeviceMemory, offset: int, shape: Any, strides: Any, dtype: Any
) -> Any:
    memory = cupy.cuda.UnownedMemory(segment.address, segment.size, segment, segment.device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, offset), strides)


def shared_place(array: Any) -> tuple[Segment, int] | None:
    """The device segment of this process ``array``'s memory lies in (cuda_fd, or
    received by cuda_ipc), with the byte offset, or None."""
    return _fd.segment_at(array.data.ptr, array.device.id)


def copy_to_shared(array: Any) -> Any:
    """A copy of ``array`` in shareable memory on its device, in its order (C unless it is
    Fortran-ordered only), as a new array."""
    order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    device = array.device.id
    with cupy.cuda.Device(device):
        place = _fd.carve(array.nbytes, device)
        if place is None:
            segment = _fd.strategy().allocate(array.nbytes)
            assert isinstance(segment, _fd.DeviceSegment)
            place = (segment, 0)
        memory = cupy.cuda.UnownedMemory(place[0].address, place[0].size, place[0], device)
        out = cupy.ndarray(
            array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, place[1]), order=order
        )
        out[...] = array
    return out


_ipc_on: bool | None = None  # set_ipc's choice; None: PROCSPAWN_GPU_IPC


def set_ipc(enabled: bool) -> None:
    """Turn ``cuda_ipc`` on or off in this process (see ``sharing.cuda.set_ipc``)."""
    global _ipc_on
    _ipc_on = bool(enabled)


def ipc_enabled() -> bool:
    return _settings.get("PROCSPAWN_GPU_IPC") if _ipc_on is None else _ipc_on


def _own_place(array: Any, durable: bool) -> tuple[Segment, int] | None:
    """This process' own allocation ``array`` lies in, to send by IPC handle (cuda_ipc on,
    in a message that does not outlive this process), with the offset; None: copy it."""
    if durable or not ipc_enabled():
        return None
    return _ipc.own_segment(array.data.ptr, array.device.id)


def _reduce_cupy(array: Any) -> Any:
    if array.size == 0:
        return array.__reduce__()
    device = array.device.id
    with cupy.cuda.Device(device):
        place = shared_place(array)
        if place is None and array.nbytes < _settings.get("PROCSPAWN_GPU_INLINE_BYTES"):
            return (_rebuild_by_value, (array.get(), _fd.device_uuid(device)))
        handle = None
        with _slots.lock():  # (a sweep between keep and the slot's take would drop it)
            if place is None:
                place = _own_place(array, _message.sending().durable)
                if place is not None:  # this process' own memory, by IPC handle
                    own = place[0]
                    assert isinstance(own, _ipc.IpcSegment)
                    own.block = _slots.keep(own.key, array.data.mem)
            if place is not None:
                handle = _handles.segment_handle(place[0])  # (takes the slot)
        if place is None:
            try:
                array = copy_to_shared(array)
            except _driver.CudaError:
                if not _settings.get("PROCSPAWN_GPU_HOST_COPY"):
                    raise
                return (_rebuild_by_value, (array.get(), _fd.device_uuid(device)))
            place = shared_place(array)
            assert place is not None
            handle = _handles.segment_handle(place[0])
        sent = _events.record(device)
        return (
            _rebuild_cupy,
            (handle, place[1], array.shape, array.strides, array.dtype.str, sent),
        )


def _rebuild_cupy(
    handle: _handles.Handle,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: str,
    sent: tuple[int, bytes] | None,
) -> Any:
    segment = _handles.segment_from_handle(handle)
    assert isinstance(segment, _fd.DeviceMemory)
    with cupy.cuda.Device(segment.device):
        _events.wait(sent, segment.device)
        return _array_over(segment, offset, shape, strides, np.dtype(dtype))


def _rebuild_by_value(host: np.ndarray, uuid: bytes) -> Any:
    try:
        device = _fd.device_of(uuid)
    except RuntimeError:
        device = cupy.cuda.runtime.getDevice()  # a copy: any GPU will do
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def is_shared(array: Any) -> bool:
    """Whether a CuPy array is sent as the same memory: it lies in cuda_fd memory or came
    by cuda_ipc, or (cuda_ipc on) it lies in memory IPC can export and is not small."""
    if not isinstance(array, cupy.ndarray) or array.size == 0:
        return False
    with cupy.cuda.Device(array.device.id):
        if shared_place(array) is not None:
            return True
        if array.nbytes < _settings.get("PROCSPAWN_GPU_INLINE_BYTES") or not ipc_enabled():
            return False
        return _ipc.own_segment(array.data.ptr, array.device.id) is not None


_registry.register(cupy.ndarray, _reduce_cupy)
_registry.shared_tests[cupy.ndarray] = is_shared
