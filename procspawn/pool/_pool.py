"""``procspawn.Pool``: ``multiprocessing.pool.Pool``'s interface on procspawn's dispatcher.

What differs from the stdlib's is what happens when things go wrong: a worker that dies
(any signal, ``os._exit``, a segfault, the OOM killer) fails exactly the task it was
running with a ``ProcessExitedException``, the tasks it had not started run elsewhere, a
new worker takes its place and the pool goes on; an initializer that raises fails every
call with an ``InitializerError`` instead of restarting workers forever; Ctrl-C during a
call stops that call's tasks (their workers are replaced) and raises one
``KeyboardInterrupt``, in the caller. The script's own functions and classes travel by
name, as the stdlib's, and what a worker does not have by cloudpickle (lambdas, closures);
arrays through shared memory.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import resource
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from multiprocessing import TimeoutError as _MpTimeoutError
from multiprocessing.context import BaseContext

from ..context._errors import ctrl_c, ctrl_c_in_caller
from ..context._progress import TICK, Progress, as_progress, wait_showing
from ..context.launch._start_method import start_method_of
from ..sharing._errors import descriptors_used_past, raise_fd_limit
from . import _worker
from ._dispatcher import Dispatcher
from ._failures import check_options
from ._tasks import Job, Task

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any, Generic, NoReturn, TypeVar
else:
    from .._generic import Generic, TypeVar

_T = TypeVar("_T")  # what a call returns
_S = TypeVar("_S")  # an item of a map's input

_STOP_CHECK = 0.5  # imap: how often a waiting next() looks whether the pool was stopped
# imap over an iterator: chunks handed to the pool per worker ahead of the results taken.
# Two per worker are held by the workers (one running, one prefetched); the dispatcher
# prefetches only with more waiting than workers (see Dispatcher._may_prefetch). At 4,
# when it wanted more than two per worker, a worker waited for each round trip and imap
# was 2-3x map's time per task
_FEED_AHEAD = 8
# imap over a list, tuple or range: its items exist already and reading them never
# waits, so more chunks per worker go ahead, in batches (one submit each), and the feeder
# is woken again only once a quarter of them is done. (Not all at once: a task per item
# of a list of a million, in memory, for nothing)
_SEQUENCES = (list, tuple, range)
_SEQUENCE_AHEAD = 32


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
        dispatcher: Dispatcher,
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
        dispatcher: Dispatcher,
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


class _MapJob(Job):
    def __init__(self, fn: Any, result: MapResult[Any], chunks: list[tuple[int, int]]) -> None:
        super().__init__(fn)
        self.result = result
        self.chunks = chunks  # (start, length) of each task's items
        result._left = len(chunks)

    def start(self, task: Task) -> bool:
        return not self.abandoned and not self.result.ready()

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        result = self.result
        if result.ready():
            return
        if not ok:
            result._values = []
            result._finish(False, value)
            return
        if result._progress is not None:
            result._progress._add(len(value))
        start, _length = self.chunks[task.index]
        result._values[start : start + len(value)] = value
        result._left -= 1
        if result._left == 0:
            values, result._values = result._values, []
            result._finish(True, values)


class IMapIterator(Generic[_T]):
    """The iterator ``imap`` returns: results in order, ``next(timeout)`` as the stdlib's.

    A failed call raises its error when its place comes (once for its whole chunk);
    iterating on goes on with the next results. Dropping the iterator before its end
    lets the calls that run finish and drops the others. The pool makes it.

    Args:
        dispatcher: the pool's dispatcher.
    """

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher
        self._pool: object = None  # the Pool that made it (see ApplyResult)
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the callers of next() wait on it
        self._room = threading.Condition(lock)  # the feeder waits on it
        # the feeder, waiting for room, is woken once this many chunks settled or were
        # taken (None: it does not wait)
        self._feeder_wants: tuple[int, int] | None = None
        self._items: dict[int, tuple[bool, Any]] = {}  # chunk index -> outcome
        self._buffer: list[Any] = []  # values of the current chunk not yet taken
        self._next_chunk = 0
        self._chunks_total: int | None = None  # known once the input is exhausted
        self._input_error: BaseException | None = None
        self._settled = 0  # chunks whose outcome came (the feeder waits on it)
        self.job: Job | None = None
        self._progress: Progress | None = None  # redrawn while next() waits

    def __iter__(self) -> IMapIterator[_T]:
        return self

    @ctrl_c_in_caller
    def next(self, timeout: float | None = None) -> _T:
        """The next result, waiting for it at most ``timeout`` seconds.

        Args:
            timeout: seconds to wait at most; None: until it is there.

        Returns:
            The next value of ``func``.

        Raises:
            StopIteration: every result was taken.
            multiprocessing.TimeoutError: it was not there within ``timeout`` seconds
                (call ``next`` again to go on waiting).
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised;
                once the results before it were taken, what the input iterable raised.
            ProcessExitedException: the worker died while running it (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: it ran longer than the pool's ``task_timeout``.
            InitializerError: the pool's ``initializer`` raised: no task can run.
            RuntimeError: the pool was terminated before it finished.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        progress = self._progress
        with self._cond:
            try:
                while True:
                    if self._buffer:
                        item: _T = self._buffer.pop(0)
                        return item
                    outcome = self._take_next()
                    if outcome is not None:
                        self._wake_feeder()  # it may wait for room
                        ok, value = outcome
                        if not ok:
                            raise value
                        self._buffer = list(value)
                        continue
                    if self._chunks_total is not None and self._next_chunk >= self._chunks_total:
                        error, self._input_error = self._input_error, None
                        if error is not None:
                            raise error
                        raise StopIteration
                    terminated = self._dispatcher.terminated_error()
                    if terminated is not None:  # no more results will come
                        raise terminated
                    self._dispatcher.check_not_serving()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise _MpTimeoutError
                    if progress is None:
                        # (woken by terminate(); the slice covers a pool stopped otherwise)
                        self._cond.wait(
                            _STOP_CHECK if remaining is None else min(_STOP_CHECK, remaining)
                        )
                    else:
                        progress.render()
                        self._cond.wait(TICK if remaining is None else min(TICK, remaining))
            except KeyboardInterrupt as interrupt:
                if self.job is not None and ctrl_c(interrupt):  # (not a task's own)
                    self._dispatcher.abandon(self.job)
                if progress is not None:
                    progress.close()
                raise
            except _MpTimeoutError:
                raise
            except BaseException:  # the end (StopIteration), or a task's error
                if progress is not None:
                    progress.close()
                raise

    __next__ = next

    def _take_next(self) -> tuple[bool, Any] | None:
        outcome = self._items.pop(self._next_chunk, None)
        if outcome is not None:
            self._next_chunk += 1
        return outcome

    def _put(self, index: int, ok: bool, value: Any) -> None:
        with self._cond:
            self._store(index, (ok, value))
            self._settled += 1
            if self._awaited(index):
                self._cond.notify_all()
            self._wake_feeder()

    def _store(self, index: int, outcome: tuple[bool, Any]) -> None:
        self._items[index] = outcome

    def _awaited(self, index: int) -> bool:
        """Whether a caller of next() may be waiting for the chunk ``index``."""
        return index == self._next_chunk

    def _wake_feeder(self) -> None:
        wants = self._feeder_wants
        if wants is not None and (self._settled >= wants[0] or self._next_chunk >= wants[1]):
            self._room.notify()

    def _wake_all(self) -> None:
        """Wake the callers and the feeder to look again (the input ended, the pool is
        stopping)."""
        with self._cond:
            self._cond.notify_all()
            self._room.notify_all()

    def _input_done(self, chunks: int, error: BaseException | None) -> None:
        with self._cond:
            self._chunks_total = chunks
            self._input_error = error
            self._cond.notify_all()

    def _wait_room(self, sent: int, ahead: int, room: int, step: int) -> int | None:
        """The feeder: how many chunks it may send now, once at least ``step`` may go:
        fewer than ``ahead`` chunks are being worked on and fewer than ``room`` wait for
        the caller (done or not), unless the results waiting hold no descriptors or the
        pool is being joined (see ``_results_room``). 0: not yet, after a wait of at most
        half a second (the feeder lets go of this iterator in between, so a caller that
        drops it ends the call); None: never (the caller stopped, or the pool ended)."""
        with self._cond:
            if not self._feeding():
                return None
            free = ahead - (sent - self._settled)
            waiting = sent - self._next_chunk
            bounded = waiting + max(free, step) > room and self._results_hold_descriptors()
            if bounded:
                free = min(free, room - waiting)
            if free >= step:
                return free
            # woken by _put or next() once that much is there (or by _wake_all)
            self._feeder_wants = (
                sent - ahead + step,
                sent - room + step if bounded else sys.maxsize,
            )
            try:
                self._room.wait(0.5)
            finally:
                self._feeder_wants = None
            return 0

    def _feeding(self) -> bool:
        """Whether the feeder should go on reading the input: the caller has not
        abandoned the job and the pool takes its tasks (after terminate() or a broken
        pool every task would fail at once: an endless input was read forever)."""
        job = self.job
        return job is not None and not job.abandoned and self._dispatcher.alive()

    def _results_hold_descriptors(self) -> bool:
        """Whether the results waiting for the caller may run this process out of
        descriptors: it uses more than a quarter of them, and nobody waits in the pool's
        ``join()`` (which returns once every task is done, as the stdlib's, so the results
        may not wait for a caller who is waiting there: past the limit a result is an
        ``FdLimitError``, never a hang)."""
        pool = self._pool
        if isinstance(pool, Pool) and pool._joining:
            return False
        return descriptors_used_past(0.25)

    def __del__(self) -> None:
        job = self.job
        if job is not None and not job.abandoned:
            try:
                self._dispatcher.abandon(job, kill_running=False)
            except Exception:
                pass


class IMapUnorderedIterator(IMapIterator[_T]):
    """The iterator ``imap_unordered`` returns: results as they come.

    Args:
        dispatcher: the pool's dispatcher.
    """

    def __init__(self, dispatcher: Dispatcher) -> None:
        super().__init__(dispatcher)
        self._arrived: collections.deque[tuple[bool, Any]] = collections.deque()

    def _store(self, index: int, outcome: tuple[bool, Any]) -> None:
        self._arrived.append(outcome)

    def _awaited(self, index: int) -> bool:
        return True

    def _take_next(self) -> tuple[bool, Any] | None:
        if not self._arrived:
            return None
        self._next_chunk += 1
        return self._arrived.popleft()


if TYPE_CHECKING:
    _Iterator = TypeVar("_Iterator", bound=IMapIterator[Any])


class _IMapJob(Job):
    """imap's tasks. The iterator is held weakly, here and by the feeder: the caller
    that drops it (a loop left with ``break``) ends the call, which goes on no longer
    for an endless input."""

    def __init__(self, fn: Any, iterator: IMapIterator[Any]) -> None:
        super().__init__(fn)
        self.iterator = weakref.ref(iterator)

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        iterator = self.iterator()
        if iterator is None:  # dropped: nobody takes the result
            return
        progress = iterator._progress
        if ok and progress is not None:
            progress._add(len(value))
        iterator._put(task.index, ok, value)


class Pool:
    """A pool of worker processes, with ``multiprocessing.pool.Pool``'s interface.

    Args:
        processes: the number of workers (default ``os.cpu_count()``).
        initializer: called as ``initializer(*initargs)`` in each worker as it starts.
            If it raises, every call fails with ``procspawn.InitializerError``.
        initargs: its arguments.
        maxtasksperchild: a worker exits after this many tasks (a map chunk is one) and
            a new one takes its place; None: workers live as long as the pool.
        context: a multiprocessing context, or a start method name, whose start method
            the workers use (default: ``procspawn.get_start_method()``, "forkserver").
        task_timeout: seconds a task (one ``apply``, or one chunk of a map) may run; a
            task running longer has its worker killed and replaced, and fails with
            ``procspawn.TaskTimeoutError`` (the other tasks go on). None: no limit.
        retries: a task whose worker dies while running it (a signal, ``os._exit``, a
            segfault, the OOM killer) runs again, up to this many times; then it fails
            with the last death's ``ProcessExitedException``. Default 0.
        max_memory_per_child: bytes; a worker whose resident memory is above it after a
            task is replaced before its next one. None: no limit.

    A worker that dies while it runs a task fails that task (``get()`` or the
    ``map``/``imap`` containing it raises ``procspawn.ProcessExitedException``, naming
    the pid, the signal or exit code, the call and the worker's last stderr lines); the
    other tasks go on, and a new worker takes its place. The script's top-level functions
    and classes travel by name, as with the stdlib (the initializer and the tasks share
    the main module's globals); lambdas, closures and what is defined under the
    ``__main__`` guard by cloudpickle; NumPy arrays through shared memory. Ctrl-C while
    a call waits stops that call's tasks (their workers are replaced) and raises one
    ``KeyboardInterrupt``.

    Use it as a context manager (``terminate()`` on leaving, as the stdlib's), or call
    ``close()`` and ``join()``; a pool dropped while running warns (``ResourceWarning``)
    and is terminated.

    Raises:
        ValueError: ``processes`` < 1, ``maxtasksperchild`` not a positive int,
            ``task_timeout``, ``retries`` or ``max_memory_per_child`` out of range, or
            ``context`` names an unknown start method.
        TypeError: ``initializer`` is not callable, or ``context`` is neither a
            multiprocessing context nor a start method name.

    Example::

        import procspawn

        def square(x):
            return x * x

        if __name__ == "__main__":
            with procspawn.Pool(2) as pool:
                assert pool.map(square, range(5)) == [0, 1, 4, 9, 16]
                assert pool.apply(square, (3,)) == 9
                assert sorted(pool.imap_unordered(square, [1, 2])) == [1, 4]
    """

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[object] = (),
        maxtasksperchild: int | None = None,
        context: str | BaseContext | None = None,
        *,
        task_timeout: float | None = None,
        retries: int = 0,
        max_memory_per_child: int | None = None,
    ) -> None:
        self._state = "INIT"
        self._joining = False  # join() waits: imap's results no longer wait for room
        self._iterators: weakref.WeakSet[IMapIterator[Any]] = weakref.WeakSet()
        if processes is None:
            processes = os.cpu_count() or 1
        if processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if maxtasksperchild is not None and (
            not isinstance(maxtasksperchild, int)
            or isinstance(maxtasksperchild, bool)
            or maxtasksperchild <= 0
        ):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        check_options(task_timeout, retries, max_memory_per_child)
        self._processes = processes
        self._dispatcher = Dispatcher(
            processes,
            start_method=start_method_of(context),
            initializer=initializer,
            initargs=initargs,
            max_tasks=maxtasksperchild,
            task_timeout=task_timeout,
            retries=retries,
            max_memory=max_memory_per_child,
            name="pool",
        )
        self._state = "RUN"

    # -- the stdlib's introspection --------------------------------------------------------

    @property
    def _pool(self) -> list[Any]:
        """The worker processes now (the stdlib's attribute, which its tests read)."""
        return self._dispatcher.workers()

    def _repopulate_pool(self) -> None:
        """Workers are replaced as they exit; nothing to do (kept for the stdlib's tests)."""

    def __repr__(self) -> str:
        return (
            f"<{type(self).__module__}.{type(self).__qualname__} "
            f"state={self._state} pool_size={self._processes}>"
        )

    def __reduce__(self) -> NoReturn:
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")

    def _check_running(self) -> None:
        self._dispatcher.check_owner()
        if self._state != "RUN":
            raise ValueError("Pool not running")

    # -- calls -------------------------------------------------------------------------------

    @ctrl_c_in_caller
    def apply(
        self,
        func: Callable[..., _T],
        args: Iterable[object] = (),
        kwds: Mapping[str, object] | None = None,
    ) -> _T:
        """``func(*args, **kwds)`` in a worker; waits for it and returns its value.

        Args:
            func: the function to call.
            args: its positional arguments.
            kwds: its keyword arguments.

        Returns:
            What ``func`` returned.

        Raises:
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised.
            ProcessExitedException: the worker died while running it (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: it ran longer than the pool's ``task_timeout``.
            InitializerError: the pool's ``initializer`` raised: no task can run.
            ValueError: the pool was closed or terminated.
            RuntimeError: the pool was terminated before it finished.
        """
        return self.apply_async(func, args, kwds).get()

    def apply_async(
        self,
        func: Callable[..., _T],
        args: Iterable[object] = (),
        kwds: Mapping[str, object] | None = None,
        callback: Callable[[_T], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> ApplyResult[_T]:
        """``func(*args, **kwds)`` in a worker; returns an ``AsyncResult`` at once.

        Args:
            func: the function to call.
            args: its positional arguments.
            kwds: its keyword arguments.
            callback: called with the value once ``func`` returned (in a thread of the
                pool: keep it short).
            error_callback: called with the exception instead, if the call failed.

        Returns:
            The result; its ``get()`` returns the value or raises what ``apply`` would.

        Raises:
            ValueError: the pool was closed or terminated.
        """
        self._check_running()
        result: _CallResult[_T] = _CallResult(self._dispatcher, callback, error_callback)
        result._pool = self  # a pool nobody else holds lives as long as its results
        job = _ApplyJob(func, result)
        result.job = job
        self._dispatcher.submit([Task(job, 0, _worker.APPLY, (tuple(args), dict(kwds or {})))])
        return result

    @ctrl_c_in_caller
    def map(
        self,
        func: Callable[[_S], _T],
        iterable: Iterable[_S],
        chunksize: int | None = None,
        *,
        progress: bool | int | Progress | None = None,
    ) -> list[_T]:
        """``list(map(func, iterable))``, run in the workers in chunks.

        Args:
            func: called on each item.
            iterable: the items; read whole before the first chunk is sent.
            chunksize: items per task (one message each way); default: four chunks per
                worker (``len(items) / (4 * processes)``, rounded up).
            progress: True, an int total or a ``procspawn.Progress``: a bar counting
                finished items while the call waits (its total: the number of items).

        Returns:
            The values, in the order of the items.

        Raises:
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised.
            ProcessExitedException: the worker died while running a chunk (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: a chunk ran longer than the pool's ``task_timeout``.
            InitializerError: the pool's ``initializer`` raised: no task can run.
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
            RuntimeError: the pool was terminated before the map finished.
        """
        return self._map_async(func, iterable, _worker.MAP, chunksize, progress=progress).get()

    @ctrl_c_in_caller
    def starmap(
        self,
        func: Callable[..., _T],
        iterable: Iterable[Iterable[object]],
        chunksize: int | None = None,
        *,
        progress: bool | int | Progress | None = None,
    ) -> list[_T]:
        """``[func(*args) for args in iterable]``, run in the workers in chunks.

        Args:
            func: called on each item's arguments.
            iterable: the items, each an iterable of arguments.
            chunksize: as for ``map``.
            progress: as for ``map``.

        Returns:
            The values, in the order of the items.

        Raises:
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised.
            ProcessExitedException: the worker died while running a chunk (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: a chunk ran longer than the pool's ``task_timeout``.
            InitializerError: the pool's ``initializer`` raised: no task can run.
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
            RuntimeError: the pool was terminated before the map finished.
        """
        return self._map_async(func, iterable, _worker.STARMAP, chunksize, progress=progress).get()

    def map_async(
        self,
        func: Callable[[_S], _T],
        iterable: Iterable[_S],
        chunksize: int | None = None,
        callback: Callable[[list[_T]], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
        *,
        progress: bool | int | Progress | None = None,
    ) -> MapResult[_T]:
        """``map`` returning at once; ``progress`` is shown while ``get()`` waits.

        Args:
            func: as for ``map``.
            iterable: as for ``map``.
            chunksize: as for ``map``.
            callback: called with the list of values once all are in (in a thread of
                the pool: keep it short).
            error_callback: called with the first failure's exception instead.
            progress: as for ``map``.

        Returns:
            The result; its ``get()`` returns the list of values or raises what ``map``
            would.

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._map_async(
            func, iterable, _worker.MAP, chunksize, callback, error_callback, progress
        )

    def starmap_async(
        self,
        func: Callable[..., _T],
        iterable: Iterable[Iterable[object]],
        chunksize: int | None = None,
        callback: Callable[[list[_T]], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
        *,
        progress: bool | int | Progress | None = None,
    ) -> MapResult[_T]:
        """``starmap`` returning at once; ``progress`` is shown while ``get()`` waits.

        Args:
            func: as for ``starmap``.
            iterable: as for ``starmap``.
            chunksize: as for ``map``.
            callback: as for ``map_async``.
            error_callback: as for ``map_async``.
            progress: as for ``map``.

        Returns:
            The result; its ``get()`` returns the list of values.

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._map_async(
            func, iterable, _worker.STARMAP, chunksize, callback, error_callback, progress
        )

    def _map_async(
        self,
        func: Callable[..., Any],
        iterable: Iterable[Any],
        kind: int,
        chunksize: int | None,
        callback: Callable[[list[Any]], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
        progress: bool | int | Progress | None = None,
    ) -> MapResult[Any]:
        self._check_running()
        shown = as_progress(progress)
        # a range stays one: its chunks are ranges, a few bytes each on the wire
        items: Sequence[Any] = (
            iterable
            if isinstance(iterable, list) or (type(iterable) is range and kind == _worker.MAP)
            else list(iterable)
        )
        if chunksize is None:
            chunksize, extra = divmod(len(items), self._processes * 4)
            if extra:
                chunksize += 1
        if len(items) == 0:
            chunksize = 0
        elif chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        if kind == _worker.STARMAP:
            items = [tuple(item) for item in items]
        result: MapResult[Any] = MapResult(self._dispatcher, len(items), callback, error_callback)
        result._pool = self
        if shown is not None:
            shown._count_here(len(items))
            result._progress = shown
        if not items:
            return result
        chunks = [(i, min(chunksize, len(items) - i)) for i in range(0, len(items), chunksize)]
        job = _MapJob(func, result, chunks)
        result.job = job
        self._dispatcher.submit(
            Task(job, n, kind, items[start : start + length])
            for n, (start, length) in enumerate(chunks)
        )
        return result

    def imap(
        self,
        func: Callable[[_S], _T],
        iterable: Iterable[_S],
        chunksize: int = 1,
        *,
        progress: bool | int | Progress | None = None,
    ) -> IMapIterator[_T]:
        """Like ``map``, but returns an iterator of the results, in order, as they come;
        the input is read as the workers need it, in a thread of its own. ``progress``
        is redrawn while the iterator waits (its total: ``len(iterable)`` when it has
        one).

        Args:
            func: called on each item.
            iterable: the items (an endless generator works).
            chunksize: items per task.
            progress: as for ``map``.

        Returns:
            The iterator of values; each failure is raised when its place comes (see
            ``IMapIterator.next``).

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._imap(IMapIterator, func, iterable, chunksize, progress)

    def imap_unordered(
        self,
        func: Callable[[_S], _T],
        iterable: Iterable[_S],
        chunksize: int = 1,
        *,
        progress: bool | int | Progress | None = None,
    ) -> IMapUnorderedIterator[_T]:
        """Like ``imap``, in the order the results come.

        Args:
            func: called on each item.
            iterable: the items.
            chunksize: items per task.
            progress: as for ``map``.

        Returns:
            The iterator of values, as they come.

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, progress)

    def _imap(
        self,
        cls: type[_Iterator],
        func: Callable[..., Any],
        iterable: Iterable[Any],
        chunksize: int,
        progress: bool | int | Progress | None = None,
    ) -> _Iterator:
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        shown = as_progress(progress)
        it = cls(self._dispatcher)
        it._pool = self
        if shown is not None:
            try:
                # an Iterable may have a length (a TypeError says it has none)
                total: int | None = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
            shown._count_here(total)
            it._progress = shown
        job = _IMapJob(func, it)
        it.job = job
        self._iterators.add(it)
        sequence = type(iterable) in _SEQUENCES
        ahead = max(2, _FEED_AHEAD * self._processes)
        room = _results_room(chunksize, ahead)
        if sequence:  # (within the room: a task's arrays hold descriptors while it runs)
            ahead = min(room, max(ahead, _SEQUENCE_AHEAD * self._processes))
        self._dispatcher.feeding(+1)
        threading.Thread(
            target=_feed,
            args=(self._dispatcher, job, iter(iterable), chunksize, ahead, room, sequence),
            name="procspawn-pool-imap-feeder",
            daemon=True,
        ).start()
        return it

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Take no more work; the workers exit once the work given is done."""
        if self._state == "RUN":
            self._state = "CLOSE"
            self._dispatcher.close()

    def terminate(self) -> None:
        """Stop the workers now (SIGTERM, then SIGKILL after the grace period); results
        not ready fail with a RuntimeError. Leaving a ``with`` block calls it."""
        self._state = "TERMINATE"
        self._dispatcher.terminate()
        self._wake_iterators()  # a next() waiting for input never fed raises

    @ctrl_c_in_caller
    def join(self) -> None:
        """Wait for the workers to exit, after ``close()`` or ``terminate()``.

        Raises:
            ValueError: the pool is still running (neither closed nor terminated).
        """
        if self._state == "RUN":
            raise ValueError("Pool is still running")
        if self._state not in ("CLOSE", "TERMINATE", "INIT"):
            raise ValueError(f"Pool is in an unknown state {self._state!r}")
        self._joining = True
        self._wake_iterators()  # an imap's feeder waiting for room goes on
        self._dispatcher.join()

    def _wake_iterators(self) -> None:
        """Wake what waits on this pool's imap iterators (their callers, their feeders)
        to look again at the pool's state."""
        for it in list(self._iterators):
            it._wake_all()

    def __enter__(self) -> Pool:
        self._check_running()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    def __del__(self, _warn: Callable[..., Any] = warnings.warn) -> None:
        if getattr(self, "_state", None) == "RUN":
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning, source=self)
            dispatcher = getattr(self, "_dispatcher", None)
            if dispatcher is not None:  # by its thread: this thread may hold its lock
                dispatcher.request(functools.partial(dispatcher.terminate, wait=False))


def _results_room(chunksize: int, ahead: int) -> int:
    """imap: how many chunks' results may wait for a caller that takes them slowly.

    Under the ``file_descriptor`` strategy each array of a result waiting to be taken
    holds a descriptor: a slow consumer of an imap over arrays ran the parent out of
    them (FdLimitError, the rest of the results lost) at a limit of 1,024. The results
    waiting are kept under a quarter of the limit (one array per item counted): no bound
    in effect where the limit is high (procspawn lifts the soft limit to the hard one),
    as the stdlib's imap has none. Past it, the feeder still goes on while this process
    uses under a quarter of its descriptors (results of plain values hold none), and
    while ``join()`` waits (``imap(); close(); join()`` returned at once with the stdlib
    and waited forever here, the results waiting for a caller who waited in ``join``)."""
    raise_fd_limit()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return sys.maxsize
    return max(ahead, soft // (4 * chunksize))


def _feed(
    dispatcher: Dispatcher,
    job: _IMapJob,
    source: Iterator[Any],
    chunksize: int,
    ahead: int,
    room: int,
    sequence: bool,
) -> None:
    """imap's input, read in a thread of its own (a slow or blocking iterable never holds
    up the dispatcher): at most ``ahead`` chunks worked on at once, and ``room`` waiting
    for the caller (see ``_results_room``). Each chunk of an iterator goes as soon as it
    was read (the next item may be long to come); a list, tuple or range is read without
    waiting, so what may go goes in one submit, and the feeder waits for room again only
    once a quarter of it is free. It holds the iterator only for a moment at a time (see
    ``_IMapJob``)."""
    iterator = job.iterator
    step = max(1, min(ahead, room) // 4)
    sent = 0
    error: BaseException | None = None
    try:
        done = False
        while not done:
            it = iterator()
            free = None if it is None else it._wait_room(sent, ahead, room, step)
            del it
            if free is None:
                break
            tasks: list[Task] = []
            try:
                for _ in range(free):
                    # an input that may wait: nothing more is read once the caller
                    # stopped or the pool ended (each item read then would be lost)
                    if not sequence and not _feeding(iterator):
                        done = True
                        break
                    chunk = list(itertools.islice(source, chunksize))
                    if chunk:
                        tasks.append(Task(job, sent + len(tasks), _worker.MAP, chunk))
                    if len(chunk) < chunksize:
                        done = True
                        break
                    if not sequence:
                        sent, taken = _submit(dispatcher, iterator, tasks, sent)
                        tasks = []
                        if not taken:
                            done = True
                            break
            finally:  # what was read goes, even when the iterable raised after it
                sent, taken = _submit(dispatcher, iterator, tasks, sent)
                if not taken:
                    done = True
    except BaseException as exc:  # the iterable raised: its results end there
        error = exc
    finally:
        del source
        it = iterator()
        if it is not None:
            it._input_done(sent, error)
        del it
        dispatcher.feeding(-1)


def _feeding(iterator: weakref.ref[IMapIterator[Any]]) -> bool:
    it = iterator()
    return it is not None and it._feeding()


def _submit(
    dispatcher: Dispatcher,
    iterator: weakref.ref[IMapIterator[Any]],
    tasks: list[Task],
    sent: int,
) -> tuple[int, bool]:
    """Hand imap's chunks to the pool: how many were sent in all, and whether the pool
    took them (when not, each failed with the error that says why)."""
    if not tasks:
        return sent, True
    try:
        # accepted before any close(): goes on after it, as the stdlib's does
        dispatcher.submit(tasks, accepted=True)
    except BaseException as exc:
        it = iterator()
        if it is not None:
            for task in tasks:
                it._put(task.index, False, exc)
        return sent + len(tasks), False
    return sent + len(tasks), True


__all__ = [
    "ApplyResult",
    "AsyncResult",
    "IMapIterator",
    "IMapUnorderedIterator",
    "MapResult",
    "Pool",
]
