"""Benchmark: process pools side by side, from start-up to a killed worker.

Run::

    python benchmarks/bench_pool.py [--repeats N] [--quick] [--json out.json]
                                    [--start-method {fork,spawn,forkserver}]
                                    [--only {all,startup,startup-numpy,tiny,fresh,result,
                                            result-warm,kill}]

Pools, 2 workers each, each used as its README shows (skipped with a note when it does
not import; the stdlib ones always run):

* ``stdlib Pool`` -- ``multiprocessing.get_context(m).Pool(2)``;
* ``PPE`` -- ``concurrent.futures.ProcessPoolExecutor(2, mp_context=get_context(m))``;
* ``loky`` -- ``loky.get_reusable_executor(max_workers=2, context=m)``; loky's reusable
  executor refuses fork, so under fork it gets no context (its default, "loky");
* ``joblib`` -- ``Parallel(n_jobs=2)(delayed(f)(x) for x in items)`` (its loky backend,
  whose start method joblib does not expose: always loky's default);
* ``mpire`` -- ``mpire.WorkerPool(n_jobs=2, start_method=m)``, with ``keep_alive=True``
  outside the start-up case (by default it starts and stops its workers in every map);
* ``pebble`` -- ``pebble.ProcessPool(max_workers=2, context=get_context(m))``;
* ``torch Pool`` -- ``torch.multiprocessing.get_context(m).Pool(2)``;
* ``procspawn Pool`` -- ``procspawn.Pool(2, context=m)``;
* ``procspawn executor`` -- ``procspawn.ProcessPoolExecutor(2, mp_context=m)``.

``m`` is ``--start-method`` (default: the platform's, fork on Linux before Python 3.14).
"Pool-likes" (stdlib, joblib, mpire, torch, procspawn Pool) are called as
``pool.map(f, items)`` with the library's default chunking; "executors" (PPE, loky,
pebble, procspawn executor) as ``list(ex.map(f, items, chunksize=c))`` (pebble:
``list(pool.map(...).result())``).

Every (library, case) run is a fresh interpreter: this file run again with a hidden
``--child`` argument, which imports the library (at the top of the main module, as a
user's script does, so spawn workers that re-run the main module import it too), makes
the measurement and prints it as JSON. procspawn's bytecode is compiled first, as a
wheel install has it and as the peers installed from wheels have theirs (a checkout
installed in editable mode under ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile
its modules in every fresh interpreter: about 6 ms of a pool's start-up here).
``--repeats`` runs (default 5, the rows taken in turn, run by run); the table gives
the median. Cases, one row per library:

* ``start-up + first result, a script of the library alone (ms)`` -- a script of a
  user's, as small as one can be: it imports the library at its top (nothing else but
  ``time``), then the timer covers creating the pool (and what the library imports
  then: each imports its pool's modules at first use), one ``inc(1)`` (``apply`` /
  ``submit(...).result()`` / a one-item call) and the shut-down: ``terminate(); join()``
  for the stdlib-style Pools (stdlib, torch, procspawn: their ``with`` block's
  ``terminate()``, then a wait for the workers), mpire's ``terminate()``, pebble's
  ``close(); join()``, ``shutdown(wait=True)`` for the executors; joblib keeps its
  workers for reuse and has no call to stop them, so its loky reusable executor gets
  ``shutdown(wait=True)``. Each library's lines are in ``STARTUP_CODE``;
* ``start-up + first result, a script that imports NumPy (ms)`` -- the same, the script
  importing NumPy first (under spawn and forkserver the workers import the script again,
  NumPy with it: procspawn's fork server has it imported already);
* ``20,000 tiny tasks x+1 (µs/task)`` -- the pool made and warmed up (4 tasks of a 20 ms
  sleep) before the timer; the timer covers ``map(inc, range(20000))``, default chunking
  for the Pool-likes (the stdlib's is 2500 here), and for the executors twice: with
  ``chunksize=1`` (their default) and with ``chunksize=2500``;
* ``fresh 4 MiB array per task (ms/task)`` -- 64 tasks, each given a new 4 MiB float64
  array (``np.full``, all made before the timer), returning ``arr.sum()``; one task per
  message (``chunksize=1``, joblib ``batch_size=1``);
* ``8 MiB result per task (ms/task)`` -- 32 tasks each returning a new
  ``np.ones(1 << 20)`` (mpire with ``concatenate_numpy_output=False``); shapes checked;
  every result is new memory for every library (procspawn: new shared segments, whose
  pages the kernel allocates as the copy fills them);
* ``8 MiB result per task, second map (ms/task)`` -- the same map timed a second time on
  the same pool, the first map's results dropped in between: what a pool that has run a
  while costs (procspawn's workers copy into the segments the first results used);
* ``killed worker reported after (s)`` -- a map over 8 tasks (20 ms each) where one
  writes ``time.time()`` to a file and SIGKILLs its own worker; the time from that stamp
  to the exception in the caller. A child that has not finished within 20 s is killed
  (its whole process group) and the row reads "hangs"; the stdlib's and torch's Pool
  wait for ever for a result that will not come.

Columns: the median; "x stdlib Pool" = median / the stdlib Pool's in the same case and
start method; "x best peer" = median / the fastest library other than procspawn in the
same case (for the tiny tasks the chunksize=1 rows are compared among themselves, the
others with each other), named in brackets. Below 1 is faster. Notes give errors, the
exception a killed worker raised, processes a run left behind (killed by the parent)
and, below the table, ``/dev/shm`` entries that appeared during a run and were still there
at the end (another program running meanwhile may have made them).

``--quick`` (a smoke test): 1 run, 2,000 tiny tasks (chunksize 250), 8 fresh arrays,
4 results; the case names still give the full sizes.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = str(Path(__file__).resolve().parent)
if BENCH_DIR not in sys.path:  # spawn children get the parent's sys.path
    sys.path.insert(0, BENCH_DIR)

import _bench_common as common  # noqa: E402

# A child's library is imported here, at the top of the main module, as in a user's
# script: a worker that re-runs the main module (spawn, forkserver) imports it too.
IMPORT_ENV = "BENCH_POOL_IMPORT"
if os.environ.get(IMPORT_ENV):
    importlib.import_module(os.environ[IMPORT_ENV])

WORKERS = 2
ARRAY_ITEMS = (4 << 20) // 8  # 4 MiB of float64
RESULT_ITEMS = 1 << 20  # 8 MiB of float64
WARMUP_TASKS, WARMUP_NAP = 4, 0.02
KILL_TASKS, KILL_INDEX, KILL_NAP = 8, 2, 0.02
KILL_SECONDS = 20.0  # the kill case's hard timeout: beyond it the library "hangs"
CHILD_SECONDS = 600.0
LEFTOVER_SECONDS = 5.0  # grace for a child's processes to exit after it did
RESULT_PREFIX = "RESULT "


@dataclass(frozen=True)
class Sizes:
    tiny: int
    chunk: int  # the executors' second chunksize: tiny / (4 * WORKERS), the stdlib's own
    fresh: int
    result: int


FULL = Sizes(tiny=20_000, chunk=2_500, fresh=64, result=32)
QUICK = Sizes(tiny=2_000, chunk=250, fresh=8, result=4)

CASES = {
    "startup": "start-up + first result, a script of the library alone (ms)",
    "startup-numpy": "start-up + first result, a script that imports NumPy (ms)",
    "tiny": "20,000 tiny tasks x+1 (µs/task)",
    "fresh": "fresh 4 MiB array per task (ms/task)",
    "result": "8 MiB result per task (ms/task)",
    "result-warm": "8 MiB result per task, second map (ms/task)",
    "kill": "killed worker reported after (s)",
}
FORMATS = {
    "startup": "{:.1f}",
    "startup-numpy": "{:.1f}",
    "tiny": "{:.2f}",
    "fresh": "{:.3f}",
    "result": "{:.3f}",
    "result-warm": "{:.3f}",
    "kill": "{:.3f}",
}


@dataclass(frozen=True)
class Library:
    """A pool library (a row per case): ``module`` is what the child imports first."""

    key: str
    label: str
    module: str
    kind: str  # "pool": map with the library's default chunking; "executor": chunksize=c
    peer: bool = True  # False for procspawn's own rows
    optional: bool = True


LIBRARIES = (
    Library("stdlib", "stdlib Pool", "multiprocessing.pool", "pool", optional=False),
    Library("ppe", "PPE", "concurrent.futures", "executor", optional=False),
    Library("loky", "loky", "loky", "executor"),
    Library("joblib", "joblib", "joblib", "pool"),
    Library("mpire", "mpire", "mpire", "pool"),
    Library("pebble", "pebble", "pebble", "executor"),
    Library("torch", "torch Pool", "torch.multiprocessing", "pool"),
    Library("procspawn", "procspawn Pool", "procspawn", "pool", peer=False),
    Library("procspawn-exec", "procspawn executor", "procspawn", "executor", peer=False),
)
BY_KEY = {lib.key: lib for lib in LIBRARIES}


# -- what the workers run (module level: spawn workers import them by name) -------------------


def inc(x: int) -> int:
    return x + 1


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def arr_sum(arr: np.ndarray) -> float:
    return float(arr.sum())


def make_ones(_: int) -> np.ndarray:
    return np.ones(RESULT_ITEMS)


def kill_task(stamp_path: str, i: int) -> int:
    """Sleep a little; task KILL_INDEX writes ``time.time()`` to ``stamp_path`` and
    SIGKILLs its own worker (once: a library that reruns the task sees it return)."""
    time.sleep(KILL_NAP)
    if i == KILL_INDEX and not os.path.exists(stamp_path):
        with open(stamp_path + ".tmp", "w") as out:
            out.write(repr(time.time()))
        os.replace(stamp_path + ".tmp", stamp_path)
        os.kill(os.getpid(), signal.SIGKILL)
    return i


# -- the pools, as the child drives them -------------------------------------------------------


def mp_context(method: str) -> Any:
    return multiprocessing.get_context(method)


def effective_start_method(lib: Library, method: str) -> str:
    """The start method the library's workers get when ``method`` is asked for."""
    if lib.key == "joblib" or (lib.key == "loky" and method == "fork"):
        return "loky"
    return method


