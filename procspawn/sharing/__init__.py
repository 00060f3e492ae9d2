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

Layout, in levels: a module imports only from the levels below it.

======  ==========================================================================
level   modules
======  ==========================================================================
0       ``_limits`` (errors, fd limit, reserving space), ``_message`` (a message's
        descriptors, per thread), ``_registry`` (reducer table, plug-ins as data),
        ``_manager_main`` (the daemon: names, counts, sweeping; stdlib only),
        ``_tree`` (the process tree's daemon address)
1       ``_segment`` (a mapping and its release), ``_mapcache`` (one Segment per key
        per process, weakly), ``_manager`` (the daemon's client),
        ``_fdpass`` (message framing over UNIX sockets, SCM_RIGHTS)
2       ``_strategy`` (interface, registry), ``_file_descriptor``, ``_file_system``,
        ``_recycled`` (recycled segments: the producer-side cache of send copies)
3       ``_handles`` (segment <-> wire form, once per message), ``_ndarray`` (layout),
        ``_slabs`` (small arrays carved out of shared slabs)
4       ``_reductions`` (ndarray reducers: procspawn and stdlib channels), ``_arrays``
5       ``_pickler`` (``dumps`` / ``loads``)
6       ``_connection``, ``_queues``, ``_startup`` (channels, the start-up message)
======  ==========================================================================

Names are imported on first use; NumPy is imported only with the array helpers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:  # pragma: no cover
    from ._arrays import empty, is_shared, share_memory_, trim, zeros
    from ._errors import ChannelClosed, FdLimitError, SharedMemoryFullError
    from ._message import attach_fd, received_fd
    from ._pickler import dumps, loads
    from ._registry import register
    from ._segment import Segment
    from ._strategy import (
        SharingStrategy,
        get_all_sharing_strategies,
        get_sharing_strategy,
        register_strategy,
        set_sharing_strategy,
    )

_LAZY = {
    "ChannelClosed": "._limits",
    "FdLimitError": "._limits",
    "Segment": "._segment",
    "SharedMemoryFullError": "._limits",
    "SharingStrategy": "._strategy",
    "attach_fd": "._message",
    "dumps": "._pickler",
    "empty": "._arrays",
    "get_all_sharing_strategies": "._strategy",
    "get_sharing_strategy": "._strategy",
    "is_shared": "._arrays",
    "loads": "._pickler",
    "received_fd": "._message",
    "register": "._registry",
    "register_strategy": "._strategy",
    "set_sharing_strategy": "._strategy",
    "share_memory_": "._arrays",
    "trim": "._arrays",
    "zeros": "._arrays",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
