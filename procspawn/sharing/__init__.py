"""Moving data between processes: arrays through shared memory, pluggable strategies.

The lifetime rule
-----------------
A shared segment is held by the arrays over it (any view, in any process) and by the
messages that carry it while they are in flight, and by nothing else. When the last
holder lets go, or the last process holding it dies in any way (SIGKILL included), its
memory goes back and, under ``file_system``, its name leaves /dev/shm within seconds,
while every other process of the program goes on. No cache keeps a segment past its last
array: a receiver maps each segment once (two handles to one segment give arrays that
share memory) and holds that mapping weakly. Small arrays are carved out of slabs (one
segment, many arrays): a slab is held while any array in it is, anywhere. The one
memory kept on purpose is the cache of recycled segments (``_recycled``): segments that
carried a copy at a send, kept once nobody anywhere holds them, bounded, visible and given
back by ``trim()``.

How each strategy keeps the rule: ``file_descriptor`` segments are anonymous memfds, freed
by the kernel when their last descriptor and mapping are gone. ``file_system`` segments
count the processes that map them and the last one unlinks the name; a per-tree cleanup
daemon drops what a dead process held, and the next daemon (or ``procspawn cleanup``)
sweeps what a tree killed whole left behind. Both kinds of message carry the segment's
descriptor, so a message keeps its memory alive by itself, after its sender exited too.

Layout: a ground floor and five rooms, each importing only from the floors below it (and
inside a room, from the modules listed before it on its line):

==========  =============================================================================
floor       modules
==========  =============================================================================
0 ground    ``_errors`` (what ran out and what to do; the fd limit; reserving space),
            ``_message`` (a message's descriptors, per thread), ``_registry`` (the
            reducer table; plug-ins as data)
1 daemon/   ``_table`` (a named segment's holder table, the sweep; stdlib only),
            ``_main`` (the cleanup daemon, run by path: imports nothing of procspawn),
            ``_tree`` (this process tree's daemon address), ``_client`` (the daemon's
            client)
2 segments/ ``_segment`` (a mapping and its release), ``_mapcache`` (one Segment per key
            per process, weakly), ``_recycled`` (the producer-side cache of send
            copies), ``_strategy`` (interface, registry, the current one),
            ``_file_descriptor``, ``_file_system`` (the two strategies), ``_slabs``
            (small arrays carved out of shared slabs), ``_ndarray`` (array layout over
            segments), ``_arrays`` (the public empty/zeros/is_shared/share_memory_/trim)
3 wire/     ``_handles`` (a segment on the wire, once per message), ``_reductions``
            (ndarray reducers: procspawn and stdlib channels), ``_swap`` (an object sent
            with other arrays in place of its own), ``_pickler`` (``dumps`` / ``loads``)
4 channels/ ``_fdpass`` (message framing over UNIX sockets, SCM_RIGHTS),
            ``_connection`` (Connection, Pipe), ``_queues``, ``_startup`` (the start-up
            message)
5 cuda/     GPU arrays (CuPy, imported only there; ``procspawn.sharing.cuda``):
            ``_driver`` (the CUDA driver calls CuPy lacks, ctypes), ``_slots`` (who holds
            memory another allocator made; host only), ``_events`` (ordering),
            ``_fd`` (the ``cuda_fd`` strategy, slabs, linger), ``_ipc`` (``cuda_ipc``),
            ``_cupy`` (the CuPy plug-in: reducers), ``_arrays`` (the public helpers)
==========  =============================================================================

Names are imported on first use; NumPy is imported only with the array helpers.
"""

from __future__ import annotations

from .._lazy import lazy_names

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)

if TYPE_CHECKING:  # pragma: no cover
    from ._errors import ChannelClosed as ChannelClosed
    from ._errors import CudaError as CudaError
    from ._errors import FdLimitError as FdLimitError
    from ._errors import SharedMemoryFullError as SharedMemoryFullError
    from ._message import attach_fd as attach_fd
    from ._message import received_fd as received_fd
    from ._registry import register as register
    from .segments._arrays import empty as empty
    from .segments._arrays import is_shared as is_shared
    from .segments._arrays import share_memory_ as share_memory_
    from .segments._arrays import trim as trim
    from .segments._arrays import zeros as zeros
    from .segments._segment import Segment as Segment
    from .segments._strategy import SharingStrategy as SharingStrategy
    from .segments._strategy import get_all_sharing_strategies as get_all_sharing_strategies
    from .segments._strategy import get_sharing_strategy as get_sharing_strategy
    from .segments._strategy import register_strategy as register_strategy
    from .segments._strategy import set_sharing_strategy as set_sharing_strategy
    from .wire._pickler import dumps as dumps
    from .wire._pickler import loads as loads

_LAZY = {
    "ChannelClosed": "._errors",
    "CudaError": "._errors",
    "FdLimitError": "._errors",
    "Segment": ".segments._segment",
    "SharedMemoryFullError": "._errors",
    "SharingStrategy": ".segments._strategy",
    "attach_fd": "._message",
    "dumps": ".wire._pickler",
    "empty": ".segments._arrays",
    "get_all_sharing_strategies": ".segments._strategy",
    "get_sharing_strategy": ".segments._strategy",
    "is_shared": ".segments._arrays",
    "loads": ".wire._pickler",
    "received_fd": "._message",
    "register": "._registry",
    "register_strategy": ".segments._strategy",
    "set_sharing_strategy": ".segments._strategy",
    "share_memory_": ".segments._arrays",
    "trim": ".segments._arrays",
    "zeros": ".segments._arrays",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
