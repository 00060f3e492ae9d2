"""The pools on a Ray cluster: the dispatcher's interface, on Ray tasks.

``ProcessPoolExecutor(backend="ray")`` and ``Pool(backend="ray")`` keep their front ends
(futures, results, imap) and hand their tasks to a ``RayDispatcher`` instead of the
``Dispatcher``::

    callers ──submit(tasks)──▶ pending deque ──▶ dispatcher thread
        each procspawn task (a call, or a chunk of a map) a Ray task of 1 CPU in the
        pool's placement group (``processes`` CPUs, reserved at once): at most
        ``processes`` run, QUEUED_PER_CPU times as many are in flight; each settled as
        its future's callback (Ray's thread) hands it over, nothing polls
        a death (WorkerCrashedError, OutOfMemoryError, NodeDiedError): Ray runs it again
                 up to ``retries`` times, then the task fails with ProcessExitedException;
                 the pool goes on (a new Ray worker takes the next task)
        a raise: the task's own exception, its remote traceback as the cause (the codec
                 of ``context._raised``: Ray never retries it)
        task_timeout, Future.kill(): ``ray.cancel(force=True)`` kills its worker

Tasks, not actors: Ray replaces a dead task's worker and re-runs the task, where a dead
actor of ``ray.util.multiprocessing.Pool`` leaves the pool a worker short for good.
Functions go to the object store once per pool, and arrays of 1 MiB or more in a call's
arguments (at its top level) through it: a read-only one once per pool, a writable one
once per call. They reach the task read-only (Ray's object store arrays are); results
come back by value (pickled by the task), writable.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import pickle
import sys
import threading
import time
import types
import uuid
import weakref
from collections.abc import Callable, Iterable

import cloudpickle

from .. import _settings
from ..context import _raised, _tags
from ..context._errors import ProcessExitedException, RayResourcesError
from ..context._ray import connect, disconnect, import_ray, refuse_shared_arrays
from . import _exit, _worker
from ._dispatching import CLOSING, DONE, RUNNING, STOPPING, DispatcherBase
from ._errors import TaskTimeoutError
from ._failures import broken_errors, remote_error
from ._tasks import Job, Task, settle

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any

STORED_BYTES = 1 << 20  # an argument array this big goes to the object store once
# tasks in flight per CPU of the pool's placement group: the group runs one per CPU, the
# others wait queued in Ray, which then starts each the moment a CPU is free (the Ray
# worker leased for the last task runs the next: no round trip between two tiny tasks)
QUEUED_PER_CPU = 4
_FUNCTIONS_KEPT = 16  # functions in the object store per pool (and per Ray worker)


class _Stored:
    """An argument put in the object store: the index of its ref among the task's."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> Any:
        return (_Stored, (self.index,))


_ready: set[str] = set()  # (in a Ray worker) the pools it has set up: path, initializer
# (in a Ray worker) the functions fetched from the object store, by ref, the last used
_functions_here: collections.OrderedDict[Any, Any] = collections.OrderedDict()


def _function_here(ray: Any, ref: Any) -> Any:
    """The function under ``ref``, fetched once per Ray worker process."""
    key = ref.binary()
    fn = _functions_here.get(key)
    if fn is None:
        fn = ray.get(ref)
        if len(_functions_here) >= _FUNCTIONS_KEPT:
            _functions_here.popitem(last=False)
        _functions_here[key] = fn
    else:
        _functions_here.move_to_end(key)
    return fn


