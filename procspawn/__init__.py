"""procspawn: spawn worker processes that share NumPy arrays through shared memory.

``import procspawn as mp`` is a drop-in for ``multiprocessing``: every public name of it is
here, and ``Process``, ``Queue``, ``JoinableQueue``, ``SimpleQueue``, ``Pipe``, ``Pool`` and
``get_context`` are procspawn's, which move arrays through shared memory.
"""

import multiprocessing as _multiprocessing

from . import context, sharing
from ._version import __version__
from .context import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)
from .context._mp import Process, get_context
from .context._mp import default_context as _default_context
from .sharing import (
    get_all_sharing_strategies,
    get_sharing_strategy,
    set_sharing_strategy,
)

Queue = _default_context.Queue
JoinableQueue = _default_context.JoinableQueue
SimpleQueue = _default_context.SimpleQueue
Pipe = _default_context.Pipe
Pool = _default_context.Pool

__all__ = [
    "JoinableQueue",
    "Pipe",
    "Pool",
    "Process",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "Queue",
    "SimpleQueue",
    "__version__",
    "context",
    "get_all_sharing_strategies",
    "get_context",
    "get_sharing_strategy",
    "set_sharing_strategy",
    "sharing",
    "spawn",
    "start_processes",
]

# The rest of multiprocessing's public names (Lock, Event, Manager, cpu_count, ...), as they
# are, for `import procspawn as mp`.
_MP_NAMES = [n for n in _multiprocessing.__all__ if n not in __all__ and not n.startswith("_")]
globals().update({name: getattr(_multiprocessing, name) for name in _MP_NAMES})
__all__ += _MP_NAMES
