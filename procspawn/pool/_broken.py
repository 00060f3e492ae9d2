"""The errors of a broken pool, ``concurrent.futures``' ``BrokenProcessPool``s
(built on ``context._errors``).

Apart from ``_errors`` because ``concurrent.futures.process`` costs ~7 ms to import on
top of a pool's own modules (``multiprocessing.connection`` and ``queues``): a pool's
thread imports it once the pool has run a moment, or when it breaks
(``_failures.broken_errors``), never on the way to a pool's first result.
"""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool

from ..context._errors import ProcessException, ProcessExitedException

TYPE_CHECKING = False  # as typing's, without importing typing
if TYPE_CHECKING:
    from typing import Any


class TerminatedWorkerError(BrokenProcessPool, ProcessExitedException):
    """A worker of a ``ProcessPoolExecutor`` died (a signal, ``os._exit``, a segfault, the
    out-of-memory killer) and the executor is broken, as the stdlib's would be.

    Every future not done gets it, and so does every later ``submit``. It is a
    ``concurrent.futures.process.BrokenProcessPool`` (``except BrokenProcessPool`` keeps
    working) and a ``procspawn.ProcessExitedException``: ``pid``, ``exit_code`` and
    ``signal_name`` say which worker died and how; the message names the task it ran and
    quotes its last lines on stderr. Make a new executor (``get_reusable_executor()``
    does it for you) once the cause is fixed.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        ProcessExitedException.__init__(self, msg, error_index, error_pid, exit_code, signal_name)

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self) -> tuple[type[ProcessException], tuple[Any, ...], dict[str, Any]]:
        return ProcessExitedException.__reduce__(self)


class InitializerError(BrokenProcessPool):
    """The pool's ``initializer`` raised in a worker, or workers keep dying before they
    are ready (a main module without the ``__main__`` guard under spawn, say): the pool
    cannot run tasks, and every task fails with this error. The message holds the
    initializer's traceback (or the last worker's stderr); fix that and make a new pool.
    A ``concurrent.futures.process.BrokenProcessPool`` (so a ``RuntimeError``), as the
    stdlib's executor raises in this case.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles


__all__ = ["InitializerError", "TerminatedWorkerError"]
