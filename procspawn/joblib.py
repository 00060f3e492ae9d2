"""A joblib backend: ``joblib.Parallel``, and scikit-learn's ``n_jobs=``, on procspawn's pool.

Register it once, then select it by name as any joblib backend::

    import joblib
    import procspawn.joblib

    procspawn.joblib.register()

    with joblib.parallel_config(backend="procspawn", n_jobs=2, task_timeout=600):
        results = joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(4))

What changes against joblib's default (loky):

* large array arguments (over ``max_nbytes``, joblib's default 1 MB) go to the workers
  through shared memory, one copy per ``Parallel`` call however many tasks get them, as
  views by ``mmap_mode`` (``"r"``, the default: read-only; ``"r+"``/``"w+"``: writable,
  one copy every task of the call sees; ``"c"``: a private copy per task; ``None``: by
  value); no temporary folder, nothing left in ``/dev/shm`` after a kill; large results
  come back through shared memory too;
* a worker's death fails the tasks it ran with procspawn's error (pid, signal or exit
  code, the out-of-memory verdict, the last lines it wrote to stderr), raised by
  ``Parallel``; on the first error only this call's running tasks are stopped, the
  workers of other calls go on;
* procspawn's options, given to ``parallel_config`` (or ``Parallel``) with the backend:
  ``task_timeout``, ``retries``, ``max_tasks_per_child``, ``max_memory_per_child``,
  ``start_method`` and ``idle_worker_timeout`` (loky's: seconds before an idle worker
  exits, default 300).

On a Ray cluster: ``procspawn.joblib.register("procspawn_ray", backend="ray")``, then
``parallel_config(backend="procspawn_ray", n_jobs=8)``: each batch of calls a Ray task of
``ProcessPoolExecutor(backend="ray")`` (arrays by value in the batch, read-only where they
arrive; ``task_timeout`` and ``retries`` as on one machine; ``ray_address`` picks the
cluster; ``start_method``, ``max_tasks_per_child``, ``max_memory_per_child`` do not apply).

joblib is imported here only: ``import procspawn`` never imports this module.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import queue
import sys
import threading
import warnings
from typing import Any

import joblib
from joblib.parallel import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
)

from ._late import renew_lock_in_child
from .context.launch._start_method import start_method_of
from .pool._failures import check_backend, check_max_tasks, check_options, check_seconds
from .pool._reusable import current_reusable_executor, get_reusable_executor
from .sharing.wire._swap import Swapped

TYPE_CHECKING = False  # as typing's (this package's one convention)
if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

    import numpy as np

    from .pool._executor import ProcessPoolExecutor

NAME = "procspawn"

_OPTIONS = {
    "task_timeout": None,
    "retries": 0,
    "max_tasks_per_child": None,
    "max_memory_per_child": None,
    "start_method": None,
    "idle_worker_timeout": 300,
    "ray_address": None,  # (a backend registered with backend="ray")
}
# what Parallel passes to every backend, which this one has no use for (no temporary
# folder; the start method is procspawn's, or the start_method option)
_IGNORED = ("temp_folder", "context", "verbose", "prefer", "require")
_MMAP_MODES = (None, "r", "r+", "w+", "c")


def register(name: str = NAME, make_default: bool = False, backend: str = "process") -> None:
    """Make the backend known to joblib as ``name`` (``"procspawn"``).

    Then ``joblib.parallel_config(backend="procspawn", ...)`` selects it, for
    ``joblib.Parallel`` and for every library that calls it (scikit-learn's ``n_jobs=``).
    ``make_default=True`` makes it joblib's default backend instead of loky.
    ``backend="ray"``: its calls run on a Ray cluster (see the module's docstring); give it
    a name of its own (``register("procspawn_ray", backend="ray")``).
    """
    check_backend(backend, None)
    factory = functools.partial(ProcspawnBackend, pool_backend=backend)
    joblib.register_parallel_backend(name, factory, make_default=make_default)


def shutdown(wait: bool = True) -> None:
    """Stop the backend's workers now (otherwise they exit after ``idle_worker_timeout``
    seconds without work, or with the program). A later ``Parallel`` call starts new ones.
    """
    executor = current_reusable_executor(break_on_death=False)
    if executor is not None:
        executor.shutdown(wait=wait)


class ProcspawnBackend(AutoBatchingMixin, ParallelBackendBase):  # type: ignore[misc]
    """joblib's backend interface over procspawn's reusable executor (see the module)."""

    supports_retrieve_callback = True
    supports_inner_max_num_threads = True
    supports_sharedmem = False
    uses_threads = False

    def __init__(
        self,
        nesting_level: int | None = None,
        inner_max_num_threads: int | None = None,
        *,
        pool_backend: str = "process",
        **options: Any,
    ) -> None:
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self.pool_backend = pool_backend
        self.options = {**_OPTIONS, **_checked(options, pool_backend)}
        self.parallel: Any = None
        self._executor: ProcessPoolExecutor | None = None
        self._array_mode: tuple[int | None, str | None] = (None, None)
        self._arrays: _CallArrays | None = None  # this call's (start_call to stop_call)
        self._env: dict[str, str] = {}
        self._futures: set[Future[Any]] = set()
        self._lock = threading.Lock()

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """loky's rules: -1 is every CPU joblib counts, -2 all but one, and so on; 1 in a
        daemonic process or below a thread (with a warning)."""
        import multiprocessing

        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if multiprocessing.current_process().daemon:
            if n_jobs != 1:
                warnings.warn(
                    "procspawn-backed parallel loops cannot be called in a daemonic "
                    "process, setting n_jobs=1",
                    stacklevel=3,
                )
            return 1
        if not (self.in_main_thread() or self.nesting_level == 0):
            if n_jobs != 1:
                warnings.warn(
                    "procspawn-backed parallel loops cannot be nested below threads, "
                    "setting n_jobs=1",
                    stacklevel=3,
                )
            return 1
        if n_jobs < 0:
            n_jobs = max(joblib.cpu_count() + 1 + n_jobs, 1)
        return int(n_jobs)

    def configure(
        self,
        n_jobs: int = 1,
        parallel: Any = None,
        prefer: str | None = None,
        require: str | None = None,
        max_nbytes: int | None = 1_000_000,
        mmap_mode: str | None = "r",
        **options: Any,
    ) -> int:
        """Get the executor for ``n_jobs`` workers with this call's options."""
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        for name in _IGNORED:
            options.pop(name, None)
        settings = {**self.options, **_checked(options, self.pool_backend)}
        if mmap_mode not in _MMAP_MODES:
            raise ValueError(f"mmap_mode must be one of {_MMAP_MODES}, got {mmap_mode!r}")
        if self.pool_backend == "ray":
            self._executor = get_reusable_executor(
                n_jobs,
                None,
                task_timeout=settings["task_timeout"],
                retries=settings["retries"],
                backend="ray",
                ray_address=settings["ray_address"],
                _break_on_death=False,
            )
            self._array_mode = (None, None)  # by value: no shared memory across machines
        else:
            self._executor = get_reusable_executor(
                n_jobs,
                settings["idle_worker_timeout"],
                mp_context=settings["start_method"],
                max_tasks_per_child=settings["max_tasks_per_child"],
                task_timeout=settings["task_timeout"],
                retries=settings["retries"],
                max_memory_per_child=settings["max_memory_per_child"],
                _break_on_death=False,
            )
            self._array_mode = (max_nbytes, mmap_mode)
        self._env = self._prepare_worker_env(n_jobs)
        self.parallel = parallel
        return n_jobs

    def start_call(self) -> None:
        """A call begins: its own copies of its large arguments (a ``with Parallel() as
        p`` block makes several calls, and an array may change between them)."""
        self._arrays = _CallArrays.for_mode(*self._array_mode)

    def stop_call(self) -> None:
        """The call is over: its copies go (their memory, once the workers let go)."""
        self._arrays = None

    def submit(self, func: Any, callback: Any = None) -> Future[Any]:
        """Run a batch of joblib calls in a worker; ``callback`` runs once it is done, in
        this module's callback thread (see ``_Callbacks``)."""
        executor = self._executor
        if executor is None:
            raise RuntimeError("the procspawn backend is not configured (or terminated)")
        arrays = self._arrays
        batch = func if arrays is None else Swapped(func, arrays.swap)
        # a new callable per batch: procspawn's pool holds a next task behind a busy
        # worker's only for the same function measured short, and every batch would be
        # _run_batch whatever it runs (a batch then waited behind a long one while other
        # workers were idle)
        runner = functools.partial(_run_batch)
        runner.__procspawn_calls__ = _calls_of  # type: ignore[attr-defined]
        future: Future[Any]
        try:
            future = executor.submit(runner, batch, self._env)
        except Exception as exc:  # (its executor was shut down meanwhile, say)
            # joblib submits from its callback too, where a raise would be lost and the
            # call would wait for ever: the error goes to joblib as this batch's outcome
            future = concurrent.futures.Future()
            future.set_exception(exc)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(functools.partial(self._settled, callback))
        return future

    def _settled(self, callback: Any, future: Future[Any]) -> None:
        with self._lock:
            self._futures.discard(future)
        if callback is not None:
            _callbacks.call(callback, future)

    def retrieve_result_callback(self, future: Future[Any]) -> Any:
        return future.result()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """The first error: stop this call's tasks (cancel those waiting, kill the
        workers running the others; new workers take their places). The executor, and
        every other call's tasks on it, go on."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            kill = getattr(future, "kill", None)
            if kill is not None:
                kill()

    def terminate(self) -> None:
        """The backend is done with (for now): the workers stay for the next call."""
        self._arrays = None
        self.reset_batch_stats()


def _checked(options: dict[str, Any], pool_backend: str = "process") -> dict[str, Any]:
    """The backend's options, each known, valid and applying to ``pool_backend``."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"procspawn's joblib backend has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(_OPTIONS)}"
        )
    settings = {**_OPTIONS, **options}
    check_options(settings["task_timeout"], settings["retries"], settings["max_memory_per_child"])
    check_max_tasks(settings["max_tasks_per_child"])
    check_seconds("idle_worker_timeout", settings["idle_worker_timeout"])
    start_method_of(settings["start_method"])  # an unknown one is refused now
    given = {k: v for k, v in options.items() if v != _OPTIONS[k]}
    check_backend(
        pool_backend,
        given.get("ray_address"),
        start_method=given.get("start_method"),
        max_tasks_per_child=given.get("max_tasks_per_child"),
        max_memory_per_child=given.get("max_memory_per_child"),
    )
    return dict(options)


