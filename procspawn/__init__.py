"""procspawn: spawn worker processes that share NumPy arrays through shared memory.

``import procspawn as mp`` is a drop-in for ``multiprocessing``: every public name of it is
here, and ``Process``, ``Queue``, ``JoinableQueue``, ``SimpleQueue``, ``Pipe``, ``Pool`` and
``get_context`` are procspawn's, which move arrays through shared memory. The primitives
tied to a start method (``Lock``, ``RLock``, ``Condition``, ``Semaphore``,
``BoundedSemaphore``, ``Event``, ``Barrier``, ``Value``, ``Array``, ``Manager``) are made
by procspawn's default context, so that they can be passed to procspawn's processes.

Names are imported on first use (PEP 562), so a rank imports only what it needs: a worker
whose function never touches NumPy does not pay for importing it.

Levels, each module importing only from those below it (the subpackages state their own
inside them; this table and theirs are the only places that state levels):

    7  cli: the procspawn command
    6  this package: the public names
    5  _dropin: the multiprocessing drop-in;  joblib: the joblib backend (an extra)
    4  pool/: Pool, the executors;  _run: procspawn run
    3  context/: spawn, its ranks, the watcher every parent uses
    2  sharing/: shared memory, the wire, channels, the cleanup daemon, GPU arrays
    1  _log: procspawn's logger
    0  _settings: every setting;  _output: the children's stdout and stderr;  _lazy:
       names on first use;  and under them _generic (Generic, TypeVar without typing),
       _late (imports after start-up that a fork must not cut in half), _version
"""

from __future__ import annotations

import multiprocessing as _multiprocessing

from ._late import late_import
from ._version import __version__

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)

if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

    from . import context as context
    from . import pool as pool
    from . import sharing as sharing
    from ._dropin import Process as Process
    from ._dropin import default_context
    from ._dropin import get_context as get_context
    from ._settings import SettingError as SettingError
    from .context import ProcessContext as ProcessContext
    from .context import ProcessException as ProcessException
    from .context import ProcessExitedException as ProcessExitedException
    from .context import ProcessRaisedException as ProcessRaisedException
    from .context import ProcessTimeoutError as ProcessTimeoutError
    from .context import Progress as Progress
    from .context import RayMissingError as RayMissingError
    from .context import RayResourcesError as RayResourcesError
    from .context import progress as progress
    from .context import spawn as spawn
    from .context import start_processes as start_processes
    from .context.launch._forkserver import set_forkserver_preload as set_forkserver_preload
    from .context.launch._start_method import get_start_method as get_start_method
    from .context.launch._start_method import set_start_method as set_start_method
    from .pool import InitializerError as InitializerError
    from .pool import Pool as Pool
    from .pool import ProcessPoolExecutor as ProcessPoolExecutor
    from .pool import TaskTimeoutError as TaskTimeoutError
    from .pool import TerminatedWorkerError as TerminatedWorkerError
    from .pool import get_reusable_executor as get_reusable_executor
    from .pool import process_map as process_map
    from .sharing import ChannelClosed as ChannelClosed
    from .sharing import CudaError as CudaError
    from .sharing import FdLimitError as FdLimitError
    from .sharing import SharedMemoryFullError as SharedMemoryFullError
    from .sharing import get_all_sharing_strategies as get_all_sharing_strategies
    from .sharing import get_sharing_strategy as get_sharing_strategy
    from .sharing import set_sharing_strategy as set_sharing_strategy

    Queue = default_context.Queue
    JoinableQueue = default_context.JoinableQueue
    SimpleQueue = default_context.SimpleQueue
    Pipe = default_context.Pipe
    Lock = default_context.Lock
    RLock = default_context.RLock
    Condition = default_context.Condition
    Semaphore = default_context.Semaphore
    BoundedSemaphore = default_context.BoundedSemaphore
    Event = default_context.Event
    Barrier = default_context.Barrier
    Value = default_context.Value
    Array = default_context.Array
    Manager = default_context.Manager

