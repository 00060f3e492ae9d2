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

import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from multiprocessing.context import BaseContext

from ..context._errors import ctrl_c_in_caller
from ..context._progress import Progress, as_progress
from ..context.launch._start_method import start_method_of
from . import _worker
from ._dispatcher import Dispatcher
from ._failures import check_backend, check_options
from ._imap import (
    _FEED_AHEAD,
    _SEQUENCE_AHEAD,
    _SEQUENCES,
    IMapIterator,
    IMapUnorderedIterator,
    _feed,
    _IMapJob,
    _results_room,
)
from ._results import ApplyResult, MapResult, _ApplyJob, _CallResult, _MapJob
from ._tasks import Task

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any, NoReturn, TypeVar

    from ._dispatching import DispatcherBase
else:
    from .._generic import TypeVar

_T = TypeVar("_T")  # what a call returns
_S = TypeVar("_S")  # an item of a map's input
if TYPE_CHECKING:
    _Iterator = TypeVar("_Iterator", bound=IMapIterator[Any])


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
        backend: ``"process"`` (workers on this machine) or ``"ray"``: each task a Ray
            task on a Ray cluster, at most ``processes`` at once, as described for
            ``procspawn.ProcessPoolExecutor``. ``context``, ``maxtasksperchild`` and
            ``max_memory_per_child`` do not apply.
        ray_address: the Ray cluster, as for ``procspawn.ProcessPoolExecutor``.

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
        backend: str = "process",
        ray_address: str | None = None,
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
        check_backend(
            backend,
            ray_address,
            context=context,
            maxtasksperchild=maxtasksperchild,
            max_memory_per_child=max_memory_per_child,
        )
        self._processes = processes
        self._dispatcher: DispatcherBase
        if backend == "ray":
            from ._ray_dispatcher import RayDispatcher

            self._dispatcher = RayDispatcher(
                processes,
                initializer=initializer,
                initargs=initargs,
                task_timeout=task_timeout,
                retries=retries,
                ray_address=ray_address,
                name="pool",
            )
            self._state = "RUN"
            return
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
        *,
        task_timeout: float | None = None,
    ) -> _T:
        """``func(*args, **kwds)`` in a worker; waits for it and returns its value.

        Args:
            func: the function to call.
            args: its positional arguments.
            kwds: its keyword arguments.
            task_timeout: seconds each of this call's tasks (a call, or a chunk) may
                run, in place of the pool's ``task_timeout``; None: the pool's.

        Returns:
            What ``func`` returned.

        Raises:
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised.
            ProcessExitedException: the worker died while running it (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: it ran longer than its ``task_timeout`` (or the pool's).
            InitializerError: the pool's ``initializer`` raised: no task can run.
            ValueError: the pool was closed or terminated, or ``task_timeout`` is not a
                number of seconds > 0.
            RuntimeError: the pool was terminated before it finished.
        """
        return self.apply_async(func, args, kwds, task_timeout=task_timeout).get()

    def apply_async(
        self,
        func: Callable[..., _T],
        args: Iterable[object] = (),
        kwds: Mapping[str, object] | None = None,
        callback: Callable[[_T], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
        *,
        task_timeout: float | None = None,
    ) -> ApplyResult[_T]:
        """``func(*args, **kwds)`` in a worker; returns an ``AsyncResult`` at once.

        Args:
            func: the function to call.
            args: its positional arguments.
            kwds: its keyword arguments.
            callback: called with the value once ``func`` returned (in a thread of the
                pool: keep it short).
            error_callback: called with the exception instead, if the call failed.
            task_timeout: seconds each of this call's tasks (a call, or a chunk) may
                run, in place of the pool's ``task_timeout``; None: the pool's.

        Returns:
            The result; its ``get()`` returns the value or raises what ``apply`` would.

        Raises:
            ValueError: the pool was closed or terminated, or ``task_timeout`` is not a
                number of seconds > 0.
        """
        self._check_running()
        check_options(task_timeout, 0, None)
        result: _CallResult[_T] = _CallResult(self._dispatcher, callback, error_callback)
        result._pool = self  # a pool nobody else holds lives as long as its results
        job = _ApplyJob(func, result)
        job.timeout = task_timeout
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
        task_timeout: float | None = None,
    ) -> list[_T]:
        """``list(map(func, iterable))``, run in the workers in chunks.

        Args:
            func: called on each item.
            iterable: the items; read whole before the first chunk is sent.
            chunksize: items per task (one message each way); default: four chunks per
                worker (``len(items) / (4 * processes)``, rounded up).
            progress: True, an int total or a ``procspawn.Progress``: a bar counting
                finished items while the call waits (its total: the number of items).
            task_timeout: seconds each chunk of this call may run, in place of the
                pool's ``task_timeout``; None: the pool's.

        Returns:
            The values, in the order of the items.

        Raises:
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised.
            ProcessExitedException: the worker died while running a chunk (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: a chunk ran longer than its ``task_timeout`` (or the
                pool's).
            InitializerError: the pool's ``initializer`` raised: no task can run.
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
            RuntimeError: the pool was terminated before the map finished.
        """
        return self._map_async(
            func, iterable, _worker.MAP, chunksize, progress=progress, task_timeout=task_timeout
        ).get()

    @ctrl_c_in_caller
    def starmap(
        self,
        func: Callable[..., _T],
        iterable: Iterable[Iterable[object]],
        chunksize: int | None = None,
        *,
        progress: bool | int | Progress | None = None,
        task_timeout: float | None = None,
    ) -> list[_T]:
        """``[func(*args) for args in iterable]``, run in the workers in chunks.

        Args:
            func: called on each item's arguments.
            iterable: the items, each an iterable of arguments.
            chunksize: as for ``map``.
            progress: as for ``map``.
            task_timeout: as for ``map``.

        Returns:
            The values, in the order of the items.

        Raises:
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised.
            ProcessExitedException: the worker died while running a chunk (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: a chunk ran longer than its ``task_timeout`` (or the
                pool's).
            InitializerError: the pool's ``initializer`` raised: no task can run.
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
            RuntimeError: the pool was terminated before the map finished.
        """
        return self._map_async(
            func,
            iterable,
            _worker.STARMAP,
            chunksize,
            progress=progress,
            task_timeout=task_timeout,
        ).get()

    def map_async(
        self,
        func: Callable[[_S], _T],
        iterable: Iterable[_S],
        chunksize: int | None = None,
        callback: Callable[[list[_T]], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
        *,
        progress: bool | int | Progress | None = None,
        task_timeout: float | None = None,
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
            task_timeout: as for ``map``.

        Returns:
            The result; its ``get()`` returns the list of values or raises what ``map``
            would.

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._map_async(
            func, iterable, _worker.MAP, chunksize, callback, error_callback, progress, task_timeout
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
        task_timeout: float | None = None,
    ) -> MapResult[_T]:
        """``starmap`` returning at once; ``progress`` is shown while ``get()`` waits.

        Args:
            func: as for ``starmap``.
            iterable: as for ``starmap``.
            chunksize: as for ``map``.
            callback: as for ``map_async``.
            error_callback: as for ``map_async``.
            progress: as for ``map``.
            task_timeout: as for ``map``.

        Returns:
            The result; its ``get()`` returns the list of values.

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._map_async(
            func,
            iterable,
            _worker.STARMAP,
            chunksize,
            callback,
            error_callback,
            progress,
            task_timeout,
        )

    def _map_async(
        self,
        func: Callable[..., Any],
        iterable: Iterable[Any],
        form: int,
        chunksize: int | None,
        callback: Callable[[list[Any]], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
        progress: bool | int | Progress | None = None,
        task_timeout: float | None = None,
    ) -> MapResult[Any]:
        self._check_running()
        check_options(task_timeout, 0, None)
        shown = as_progress(progress)
        # a range stays one: its chunks are ranges, a few bytes each on the wire
        items: Sequence[Any] = (
            iterable
            if isinstance(iterable, list) or (type(iterable) is range and form == _worker.MAP)
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
        if form == _worker.STARMAP:
            items = [tuple(item) for item in items]
        result: MapResult[Any] = MapResult(self._dispatcher, len(items), callback, error_callback)
        result._pool = self
        if shown is not None:
            shown.reset(len(items))
            result._progress = shown
        if not items:
            return result
        chunks = [(i, min(chunksize, len(items) - i)) for i in range(0, len(items), chunksize)]
        job = _MapJob(func, result, chunks)
        job.progress = shown
        job.timeout = task_timeout
        result.job = job
        self._dispatcher.submit(
            Task(job, n, form, items[start : start + length])
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
        task_timeout: float | None = None,
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
            task_timeout: as for ``map``.

        Returns:
            The iterator of values; each failure is raised when its place comes (see
            ``IMapIterator.next``).

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._imap(IMapIterator, func, iterable, chunksize, progress, task_timeout)

    def imap_unordered(
        self,
        func: Callable[[_S], _T],
        iterable: Iterable[_S],
        chunksize: int = 1,
        *,
        progress: bool | int | Progress | None = None,
        task_timeout: float | None = None,
    ) -> IMapUnorderedIterator[_T]:
        """Like ``imap``, in the order the results come.

        Args:
            func: called on each item.
            iterable: the items.
            chunksize: items per task.
            progress: as for ``map``.
            task_timeout: as for ``map``.

        Returns:
            The iterator of values, as they come.

        Raises:
            ValueError: the pool was closed or terminated, or ``chunksize`` < 1.
        """
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize, progress, task_timeout)

    def _imap(
        self,
        cls: type[_Iterator],
        func: Callable[..., Any],
        iterable: Iterable[Any],
        chunksize: int,
        progress: bool | int | Progress | None = None,
        task_timeout: float | None = None,
    ) -> _Iterator:
        self._check_running()
        check_options(task_timeout, 0, None)
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        shown = as_progress(progress)
        it = cls(self._dispatcher)
        it._pool = self
        it._pool_joining = self._is_joining
        if shown is not None:
            try:
                # an Iterable may have a length (a TypeError says it has none)
                total: int | None = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
            shown.reset(total)
            it._progress = shown
        job = _IMapJob(func, it)
        job.progress = shown
        job.timeout = task_timeout
        it.job = job
        self._iterators.add(it)
        sequence = type(iterable) in _SEQUENCES
        ahead = max(2, _FEED_AHEAD * self._processes)
        room = _results_room(chunksize, ahead)
        if sequence:  # (within the room: a task's arrays hold descriptors while it runs)
            ahead = min(room, max(ahead, _SEQUENCE_AHEAD * self._processes))
        self._dispatcher.submitting(+1)
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

    def _is_joining(self) -> bool:
        """Whether a caller waits in ``join()`` (imap's results no longer wait for room)."""
        return self._joining

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


__all__ = ["Pool"]