class _CallArrays:
    """One ``Parallel`` call's large array arguments: each sent as one shared copy, made
    the first time a task of the call gets it (the same array object: the same copy)."""

    def __init__(self, max_nbytes: int, writeable: bool) -> None:
        self.max_nbytes = max_nbytes
        self.writeable = writeable
        self._copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._made: set[int] = set()  # ids of the copies (kept alive in _copies)
        self._lock = threading.Lock()

    @classmethod
    def for_mode(cls, max_nbytes: int | None, mmap_mode: str | None) -> _CallArrays | None:
        """None where arrays go by value: ``mmap_mode`` None, ``max_nbytes`` None, or
        ``"c"`` (a private copy per task, which is what a message carries anyway)."""
        if max_nbytes is None or mmap_mode in (None, "c"):
            return None
        return cls(max_nbytes, writeable=mmap_mode in ("r+", "w+"))

    def swap(self, array: np.ndarray) -> np.ndarray:
        """What goes to the worker in place of ``array`` (runs while a task is pickled)."""
        if array.nbytes <= self.max_nbytes or array.dtype.hasobject:
            return array
        key = id(array)
        with self._lock:
            if key in self._made:  # one of ours, reduced in its turn
                return array
            known = self._copies.get(key)
            if known is None:
                known = self._copies[key] = (array, self._shared(array))
                self._made.add(id(known[1]))
        return known[1]

    def _shared(self, array: np.ndarray) -> np.ndarray:
        from .sharing.segments._arrays import is_shared
        from .sharing.segments._ndarray import copy_to_segment

        # one already in shared memory goes as it is: writes reach the caller's array.
        # Another is copied as a send copies it (for_send): into a recycled segment, its
        # pages in place, when an earlier call's copy of that size is free again
        if is_shared(array):
            shared = array
        else:
            shared = copy_to_segment(array, for_send=True)
            shared.flags.writeable = True  # (a copy of a read-only array is read-only)
        if self.writeable:
            return shared
        view: np.ndarray = shared.view()
        view.flags.writeable = False
        return view


