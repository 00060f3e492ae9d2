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

Then, for each of ``--kill-methods`` (default fork, spawn and forkserver), a second
table: a task that writes ``time.time()`` to a file and SIGKILLs its own worker, in the
middle of ``Pool(2).map`` and ``imap_unordered`` (8 tasks, chunksize 1), of
``Pool(2).apply_async`` and of ``ProcessPoolExecutor(2).submit``: milliseconds from that
stamp to the exception in the caller, and whether the pool then ran a map of 8 tasks
right ("works after"; the executor is broken by a death, as the stdlib's, unless
``retries`` is set: "broken, as designed").
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
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


def nap_or_die(stamp_path: str, i: int) -> int:
    """Task 2 stamps the time and SIGKILLs its worker; the others nap 20 ms."""
    if i == 2:
        with open(stamp_path, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
    return i


def kill_case(method: str, call: str) -> tuple[float, str]:
    """(ms from the death to the caller's exception, what the pool does after)."""
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "stamp")
        items = [(stamp, i) for i in range(8)]
        if call == "submit":
            with procspawn.ProcessPoolExecutor(2, mp_context=method) as ex:
                futures = [ex.submit(nap_or_die, *item) for item in items]
                try:
                    [f.result(30) for f in futures]
                    raise AssertionError("no error")
                except procspawn.ProcessExitedException:
                    failed = time.time()
                try:
                    ex.submit(inc, 1).result(30)
                    after = "works after"
                except procspawn.TerminatedWorkerError:
                    after = "broken, as designed"
        else:
            with procspawn.Pool(2, context=method) as pool:
                pool.map(inc, range(4))
                try:
                    if call == "map":
                        pool.starmap(nap_or_die, items, chunksize=1)
                    elif call == "imap_unordered":
                        list(pool.imap_unordered(_star_nap_or_die, items))
                    else:
                        pool.apply_async(nap_or_die, items[2]).get(30)
                    raise AssertionError("no error")
                except procspawn.ProcessExitedException:
                    failed = time.time()
                ok = pool.map(inc, range(8)) == list(range(1, 9))
                after = "works after" if ok else "WRONG after"
        with open(stamp) as f:
            died = float(f.read())
    return (failed - died) * 1e3, after


def _star_nap_or_die(item: tuple[str, int]) -> int:
    return nap_or_die(*item)


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
    parser.add_argument("--kill-methods", nargs="+", default=["fork", "spawn", "forkserver"])
    parser.add_argument("--only-kill", action="store_true", help="the second table only")
    args = parser.parse_args()
    if not args.only_kill:
        options_table(args)
    print()
    print("| start method | call | killed worker -> error (ms) | after |")
    print("|---|---|---|---|")
    for method in args.kill_methods:
        for call in ("map", "imap_unordered", "apply_async", "submit"):
            runs = [kill_case(method, call) for _ in range(args.repeats)]
            afters = sorted({after for _, after in runs})
            latency = statistics.median(ms for ms, _ in runs)
            print(f"| {method} | {call} | {latency:.1f} | {', '.join(afters)} |")


def options_table(args: argparse.Namespace) -> None:
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
