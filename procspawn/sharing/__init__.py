"""Moving data between processes: arrays through shared memory, pluggable strategies.

Names are imported on first use; NumPy is imported only with the array helpers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:  # pragma: no cover
    from ._arrays import empty, is_shared, share_memory_, zeros
    from ._fdpass import FdLimitError
    from ._pickler import attach_fd, dumps, loads, received_fd, register
    from ._resources import SharedMemoryFullError
    from ._segment import Segment, release_unused
    from ._strategy import (
        SharingStrategy,
        get_all_sharing_strategies,
        get_sharing_strategy,
        register_strategy,
        set_sharing_strategy,
    )

_LAZY = {
    "FdLimitError": "._fdpass",
    "Segment": "._segment",
    "SharedMemoryFullError": "._resources",
    "SharingStrategy": "._strategy",
    "attach_fd": "._pickler",
    "dumps": "._pickler",
    "empty": "._arrays",
    "get_all_sharing_strategies": "._strategy",
    "get_sharing_strategy": "._strategy",
    "is_shared": "._arrays",
    "loads": "._pickler",
    "received_fd": "._pickler",
    "register": "._pickler",
    "register_strategy": "._strategy",
    "release_unused": "._segment",
    "set_sharing_strategy": "._strategy",
    "share_memory_": "._arrays",
    "zeros": "._arrays",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