class Runner:
    """One library's pool in a child: ``open`` makes it, ``one`` gets one result, ``map``
    runs a call (``chunksize=None``: the library's default chunking for a Pool-like, 1 for
    an executor), ``close`` shuts it down as the library's ``with`` block does. The
    constructor resolves every name, so no import happens while a timer runs."""

    def __init__(self, method: str, keep_alive: bool) -> None:
        self.method = method
        self.keep_alive = keep_alive
        self.pool: Any = None

    def open(self) -> None:
        raise NotImplementedError

    def one(self, fn: Callable[[Any], Any], x: Any) -> Any:
        return self.map(fn, [x])[0]

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], chunksize: int | None = None):
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class StdlibPoolRunner(Runner):
    """multiprocessing.Pool; also torch's and procspawn's, which share its interface."""

    def __init__(self, method: str, keep_alive: bool, factory: Callable[[], Any] | None = None):
        super().__init__(method, keep_alive)
        self.factory = factory or (lambda: mp_context(method).Pool(WORKERS))

    def open(self) -> None:
        self.pool = self.factory()

    def one(self, fn, x):
        return self.pool.apply(fn, (x,))

    def map(self, fn, items, chunksize=None):
        return self.pool.map(fn, items, chunksize)

    def close(self) -> None:
        self.pool.terminate()  # what ``with Pool(...)`` does on exit
        self.pool.join()


