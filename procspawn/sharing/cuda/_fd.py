"""The ``cuda_fd`` strategy: device memory from ``cuMemCreate``, exported as a POSIX file
descriptor that rides inside the message as a memfd does.

Who holds what. The maker of a segment maps it and keeps the exported descriptor (to send
it); a receiver gets a duplicate of that descriptor with the message, imports it, maps it
and keeps the descriptor too (to send it on). The allocation handles are given back as
soon as the memory is mapped: from then on the driver counts the mappings and the
descriptors, in every process, and frees the memory when the last is gone. That count is
the lifetime: nothing to collect, nothing left behind when a process is SIGKILLed (the
kernel closes its descriptors and the driver its mappings), and memory stays valid in a
receiver after its maker exited.

A ``DeviceSegment`` is a ``Segment`` whose address is a device address: the per-message
memo, the receiver's map cache (one mapping per segment per process) and the strategy
registry are the host segments' own. Its mapping goes when the last CuPy array over it
does, once the work the current stream had queued is done (the release synchronises that
stream, as torch's does for a received storage).

Small arrays (``zeros``/``empty`` under half the granularity, copies made at a send) are
carved out of slabs of one granularity (2 MiB on most GPUs), as small host arrays are.
"""

from __future__ import annotations

import bisect
import os
import secrets
import threading
import time
import weakref

import cupy

from ... import _settings
from ..._late import renew_lock_in_child
from .. import _message
from ..segments import _mapcache, _strategy
from ..segments._segment import Segment
from ..segments._strategy import SharingStrategy
from . import _driver

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

NAME = "cuda_fd"
_ALIGN = 512  # as CuPy's pool aligns its chunks

_lock = threading.Lock()
renew_lock_in_child(globals())
# device -> sorted start addresses, and (device, start) -> (end, weak reference) of every
# live device segment of this process (cuda_fd, and cuda_ipc received): which segment an
# array's pointer lies in
_starts: dict[int, list[int]] = {}
_ranges: dict[tuple[int, int], tuple[int, weakref.ref[Any]]] = {}
_uuids: list[bytes] = []  # device ordinal of this process -> its UUID


def device_uuid(device: int) -> bytes:
    """The UUID of ``device`` (an ordinal of this process): the same GPU has the same UUID
    in every process, whatever its ``CUDA_VISIBLE_DEVICES``."""
    if not _uuids:
        count = cupy.cuda.runtime.getDeviceCount()
        _uuids[:] = [bytes(cupy.cuda.runtime.getDeviceProperties(i)["uuid"]) for i in range(count)]
    return _uuids[device]


def device_of(uuid: bytes) -> int:
    """This process' ordinal of the GPU with ``uuid``.

    Raises:
        RuntimeError: this process does not see that GPU (its ``CUDA_VISIBLE_DEVICES``).
    """
    device_uuid(0)
    try:
        return _uuids.index(uuid)
    except ValueError:
        raise RuntimeError(
            f"received a GPU array on the GPU with UUID {uuid.hex()}, which this process "
            f"does not see (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
            f", {len(_uuids)} GPU(s) visible): give the receiving process that GPU too, or "
            f"copy the array to host memory (array.get()) before sending it"
        ) from None


class DeviceMemory(Segment):
    """A device segment: a ``Segment`` whose address is a device address on ``device``
    (an ordinal of this process); ``uuid`` names that GPU across processes."""

    __slots__ = ("device", "uuid")

    def _fields(self, *, address: int, size: int, strategy: str, key: Any, device: int) -> None:
        # Segment.__init__ maps host memory: a device segment sets the fields itself
        self.address = address
        self.size = size
        self.strategy = strategy
        self.key = key
        self.fd = -1
        self.name = None
        self.view = None
        self.reused = False
        self.recycled = False
        self.header = 0
        self.device = device
        self.uuid = device_uuid(device)


class DeviceSegment(DeviceMemory):
    """A mapping of ``cuda_fd`` memory in this process (see the module's text); ``fd`` is
    the exported descriptor, which it keeps."""

    __slots__ = ()

    def __init__(self, *, address: int, size: int, key: Any, fd: int, device: int) -> None:
        self._fields(address=address, size=size, strategy=NAME, key=key, device=device)
        self.fd = fd
        self._finalizer = weakref.ref(self, _released)
        with _lock:
            _live[self._finalizer] = (device, address, size, fd, os.getpid())
        track(self, self._finalizer)

    def __repr__(self) -> str:
        return f"<procspawn DeviceSegment cuda_fd GPU {self.device} size={self.size}>"


