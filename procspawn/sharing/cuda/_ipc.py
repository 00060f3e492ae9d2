"""The ``cuda_ipc`` strategy: device memory procspawn did not allocate (CuPy's pool, any
``cudaMalloc``), sent as its allocation's IPC handle, with a slot that says who holds it.

An ``IpcSegment`` is one ``cudaMalloc`` allocation as a process sees it:

* in its **producer** (the process that allocated it): the allocation itself, at its base
  address; each send keeps the memory of the arrays sent (``_slots.keep``) and takes a
  slot for the message (``reduce``, once per message and allocation);
* in a **receiver**: the allocation opened once (``cudaIpcOpenMemHandle``, one mapping per
  process for every array over it, through the map cache), holding the slots of the
  messages that brought it. When the last array over it goes (and its linger), the
  mapping is closed first and the slots are freed after, so a producer never frees
  memory a live receiver still has open. A receiver that dies in any way holds nothing:
  the driver closes its mappings, and the producer's sweep sees its pid gone.

A received array can be sent on: the forwarder takes a slot in the producer's own slab
(it maps it already: the slab came with the message), so the producer keeps the memory
for the next receiver too, whoever dies first. A handle that comes back to its producer
resolves to the producer's own memory.

The memory is the producer's: it goes when the producer exits. So a message that may be
read after its sender exited (a rank's result, a pool worker's) copies the sender's own
memory into ``cuda_fd`` memory instead (``_message.SendState.durable``).
"""

from __future__ import annotations

import os
import weakref

import cupy

from .. import _message
from .._errors import CudaError
from ..segments import _mapcache
from ..segments._segment import Segment
from ..segments._strategy import SharingStrategy
from ..wire import _handles
from . import _driver, _fd, _slots

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

NAME = "cuda_ipc"

# weak reference -> (pid, device, address, holds, size) of every opened IpcSegment
_opened: dict[weakref.ref[Any], tuple[int, int, int, list[tuple[Segment, int, int]], int]] = {}


class IpcSegment(_fd.DeviceMemory):
    """A ``cudaMalloc`` allocation as this process sees it (see the module's text).

    ``producer`` is ``(pid, start time)`` of the process that allocated it, ``origin`` its
    base address there, ``block`` the producer's block that keeps it, ``slab`` the
    producer's slot slab (None in the producer), ``holds`` the slots this process holds,
    ``keepalive`` what keeps the memory of arrays built on it in its producer.
    """

    __slots__ = (
        "producer",
        "origin",
        "ipc_handle",
        "block",
        "slab",
        "holds",
        "keepalive",
    )

    def __init__(
        self,
        address: int,
        size: int,
        device: int,
        producer: tuple[int, int],
        origin: int,
        ipc_handle: bytes,
        block: int,
        slab: Segment | None,
    ) -> None:
        """Opened here when ``slab`` is given (a receiver's mapping, closed when it goes);
        else the producer's own memory."""
        key = (producer, ipc_handle)
        self._fields(address=address, size=size, strategy=NAME, key=key, device=device)
        self.producer = producer
        self.origin = origin
        self.ipc_handle = ipc_handle
        self.block = block
        self.slab = slab
        self.holds: list[tuple[Segment, int, int]] = []  # (slab, slot, block)
        self.keepalive: Any = None
        if slab is not None:
            self._finalizer = weakref.ref(self, _closed)
            _opened[self._finalizer] = (os.getpid(), device, address, self.holds, size)
            _fd.track(self, self._finalizer)

    def __repr__(self) -> str:
        return f"<procspawn IpcSegment cuda_ipc GPU {self.device} size={self.size}>"


def _closed(ref: weakref.ref[Any], opened: dict[Any, Any] = _opened) -> None:
    """The last array over a received allocation is gone: close the mapping once the
    current stream's work is done, then free the slots that held it. (``opened`` is
    bound here: at interpreter exit this may run after the module's globals are gone.)"""
    entry = opened.pop(ref, None)
    if entry is None:
        return
    pid, device, address, holds, _ = entry
    try:
        _fd.untrack(device, address, ref)
        if pid != os.getpid():  # a forked child that merely inherited it
            return
        with cupy.cuda.Device(device):
            cupy.cuda.get_current_stream().synchronize()
            cupy.cuda.runtime.ipcCloseMemHandle(address)
    except Exception:  # noqa: BLE001 -- at exit, or the producer's context is gone
        return  # (at exit the driver closes it with the process; slots: the sweep)
    for slab, index, _ in holds:  # (after the close: see the module's text)
        _slots.free(slab, index)


