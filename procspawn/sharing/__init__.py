"""Moving data between processes: arrays through shared memory, pluggable strategies."""

from . import _reductions  # noqa: F401  (registers the ndarray reducer)
from ._arrays import empty, is_shared, share_memory_, zeros
from ._fdpass import FdLimitError
from ._pickler import attach_fd, dumps, loads, received_fd, register
from ._resources import SharedMemoryFullError
from ._segment import Segment
from ._strategy import (
    SharingStrategy,
    get_all_sharing_strategies,
    get_sharing_strategy,
    register_strategy,
    set_sharing_strategy,
)

__all__ = [
    "FdLimitError",
    "Segment",
    "attach_fd",
    "received_fd",
    "SharedMemoryFullError",
    "SharingStrategy",
    "dumps",
    "empty",
    "get_all_sharing_strategies",
    "get_sharing_strategy",
    "is_shared",
    "loads",
    "register",
    "register_strategy",
    "set_sharing_strategy",
    "share_memory_",
    "zeros",
]