def run_task(
    pool_id: str,
    path: list[str],
    init: bytes | None,
    fn_box: list[Any],
    form: int,
    payload: bytes,
    refs: list[Any],
    executor: bool,
) -> tuple[Any, ...]:
    """One procspawn task in a Ray worker: ``(RESULT, pickled value)`` or ``(RAISED, blob,
    text)``, ``(INIT_FAILED, blob, text)`` if the pool's initializer raised here.

    The caller's import path comes first (as multiprocessing's spawn does), then what was
    pickled in the caller is loaded: the function (``fn_box``: its ref, in a list so that
    Ray leaves it to this function to fetch; empty: it is in the payload), the
    arguments (their large arrays from the object store, ``refs``), the initializer."""
    import cloudpickle
    import ray

    try:
        if pool_id not in _ready:  # this Ray worker's first task of the pool
            sys.path.extend(p for p in path if p not in sys.path)
            if init is not None:
                initializer, initargs = pickle.loads(init)
                try:
                    initializer(*initargs)
                except BaseException as exc:
                    return (_tags.INIT_FAILED, _raised.pack(exc), _raised.traceback_text(exc))
            _ready.add(pool_id)
        fn_in_payload, data = pickle.loads(payload)
        fn = _function_here(ray, fn_box[0]) if fn_box else fn_in_payload

        def arg(obj: Any) -> Any:
            return ray.get(refs[obj.index]) if isinstance(obj, _Stored) else obj

        if form == _worker.APPLY:
            args, kwargs = data
            value: Any = fn(*[arg(a) for a in args], **{k: arg(v) for k, v in kwargs.items()})
        elif form == _worker.MAP:
            value = [fn(arg(item)) for item in data]
        else:
            value = [fn(*[arg(a) for a in item]) for item in data]
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: the task's error
        if isinstance(exc, SystemExit) and not executor:
            raise  # as a Pool's worker: it exits (Ray: a crashed worker)
        return (_tags.RAISED, _raised.pack(exc), _raised.traceback_text(exc, users_only=True))
    try:
        return (_tags.RESULT, cloudpickle.dumps(value))
    except BaseException as exc:
        what = f"the result of the task could not be pickled: {type(exc).__name__}: {exc}"
        error = pickle.PicklingError(what)
        return (_tags.RAISED, _raised.pack(error), what + "\n")


def _reserve(ray: Any, cpus: int, name: str) -> Any:
    """A placement group of ``cpus`` one-CPU bundles, ready; RayResourcesError (naming
    the numbers) if the cluster has fewer CPUs, or cannot reserve them in time."""
    from ray.util.placement_group import placement_group

    what = f"backend='ray' ({name})"
    total = ray.cluster_resources().get("CPU", 0)
    if total < cpus:
        raise RayResourcesError(
            f"{what}: the Ray cluster has {total:g} CPU(s) in all, and the pool asks for "
            f"{cpus} (one per task it runs at once). Ask for fewer, or add nodes."
        )
    group = placement_group([{"CPU": 1}] * cpus, strategy="PACK")
    wait = float(_settings.get("PROCSPAWN_RAY_READY_TIMEOUT"))
    try:
        ready, _ = ray.wait([group.ready()], timeout=wait)
    except BaseException:  # Ctrl-C while the cluster reserves them
        _remove(ray, group)
        raise
    if not ready:
        _remove(ray, group)
        raise RayResourcesError(
            f"{what}: the Ray cluster could not reserve {cpus} CPU(s) within {wait:g} s "
            f"(available now: {ray.available_resources().get('CPU', 0):g}); other jobs "
            f"may hold them. Ask for fewer, or wait (PROCSPAWN_RAY_READY_TIMEOUT)."
        )
    return group