class _Callbacks:
    """The thread that runs joblib's completion callbacks, in order: one per process, for
    every call and backend, started with the first (a daemon). joblib's callback may
    submit the next batch and read the caller's generator: never in the thread that
    serves the executor."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Any]] | None = None
        self._pid: int | None = None

    def call(self, callback: Any, future: Any) -> None:
        with _lock:
            if self._pid != os.getpid():  # the first call, or a forked child (no thread)
                self._queue = queue.SimpleQueue()
                threading.Thread(
                    target=self._run,
                    args=(self._queue,),
                    name="procspawn-joblib-callbacks",
                    daemon=True,
                ).start()
                self._pid = os.getpid()
            assert self._queue is not None
            self._queue.put((callback, future))

    @staticmethod
    def _run(calls: queue.SimpleQueue[tuple[Any, Any]]) -> None:
        while True:
            callback, future = calls.get()
            try:
                callback(future)
            except BaseException:  # noqa: BLE001 -- as concurrent.futures does for its own
                logging.getLogger("procspawn.joblib").exception(
                    "a joblib completion callback raised"
                )


_lock = threading.Lock()
renew_lock_in_child(globals())
_callbacks = _Callbacks()


# -- in the worker --------------------------------------------------------------------------

_limits: dict[str, str] | None = None  # the thread limits this worker has now
_exit_hooked = False  # _stop_nested runs at this worker's exit


def _run_batch(batch: Any, env: dict[str, str]) -> Any:
    """Run a batch of joblib calls with the thread limits of its call."""
    global _exit_hooked
    if not _exit_hooked:
        import multiprocessing.util

        # priority >= 0: before multiprocessing joins this worker's children at its exit
        multiprocessing.util.Finalize(None, _stop_nested, exitpriority=100)
        _exit_hooked = True
    if NAME not in joblib.parallel.BACKENDS:  # a nested Parallel(backend="procspawn")
        register()
    if env != _limits:
        _limit_threads(env)
    return batch()


def _stop_nested() -> None:
    """At a worker's exit: stop the executors its batches started (nested Parallel
    calls), as a loky worker does; loky's workers would otherwise wait out their idle
    timeout (300 s), and this worker's exit, hence ``shutdown()``, with them."""
    loky = sys.modules.get("joblib.externals.loky.process_executor")
    if loky is not None:
        loky._python_exit()
    shutdown(wait=True)


def _calls_of(batch: Any, env: dict[str, str]) -> list[Any]:
    """The calls of a batch, for an error's "while running ..." (in the parent)."""
    if isinstance(batch, Swapped):
        batch = batch.obj
    return list(getattr(batch, "items", ()))


def _limit_threads(env: dict[str, str]) -> None:
    """BLAS and OpenMP threads as the call asks: the variables for libraries loaded from
    now on, threadpoolctl for those loaded already (a fork server's NumPy)."""
    global _limits
    os.environ.update(env)
    _limits = env
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # joblib runs without it; so do the variables
        return
    try:
        openmp = int(env["OMP_NUM_THREADS"])
        blas = min(
            int(env[name])
            for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
        )
    except (KeyError, ValueError):  # a value the variable's library reads its own way
        return
    threadpool_limits(limits={"openmp": openmp, "blas": blas})


__all__ = ["ProcspawnBackend", "register", "shutdown"]
