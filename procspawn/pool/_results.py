"""What ``Pool``'s asynchronous calls return: ``AsyncResult`` (``ApplyResult``) and
``MapResult``, each settled by its job as the dispatcher reports its tasks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing import TimeoutError as _MpTimeoutError

from ..context._errors import ctrl_c_in_caller
from ..context._progress import Progress, wait_showing
from ._tasks import Job, Task

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any, Generic, TypeVar

    from ._dispatching import DispatcherBase
else:
    from .._generic import Generic, TypeVar

_T = TypeVar("_T")  # what a call returns


class ApplyResult(Generic[_T]):
    """The result of ``apply_async`` (``multiprocessing.pool.AsyncResult``'s interface).

    ``procspawn.pool.AsyncResult`` is the same class. ``get()`` waits for the value;
    ``ready()``, ``successful()`` and ``wait()`` tell without taking it. The pool makes
    it.

    Args:
        dispatcher: the pool's dispatcher.
        callback: called with the value once the call returned.
        error_callback: called with the exception once the call failed.
    """

    def __init__(
        self,
        dispatcher: DispatcherBase,
        callback: Callable[[_T], object] | None,
        error_callback: Callable[[BaseException], object] | None,
    ) -> None:
        self._dispatcher = dispatcher
        # the Pool that made it, held as the stdlib's results hold theirs: one dropped
        # by the caller (``Pool(2).apply_async(f)``) is not terminated while it works
        self._pool: object = None
        self._event = threading.Event()
        self._callback = callback
        self._error_callback = error_callback
        self._success = False
        self._value: Any = None
        self._progress: Progress | None = None  # shown while get() waits (a map's)

    def ready(self) -> bool:
        """Whether the call has finished (returned or failed).

        Returns:
            True once ``get()`` would return or raise at once.
        """
        return self._event.is_set()

    def successful(self) -> bool:
        """Whether the call returned (rather than failed).

        Returns:
            True when it returned a value, False when it failed.

        Raises:
            ValueError: it has not finished yet.
        """
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._success

    @ctrl_c_in_caller
    def wait(self, timeout: float | None = None) -> None:
        """Wait until the call has finished, or ``timeout`` seconds passed.

        Args:
            timeout: seconds to wait at most; None: until it finished.

        Raises:
            RuntimeError: called by a callback of the pool while the call is not done.
        """
        if not self._event.is_set():
            self._dispatcher.check_not_serving()
        self._event.wait(timeout)

    @ctrl_c_in_caller
    def get(self, timeout: float | None = None) -> _T:
        """The task's return value; raises what it raised (or how its worker died).

        Ctrl-C while a ``map_async`` / ``apply_async`` result is waited for stops its
        tasks (their workers are replaced) and raises ``KeyboardInterrupt``.

        Args:
            timeout: seconds to wait at most; None: until it finished.

        Returns:
            What the call returned (the list of values for a map).

        Raises:
            multiprocessing.TimeoutError: not ready within ``timeout`` seconds (the call
                goes on; ``get`` may be called again).
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised.
            ProcessExitedException: the worker died while running it (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: it ran longer than the pool's ``task_timeout``.
            InitializerError: the pool's ``initializer`` raised: no task can run.
            RuntimeError: the pool was terminated before it finished, or ``get`` was
                called by a callback of the pool while the call was not done (it would
                wait forever).
        """
        if not self._event.is_set():
            self._dispatcher.check_not_serving()
        try:
            if self._progress is None:
                self._event.wait(timeout)
            else:
                self._wait_showing(self._progress, timeout)
        except KeyboardInterrupt:
            self._interrupted()
            raise
        if not self.ready():
            raise _MpTimeoutError
        if self._success:
            value: _T = self._value
            return value
        raise self._value

    def _interrupted(self) -> None:
        pass

    def _wait_showing(self, progress: Progress, timeout: float | None) -> None:
        """Wait as ``get`` does, redrawing ``progress``; it is closed once the result is
        there (or the wait is interrupted)."""
        try:
            done = wait_showing(self._event.wait, progress, timeout)
        except BaseException:
            progress.close()
            raise
        if done:
            progress.close()

    def _finish(self, ok: bool, value: Any) -> None:
        self._success, self._value = ok, value
        try:
            if ok and self._callback is not None:
                self._callback(value)
            elif not ok and self._error_callback is not None:
                self._error_callback(value)
        finally:
            self._event.set()
            self._callback = self._error_callback = None
            # job <-> result is a cycle: broken here, so the values (arrays: shared
            # segments) go as soon as the caller drops them, not at the next collection
            self.__dict__.pop("job", None)


AsyncResult = ApplyResult


class _ApplyJob(Job):
    def __init__(self, fn: Any, result: ApplyResult[Any]) -> None:
        super().__init__(fn)
        self.result = result

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        if not self.result.ready():
            self.result._finish(ok, value)


class _CallResult(ApplyResult[_T]):
    """An ApplyResult whose job is stopped when the caller's wait is interrupted."""

    job: Job

    def _interrupted(self) -> None:
        job = self.__dict__.get("job")
        if job is not None and not self.ready():
            self._dispatcher.abandon(job)


class MapResult(_CallResult[list[_T]]):
    """The result of ``map_async`` / ``starmap_async``: the list of return values.

    Args:
        dispatcher: the pool's dispatcher.
        length: the number of items.
        callback: called with the list of values once all are in.
        error_callback: called with the first failure's exception.
    """

    def __init__(
        self,
        dispatcher: DispatcherBase,
        length: int,
        callback: Callable[[list[_T]], object] | None,
        error_callback: Callable[[BaseException], object] | None,
    ) -> None:
        super().__init__(dispatcher, callback, error_callback)
        self._values: list[Any] = [None] * length
        self._left = 0
        self._lock = threading.Lock()
        if length == 0:
            self._finish(True, [])

    def _expect(self, chunks: int) -> None:
        """The map goes out as ``chunks`` tasks."""
        self._left = chunks

    def _settle_chunk(self, start: int, ok: bool, value: Any) -> None:
        """A chunk settled: its values (at ``start``), or the error that fails the map."""
        if self.ready():
            return
        if not ok:
            self._values = []
            self._finish(False, value)
            return
        if self._progress is not None:
            self._progress.update(len(value))
        self._values[start : start + len(value)] = value
        self._left -= 1
        if self._left == 0:
            values, self._values = self._values, []
            self._finish(True, values)


class _MapJob(Job):
    def __init__(self, fn: Any, result: MapResult[Any], chunks: list[tuple[int, int]]) -> None:
        super().__init__(fn)
        self.result = result
        self.chunks = chunks  # (start, length) of each task's items
        result._expect(len(chunks))

    def start(self, task: Task) -> bool:
        return not self.abandoned and not self.result.ready()

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        self.result._settle_chunk(self.chunks[task.index][0], ok, value)


__all__ = ["ApplyResult", "AsyncResult", "MapResult"]