def opened_bytes() -> int:
    """Bytes of other processes' allocations this process has open."""
    me = os.getpid()
    return sum(entry[4] for entry in list(_opened.values()) if entry[0] == me)


def own_segment(pointer: int, device: int) -> tuple[IpcSegment, int] | None:
    """This process' own allocation that ``pointer`` lies in, as an IpcSegment, with the
    offset; None when the driver cannot export it by IPC (managed memory, a stream-ordered
    pool, memory of another process or of cuda_fd)."""
    base, size, capable = _driver.allocation_of(pointer)
    if not capable:
        return None
    ipc_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
    me = _slots.identity()
    with _mapcache.lock():
        segment = _mapcache.cached(NAME, (me, ipc_handle))
        if segment is None:
            segment = IpcSegment(base, size, device, me, base, ipc_handle, 0, None)
            _mapcache.remember(segment)
    assert isinstance(segment, IpcSegment)
    return segment, pointer - base


class CudaIpcStrategy(SharingStrategy):
    """Memory another allocator made, shared by IPC handle and slots (module's text)."""

    def allocate(self, nbytes: int) -> Segment:
        raise TypeError(
            "cuda_ipc shares memory that CuPy or another allocator made; new shareable "
            "memory comes from procspawn.sharing.cuda.zeros/empty (cuda_fd)"
        )

    def reduce(self, segment: Segment) -> object:
        assert isinstance(segment, IpcSegment)
        if segment.producer == _slots.identity():
            got = _slots.take(segment.block)
        else:
            got = _slots.take(segment.block, segment.slab)
            if got is None:
                raise CudaError(
                    "a GPU array received from another process cannot be sent on: all "
                    f"{_slots.SLOTS} slots of its producer's slab are in use. Send a copy "
                    "(sharing.cuda.share_memory_(array.copy())) instead."
                )
        assert got is not None
        slab, index = got
        _message.sending().on_abandon.append(lambda: _slots.free(slab, index))
        return (
            _handles.segment_handle(slab),
            index,
            segment.block,
            segment.ipc_handle,
            segment.size,
            segment.uuid,
            segment.producer,
            segment.origin,
        )

    def rebuild(self, handle: Any) -> Segment:
        slab_handle, index, block, ipc_handle, size, uuid, producer, origin = handle
        slab = _handles.segment_from_handle(slab_handle)
        device = _fd.device_of(uuid)
        if producer == _slots.identity():  # back home: the producer's own memory
            _slots.free(slab, index)
            keepalive = _slots.keepalives(block)
            if keepalive is None:
                raise CudaError("a GPU array came back to its producer after it let go of it")
            home = IpcSegment(origin, size, device, producer, origin, ipc_handle, block, None)
            home.keepalive = keepalive
            return home
        _slots.hold(slab, index)
        try:
            with cupy.cuda.Device(device):
                address = cupy.cuda.runtime.ipcOpenMemHandle(ipc_handle)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            _slots.free(slab, index)
            raise CudaError(
                f"a GPU array from process {producer[0]} could not be opened here ({exc}): "
                f"its producer has probably exited (memory shared by IPC handle lives as "
                f"long as the process that allocated it), or the processes do not share "
                f"a PID namespace. Keep the producer alive until the array is received, "
                f"or send arrays from sharing.cuda.zeros/empty (cuda_fd), which outlive it."
            ) from None
        segment = IpcSegment(address, size, device, producer, origin, ipc_handle, block, slab)
        segment.holds.append((slab, index, block))
        _fd.linger(segment)
        return segment

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        assert isinstance(segment, IpcSegment)
        slab_handle, index, block = handle[:3]
        slab = _handles.segment_from_handle(slab_handle)
        if segment.producer == _slots.identity():
            _slots.free(slab, index)
            if segment.keepalive is None:
                segment.keepalive = _slots.keepalives(block)
            return
        if any(held == block for _, _, held in segment.holds):
            _slots.free(slab, index)  # one slot per block is enough while it is open
        else:
            _slots.hold(slab, index)
            segment.holds.append((slab, index, block))
            segment.block, segment.slab = block, slab
        _fd.linger(segment)
