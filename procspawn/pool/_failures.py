"""How a pool's failures are worded: a task's own exception, a result that cannot
be unpickled, descriptors running out, bad options, and the errors of a broken pool
(imported late: see ``broken_errors``).
"""

from __future__ import annotations

import errno
import threading

from .._late import late_import
from ..sharing._errors import FdLimitError

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any

    from ._tasks import Task

BROKEN = "procspawn.pool._broken"
BROKEN_QUIET = 0.005  # seconds without an event before an executor imports _broken


def broken_errors() -> Any:
    """``_broken``, the errors of a broken pool (concurrent.futures' BrokenProcessPool),
    imported now if need be; None if it cannot be.

    A pool does not import it as it starts (concurrent.futures.process: ~7 ms of a pool's
    start); an executor's thread does once a worker has answered and the thread has had
    nothing to do for BROKEN_QUIET seconds (never within a short program's start, one
    result and shut-down), and any pool at its first break. That module registers a hook
    with ``threading`` as it is imported, which Python refuses once the main thread has
    ended (a pool still running then: its program leaves without closing it, and a worker
    dies or an initializer raises before the thread imported the module); then it is
    imported without that hook. None if even that fails, and the callers get an error
    that says the same in other words (a ProcessExitedException, a RuntimeError for an
    initializer's)."""
    try:
        return late_import(BROKEN)  # (a fork waits for it: see _late)
    except RuntimeError:  # "can't register atexit after shutdown"
        pass
    # The hook only tells the stdlib's own executors to stop, and there are none (that
    # module was not imported before): import it without, as every registration fails now.
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return None
    threading._register_atexit = _no_exit_hook  # type: ignore[attr-defined]
    try:
        return late_import(BROKEN)
    except RuntimeError:
        return None
    finally:
        threading._register_atexit = register  # type: ignore[attr-defined]


def _no_exit_hook(*args: Any, **kwargs: Any) -> None:
    pass


def check_backend(backend: Any, ray_address: Any, **local_only: Any) -> None:
    """Refuse an unknown backend, and options that do not apply to it, in the caller;
    ``local_only``: the options that apply on this machine only, as given."""
    if backend not in ("process", "ray"):
        raise ValueError(f"unknown backend {backend!r}; use 'process' (default) or 'ray'")
    if backend != "ray":
        if ray_address is not None:
            raise ValueError("ray_address applies to backend='ray' only")
        return
    given = sorted(name for name, value in local_only.items() if value is not None)
    if given:
        raise ValueError(
            f"{', '.join(given)} do(es) not apply to backend='ray': Ray starts and replaces "
            f"the processes that run the tasks (a Ray worker runs many tasks; one that dies "
            f"is replaced, and with retries= its task runs again)"
        )


def check_options(task_timeout: Any, retries: Any, max_memory_per_child: Any) -> None:
    """Refuse bad values of the options procspawn's pools add, in the caller."""
    if task_timeout is not None and (
        isinstance(task_timeout, bool)
        or not isinstance(task_timeout, (int, float))
        or not task_timeout > 0
    ):
        raise ValueError(
            f"task_timeout must be a number of seconds > 0 (or None: no limit), got "
            f"{task_timeout!r}"
        )
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    if max_memory_per_child is not None and (
        isinstance(max_memory_per_child, bool)
        or not isinstance(max_memory_per_child, int)
        or max_memory_per_child <= 0
    ):
        raise ValueError(
            f"max_memory_per_child must be a number of bytes (an int > 0, e.g. 2 << 30 for "
            f"2 GiB) or None, got {max_memory_per_child!r}"
        )


def check_max_tasks(max_tasks_per_child: Any) -> None:
    """Refuse a bad ``max_tasks_per_child`` (None: no limit), in the caller."""
    if max_tasks_per_child is None:
        return
    if not isinstance(max_tasks_per_child, int) or isinstance(max_tasks_per_child, bool):
        raise TypeError("max_tasks_per_child must be an integer")
    if max_tasks_per_child <= 0:
        raise ValueError("max_tasks_per_child must be >= 1")


def check_seconds(name: str, value: Any) -> None:
    """Refuse a ``value`` that is neither None nor a number of seconds > 0, naming it."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
    ):
        raise ValueError(f"{name} must be a number of seconds > 0 or None, got {value!r}")


def remote_error(exc: BaseException | None, text: str, executor: bool = False) -> BaseException:
    """The exception a task raised, with the worker's traceback as its cause, of the
    type the stdlib's Pool or executor gives."""
    if executor:
        from concurrent.futures.process import _RemoteTraceback as RemoteTraceback
    else:
        # typeshed leaves out multiprocessing.pool's RemoteTraceback (the same shape: an
        # exception holding the traceback text)
        from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined,no-redef]

    if exc is None:
        exc = RuntimeError(
            "the task raised an exception that could not be sent back to the parent; "
            "its traceback:\n" + text
        )
    # typeshed has _RemoteTraceback take a TracebackType; both classes take the text
    exc.__cause__ = RemoteTraceback(text)  # type: ignore[arg-type]
    return exc


def out_of_descriptors(exc: BaseException, what: str) -> BaseException:
    """``exc`` as an FdLimitError (which says what holds descriptors and what to do) when it
    is this process being out of them (EMFILE) as a pool starts workers, else ``exc``."""
    if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        if isinstance(exc, FdLimitError):
            return exc
        return FdLimitError(f"{what} (a worker's channel and pipes need some)")
    return exc


def unpickling_error(task: Task, pid: int | None, exc: BaseException) -> BaseException:
    import pickle

    err = pickle.UnpicklingError(
        f"the result of {task.job.describe(task)} sent by worker pid {pid} could not "
        f"be unpickled in the parent: {type(exc).__name__}: {exc}. Return plain data (or "
        f"objects whose classes the parent can import)"
    )
    err.__cause__ = exc
    return err


__all__ = [
    "BROKEN",
    "BROKEN_QUIET",
    "broken_errors",
    "check_options",
    "out_of_descriptors",
    "remote_error",
    "unpickling_error",
]
