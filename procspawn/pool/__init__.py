"""The pool half of procspawn: many tasks over a set of long-lived worker processes.

``Pool`` has ``multiprocessing.pool.Pool``'s interface, ``ProcessPoolExecutor`` is a
``concurrent.futures.Executor`` and ``get_reusable_executor()`` returns one executor per
program, as loky's does. All three run on one dispatcher (``_dispatcher``): each worker has
its own channel, the parent hands out tasks, and one thread watches every worker, so a
death fails exactly what it must and never hangs a caller.

Levels, each module importing only from those below it (this table is the only place
that states them):

    5  _pool: Pool;  _reusable: get_reusable_executor;  _process_map: tqdm's one-liner
    4  _executor: ProcessPoolExecutor;  _results: what Pool's asynchronous calls return;
       _imap: imap's iterators and the thread that feeds their input
    3  _dispatcher: the one thread that hands out tasks, reads results, watches and
       replaces workers;  _ray_dispatcher: its interface on Ray tasks (backend="ray")
    2  _tasks: Task, and Job, what the front ends implement;  _dispatching:
       DispatcherBase, what they call;  _workers: the parent's side of one worker
       (start, send, retire, stop, kill, close)
    1  _exit: what the pools do as the program ends;
       _worker: the loop a worker runs;  _failures: how failures are worded, option
       checks;  _prefetch: functions' run times (may a busy worker hold the next call);
       _errors: TaskTimeoutError;  _broken: TerminatedWorkerError,
       InitializerError (BrokenProcessPool subclasses, imported by a pool's thread after
       its start: concurrent.futures.process costs ~7 ms of start-up)
"""

from __future__ import annotations

from .._lazy import lazy_names

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)

if TYPE_CHECKING:  # pragma: no cover
    from ._broken import InitializerError as InitializerError
    from ._broken import TerminatedWorkerError as TerminatedWorkerError
    from ._errors import TaskTimeoutError as TaskTimeoutError
    from ._executor import Future as Future
    from ._executor import ProcessPoolExecutor as ProcessPoolExecutor
    from ._imap import IMapIterator as IMapIterator
    from ._imap import IMapUnorderedIterator as IMapUnorderedIterator
    from ._pool import Pool as Pool
    from ._process_map import process_map as process_map
    from ._results import AsyncResult as AsyncResult
    from ._results import MapResult as MapResult
    from ._reusable import get_reusable_executor as get_reusable_executor

_LAZY = {
    "AsyncResult": "._results",
    "IMapIterator": "._imap",
    "IMapUnorderedIterator": "._imap",
    "MapResult": "._results",
    "Future": "._executor",
    "InitializerError": "._broken",
    "Pool": "._pool",
    "ProcessPoolExecutor": "._executor",
    "TaskTimeoutError": "._errors",
    "TerminatedWorkerError": "._broken",
    "get_reusable_executor": "._reusable",
    "process_map": "._process_map",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
