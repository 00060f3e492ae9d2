"""``procspawn.ProcessPoolExecutor``: a ``concurrent.futures.Executor`` on the dispatcher.

As ``concurrent.futures.ProcessPoolExecutor``: ``submit`` returns a Future, ``map`` an
iterator of results in order, and a worker that dies unexpectedly breaks the executor:
every future not done and every later ``submit`` raise ``procspawn.TerminatedWorkerError``,
a ``BrokenProcessPool`` that names the worker, how it died, the call it ran and its last
stderr lines. Unlike the stdlib's, what a worker's main module does not have travels by
cloudpickle (lambdas, closures, functions defined under the ``__main__`` guard), arrays
through shared memory, and no queue or lock is shared between workers. Workers start as
work comes, up to ``max_workers``.
"""

from __future__ import annotations

import concurrent.futures as _cf
import functools
import itertools
import multiprocessing
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.context import BaseContext
from types import TracebackType

from ..context._errors import ctrl_c, ctrl_c_in_caller
from ..context._progress import Progress, as_progress, wait_showing
from ..context.launch._start_method import start_method_of
from . import _worker
from ._dispatcher import Dispatcher
from ._failures import check_backend, check_max_tasks, check_options
from ._tasks import Job, Task

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any, ParamSpec, TypeVar

    from ._dispatching import DispatcherBase
else:
    from .._generic import TypeVar

_T = TypeVar("_T")  # what a call returns
if TYPE_CHECKING:
    _P = ParamSpec("_P")  # a submitted function's parameters