# weak reference -> (device, address, size, fd, pid) of every live DeviceSegment
_live: dict[weakref.ref[Any], tuple[int, int, int, int, int]] = {}


def _released(ref: weakref.ref[Any]) -> None:
    """The last array over a DeviceSegment is gone: unmap it once the work queued on the
    current stream before now is done (CuPy's pool reuses memory in the same order). At
    interpreter exit this may run after the module's globals are gone: then the driver
    frees it with the process."""
    try:
        with _lock:
            entry = _live.pop(ref, None)
    except Exception:  # noqa: BLE001 -- module globals already cleared (interpreter exit)
        return
    if entry is None:
        return
    device, address, size, fd, pid = entry
    untrack(device, address, ref)
    if pid != os.getpid():  # a forked child that merely inherited it
        return
    try:
        with cupy.cuda.Device(device):
            cupy.cuda.get_current_stream().synchronize()
    except Exception:  # noqa: BLE001,S110 -- at interpreter exit: nothing runs any more
        pass
    _driver.unmap(address, size)
    os.close(fd)


def held() -> int:
    """Bytes of shareable device memory this process maps now."""
    with _lock:
        return sum(entry[2] for entry in _live.values() if entry[4] == os.getpid())


def track(segment: Segment, ref: weakref.ref[Any]) -> None:
    """Let ``segment_at`` find the device segment ``segment`` (``ref`` is its weak
    reference; ``untrack`` with it when it goes)."""
    device = segment.device  # type: ignore[attr-defined]
    with _lock:
        starts = _starts.setdefault(device, [])
        if (device, segment.address) not in _ranges:
            bisect.insort(starts, segment.address)
        _ranges[(device, segment.address)] = (segment.address + segment.size, ref)


def untrack(device: int, address: int, ref: weakref.ref[Any]) -> None:
    """Forget the device segment at ``address`` if ``ref`` is still the one there."""
    with _lock:
        entry = _ranges.get((device, address))
        if entry is None or entry[1] is not ref:
            return
        del _ranges[(device, address)]
        starts = _starts.get(device, [])
        index = bisect.bisect_left(starts, address)
        if index < len(starts) and starts[index] == address:
            del starts[index]


def segment_at(pointer: int, device: int) -> tuple[Segment, int] | None:
    """The live device segment of this process (made here or received) that ``pointer``
    lies in, with the offset, or None."""
    with _lock:
        starts = _starts.get(device)
        if not starts:
            return None
        index = bisect.bisect_right(starts, pointer) - 1
        if index < 0:
            return None
        start = starts[index]
        end, ref = _ranges[(device, start)]
    segment = ref()
    if segment is None or pointer >= end:
        return None
    return segment, pointer - start