def torch_runner(method: str, keep_alive: bool) -> Runner:
    import torch.multiprocessing

    ctx = torch.multiprocessing.get_context(method)
    return StdlibPoolRunner(method, keep_alive, lambda: ctx.Pool(WORKERS))


def procspawn_pool_runner(method: str, keep_alive: bool) -> Runner:
    import procspawn

    pool_class = procspawn.Pool
    return StdlibPoolRunner(method, keep_alive, lambda: pool_class(WORKERS, context=method))


class ExecutorRunner(Runner):
    """A concurrent.futures executor: PPE, loky's, procspawn's."""

    def __init__(self, method: str, keep_alive: bool, factory: Callable[[], Any] | None = None):
        super().__init__(method, keep_alive)
        if factory is None:
            from concurrent.futures import ProcessPoolExecutor

            ctx = mp_context(method)
            factory = functools.partial(ProcessPoolExecutor, WORKERS, mp_context=ctx)
        self.factory = factory

    def open(self) -> None:
        self.pool = self.factory()

    def one(self, fn, x):
        return self.pool.submit(fn, x).result()

    def map(self, fn, items, chunksize=None):
        return list(self.pool.map(fn, items, chunksize=chunksize or 1))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def loky_runner(method: str, keep_alive: bool) -> Runner:
    import loky

    context = None if method == "fork" else method  # the reusable executor refuses fork
    factory = functools.partial(loky.get_reusable_executor, max_workers=WORKERS, context=context)
    return ExecutorRunner(method, keep_alive, factory)