class Future(_cf.Future[_T]):
    """A ``concurrent.futures.Future`` that can also stop a call that runs: ``kill()``.

    ``ProcessPoolExecutor.submit`` returns one. ``cancel()`` keeps its meaning (it
    succeeds only before the call starts); ``result()`` and ``exception()`` are the
    stdlib's, except that Ctrl-C while they wait ends in a short traceback of the
    caller's frames.
    """

    _procspawn_kill: Callable[[], None] | None = None
    _procspawn_dispatcher: DispatcherBase | None = None

    @ctrl_c_in_caller
    def result(self, timeout: float | None = None) -> _T:
        """As ``concurrent.futures.Future.result``; raises RuntimeError when a callback of
        the executor (a done-callback) waits for a call not done (it would never end)."""
        self._check_waitable()
        return _cf.Future.result(self, timeout)

    @ctrl_c_in_caller
    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As ``concurrent.futures.Future.exception``; see ``result``."""
        self._check_waitable()
        return _cf.Future.exception(self, timeout)

    def _check_waitable(self) -> None:
        dispatcher = self._procspawn_dispatcher
        if dispatcher is not None and not self.done():
            dispatcher.check_not_serving()

    def kill(self) -> bool:
        """Stop this call now, whatever its state but done.

        Not started yet: cancelled, as ``cancel()`` does. Running: its worker is killed
        (SIGKILL) and a new one takes its place; the future fails with
        ``concurrent.futures.CancelledError`` (``result()`` raises it at once after the
        worker's death is seen, within milliseconds), unless the call's result arrived
        first. The executor goes on.

        Returns:
            True when the call was cancelled or its worker is being killed; False if the
            call had already finished.
        """
        if self.cancel():
            return True
        if self.done():
            return False
        kill = self._procspawn_kill
        if kill is None:
            return False
        kill()
        return True


class _CallJob(Job):
    def __init__(self, fn: Any, future: _cf.Future[Any]) -> None:
        super().__init__(fn)
        self.future = future

    def start(self, task: Task) -> bool:
        return _start(self.future)

    def cancel(self, task: Task) -> None:
        _cancel(self.future)

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        _set(self.future, ok, value)


class _ChunksJob(Job):
    """``map``: one future per chunk, by the chunk's index, the function sent once per
    worker. A future is let go once its chunk settled (a ``buffersize`` map over an
    endless input keeps only the chunks in flight)."""

    def __init__(self, fn: Any, progress: Progress | None) -> None:
        super().__init__(fn)
        self.futures: dict[int, _cf.Future[Any]] = {}
        self.progress = progress
        self._added = 0

    def add(self, count: int) -> tuple[int, list[_cf.Future[Any]]]:
        """The index of the first of the next ``count`` chunks, and their futures."""
        first = self._added
        self._added += count
        added: list[_cf.Future[Any]] = [_cf.Future() for _ in range(count)]
        self.futures.update(zip(range(first, self._added), added, strict=True))
        return first, added

    def start(self, task: Task) -> bool:
        future = self.futures.get(task.index)
        return future is not None and _start(future)

    def cancel(self, task: Task) -> None:
        future = self.futures.pop(task.index, None)
        if future is not None:
            _cancel(future)

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        future = self.futures.pop(task.index, None)
        if future is None:
            return
        if ok and self.progress is not None:
            self.progress.update(len(value))
        _set(future, ok, value)


def _kill(dispatcher: DispatcherBase, job_ref: weakref.ref[Job]) -> None:
    """``Future.kill()`` of a call not done (its job is alive while its task is)."""
    job = job_ref()
    if job is not None:
        dispatcher.kill(
            lambda task: task.job is job,
            _cf.CancelledError(f"{job.describe_fn()} was killed while it ran (Future.kill())"),
        )


def _done_within(future: _cf.Future[Any], seconds: float) -> bool:
    return not _cf.wait([future], seconds).not_done


def _cancel(future: _cf.Future[Any]) -> None:
    """Cancel a call that will never be handed out, and tell ``wait()`` and
    ``as_completed()``, which ``Future.cancel()`` alone does not (after the stdlib's
    ``shutdown(cancel_futures=True)`` they wait forever for such a future)."""
    if future.cancel() and future._state == _cf._base.CANCELLED:
        future.set_running_or_notify_cancel()  # CANCELLED_AND_NOTIFIED: the waiters know


def _start(future: _cf.Future[Any]) -> bool:
    """Mark it running, unless it was cancelled (False); a task handed out again (its
    worker died, or stopped before it ran it) is running already."""
    return future.running() or future.set_running_or_notify_cancel()


def _set(future: _cf.Future[Any], ok: bool, value: Any) -> None:
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except _cf.InvalidStateError:
        pass  # cancelled meanwhile (it was still pending)


class ProcessPoolExecutor(_cf.Executor):
    """A ``concurrent.futures`` executor running calls in worker processes.

    Args:
        max_workers: at most this many workers (default ``os.cpu_count()``); they start
            as work comes.
        mp_context: a multiprocessing context (or start method name) for the workers
            (default: ``procspawn.get_start_method()``, "forkserver").
        initializer: called as ``initializer(*initargs)`` in each worker as it starts; if
            it raises, the executor is broken (``procspawn.InitializerError``, a
            ``BrokenProcessPool``).
        initargs: its arguments.
        max_tasks_per_child: a worker exits after this many calls and a new one takes
            its place (allowed with every start method).
        task_timeout: seconds a call (one ``submit``, or one chunk of ``map``) may run;
            one running longer has its worker killed and replaced, and its future fails
            with ``procspawn.TaskTimeoutError``. The executor goes on. None: no limit.
        retries: a call whose worker dies while running it runs again, up to this many
            times, then fails with that death's ``ProcessExitedException``; with
            ``retries`` >= 1 no death breaks the executor. Default 0: a death breaks it,
            as the stdlib's (``TerminatedWorkerError``).
        max_memory_per_child: bytes; a worker whose resident memory is above it after a
            call is replaced before its next one. None: no limit.
        backend: ``"process"`` (worker processes on this machine) or ``"ray"``: each
            call (or chunk of ``map``) a Ray task on a Ray cluster, at most
            ``max_workers`` at once (1 CPU each). ``retries`` is Ray's ``max_retries`` (a
            call may then run more than once), ``task_timeout`` and ``Future.kill()``
            cancel the task (``ray.cancel(force=True)``: its Ray worker is killed), a
            dead Ray worker is ``ProcessExitedException`` naming Ray's cause and never
            breaks the executor. Arrays of 1 MiB or more among a call's arguments go
            through Ray's object store (a read-only one once per executor, a writable
            one once per call) and reach the task read-only; results come back
            writable. ``mp_context``, ``max_tasks_per_child`` and
            ``max_memory_per_child`` do not apply. Needs ``pip install 'procspawn[ray]'``.
        ray_address: the Ray cluster (default: ``RAY_ADDRESS``, else the one this
            process is connected to, else a local one procspawn starts and shuts down
            with the last pool or spawn that used it).

    ``submit`` returns a ``procspawn.pool.Future``, whose ``kill()`` stops a running call.
    Use it as a context manager (``shutdown(wait=True)`` on leaving; Ctrl-C in the block
    stops the calls instead of waiting for them), or call ``shutdown()``.

    Raises:
        ValueError: ``max_workers`` <= 0, ``max_tasks_per_child`` < 1, ``task_timeout``,
            ``retries`` or ``max_memory_per_child`` out of range, or ``mp_context``
            names an unknown start method.
        TypeError: ``initializer`` is not callable, ``max_tasks_per_child`` not an int,
            or ``mp_context`` neither a multiprocessing context nor a start method name.

    Example::

        from procspawn import ProcessPoolExecutor

        def cube(x):
            return x**3

        if __name__ == "__main__":
            with ProcessPoolExecutor(max_workers=2) as executor:
                future = executor.submit(cube, 3)
                assert future.result() == 27
                assert list(executor.map(cube, [1, 2, 3])) == [1, 8, 27]
    """

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: str | BaseContext | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[object] = (),
        *,
        max_tasks_per_child: int | None = None,
        task_timeout: float | None = None,
        retries: int = 0,
        max_memory_per_child: int | None = None,
        backend: str = "process",
        ray_address: str | None = None,
        _idle_timeout: float | None = None,
        _break_on_death: bool = True,
    ) -> None:
        if max_workers is None:
            max_workers = os.cpu_count() or 1
        elif not isinstance(max_workers, int):  # a float would pass below, and run
            raise TypeError(f"max_workers must be an int, got {max_workers!r}")
        elif max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        check_max_tasks(max_tasks_per_child)
        check_options(task_timeout, retries, max_memory_per_child)
        check_backend(
            backend,
            ray_address,
            mp_context=mp_context,
            max_tasks_per_child=max_tasks_per_child,
            max_memory_per_child=max_memory_per_child,
        )
        method = start_method_of(mp_context)
        self._max_workers = max_workers
        self._mp_context = multiprocessing.get_context(method)  # what the stdlib's keeps
        self._shutdown_lock = threading.Lock()
        self._shutdown = False
        if backend == "ray":
            from ._ray_dispatcher import RayDispatcher

            self._dispatcher: DispatcherBase = RayDispatcher(
                max_workers,
                initializer=initializer,
                initargs=initargs,
                executor_rules=True,
                task_timeout=task_timeout,
                retries=retries,
                ray_address=ray_address,
                name="executor",
            )
            weakref.finalize(self, self._dispatcher.request, self._dispatcher.close)
            return
        self._dispatcher = Dispatcher(
            max_workers,
            start_method=method,
            initializer=initializer,
            initargs=initargs,
            max_tasks=max_tasks_per_child,
            break_on_death=_break_on_death,
            executor_rules=True,
            # as work comes; under fork all at once, from this thread (forking the
            # dispatcher thread's process later would fork a threaded process)
            lazy=method != "fork",
            idle_timeout=_idle_timeout,
            task_timeout=task_timeout,
            retries=retries,
            max_memory=max_memory_per_child,
            name="executor",
        )
        # an executor dropped without shutdown() finishes its work, then its workers exit
        # (by its thread: the collector may run this in a thread holding its lock)
        weakref.finalize(self, self._dispatcher.request, self._dispatcher.close)

    @property
    def _processes(self) -> dict[int, Any]:
        """The worker processes now, by pid (the stdlib's attribute)."""
        self._dispatcher.sync()
        return {p.pid: p for p in self._dispatcher.workers() if p.pid is not None}

    @property
    def _broken(self) -> bool | str:
        broken = self._dispatcher.broken
        return False if broken is None else str(broken)

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Run ``fn(*args, **kwargs)`` in a worker; returns a Future.

        The future's ``result()`` returns what ``fn`` returned, or raises what it raised
        (the worker's traceback is the ``__cause__``), what pickling an argument or the
        result raised, ``procspawn.TerminatedWorkerError`` if a worker died (with
        ``retries=0``), ``procspawn.TaskTimeoutError`` past ``task_timeout``, or
        ``procspawn.InitializerError`` if the initializer raised.

        Args:
            fn: the function to call.
            *args: its positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            The future of the call.

        Raises:
            concurrent.futures.process.BrokenProcessPool: a worker died (the executor is
                broken; ``procspawn.TerminatedWorkerError`` says how).
            RuntimeError: after ``shutdown()``.
        """
        return self._submit(fn, args, kwargs)

    def _submit(
        self,
        fn: Callable[..., _T],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        task_timeout: float | None = None,
    ) -> Future[_T]:
        with self._shutdown_lock:
            self._check_open()
            future: Future[_T] = Future()
            job = _CallJob(fn, future)
            job.timeout = task_timeout
            # the job holds the future: the future holds the job weakly, or the two would
            # be a cycle keeping the result (shared arrays) until a garbage collection
            future._procspawn_kill = functools.partial(_kill, self._dispatcher, weakref.ref(job))
            future._procspawn_dispatcher = self._dispatcher
            self._dispatcher.submit([Task(job, 0, _worker.APPLY, (args, kwargs))])
        return future

    def schedule(
        self,
        fn: Callable[..., _T],
        args: Iterable[object] = (),
        kwargs: dict[str, object] | None = None,
        *,
        task_timeout: float | None = None,
    ) -> Future[_T]:
        """``submit`` with the arguments apart and a limit of this call's own (pebble's
        ``schedule(function, args, kwargs, timeout)``): ``fn(*args, **kwargs)``.

        Args:
            fn: the function to call.
            args: its positional arguments.
            kwargs: its keyword arguments.
            task_timeout: seconds this call may run, in place of the executor's
                ``task_timeout``: past it, its worker is killed and replaced, and the
                future fails with ``procspawn.TaskTimeoutError``; None: the executor's.

        Returns:
            The future of the call.

        Raises:
            ValueError: ``task_timeout`` is not a number of seconds > 0.
            concurrent.futures.process.BrokenProcessPool: the executor is broken.
            RuntimeError: after ``shutdown()``.
        """
        check_options(task_timeout, 0, None)
        return self._submit(fn, tuple(args), dict(kwargs or {}), task_timeout)

    def _check_open(self) -> None:
        self._dispatcher.check_owner()
        if self._dispatcher.broken is not None:
            raise self._dispatcher.broken_error()
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if not self._dispatcher.alive():  # stopped by the interpreter's exit
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    def map(
        self,
        fn: Callable[..., _T],
        *iterables: Iterable[object],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
        progress: bool | int | Progress | None = None,
        task_timeout: float | None = None,
    ) -> Iterator[_T]:
        """``map(fn, *iterables)`` run in the workers, ``chunksize`` calls per message;
        the iterator raises TimeoutError if a result is not there ``timeout`` seconds
        after this call, and what ``fn`` raised for an item when that item comes.
        ``progress`` (True, an int total or a ``procspawn.Progress``): a bar counting
        finished calls, redrawn while the iterator waits.

        Without ``buffersize`` the iterables are read whole, at once, and every chunk is
        submitted. With it (Python 3.14's argument, here on every Python), they are read
        as the results are taken: at most ``buffersize`` chunks are submitted and not yet
        yielded, so an endless iterator works and memory stays bounded. An iterator
        closed or dropped after its first value cancels the chunks not started.

        Args:
            fn: called as ``fn(*items)``, one item of each iterable.
            *iterables: the items; the shortest one ends the calls.
            timeout: seconds after this call by which each result must be there; None:
                no limit.
            chunksize: calls per task (one message each way).
            buffersize: at most this many chunks submitted ahead of the results taken;
                None: all at once.
            progress: True, an int total or a ``procspawn.Progress``.
            task_timeout: seconds each chunk of this map may run, in place of the
                executor's ``task_timeout``; None: the executor's.

        Returns:
            An iterator of the values, in order.

        Raises:
            ValueError: ``chunksize`` < 1, ``buffersize`` < 1, or ``task_timeout`` is not
                a number of seconds > 0.
            TypeError: ``buffersize`` is not an int or None.
            concurrent.futures.process.BrokenProcessPool: a worker died before (the
                executor is broken).
            RuntimeError: after ``shutdown()``.
        """
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if buffersize is not None and not isinstance(buffersize, int):
            raise TypeError("buffersize must be an integer or None")
        if buffersize is not None and buffersize < 1:
            raise ValueError("buffersize must be None or > 0")
        check_options(task_timeout, 0, None)
        shown = as_progress(progress)
        end_time = None if timeout is None else timeout + time.monotonic()
        form, chunks = _chunks(iterables, chunksize)
        job = _ChunksJob(fn, shown)
        job.timeout = task_timeout
        dispatcher = self._dispatcher
        executor = weakref.ref(self)  # the executor can be collected while a map is read

        def submit(count: int | None, initial: bool = False) -> list[_cf.Future[Any]]:
            """The futures of the next ``count`` chunks (None: all), submitted."""
            owner = executor()
            if owner is None:  # collected: no more is read, as the stdlib's map does
                return []
            taken = list(chunks if count is None else itertools.islice(chunks, count))
            if not taken and not initial:
                return []
            with owner._shutdown_lock:
                owner._check_open()
                if not taken:
                    return []
                first, futures = job.add(len(taken))
                if shown is not None and count is None:  # (all: the total is known)
                    shown.reset(sum(len(chunk) for chunk in taken))
                dispatcher.submit(
                    Task(job, first + n, form, chunk) for n, chunk in enumerate(taken)
                )
            return futures

        if shown is not None and buffersize is not None:
            # read lazily: the total is known only where every input has a length
            lengths = [len(it) for it in iterables if hasattr(it, "__len__")]  # type: ignore[arg-type]
            shown.reset(min(lengths) if len(lengths) == len(iterables) else None)
        futures = submit(buffersize, initial=True)
        more = None if buffersize is None else functools.partial(submit, 1)
        stop = functools.partial(_kill, dispatcher, weakref.ref(job))
        return _results(futures, end_time, shown, stop, dispatcher, more)

    @ctrl_c_in_caller
    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; the workers exit once the calls given are done.

        Args:
            wait: return once every worker exited.
            cancel_futures: cancel the calls not started yet.
        """
        with self._shutdown_lock:
            self._shutdown = True
        if cancel_futures:
            self._dispatcher.cancel_pending()
        self._dispatcher.close()
        if wait:
            self._dispatcher.join()

    def terminate_workers(self) -> None:
        """Stop every worker now with SIGTERM (Python 3.14's method, here on every
        Python): the calls not started are cancelled, those running fail with
        ``BrokenProcessPool``, and the executor takes no more calls. Returns at once; a
        worker still there after the grace period (``PROCSPAWN_GRACE_PERIOD``) is killed.
        """
        self._force_shutdown("terminate_workers()", None)

    def kill_workers(self) -> None:
        """As ``terminate_workers()``, with SIGKILL (Python 3.14's method, here on every
        Python)."""
        self._force_shutdown("kill_workers()", 0.0)

    def _force_shutdown(self, how: str, grace: float | None) -> None:
        with self._shutdown_lock:
            self._shutdown = True
        self._dispatcher.cancel_pending(keep_none=True)
        from concurrent.futures.process import BrokenProcessPool  # (imports at first use)

        error = BrokenProcessPool(f"the executor's workers were stopped by {how}")
        self._dispatcher.terminate(grace, error=error, wait=False)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if ctrl_c(exc):
            # Ctrl-C in the block: the calls are not waited for; their workers stop
            with self._shutdown_lock:
                self._shutdown = True
            self._dispatcher.terminate(error=_cf.CancelledError("interrupted by Ctrl-C"))
        else:
            self.shutdown(wait=True)


def _chunks(iterables: tuple[Iterable[object], ...], chunksize: int) -> tuple[int, Iterator[Any]]:
    """How map's tasks call the function, and its chunks, read lazily."""
    if len(iterables) == 1 and type(iterables[0]) is range:
        # a range stays one: its chunks are ranges, a few bytes each on the wire
        whole = iterables[0]
        return _worker.MAP, (whole[i : i + chunksize] for i in range(0, len(whole), chunksize))
    items = zip(*iterables, strict=False)
    return _worker.STARMAP, iter(lambda: list(itertools.islice(items, chunksize)), [])


def _results(
    futures: list[_cf.Future[list[_T]]],
    end_time: float | None,
    progress: Progress | None = None,
    stop: Callable[[], None] | None = None,
    dispatcher: DispatcherBase | None = None,
    more: Callable[[], list[_cf.Future[Any]]] | None = None,
) -> Iterator[_T]:
    """map's values in order; nothing of a value is held once it was yielded. Ctrl-C
    while it waits calls ``stop`` (the map's chunks still running are killed). ``more``
    (a ``buffersize`` map): submits the next chunk before each chunk's values are
    waited for, and returns its future (none once the input is read)."""
    try:
        futures.reverse()
        while futures:
            if more is not None:
                futures[:0] = more()
            future = futures[-1]
            if dispatcher is not None and not future.done():
                dispatcher.check_not_serving()
            if progress is not None:
                wait_showing(
                    functools.partial(_done_within, future),
                    progress,
                    None if end_time is None else end_time - time.monotonic(),
                )
            if end_time is None:
                values = future.result()
            else:
                values = future.result(end_time - time.monotonic())
            futures.pop()
            del future
            values.reverse()
            while values:
                yield values.pop()
    except KeyboardInterrupt as interrupt:
        # nobody else holds these futures: the chunks running are stopped (their workers
        # replaced) as a Pool's map stops its own, instead of running on for nothing
        if stop is not None and ctrl_c(interrupt) and any(not f.done() for f in futures):
            stop()
        raise
    finally:
        for future in futures:
            future.cancel()
        if progress is not None:
            progress.close()


__all__ = ["ProcessPoolExecutor"]