def _rounded(nbytes: int, device: int) -> int:
    unit = _driver.granularity(device)
    return max(unit, -(-nbytes // unit) * unit)


class CudaFdStrategy(SharingStrategy):
    """Shareable device memory on the current CUDA device (see the module's text)."""

    def allocate(self, nbytes: int) -> Segment:
        device = cupy.cuda.runtime.getDevice()
        if not _driver.vmm_supported(device):
            raise _driver.CudaError(
                f"GPU {device} cannot export memory as a file descriptor (no virtual "
                f"memory management, or no POSIX descriptor handles: a MIG instance, WSL2 "
                f"or an old driver), so procspawn cannot share its arrays. Send "
                f"array.get() (a host copy) instead, or set PROCSPAWN_GPU_HOST_COPY=1 to "
                f"have procspawn send such arrays as host copies."
            )
        size = _rounded(nbytes, device)
        handle, fd = _driver.create(size, device)
        try:
            address = _driver.map_handle(handle, size, device)
        except BaseException:
            os.close(fd)
            raise
        finally:
            _driver.release(handle)  # the mapping and the descriptor hold it now
        segment = DeviceSegment(
            address=address, size=size, key=secrets.token_bytes(12), fd=fd, device=device
        )
        with _mapcache.lock():  # a handle of it coming back resolves to this mapping
            _mapcache.remember(segment)
        # fresh segments are zero, as on the host (in the order of the current stream)
        cupy.cuda.runtime.memsetAsync(address, 0, size, cupy.cuda.get_current_stream().ptr)
        return segment

    def reduce(self, segment: Segment) -> object:
        assert isinstance(segment, DeviceSegment)
        return (_message.attach_fd(segment.fd, segment), segment.size, segment.uuid, segment.key)

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        linger(segment)

    def rebuild(self, handle: Any) -> Segment:
        index, size, uuid, key = handle
        device = device_of(uuid)
        fd = os.dup(_message.received_fd(index))
        try:
            with cupy.cuda.Device(device):
                allocation = _driver.import_fd(fd)
                try:
                    address = _driver.map_handle(allocation, size, device)
                finally:
                    _driver.release(allocation)
        except BaseException:
            os.close(fd)
            raise
        segment = DeviceSegment(address=address, size=size, key=key, fd=fd, device=device)
        linger(segment)
        return segment


# -- slabs: small arrays share one allocation -------------------------------------------------

_filling: dict[int, tuple[weakref.ref[Any], int]] = {}  # device -> (slab, bytes used)
_carving = threading.Lock()
renew_lock_in_child(globals(), "_carving")


def carve(nbytes: int, device: int) -> tuple[DeviceSegment, int] | None:
    """``nbytes`` of zeroed shareable memory on ``device`` in a slab, as (slab, offset);
    None when the array should have a segment of its own."""
    unit = _driver.granularity(device)
    if not 0 < nbytes <= unit // 2:
        return None
    need = -(-nbytes // _ALIGN) * _ALIGN
    with _carving:
        entry = _filling.get(device)
        slab, used = (entry[0](), entry[1]) if entry is not None else (None, 0)
        if slab is None or used + need > slab.size:
            with cupy.cuda.Device(device):
                slab, used = strategy().allocate(unit), 0
        assert isinstance(slab, DeviceSegment)
        _filling[device] = (weakref.ref(slab), used + need)
    return slab, used


def strategy() -> SharingStrategy:
    """The registered ``cuda_fd`` strategy object."""
    found = _strategy.strategy_named(NAME)
    assert found is not None
    return found


# -- linger: a received mapping outlives its last array by PROCSPAWN_GPU_LINGER seconds ------
#
# Mapping shareable memory costs about as much as moving a few MiB (import, reserve, map,
# set access), so a consumer that drops each array it gets and receives the same memory
# again would pay it every time. A received segment is kept for a while after each receipt:
# memory kept on purpose, bounded in time, given back by ``release_lingering()``
# (``sharing.cuda.collect()``).

# (strategy, key) -> (segment, deadline)
_lingering: dict[tuple[str, Any], tuple[Segment, float]] = {}
_wake = threading.Condition(threading.Lock())
_keeper: threading.Thread | None = None


def linger(segment: Segment) -> None:
    """Keep received ``segment`` mapped until PROCSPAWN_GPU_LINGER seconds from now."""
    global _keeper
    seconds = _settings.get("PROCSPAWN_GPU_LINGER")
    if seconds <= 0:
        return
    with _wake:
        _lingering[(segment.strategy, segment.key)] = (segment, time.monotonic() + seconds)
        if _keeper is None or not _keeper.is_alive():
            _keeper = threading.Thread(target=_keep, name="procspawn-gpu-linger", daemon=True)
            _keeper.start()
        _wake.notify()


def _keep() -> None:
    """Drop each lingering segment at its deadline (the keeper thread; it ends after 5 s
    with nothing to keep)."""
    global _keeper
    while True:
        with _wake:
            now = time.monotonic()
            expired = [key for key, (_, deadline) in _lingering.items() if deadline <= now]
            dropped = [_lingering.pop(key) for key in expired]
            if not dropped:
                if not _lingering:
                    _wake.wait(5.0)
                    if not _lingering:
                        _keeper = None
                        return
                else:
                    soonest = min(deadline for _, deadline in _lingering.values())
                    _wake.wait(max(0.0, soonest - now))
                continue
        del dropped  # (outside the lock: releasing a segment syncs its stream and unmaps)


def release_lingering() -> int:
    """Let go now of every received segment kept by the linger; returns how many."""
    with _wake:
        dropped = list(_lingering.values())
        _lingering.clear()
    count = len(dropped)
    del dropped
    return count


def _reset_after_fork() -> None:
    global _keeper, _wake
    _lingering.clear()
    _keeper = None
    _wake = threading.Condition(threading.Lock())


os.register_at_fork(after_in_child=_reset_after_fork)
