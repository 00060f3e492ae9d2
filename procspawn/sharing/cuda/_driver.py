"""The CUDA driver calls CuPy does not wrap: virtual memory management (VMM) with memory
exported as a POSIX file descriptor, through ctypes on ``libcuda.so.1``.

Nothing here is loaded until a GPU array is shared: ``import procspawn`` loads no CUDA
library. Every call raises :class:`CudaError` (the driver's error name and what was being
done) instead of returning a status. Standard library only.
"""

from __future__ import annotations

import ctypes
import threading

from .._errors import CudaError

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["CudaError"]

# cuda.h's values (the same in CUDA 11, 12 and 13)
_ALLOCATION_TYPE_PINNED = 1
_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1
_ATTRIBUTE_VMM_SUPPORTED = 102
_ATTRIBUTE_POSIX_FD_SUPPORTED = 103
_POINTER_IS_LEGACY_IPC_CAPABLE = 10
_POINTER_RANGE_START = 11
_POINTER_RANGE_SIZE = 12


class _Location(ctypes.Structure):
    # CUDA 13 puts ``id`` in a union with a 2-byte ``localized``: the same 8 bytes
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64 = ctypes.c_ulonglong
_size = ctypes.c_size_t
_ptr = ctypes.c_void_p
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuMemGetAllocationGranularity": [
        ctypes.POINTER(_size),
        ctypes.POINTER(_AllocationProp),
        ctypes.c_int,
    ],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocationProp), _u64],
    "cuMemExportToShareableHandle": [_ptr, _u64, ctypes.c_int, _u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), _ptr, ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemUnmap": [_u64, _size],
    "cuMemAddressFree": [_u64, _size],
    "cuMemRelease": [_u64],
    "cuPointerGetAttribute": [_ptr, ctypes.c_int, _u64],
}

_lib: Any = None
_lock = threading.Lock()
_granularity: dict[int, int] = {}
_supported: dict[int, bool] = {}


def _load() -> Any:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaError(
                    f"procspawn could not load the CUDA driver (libcuda.so.1: {exc}); GPU "
                    f"arrays need an NVIDIA driver on this machine"
                ) from None
            for name, argtypes in _SIGNATURES.items():
                function = getattr(lib, name)
                function.argtypes = argtypes
                function.restype = ctypes.c_int
            _lib = lib
            _check(lib.cuInit(0), "cuInit", "starting the CUDA driver")
    return _lib


def _check(status: int, call: str, doing: str) -> None:
    if status == 0:
        return
    name = ctypes.c_char_p()
    lib = _lib
    text = f"error {status}"
    if lib is not None and lib.cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value:
        text = name.value.decode()
    raise CudaError(f"{call} failed ({text}) while {doing}", status)


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = _HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location.type = _LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def vmm_supported(device: int) -> bool:
    """Whether ``device`` (an ordinal of this process) can make memory exported as a file
    descriptor."""
    supported = _supported.get(device)
    if supported is None:
        lib = _load()
        out = ctypes.c_int()
        supported = True
        for attribute in (_ATTRIBUTE_VMM_SUPPORTED, _ATTRIBUTE_POSIX_FD_SUPPORTED):
            status = lib.cuDeviceGetAttribute(ctypes.byref(out), attribute, device)
            _check(status, "cuDeviceGetAttribute", f"asking what GPU {device} supports")
            supported = supported and bool(out.value)
        _supported[device] = supported
    return supported


def granularity(device: int) -> int:
    """The size every VMM allocation on ``device`` is a multiple of (2 MiB on most GPUs)."""
    size = _granularity.get(device)
    if size is None:
        lib = _load()
        out = _size()
        prop = _prop(device)
        status = lib.cuMemGetAllocationGranularity(
            ctypes.byref(out), ctypes.byref(prop), _GRANULARITY_RECOMMENDED
        )
        _check(status, "cuMemGetAllocationGranularity", f"sizing memory on GPU {device}")
        size = _granularity[device] = int(out.value)
    return size


def create(nbytes: int, device: int) -> tuple[int, int]:
    """New device memory of ``nbytes`` (a multiple of ``granularity``) on ``device``,
    exported: ``(allocation handle, file descriptor)``; the caller owns both."""
    lib = _load()
    handle = _u64()
    prop = _prop(device)
    status = lib.cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(prop), 0)
    _check(status, "cuMemCreate", f"allocating {nbytes} bytes of shareable memory on GPU {device}")
    fd = ctypes.c_int(-1)
    status = lib.cuMemExportToShareableHandle(
        ctypes.byref(fd), handle.value, _HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
    )
    if status != 0:
        lib.cuMemRelease(handle.value)
        _check(status, "cuMemExportToShareableHandle", "exporting GPU memory as a descriptor")
    return int(handle.value), int(fd.value)


def import_fd(fd: int) -> int:
    """The allocation handle of memory another process exported as ``fd`` (which stays
    the caller's); release it with ``release``."""
    lib = _load()
    handle = _u64()
    status = lib.cuMemImportFromShareableHandle(
        ctypes.byref(handle), ctypes.c_void_p(fd), _HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    _check(status, "cuMemImportFromShareableHandle", "importing GPU memory another process shared")
    return int(handle.value)


def map_handle(handle: int, nbytes: int, device: int) -> int:
    """Map allocation ``handle`` (``nbytes``) readable and writable by ``device``; returns
    the device address. Undo with ``unmap``."""
    lib = _load()
    address = _u64()
    status = lib.cuMemAddressReserve(ctypes.byref(address), nbytes, 0, 0, 0)
    _check(status, "cuMemAddressReserve", f"reserving {nbytes} bytes of GPU address space")
    status = lib.cuMemMap(address.value, nbytes, 0, handle, 0)
    if status != 0:
        lib.cuMemAddressFree(address.value, nbytes)
        _check(status, "cuMemMap", "mapping shared GPU memory")
    access = _AccessDesc()
    access.location.type = _LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = _ACCESS_READWRITE
    status = lib.cuMemSetAccess(address.value, nbytes, ctypes.byref(access), 1)
    if status != 0:
        unmap(int(address.value), nbytes)
        _check(status, "cuMemSetAccess", f"making shared GPU memory accessible to GPU {device}")
    return int(address.value)


def unmap(address: int, nbytes: int) -> None:
    """Undo ``map_handle`` (errors ignored: this runs from finalizers)."""
    lib = _lib
    if lib is not None:
        lib.cuMemUnmap(address, nbytes)
        lib.cuMemAddressFree(address, nbytes)


def release(handle: int) -> None:
    """Give back an allocation handle (from ``create`` or ``import_fd``); errors ignored."""
    lib = _lib
    if lib is not None:
        lib.cuMemRelease(handle)


def allocation_of(pointer: int) -> tuple[int, int, bool]:
    """``(base, size, legacy IPC capable)`` of the allocation ``pointer`` lies in: its
    ``cudaMalloc`` block, whose IPC handle opens at the base (an array of CuPy's pool may
    sit at an offset in it). Not capable: managed memory, stream-ordered pools, VMM."""
    lib = _load()
    capable = ctypes.c_int(0)
    start = _u64()
    size = _size()
    doing = "finding the allocation a GPU array lies in"
    for attribute, out in (
        (_POINTER_IS_LEGACY_IPC_CAPABLE, capable),
        (_POINTER_RANGE_START, start),
        (_POINTER_RANGE_SIZE, size),
    ):
        status = lib.cuPointerGetAttribute(ctypes.byref(out), attribute, pointer)
        _check(status, "cuPointerGetAttribute", doing)
    return int(start.value), int(size.value), bool(capable.value)