def procspawn_executor_runner(method: str, keep_alive: bool) -> Runner:
    import procspawn

    factory = functools.partial(procspawn.ProcessPoolExecutor, WORKERS, mp_context=method)
    return ExecutorRunner(method, keep_alive, factory)


class JoblibRunner(Runner):
    """joblib.Parallel over its loky backend; ``chunksize`` is its ``batch_size``."""

    def __init__(self, method: str, keep_alive: bool) -> None:
        super().__init__(method, keep_alive)
        import joblib
        from joblib.externals.loky import reusable_executor

        self.parallel_class, self.delayed = joblib.Parallel, joblib.delayed
        self.loky_module = reusable_executor  # where loky keeps its reusable executor

    def open(self) -> None:
        self.pool = self.parallel_class(n_jobs=WORKERS)

    def map(self, fn, items, chunksize=None):
        parallel = self.pool
        if chunksize is not None:
            parallel = self.parallel_class(n_jobs=WORKERS, batch_size=chunksize)
        return parallel(self.delayed(fn)(x) for x in items)

    def close(self) -> None:
        # joblib keeps its loky workers for the next call (300 s) and has no public call
        # to stop them: shut its reusable executor down as loky's users do
        storage = getattr(self.loky_module, "_executor_storage", None)  # loky >= 3.7
        executor = getattr(storage or self.loky_module, "executor" if storage else "_executor")
        if executor is not None:
            executor.shutdown(wait=True)


class MpireRunner(Runner):
    def __init__(self, method: str, keep_alive: bool) -> None:
        super().__init__(method, keep_alive)
        import mpire

        self.pool_class = mpire.WorkerPool

    def open(self) -> None:
        self.pool = self.pool_class(
            n_jobs=WORKERS, start_method=self.method, keep_alive=self.keep_alive
        )

    def map(self, fn, items, chunksize=None):
        items = list(items)
        return self.pool.map(fn, items, chunk_size=chunksize, concatenate_numpy_output=False)

    def close(self) -> None:
        self.pool.terminate()  # what ``with WorkerPool(...)`` does on exit


class PebbleRunner(Runner):
    def __init__(self, method: str, keep_alive: bool) -> None:
        super().__init__(method, keep_alive)
        import pebble

        self.pool_class, self.ctx = pebble.ProcessPool, mp_context(method)

    def open(self) -> None:
        self.pool = self.pool_class(max_workers=WORKERS, context=self.ctx)

    def one(self, fn, x):
        return self.pool.schedule(fn, args=(x,)).result()

    def map(self, fn, items, chunksize=None):
        return list(self.pool.map(fn, items, chunksize=chunksize or 1).result())

    def close(self) -> None:
        self.pool.close()  # what ``with ProcessPool(...)`` does on exit
        self.pool.join()


RUNNERS: dict[str, Callable[[str, bool], Runner]] = {
    "stdlib": StdlibPoolRunner,
    "ppe": ExecutorRunner,
    "loky": loky_runner,
    "joblib": JoblibRunner,
    "mpire": MpireRunner,
    "pebble": PebbleRunner,
    "torch": torch_runner,
    "procspawn": procspawn_pool_runner,
    "procspawn-exec": procspawn_executor_runner,
}


# -- the child: one measurement, printed as JSON ---------------------------------------------


