"""The exceptions that ``spawn`` and ``ProcessContext.join`` raise (with ``backend="ray"`` too)."""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _F = TypeVar("_F", bound=Callable[..., Any])


class ProcessException(Exception):
    """A worker rank failed.

    Raised by ``spawn`` / ``ProcessContext.join`` once the first failing rank is known and
    every sibling has been stopped. Catch this to handle any rank failure; the subclasses
    say whether the rank raised, exited or ran out of time. ``error_index`` is the rank,
    ``pid`` its process id, and ``results`` the return values of the ranks that had
    finished before the failure, by rank (None for the others).
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __init__(self, msg: str, error_index: int, pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = pid
        self.results: list[Any] | None = None

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self) -> tuple[type[ProcessException], tuple[Any, ...], dict[str, Any]]:
        return (type(self), (self.msg, self.error_index, self.pid), {"results": self.results})


class ProcessRaisedException(ProcessException):
    """A rank raised an exception (``KeyboardInterrupt`` included).

    ``str()`` holds the child's full traceback text. When the child's exception could be
    pickled and unpickled in the parent it is attached as ``__cause__``, so
    ``isinstance(err.__cause__, ValueError)`` tells what the rank raised. Fix the bug the
    traceback points at.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg, error_index=error_index, pid=error_pid)


class ProcessExitedException(ProcessException):
    """A rank exited without raising: ``sys.exit(n)``, ``os._exit(n)`` or a signal.

    ``exit_code`` is the process exit code (negative for a signal, as in
    ``multiprocessing``) and ``signal_name`` the signal's name (``"SIGKILL"``) or None.
    A SIGKILL that nobody sent on purpose is most often the kernel's out-of-memory killer:
    check ``dmesg`` and the memory the ranks use.
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
        super().__init__(msg, error_index=error_index, pid=error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[type[ProcessException], tuple[Any, ...], dict[str, Any]]:
        return (
            type(self),
            (self.msg, self.error_index, self.pid, self.exit_code, self.signal_name),
            {"results": self.results},
        )


class ProcessTimeoutError(ProcessException, TimeoutError):
    """``spawn(..., timeout=...)`` ran out of time: every rank still running was stopped.

    ``ranks`` lists the ranks that were still running, ``elapsed`` how long they had run
    (seconds). ``error_index`` and ``pid`` name the first of them. Also a ``TimeoutError``.
    Give the ranks more time, or find out what those ranks wait for (a rank waiting on a
    message from one that never sends, say).
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __init__(
        self, msg: str, error_index: int, pid: int, ranks: list[int], elapsed: float
    ) -> None:
        super().__init__(msg, error_index=error_index, pid=pid)
        self.ranks = ranks
        self.elapsed = elapsed

    def __reduce__(self) -> tuple[type[ProcessException], tuple[Any, ...], dict[str, Any]]:
        return (
            type(self),
            (self.msg, self.error_index, self.pid, self.ranks, self.elapsed),
            {"results": self.results},
        )


class RayMissingError(ImportError):
    """``backend="ray"`` was asked for, but Ray is not installed.

    Raised by ``spawn(..., backend="ray")`` before anything starts. Install it
    (``pip install 'procspawn[ray]'``), or leave ``backend`` out to run the ranks as
    processes on this machine. An ``ImportError``.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles


class RayResourcesError(RuntimeError):
    """The Ray cluster cannot give every rank a CPU (nothing was started).

    Raised by ``spawn(..., backend="ray")`` when the cluster has fewer CPUs in all than
    ranks, or could not reserve one for each rank (or start each rank's actor) within
    ``PROCSPAWN_RAY_READY_TIMEOUT`` seconds; every rank was stopped. Start fewer ranks,
    add nodes, or wait for other jobs to give back their CPUs (or raise the timeout).
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles


# The classes a pool gives a task's exception as its cause, the worker's traceback (the
# standard library's own: multiprocessing.pool's for a Pool, concurrent.futures' for an
# executor), by module and name: a module not imported has made none
_REMOTE_TRACEBACKS = (
    ("multiprocessing.pool", "RemoteTraceback"),
    ("concurrent.futures.process", "_RemoteTraceback"),
)


def ctrl_c(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a Ctrl-C of this process: a KeyboardInterrupt that is not a
    task's own exception handed to its caller (whose cause is the worker's traceback)."""
    if not isinstance(exc, KeyboardInterrupt):
        return False
    cause = exc.__cause__
    for module, name in _REMOTE_TRACEBACKS:
        remote = getattr(sys.modules.get(module), name, None)
        if remote is not None and isinstance(cause, remote):
            return False
    return True


def ctrl_c_in_caller(call: _F) -> _F:
    """For a public call that waits: a Ctrl-C while it waits (its processes already
    stopped by the code that caught it), or a rank's failure, ends in a traceback of the
    caller's frames and this one line, not procspawn's waiting loops. A task's own
    KeyboardInterrupt, handed to its caller, goes on as it is, its traceback and cause
    kept."""

    @functools.wraps(call)
    def waiting(*args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except KeyboardInterrupt as interrupt:
            if not ctrl_c(interrupt):
                raise  # a task's, as any other exception of a task
            raise interrupt.with_traceback(None) from None  # Ctrl-C while procspawn waited
        except ProcessException as failure:
            # a rank's failure: the caller's frames and this one, not procspawn's waiting
            # loops (the rank's own traceback is in the message and the cause)
            raise failure.with_traceback(None)  # noqa: B904 -- (its cause is kept as it is)

    # functools.wraps types the wrapper as its own _Wrapped, not as call's type, which it has
    return waiting  # type: ignore[return-value]


def signal_name(signum: int) -> str:
    """The name of a signal number ("SIGKILL"), or "signal <n>" if it has none."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
