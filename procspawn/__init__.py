"""procspawn: spawn worker processes that share NumPy arrays through shared memory.

``import procspawn as mp`` is a drop-in for ``multiprocessing``: every public name of it is
here, and ``Process``, ``Queue``, ``JoinableQueue``, ``SimpleQueue``, ``Pipe``, ``Pool`` and
``get_context`` are procspawn's, which move arrays through shared memory.

Names are imported on first use (PEP 562), so a rank imports only what it needs: a worker
whose function never touches NumPy does not pay for importing it.
"""

from __future__ import annotations

import importlib
import multiprocessing as _multiprocessing
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from . import context, pool, sharing
    from ._dropin import Process, get_context
    from ._settings import SettingError
    from .context import (
        ProcessContext,
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
        ProcessTimeoutError,
        Progress,
        RayMissingError,
        RayResourcesError,
        progress,
        spawn,
        start_processes,
    )
    from .context._forkserver import set_forkserver_preload
    from .context._start_method import get_start_method, set_start_method
    from .pool import (
        InitializerError,
        Pool,
        ProcessPoolExecutor,
        TaskTimeoutError,
        TerminatedWorkerError,
        get_reusable_executor,
    )
    from .sharing import (
        ChannelClosed,
        FdLimitError,
        SharedMemoryFullError,
        get_all_sharing_strategies,
        get_sharing_strategy,
        set_sharing_strategy,
    )

# public name -> (module, attribute); attribute None means the module itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "context": (".context", None),
    "sharing": (".sharing", None),
    "ProcessContext": (".context", "ProcessContext"),
    "ProcessException": (".context", "ProcessException"),
    "ProcessExitedException": (".context", "ProcessExitedException"),
    "ProcessRaisedException": (".context", "ProcessRaisedException"),
    "ProcessTimeoutError": (".context", "ProcessTimeoutError"),
    "Progress": (".context", "Progress"),
    "RayMissingError": (".context", "RayMissingError"),
    "RayResourcesError": (".context", "RayResourcesError"),
    "SettingError": ("._settings", "SettingError"),
    "ChannelClosed": (".sharing", "ChannelClosed"),
    "FdLimitError": (".sharing", "FdLimitError"),
    "SharedMemoryFullError": (".sharing", "SharedMemoryFullError"),
    "progress": (".context._progress", "progress"),
    "set_forkserver_preload": (".context._forkserver", "set_forkserver_preload"),
    "spawn": (".context", "spawn"),
    "start_processes": (".context", "start_processes"),
    "Process": ("._dropin", "Process"),
    "get_context": ("._dropin", "get_context"),
    "get_start_method": (".context._start_method", "get_start_method"),
    "set_start_method": (".context._start_method", "set_start_method"),
    "InitializerError": (".pool", "InitializerError"),
    "Pool": (".pool", "Pool"),
    "ProcessPoolExecutor": (".pool", "ProcessPoolExecutor"),
    "TaskTimeoutError": (".pool", "TaskTimeoutError"),
    "TerminatedWorkerError": (".pool", "TerminatedWorkerError"),
    "get_reusable_executor": (".pool", "get_reusable_executor"),
    "pool": (".pool", None),
    "get_all_sharing_strategies": (".sharing", "get_all_sharing_strategies"),
    "get_sharing_strategy": (".sharing", "get_sharing_strategy"),
    "set_sharing_strategy": (".sharing", "set_sharing_strategy"),
}
# bound methods of procspawn's default context (multiprocessing's default start method)
_DEFAULT_CONTEXT_METHODS = ("Queue", "JoinableQueue", "SimpleQueue", "Pipe")

__all__ = [
    "ChannelClosed",
    "FdLimitError",
    "InitializerError",
    "JoinableQueue",
    "Pipe",
    "Pool",
    "Process",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessPoolExecutor",
    "ProcessRaisedException",
    "ProcessTimeoutError",
    "Progress",
    "Queue",
    "RayMissingError",
    "RayResourcesError",
    "SettingError",
    "SharedMemoryFullError",
    "SimpleQueue",
    "TaskTimeoutError",
    "TerminatedWorkerError",
    "__version__",
    "context",
    "get_all_sharing_strategies",
    "get_context",
    "get_reusable_executor",
    "get_sharing_strategy",
    "get_start_method",
    "pool",
    "progress",
    "set_forkserver_preload",
    "set_sharing_strategy",
    "set_start_method",
    "sharing",
    "spawn",
    "start_processes",
]

# The rest of multiprocessing's public names (Lock, Event, Manager, cpu_count, ...), as they
# are, for `import procspawn as mp`.
_MP_NAMES = [n for n in _multiprocessing.__all__ if n not in __all__ and not n.startswith("_")]
globals().update({name: getattr(_multiprocessing, name) for name in _MP_NAMES})
__all__ += _MP_NAMES


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name, __name__)
        value = module if attr is None else getattr(module, attr)
    elif name in _DEFAULT_CONTEXT_METHODS:
        from ._dropin import default_context

        value = getattr(default_context, name)
    else:
        raise AttributeError(f"module 'procspawn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