def emit(data: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(data), flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def warm_up(runner: Runner) -> None:
    """A few short naps, so every worker has started and run a task."""
    check(runner.map(nap, [WARMUP_NAP] * WARMUP_TASKS) == [WARMUP_NAP] * WARMUP_TASKS, "warm-up")


STARTUP_CASES = ("startup", "startup-numpy")

# The start-up cases run a script of their own, as small as a user's: the library (NumPy
# first for "startup-numpy") imported at its top and nothing else of this benchmark's, so
# what the library imports when its pool is made (lazily, as all of them do) is in the
# timer, as in the user's. Per library: (the script's imports, the timed code, which
# sets ``value``), used as its README shows, shut down as in the other cases. ``METHOD``
# is the start method's name as a literal, ``CTX`` loky's context (None under fork).
STARTUP_CODE: dict[str, tuple[str, str]] = {
    "stdlib": (
        "import multiprocessing",
        "with multiprocessing.get_context(METHOD).Pool(2) as pool:\n"
        "    value = pool.apply(inc, (1,))\n"
        "pool.join()",
    ),
    "ppe": (
        "import concurrent.futures\nimport multiprocessing",
        "ctx = multiprocessing.get_context(METHOD)\n"
        "with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as ex:\n"
        "    value = ex.submit(inc, 1).result()",
    ),
    "loky": (
        "import loky",
        "ex = loky.get_reusable_executor(max_workers=2, context=CTX)\n"
        "value = ex.submit(inc, 1).result()\n"
        "ex.shutdown(wait=True)",
    ),
    "joblib": (
        "import joblib\nfrom joblib.externals.loky import reusable_executor",
        "(value,) = joblib.Parallel(n_jobs=2)(joblib.delayed(inc)(x) for x in [1])\n"
        "storage = getattr(reusable_executor, '_executor_storage', None)\n"
        "executor = getattr(storage or reusable_executor, "
        "'executor' if storage else '_executor')\n"
        "executor.shutdown(wait=True)",
    ),
    "mpire": (
        "import mpire",
        "pool = mpire.WorkerPool(n_jobs=2, start_method=METHOD)\n"
        "(value,) = pool.map(inc, [1])\n"
        "pool.terminate()",
    ),
    "pebble": (
        "import multiprocessing\nimport pebble",
        "pool = pebble.ProcessPool(max_workers=2, context=multiprocessing.get_context(METHOD))\n"
        "value = pool.schedule(inc, args=(1,)).result()\n"
        "pool.close()\n"
        "pool.join()",
    ),
    "torch": (
        "import torch.multiprocessing",
        "with torch.multiprocessing.get_context(METHOD).Pool(2) as pool:\n"
        "    value = pool.apply(inc, (1,))\n"
        "pool.join()",
    ),
    "procspawn": (
        "import procspawn",
        "with procspawn.Pool(2, context=METHOD) as pool:\n"
        "    value = pool.apply(inc, (1,))\n"
        "pool.join()",
    ),
    "procspawn-exec": (
        "import procspawn",
        "with procspawn.ProcessPoolExecutor(2, mp_context=METHOD) as ex:\n"
        "    value = ex.submit(inc, 1).result()",
    ),
}


def startup_script(lib_key: str, case: str, method: str) -> str:
    """The start-up case's script for ``lib_key``: it prints the milliseconds from
    making the pool to its shut-down, one ``inc(1)`` in between, as a RESULT line."""
    imports, timed = STARTUP_CODE[lib_key]
    context = None if method == "fork" else method  # loky's reusable executor refuses fork
    timed = timed.replace("CTX", repr(context)).replace("METHOD", repr(method))
    body = "\n".join("    " + line for line in timed.splitlines())
    return (
        "import time\n"
        + ("import numpy\n" if case == "startup-numpy" else "")
        + imports
        + "\n\n\ndef inc(x):\n    return x + 1\n\n\n"
        + 'if __name__ == "__main__":\n'
        + "    start = time.perf_counter()\n"
        + body
        + "\n    elapsed = time.perf_counter() - start\n"
        + "    assert value == 2, value\n"
        + f"    print({RESULT_PREFIX!r} + '{{\"value\": %r}}' % (elapsed * 1e3), flush=True)\n"
    )


def measure_tiny(runner: Runner, n: int, chunksize: int | None) -> float:
    """Microseconds per task of one map of ``inc`` over ``range(n)``."""
    runner.open()
    try:
        warm_up(runner)
        start = time.perf_counter()
        values = runner.map(inc, range(n), chunksize)
        elapsed = time.perf_counter() - start
        check(list(values) == list(range(1, n + 1)), "wrong results")
    finally:
        runner.close()
    return elapsed / n * 1e6


def measure_fresh(runner: Runner, n: int) -> float:
    """Milliseconds per task of a map of ``arr_sum`` over n new 4 MiB arrays."""
    runner.open()
    try:
        warm_up(runner)
        arrays = [np.full(ARRAY_ITEMS, float(i)) for i in range(n)]
        start = time.perf_counter()
        sums = runner.map(arr_sum, arrays, 1)
        elapsed = time.perf_counter() - start
        del arrays
        check(list(sums) == [float(i * ARRAY_ITEMS) for i in range(n)], "wrong sums")
    finally:
        runner.close()
    return elapsed / n * 1e3


def measure_result(runner: Runner, n: int, rounds: int = 1) -> float:
    """Milliseconds per task of a map of ``make_ones`` (8 MiB results) over range(n): the
    last of ``rounds`` maps on one pool, the results of each dropped before the next."""
    runner.open()
    try:
        warm_up(runner)
        for _ in range(rounds):
            start = time.perf_counter()
            arrays = runner.map(make_ones, range(n), 1)
            elapsed = time.perf_counter() - start
            check(len(arrays) == n, f"{len(arrays)} results for {n} tasks")
            for arr in arrays:
                check(arr.shape == (RESULT_ITEMS,) and arr[-1] == 1.0, f"a result {arr.shape}")
            del arrays, arr
    finally:
        runner.close()
    return elapsed / n * 1e3


def measure_kill(runner: Runner) -> None:
    """Emit the seconds from a worker's SIGKILL to the exception in the caller, then
    whether the pool shut down after it (the parent's timeout catches a hang)."""
    runner.open()
    warm_up(runner)
    with tempfile.TemporaryDirectory(prefix="bench_pool_") as tmp:
        stamp_path = os.path.join(tmp, "stamp")
        task = functools.partial(kill_task, stamp_path)
        try:
            values = runner.map(task, range(KILL_TASKS))
        except Exception as exc:
            seen = time.time()
            with open(stamp_path) as stamp_file:
                stamp = float(stamp_file.read())
            emit({"value": seen - stamp, "exception": type(exc).__name__})
        else:
            emit({"error": f"map returned without an error: {values!r}"})
    try:
        runner.close()
    except Exception as exc:
        emit({"close_error": common.describe(exc)})
    emit({"closed": True})


def child_main(args: argparse.Namespace) -> None:
    lib_key, case = args.child
    sizes = QUICK if args.quick else FULL
    try:
        runner = RUNNERS[lib_key](args.start_method, True)
        if case == "tiny":
            value = measure_tiny(runner, sizes.tiny, args.chunksize)
        elif case == "fresh":
            value = measure_fresh(runner, sizes.fresh)
        elif case == "result":
            value = measure_result(runner, sizes.result)
        elif case == "result-warm":
            value = measure_result(runner, sizes.result, rounds=2)
        else:
            measure_kill(runner)
            return
    except Exception as exc:
        emit({"error": common.describe(exc)})
        return
    emit({"value": value})


# -- the parent: one child per (row, run) ------------------------------------------------------


@dataclass
class Row:
    """A row of the table and the runs measured for it so far."""

    case: str
    lib: Library
    chunksize: int | None = None  # the executors' tiny-task variants
    values: list[float] = field(default_factory=list)
    error: str | None = None
    hangs: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.chunksize is None:
            return self.lib.label
        return f"{self.lib.label} (chunksize={self.chunksize})"

    @property
    def group(self) -> str:
        """Rows compared with each other for "x best peer"."""
        return "chunksize=1" if self.chunksize == 1 else "default"

    @property
    def median(self) -> float | None:
        if self.error or self.hangs or not self.values:
            return None
        return statistics.median(self.values)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def library_problem(lib: Library) -> str | None:
    """None when the library imports here, else why it is skipped."""
    if lib.key == "torch":
        return common.torch_problem()
    if importlib.util.find_spec(lib.module.split(".")[0]) is None:
        return f"{lib.module.split('.')[0]} is not installed"
    try:
        importlib.import_module(lib.module)
    except Exception as exc:
        return f"{lib.module} cannot be imported: {common.describe(exc)}"
    return None


def plan(cases: list[str], libraries: list[Library], sizes: Sizes) -> list[Row]:
    rows = []
    for case in cases:
        for lib in libraries:
            if case == "tiny" and lib.kind == "executor":
                rows += [Row(case, lib, 1), Row(case, lib, sizes.chunk)]
            else:
                rows.append(Row(case, lib))
    return rows


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def wait_group(pgid: int, seconds: float) -> list[int]:
    """Wait up to ``seconds`` for process group ``pgid`` to empty; who is left."""
    deadline = time.monotonic() + seconds
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def stop_group(pgid: int) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after LEFTOVER_SECONDS. A
    multiprocessing resource tracker ignores SIGTERM: it outlives the others and unlinks
    the semaphores they left (after a SIGKILL of the group they would stay in /dev/shm)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        if not wait_group(pgid, LEFTOVER_SECONDS):
            return


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def run_child(row: Row, method: str, quick: bool) -> list[dict[str, Any]]:
    """Run one measurement in a new session; the child's JSON reports, plus
    ``{"timeout": True}`` if it had to be killed and ``{"leftover": n}`` if processes
    of its group outlived it (they are killed)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", row.lib.key, row.case]
    cmd += ["--start-method", method] + (["--quick"] if quick else [])
    if row.chunksize is not None:
        cmd += ["--chunksize", str(row.chunksize)]
    env = {**os.environ, IMPORT_ENV: row.lib.module}
    with tempfile.TemporaryDirectory(prefix="bench_pool_") as tmp:
        if row.case in STARTUP_CASES:
            script = Path(tmp) / "startup.py"
            script.write_text(startup_script(row.lib.key, row.case, method))
            cmd, env = [sys.executable, str(script)], dict(os.environ)
        return _run(cmd, env, row.case)


def _run(cmd: list[str], env: dict[str, str], case: str) -> list[dict[str, Any]]:
    timeout = KILL_SECONDS if case == "kill" else CHILD_SECONDS
    reports: list[dict[str, Any]] = []
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            reports.append({"timeout": True})
            stop_group(proc.pid)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # something outside the group holds a pipe
                proc.kill()
                out, err = "", ""
    finally:
        if proc.poll() is None:  # interrupted: take the child's processes down with it
            stop_group(proc.pid)
            proc.wait()
    if left := wait_group(proc.pid, LEFTOVER_SECONDS):
        stop_group(proc.pid)
        reports.append({"leftover": len(left)})
    for line in (out or "").splitlines():
        if line.startswith(RESULT_PREFIX):
            reports.append(json.loads(line[len(RESULT_PREFIX) :]))
    answered = any("value" in r or "error" in r for r in reports)
    if not answered and not any(r.get("timeout") for r in reports):
        tail = " / ".join((err or "").strip().splitlines()[-3:])
        reports.append({"error": f"exit code {proc.returncode}, no result: {tail}"[:300]})
    return reports


def record(row: Row, reports: list[dict[str, Any]]) -> None:
    """Fold one run's reports into the row."""
    timed_out = any(r.get("timeout") for r in reports)
    for report in reports:
        if "value" in report:
            row.values.append(report["value"])
        if "error" in report:
            row.error = report["error"]
        if "exception" in report:
            row.note(f"raised {report['exception']}")
        if "close_error" in report:
            row.note(f"shut-down raised {report['close_error']}")
        if "leftover" in report:
            row.note(f"left {report['leftover']} process(es) behind (killed)")
    if timed_out:
        answered = any("value" in r or "error" in r for r in reports)
        if row.case == "kill" and not answered:
            row.hangs = True
        elif row.case == "kill":
            row.note(f"shut-down after the error hangs (killed after {KILL_SECONDS:.0f} s)")
        elif not answered:
            row.error = f"did not finish within {CHILD_SECONDS:.0f} s"


def measure(rows: list[Row], method: str, quick: bool, repeats: int) -> list[str]:
    """Run every row ``repeats`` times, rows in turn. Returns notes on the ``/dev/shm``
    entries that appeared while a run was going and are still there at the end."""
    appeared: dict[str, str] = {}  # entry -> the first run it appeared in
    for run in range(repeats):
        for row in rows:
            if row.error or row.hangs:
                continue  # one failure is the row's answer
            before = shm_entries()
            record(row, run_child(row, method, quick))
            for name in shm_entries() - before:
                appeared.setdefault(name, f"{row.label}, {row.case}")
            print(f"  run {run + 1}/{repeats}  {row.case}  {row.label}: done", file=sys.stderr)
    left: dict[str, list[str]] = {}
    for name in sorted(shm_entries() & appeared.keys()):
        left.setdefault(appeared[name], []).append(name)
    return [f"{where}: left in /dev/shm: {', '.join(names)}" for where, names in left.items()]


def value_text(row: Row) -> str:
    if row.hangs:
        return "hangs"
    if row.error:
        return "n/a"
    median = row.median
    return "-" if median is None else FORMATS[row.case].format(median)


def table(rows: list[Row]) -> str:
    headers = ["case", "library", "median", "x stdlib Pool", "x best peer", "notes"]
    lines = []
    for row in rows:
        same_case = [r for r in rows if r.case == row.case]
        stdlib = next((r.median for r in same_case if r.lib.key == "stdlib"), None)
        peers = [
            r for r in same_case if r.lib.peer and r.group == row.group and r.median is not None
        ]
        best = min(peers, key=lambda r: r.median, default=None)
        best_text = "-"
        if best is not None and row.median is not None:
            best_text = f"{common.ratio(row.median, best.median)} ({best.label})"
        notes = ([f"error: {row.error}"] if row.error else []) + row.notes
        lines.append(
            [
                CASES[row.case],
                row.label,
                value_text(row),
                common.ratio(row.median, stdlib),
                best_text,
                "; ".join(notes).replace("|", "/"),
            ]
        )
    return common.markdown_table(headers, lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per row (median)")
    parser.add_argument(
        "--quick", action="store_true", help="1 run, 2,000 tiny tasks, 8 arrays, 4 results"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--start-method",
        choices=multiprocessing.get_all_start_methods(),
        default=None,
        help="the workers' start method (default: the platform's, "
        f"{multiprocessing.get_start_method()} here)",
    )
    parser.add_argument(
        "--only", choices=("all", *CASES), default="all", help="run one case (default: all)"
    )
    parser.add_argument("--child", nargs=2, metavar=("LIB", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--chunksize", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    method = args.start_method or multiprocessing.get_start_method()
    if args.child:
        args.start_method = method
        child_main(args)
        return
    repeats = 1 if args.quick else args.repeats
    sizes = QUICK if args.quick else FULL
    cases = list(CASES) if args.only == "all" else [args.only]
    problems = {lib.key: library_problem(lib) for lib in LIBRARIES if lib.optional}
    libraries = [lib for lib in LIBRARIES if problems.get(lib.key) is None]
    rows = plan(cases, libraries, sizes)
    compiled = common.compile_package("procspawn")
    started = time.monotonic()
    shm_notes = measure(rows, method, args.quick, repeats)

    notes = [f"skipped {BY_KEY[k].label}: {p}" for k, p in problems.items() if p is not None]
    if compiled:
        notes.append(compiled)
    for lib in libraries:
        used = effective_start_method(lib, method)
        if used != method:
            notes.append(f"{lib.label}: workers started by '{used}', not '{method}'")
    notes += shm_notes
    print(
        f"## process pools, {WORKERS} workers, start method '{method}' (median of "
        f"{repeats} run(s), each in a fresh interpreter; {time.monotonic() - started:.0f} s)"
    )
    if args.quick:
        print(
            f"\n--quick: {sizes.tiny:,} tiny tasks (chunksize {sizes.chunk:,}), "
            f"{sizes.fresh} fresh arrays, {sizes.result} results; the case names give "
            "the full sizes."
        )
    print("\n" + table(rows))
    if notes:
        print("\n" + "\n".join(f"- {note}" for note in notes))
    if args.json:
        data = {
            "kind": "bench_pool",  # docs/_scripts/bench_plots.py draws it
            "source": {
                "command": " ".join(["python", "benchmarks/bench_pool.py", *sys.argv[1:]]),
                "date": time.strftime("%Y-%m-%d"),
                "machine": common.machine(),
                "versions": common.versions(
                    ["procspawn", "numpy", "loky", "joblib", "mpire", "pebble", "torch"]
                ),
            },
            "start_method": method,
            "repeats": repeats,
            "quick": args.quick,
            "rows": [
                {
                    "case": CASES[r.case],
                    "case_key": r.case,
                    "library": r.label,
                    "library_key": r.lib.key,
                    "chunksize": r.chunksize,
                    "peer": r.lib.peer,
                    "values": r.values,
                    "median": r.median,
                    "hangs": r.hangs,
                    "error": r.error,
                    "notes": r.notes,
                }
                for r in rows
            ],
            "notes": notes,
        }
        common.write_json(args.json, data)


if __name__ == "__main__":
    main()
