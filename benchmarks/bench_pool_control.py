"""Benchmark: what procspawn's pool options cost, and how fast a timed-out task is dealt with.

Run::

    python benchmarks/bench_pool_control.py [--repeats N] [--start-method M ...]

For each start method (default: fork and forkserver), in this process, medians of
``--repeats`` (default 5):

* ``tiny, no option`` / ``tiny, options set`` -- µs per task of ``Pool(2).map(inc,
  range(20000))`` (default chunking), the pool made and warmed before the timer; the
  second with ``task_timeout=60, retries=2, max_memory_per_child=8 GiB`` (none fires);
  ``tiny, progress=`` with ``progress=Progress(show=True, use_tqdm=False)`` (stderr
  redirected: lines every 5 s) -- the counting and the redraw checks.
* ``timeout -> error (ms)`` -- ``Pool(1, task_timeout=0.5)``: a task that sleeps 30 s;
  from its deadline (0.5 s after the worker took it, read from the clock at submit +
  the time the worker reported starting) to the caller's ``TaskTimeoutError``.
* ``timeout -> replacement ready (ms)`` -- from the same deadline to the moment a
  tiny task submitted right after the error has run on the new worker (the pool has one
  worker, so the new one runs it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import procspawn

TINY = 20_000
LIMIT = 0.5


def inc(x: int) -> int:
    return x + 1


def started_then_sleep(seconds: float) -> float:
    now = time.time()
    time.sleep(seconds)
    return now


def stamp(_: int = 0) -> float:
    return time.time()


def tiny(method: str, progress: bool = False, **options) -> float:
    with procspawn.Pool(2, context=method, **options) as pool:
        pool.map(inc, range(100))
        shown = procspawn.Progress(show=True, use_tqdm=False) if progress else None
        start = time.perf_counter()
        out = pool.map(inc, range(TINY), progress=shown)
        elapsed = time.perf_counter() - start
    assert out[-1] == TINY
    return elapsed / TINY * 1e6


def timeout_case(method: str) -> tuple[float, float]:
    with procspawn.Pool(1, context=method, task_timeout=LIMIT) as pool:
        pool.apply(inc, (1,))
        submitted = time.time()
        late = pool.apply_async(started_then_sleep, (30,))
        try:
            late.get(60)
            raise AssertionError("the task was not timed out")
        except procspawn.TaskTimeoutError:
            failed = time.time()
        ran = pool.apply(stamp)
    # the worker took the task at once (idle, one worker): its deadline is about
    # submit + LIMIT (the worker's own start stamp is lost with it)
    deadline = submitted + LIMIT
    return (failed - deadline) * 1e3, (ran - deadline) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--start-method", nargs="+", default=["fork", "forkserver"])
    args = parser.parse_args()
    opts = dict(task_timeout=60, retries=2, max_memory_per_child=8 << 30)
    print(
        "| start method | tiny, no option (µs/task) | tiny, options set (µs/task) | "
        "tiny, progress= (µs/task) | timeout -> error (ms) | timeout -> replacement ready (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for method in args.start_method:
        plain, set_, shown, errors, ready = [], [], [], [], []
        for _ in range(args.repeats):  # alternated, so drift hits them alike
            plain.append(tiny(method))
            set_.append(tiny(method, **opts))
            shown.append(tiny(method, progress=True))
            e, r = timeout_case(method)
            errors.append(e)
            ready.append(r)
        med = statistics.median
        print(
            f"| {method} | {med(plain):.3f} | {med(set_):.3f} | {med(shown):.3f} "
            f"| {med(errors):.1f} | {med(ready):.1f} |"
        )


if __name__ == "__main__":
    main()