def _remove(ray: Any, group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:
        pass  # the cluster is gone already


def _deaths(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray's errors for a task whose worker died (its process, or its node)."""
    names = ("WorkerCrashedError", "OutOfMemoryError", "NodeDiedError", "LocalRayletDiedError")
    return tuple(getattr(ray.exceptions, n) for n in names if hasattr(ray.exceptions, n))


class _InFlight:
    __slots__ = ("task", "started", "deadline", "killed")

    def __init__(self, task: Task) -> None:
        self.task = task
        self.started: float | None = None  # when it was seen to be running (_start_clocks)
        self.deadline: float | None = None
        self.killed = False  # cancelled by us (a timeout, a kill): its outcome is settled


class RayDispatcher(DispatcherBase):
    """The ``Dispatcher``'s interface, run on Ray tasks (see the module's docstring).

    Args:
        processes: Ray tasks running at most: the CPUs of the pool's placement group,
            reserved at once (RayResourcesError if the cluster cannot).
        initializer, initargs: run once in each Ray worker process before its first task
            of this pool; if it raises, the pool breaks (InitializerError).
        executor_rules: ``concurrent.futures``' rules (a ``sys.exit()`` in a task is its
            error); otherwise ``multiprocessing.Pool``'s (it ends the worker: a death).
        task_timeout: seconds a task may run from its turn (when it is among the first
            ``processes`` in flight); then it is cancelled (``ray.cancel(force=True)``:
            its worker is killed) and fails with TaskTimeoutError.
        retries: Ray's ``max_retries``: a task whose worker died runs again up to this
            many times (it may then run more than once); a raise is never retried.
        ray_address: the cluster (default: ``RAY_ADDRESS``, else the one this process
            is connected to, else a local one of procspawn's own, shut down with the
            last pool or spawn that used it).
    """

    def __init__(
        self,
        processes: int,
        *,
        initializer: Callable[..., Any] | None = None,
        initargs: Iterable[Any] = (),
        executor_rules: bool = False,
        task_timeout: float | None = None,
        retries: int = 0,
        ray_address: str | None = None,
        name: str = "pool",
    ) -> None:
        super().__init__()
        # what was put in the object store: functions (the last used, weakly), read-only
        # arrays (while they live), by id
        self._functions: collections.OrderedDict[int, tuple[weakref.ref[Any], Any]] = (
            collections.OrderedDict()
        )
        self._arrays: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self._own_cluster = False
        self._ray = ray = import_ray(f"backend='ray' ({name})")
        # pickled here: one that cannot be is refused in the caller, before anything starts
        self._init = (
            cloudpickle.dumps((initializer, tuple(initargs))) if initializer is not None else None
        )
        self._own_cluster = connect(ray, ray_address, processes)
        self._group: Any = None
        try:
            # the pool's CPUs, reserved at once: at most ``processes`` tasks run, however
            # many wait queued behind them
            self._group = _reserve(ray, processes, name)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            strategy = PlacementGroupSchedulingStrategy(placement_group=self._group)
            self._remote = ray.remote(
                num_cpus=1,
                max_retries=retries,
                retry_exceptions=False,
                scheduling_strategy=strategy,
            )(run_task)
        except BaseException:  # (Ctrl-C while the cluster reserves the CPUs too)
            self._release()
            raise
        self.size = processes
        self.executor_rules = executor_rules
        self.task_timeout = task_timeout
        self.retries = retries
        self.name = name
        self._news = threading.Event()  # set by _wake
        self._pending: collections.deque[Task] = collections.deque()
        self._in_flight: dict[Any, _InFlight] = {}
        self._done: collections.deque[tuple[Any, Any]] = collections.deque()  # (ref, future)
        self._pool_id = uuid.uuid4().hex
        self._path = list(sys.path)
        self._stop_error: BaseException | None = None
        self._terminated = False
        self._thread = threading.Thread(
            target=self._serve, name=f"procspawn-{name}-ray-dispatcher", daemon=True
        )
        self._thread.start()
        _at_exit_registered()
        _live.add(self)

    # -- the callers' side (any thread) ----------------------------------------------------

    def submit(self, tasks: Iterable[Task], accepted: bool = False) -> None:
        with self._lock:
            if accepted and self.state in (STOPPING, DONE) and self.broken is None:
                raise self._stopped_error()  # what the job's other unfinished tasks get
            if self.broken is not None:
                raise self.broken_error()
            if self.state not in (RUNNING, CLOSING if accepted else RUNNING):
                raise ValueError("Pool not running")
            self._pending.extend(tasks)
        self._wake()

    def abandon(self, job: Job, kill_running: bool = True) -> None:
        job.abandoned = True

        def act() -> None:
            self._drop_pending(lambda task: task.job is job)
            if kill_running:
                for ref, flight in list(self._in_flight.items()):
                    if flight.task.job is job:
                        self._cancel(ref)

        self.request(act)

    def kill(self, which: Callable[[Task], bool], error: BaseException) -> None:
        def act() -> None:
            for ref, flight in list(self._in_flight.items()):
                if which(flight.task) and not flight.task.settled:
                    self._cancel(ref)
                    settle(flight.task, False, error)

        self.request(act)

    def cancel_pending(self, keep_none: bool = False) -> None:
        with self._lock:
            dropped = list(self._pending)
            self._pending.clear()
        for task in dropped:
            task.job.cancel(task)
        self._wake()

    def resize(self, processes: int) -> None:
        raise RuntimeError(
            "a pool on Ray keeps the CPUs it reserved: make a new one for another size"
        )

    def terminate(
        self,
        grace_period: float | None = None,
        error: BaseException | None = None,
        wait: bool = True,
        ctrl_c_raises: bool = True,
    ) -> None:
        """Cancel every task in flight (their Ray workers killed); those not done fail
        with ``error`` (default: the pool was terminated)."""
        with self._lock:
            if self.state in (RUNNING, CLOSING):
                self.state = STOPPING
                self._terminated = True
                self._stop_error = error
        self._wake()
        if wait:
            self.join()

    def sync(self, timeout: float = 10.0) -> None:
        pass  # nothing starts ahead of the work on Ray

    def workers(self) -> list[Any]:
        return []  # Ray's worker processes are not this pool's

    def terminated_error(self) -> BaseException | None:
        if self.state == DONE and self._terminated:
            return self._stopped_error()
        return None

    def _wake(self) -> None:
        self._news.set()

    # -- the dispatcher thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._news.clear()
            while self._done:  # first: a kill or a stop after a result does not undo it
                self._finished(*self._done.popleft())
            self._take_requests()
            if self.state == STOPPING:
                self._stop()
                return
            if self.broken is not None:
                return
            self._hand_out()
            self._start_clocks()
            if self.state == CLOSING and self._all_done():
                self.state = DONE
                return
            if not self._done:
                self._news.wait(self._timeout())
            while self._done:
                self._finished(*self._done.popleft())
            self._on_timers()

    def _timeout(self) -> float | None:
        deadlines = [f.deadline for f in self._in_flight.values() if f.deadline is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _all_done(self) -> bool:
        return not self._submitting and not self._pending and not self._in_flight

    def _hand_out(self) -> None:
        while len(self._in_flight) < self.size * QUEUED_PER_CPU:
            with self._lock:
                if not self._pending:
                    return
                task = self._pending.popleft()
            if task.settled or not task.job.start(task):
                continue
            try:
                fn_ref = self._function(task.job.fn)
                data, refs = self._payload(task)
                payload = cloudpickle.dumps((task.job.fn if fn_ref is None else None, data))
                ref = self._remote.remote(
                    self._pool_id,
                    self._path,
                    self._init,
                    [] if fn_ref is None else [fn_ref],
                    task.form,
                    payload,
                    refs,
                    self.executor_rules,
                )
            except BaseException as exc:  # the pickler's error names what failed
                settle(task, False, exc)
                continue
            self._in_flight[ref] = _InFlight(task)
            ref.future().add_done_callback(functools.partial(self._on_done, ref))

    def _start_clocks(self) -> None:
        """The first ``size`` tasks in flight are the ones running (Ray starts the queued
        ones in the order they came, as CPUs free): their ``task_timeout`` counts from
        now, if it does not already."""
        now = time.monotonic()
        for flight in itertools.islice(self._in_flight.values(), self.size):
            if flight.started is None:
                flight.started = now
                task = flight.task
                timeout = self.task_timeout if task.job.timeout is None else task.job.timeout
                flight.deadline = None if timeout is None else now + timeout

    def _on_done(self, ref: Any, future: Any) -> None:
        """(Ray's thread) a task in flight finished: the dispatcher thread settles it."""
        self._done.append((ref, future))
        self._wake()

    def _payload(self, task: Task) -> tuple[Any, list[Any]]:
        """The task's arguments, each large array as a ``_Stored`` index into the refs
        returned (put in the object store once while the array lives)."""
        what = f"backend='ray' ({self.name})"
        refs: list[Any] = []
        if task.form == _worker.APPLY:
            args, kwargs = task.payload
            refuse_shared_arrays(tuple(args), dict(kwargs), what)
            stored = [self._store(a, refs) for a in args]
            return (stored, {k: self._store(v, refs) for k, v in kwargs.items()}), refs
        items = list(task.payload)
        refuse_shared_arrays(tuple(items), {}, what)
        if task.form == _worker.MAP:
            return [self._store(item, refs) for item in items], refs
        return [tuple(self._store(a, refs) for a in item) for item in items], refs

    def _function(self, fn: Any) -> Any:
        """A plain function's ref in the object store, put once while it lives (among the
        last FUNCTIONS_KEPT used); None for anything else (a bound method, a partial: made
        anew for each call), which goes with the arguments."""
        if not isinstance(fn, types.FunctionType):
            return None
        key = id(fn)
        kept = self._functions.get(key)
        if kept is not None and kept[0]() is fn:
            self._functions.move_to_end(key)
            return kept[1]
        ref = self._ray.put(fn)
        self._functions[key] = (weakref.ref(fn), ref)
        self._functions.move_to_end(key)
        if len(self._functions) > _FUNCTIONS_KEPT:
            self._functions.popitem(last=False)
        return ref

    def _store(self, obj: Any, refs: list[Any]) -> Any:
        """An argument: an array of STORED_BYTES or more goes to the object store and
        travels as a ``_Stored`` index into ``refs``; the rest as it is. A read-only
        array is put once while it lives (its entry goes with it), for every call; a
        writable one once per call (the caller may change it between calls)."""
        numpy = sys.modules.get("numpy")
        if numpy is None or not isinstance(obj, numpy.ndarray) or obj.nbytes < STORED_BYTES:
            return obj
        key = id(obj)
        array: Any = obj
        read_only = not array.flags.writeable
        kept = self._arrays.get(key)
        if kept is not None and kept[0]() is obj and read_only:
            ref = kept[1]
        else:
            ref = self._ray.put(obj)
            if read_only:
                arrays = self._arrays

                def forget(_: Any) -> None:
                    arrays.pop(key, None)

                arrays[key] = (weakref.ref(obj, forget), ref)
        refs.append(ref)
        return _Stored(len(refs) - 1)

    def _finished(self, ref: Any, future: Any) -> None:
        flight = self._in_flight.pop(ref, None)
        if flight is None:
            return
        task = flight.task
        ray = self._ray
        try:
            outcome = future.result()
        except ray.exceptions.TaskCancelledError:
            if not task.settled:
                settle(task, False, self._stopped_error())
            return
        except ray.exceptions.RayError as exc:
            if flight.killed or task.settled:
                return
            if isinstance(exc, _deaths(ray)):
                settle(task, False, self._death_error(task, exc))
                return
            error: BaseException = RuntimeError(
                f"Ray could not run {task.job.describe(task)}: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            settle(task, False, error)
            return
        except BaseException as exc:  # (not Ray's: its future was cancelled, say)
            if not task.settled:
                settle(task, False, exc)
            return
        if task.settled:
            return
        tag = outcome[0]
        if tag == _tags.RESULT:
            try:
                value = pickle.loads(outcome[1])
            except BaseException as exc:
                error = pickle.UnpicklingError(
                    f"the result of {task.job.describe(task)} could not be unpickled in "
                    f"the parent: {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                settle(task, False, error)
                return
            settle(task, True, value)
        elif tag == _tags.RAISED:
            settle(
                task,
                False,
                remote_error(_raised.unpack(outcome[1]), outcome[2], self.executor_rules),
            )
        else:  # INIT_FAILED
            errors = broken_errors()
            broken: BaseException = (errors.InitializerError if errors else RuntimeError)(
                f"the pool's initializer raised in a Ray worker; the pool cannot run "
                f"tasks. Fix the initializer (or catch the error in it). Its traceback:\n"
                f"{outcome[2]}"
            )
            broken.__cause__ = _raised.unpack(outcome[1])
            with self._lock:
                self._pending.appendleft(task)
            self._break(broken)

    def _death_error(self, task: Task, exc: BaseException) -> ProcessExitedException:
        first = str(exc).strip().splitlines()
        cause = type(exc).__name__ + (f": {first[0]}" if first else "")
        msg = f"the Ray worker running {task.job.describe(task)} died ({cause})"
        if self.retries:
            msg += f"; the task ran {self.retries + 1} times (retries={self.retries})"
        error = ProcessExitedException(msg, -1, -1, -9, None)
        error.__cause__ = exc
        return error

    def _on_timers(self) -> None:
        now = time.monotonic()
        for ref, flight in list(self._in_flight.items()):
            if flight.deadline is not None and now >= flight.deadline and not flight.killed:
                task = flight.task
                timeout = self.task_timeout if task.job.timeout is None else task.job.timeout
                self._cancel(ref)
                settle(
                    task,
                    False,
                    TaskTimeoutError(
                        f"{task.job.describe(task)} ran longer than the task_timeout of "
                        f"{timeout:g} s; its Ray task was cancelled (its worker killed)",
                        timeout,  # type: ignore[arg-type]  # set: the task timed out
                        -1,
                    ),
                )

    def _cancel(self, ref: Any) -> None:
        flight = self._in_flight.get(ref)
        if flight is None or flight.killed:
            return
        flight.killed = True
        flight.deadline = None
        try:
            self._ray.cancel(ref, force=True)
        except Exception:  # done meanwhile: its outcome is dropped
            pass

    def _stopped_error(self) -> BaseException:
        return self._stop_error or RuntimeError("the pool was terminated before this task finished")

    def _drop_pending(self, which: Callable[[Task], bool]) -> None:
        with self._lock:
            self._pending = collections.deque(t for t in self._pending if not which(t))

    def _fail_everything(self, error: BaseException) -> None:
        for ref, flight in list(self._in_flight.items()):
            self._cancel(ref)
            if not flight.task.settled:
                settle(flight.task, False, error)
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for task in pending:
            if not task.settled:
                settle(task, False, error)

    def _stop(self) -> None:
        self._fail_everything(self._stopped_error())
        self._wait_cancelled()
        self.state = DONE

    def _break(self, error: BaseException) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = error
        self._fail_everything(error)
        self._wait_cancelled()
        self.state = DONE

    def _wait_cancelled(self, timeout: float = 10.0) -> None:
        """Until the cancelled tasks are gone from the cluster (their CPUs free)."""
        refs = list(self._in_flight)
        self._in_flight.clear()
        if refs:
            try:
                self._ray.wait(refs, num_returns=len(refs), timeout=timeout)
            except Exception:
                pass

    def _release(self) -> None:
        self._functions.clear()
        self._arrays.clear()
        if self._group is not None:
            group, self._group = self._group, None
            _remove(self._ray, group)
        if self._own_cluster:
            self._own_cluster = False
            disconnect(self._ray)


_live: weakref.WeakSet[RayDispatcher] = weakref.WeakSet()
_registered = False


def _at_exit_registered() -> None:
    """Registered once, after Ray was imported (and its own exit function, which shuts
    Ray down, with it): atexit runs the last registered first, so this one runs while
    Ray still serves."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    _exit.finish(list(_live), "its calls on Ray were cancelled")


__all__ = ["RayDispatcher", "run_task"]