# The one table of public names: name -> (module, attribute path), the attribute path None
# for a module itself. ``__all__`` and ``__getattr__`` are built from it; the
# ``TYPE_CHECKING`` imports above say the same for type checkers (tests/test_public_names.py
# holds them to it).
_PUBLIC: dict[str, tuple[str, str | None]] = {
    # spawn: ranks, their results and their failures
    "spawn": (".context", "spawn"),
    "start_processes": (".context", "start_processes"),
    "ProcessContext": (".context", "ProcessContext"),
    "ProcessException": (".context", "ProcessException"),
    "ProcessExitedException": (".context", "ProcessExitedException"),
    "ProcessRaisedException": (".context", "ProcessRaisedException"),
    "ProcessTimeoutError": (".context", "ProcessTimeoutError"),
    "Progress": (".context", "Progress"),
    "progress": (".context", "progress"),
    "RayMissingError": (".context", "RayMissingError"),
    "RayResourcesError": (".context", "RayResourcesError"),
    "get_start_method": (".context.launch._start_method", "get_start_method"),
    "set_start_method": (".context.launch._start_method", "set_start_method"),
    "set_forkserver_preload": (".context.launch._forkserver", "set_forkserver_preload"),
    # the pools
    "Pool": (".pool", "Pool"),
    "ProcessPoolExecutor": (".pool", "ProcessPoolExecutor"),
    "get_reusable_executor": (".pool", "get_reusable_executor"),
    "process_map": (".pool", "process_map"),
    "InitializerError": (".pool", "InitializerError"),
    "TaskTimeoutError": (".pool", "TaskTimeoutError"),
    "TerminatedWorkerError": (".pool", "TerminatedWorkerError"),
    # sharing arrays
    "get_all_sharing_strategies": (".sharing", "get_all_sharing_strategies"),
    "get_sharing_strategy": (".sharing", "get_sharing_strategy"),
    "set_sharing_strategy": (".sharing", "set_sharing_strategy"),
    "ChannelClosed": (".sharing", "ChannelClosed"),
    "CudaError": (".sharing", "CudaError"),
    "FdLimitError": (".sharing", "FdLimitError"),
    "SharedMemoryFullError": (".sharing", "SharedMemoryFullError"),
    # multiprocessing's names that procspawn makes its own (the default context's methods)
    "Process": ("._dropin", "Process"),
    "get_context": ("._dropin", "get_context"),
    "Queue": ("._dropin", "default_context.Queue"),
    "JoinableQueue": ("._dropin", "default_context.JoinableQueue"),
    "SimpleQueue": ("._dropin", "default_context.SimpleQueue"),
    "Pipe": ("._dropin", "default_context.Pipe"),
    # ... and the primitives whose semaphores (or server process) belong to a start
    # method: made by procspawn's default context, they can go to procspawn's processes
    "Lock": ("._dropin", "default_context.Lock"),
    "RLock": ("._dropin", "default_context.RLock"),
    "Condition": ("._dropin", "default_context.Condition"),
    "Semaphore": ("._dropin", "default_context.Semaphore"),
    "BoundedSemaphore": ("._dropin", "default_context.BoundedSemaphore"),
    "Event": ("._dropin", "default_context.Event"),
    "Barrier": ("._dropin", "default_context.Barrier"),
    "Value": ("._dropin", "default_context.Value"),
    "Array": ("._dropin", "default_context.Array"),
    "Manager": ("._dropin", "default_context.Manager"),
    # settings
    "SettingError": ("._settings", "SettingError"),
    # the subpackages
    "context": (".context", None),
    "pool": (".pool", None),
    "sharing": (".sharing", None),
}

__all__ = sorted([*_PUBLIC, "__version__"])

# The rest of multiprocessing's public names (cpu_count, current_process, ...), as they
# are, for `import procspawn as mp`.
_MP_NAMES = [n for n in _multiprocessing.__all__ if n not in __all__ and not n.startswith("_")]
globals().update({name: getattr(_multiprocessing, name) for name in _MP_NAMES})
__all__ += _MP_NAMES


def __getattr__(name: str) -> Any:
    try:
        module_name, path = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'procspawn' has no attribute {name!r}") from None
    value: Any = late_import(module_name, __name__)  # (a fork waits for it: see _late)
    for attr in path.split(".") if path else ():
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
