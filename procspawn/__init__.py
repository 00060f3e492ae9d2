"""procspawn: spawn worker processes that share NumPy arrays through shared memory.

``import procspawn as mp`` is a drop-in for ``multiprocessing``: every public name of it is
here, and the queues, pipes and pools move arrays through shared memory.
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
from .context._mp import Process, default_context as _default_context, get_context
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

_OWN = [
    "JoinableQueue",
    "Pipe",
    "Pool",
    "Process",
    "Queue",
    "SimpleQueue",
    "get_context",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "__version__",
    "context",
    "get_all_sharing_strategies",
    "get_sharing_strategy",
    "set_sharing_strategy",
    "sharing",
    "spawn",
    "start_processes",
]

# multiprocessing's public names, for `import procspawn as mp`; ours take precedence.
_MP_NAMES = [
    name
    for name in _multiprocessing.__all__
    if name not in _OWN and not name.startswith("_")
]
globals().update({name: getattr(_multiprocessing, name) for name in _MP_NAMES})

__all__ = sorted(set(_OWN) | set(_MP_NAMES))
