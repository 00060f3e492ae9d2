"""Benchmark: spawn(backend="ray") on a local Ray cluster against processes, 4 ranks.

Run (Ray installed: ``pip install -e '.[ray]'``)::

    python benchmarks/bench_ray.py [--ranks 4] [--repeats 7] [--quick] [--json out.json]

Rows, each the median of ``--repeats`` calls of ``procspawn.spawn`` (the first call of each
row is an untimed warm-up):

* ``start-up``: ``spawn(fn, nprocs=4)`` of a function that returns its rank, from the call
  to the list of results;
* ``64 MiB argument``: ``spawn(fn, args=(a,), nprocs=4)`` with a fresh unshared 64 MiB
  ``np.ndarray`` made before each call, each rank returning ``float(a.sum())``: the time
  to get one large argument to 4 ranks and read it there.

Columns: ``process spawn`` and ``process forkserver`` (``backend="process"`` with that
start method) and ``ray`` (``backend="ray"`` on a local cluster started once before the
timed calls with ``ray.init(num_cpus=max(CPUs, ranks), include_dashboard=False)``, as
``spawn`` itself would; its start-up is reported on its own line, since a long-lived
cluster pays it once). "x spawn" = time / the process spawn column.

Then the pools on the same cluster, 2 workers each (``--no-pools`` leaves them out):
``procspawn`` (``ProcessPoolExecutor(2, backend="ray")``; its ``Pool(2, backend="ray")``
for ``map``), ``ray Pool`` (``ray.util.multiprocessing.Pool(2)``, on actors) and
``joblib ray`` (``joblib.Parallel(n_jobs=2)`` under Ray's joblib backend). Rows, medians
of ``--repeats``:

* ``start-up``: the pool made, one call's result, the pool shut down;
* ``1,000 calls``: 1,000 calls of ``x + 1``, each its own (``submit`` / ``apply_async`` /
  ``delayed``), the pool made before the timer;
* ``map of 1,000``: ``map(inc, range(1000))`` with each pool's default chunking;
* ``64 MiB argument x 16``: 16 calls given the same read-only 64 MiB array (procspawn
  puts a read-only array in the object store once per pool), each returning its sum;
* ``killed worker``: a call that calls ``os._exit``: the time until its error (or
  ``hangs``, at 30 s), then the time two calls of a 0.5 s sleep take right after it
  (0.5 s: both workers run; more: a worker is being replaced; "stuck": they fail or take
  more than 10 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from _bench_common import markdown_table, ratio, write_json

import procspawn

MIB = 1 << 20


def rank_only(rank: int) -> int:
    return rank


def total(rank: int, array: np.ndarray) -> float:
    return float(array.sum())


def inc(x: int) -> int:
    return x + 1


def array_sum(array: np.ndarray) -> float:
    return float(array.sum())


def exit_now(x: int) -> int:
    os._exit(3)


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def timed(run: Any, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 repeats, a 4 MiB argument")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--no-pools", action="store_true", help="spawn's rows only")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    nbytes = 4 * MIB if args.quick else 64 * MIB
    n = args.ranks
    import ray

    started = time.perf_counter()
    ray.init(
        num_cpus=max(os.cpu_count() or 1, n),
        include_dashboard=False,
        object_store_memory=max(256 * MIB, 4 * nbytes),
        logging_level="warning",
    )
    cluster_seconds = time.perf_counter() - started
    columns = {
        "process spawn": {"start_method": "spawn"},
        "process forkserver": {"start_method": "forkserver"},
        "ray": {"backend": "ray"},
    }
    results: dict[str, dict[str, float]] = {}
    try:
        for row, fn, make_args in (
            ("start-up", rank_only, lambda: ()),
            (f"{nbytes // MIB} MiB argument", total, lambda: (np.ones(nbytes, np.uint8),)),
        ):
            results[row] = {}
            for column, options in columns.items():

                def run(fn: Any = fn, make_args: Any = make_args, options: Any = options) -> None:
                    out = procspawn.spawn(fn, args=make_args(), nprocs=n, **options)
                    assert len(out) == n

                results[row][column] = timed(run, repeats)
                print(f"  {row} / {column}: done", file=sys.stderr)
        pools = {} if args.no_pools else pool_rows(repeats, nbytes)
    finally:
        ray.shutdown()
    headers = ["workload", *(f"{c} (ms)" for c in columns), "ray x spawn"]
    lines = [
        [
            row,
            *(f"{values[c] * 1e3:.1f}" for c in columns),
            ratio(values["ray"], values["process spawn"]),
        ]
        for row, values in results.items()
    ]
    print(f"## spawn of {n} ranks: processes vs a local Ray cluster (median of {repeats})\n")
    print(markdown_table(headers, lines))
    print(f"\nlocal Ray cluster start (ray.init, once): {cluster_seconds * 1e3:.0f} ms")
    if pools:
        print_pools(pools, repeats)
    if args.json:
        data: dict[str, Any] = {"ranks": n, "cluster_seconds": cluster_seconds, **results}
        if pools:
            data["pools"] = pools
        write_json(args.json, data)


POOLS = ("procspawn", "ray Pool", "joblib ray")


def pool_rows(repeats: int, nbytes: int) -> dict[str, dict[str, Any]]:
    """The pools' rows (see the module's docstring): row -> pool -> seconds, or for the
    killed worker a dict (seconds to the error or None, whether the pool goes on)."""
    import joblib
    from ray.util.joblib import register_ray
    from ray.util.multiprocessing import Pool as RayPool

    register_ray()
    array = np.ones(nbytes, np.uint8)
    array.flags.writeable = False

    def joblib_ray(calls: Any) -> list[Any]:
        with joblib.parallel_config(backend="ray", n_jobs=2):
            return joblib.Parallel()(calls)

    def startup() -> dict[str, float]:
        def ours() -> None:
            with procspawn.ProcessPoolExecutor(2, backend="ray") as ex:
                assert ex.submit(inc, 1).result() == 2

        def theirs() -> None:
            pool = RayPool(2)
            assert pool.apply(inc, (1,)) == 2
            pool.terminate()

        def jl() -> None:
            assert joblib_ray(joblib.delayed(inc)(1) for _ in range(1)) == [2]

        return {
            "procspawn": timed(ours, repeats),
            "ray Pool": timed(theirs, repeats),
            "joblib ray": timed(jl, repeats),
        }

    rows: dict[str, dict[str, Any]] = {"start-up": startup()}
    ex = procspawn.ProcessPoolExecutor(2, backend="ray")
    pool = procspawn.Pool(2, backend="ray")
    theirs = RayPool(2)
    try:
        rows["1,000 calls"] = {
            "procspawn": timed(
                lambda: [f.result() for f in [ex.submit(inc, i) for i in range(1000)]], repeats
            ),
            "ray Pool": timed(
                lambda: [r.get() for r in [theirs.apply_async(inc, (i,)) for i in range(1000)]],
                repeats,
            ),
            "joblib ray": timed(
                lambda: joblib_ray(joblib.delayed(inc)(i) for i in range(1000)), repeats
            ),
        }
        rows["map of 1,000"] = {
            "procspawn": timed(lambda: pool.map(inc, range(1000)), repeats),
            "ray Pool": timed(lambda: theirs.map(inc, range(1000)), repeats),
            "joblib ray": rows["1,000 calls"]["joblib ray"],  # (joblib batches its calls)
        }
        rows[f"{nbytes >> 20} MiB argument x 16"] = {
            "procspawn": timed(
                lambda: [f.result() for f in [ex.submit(array_sum, array) for _ in range(16)]],
                repeats,
            ),
            "ray Pool": timed(
                lambda: [
                    r.get() for r in [theirs.apply_async(array_sum, (array,)) for _ in range(16)]
                ],
                repeats,
            ),
            "joblib ray": timed(
                lambda: joblib_ray(joblib.delayed(array_sum)(array) for _ in range(16)), repeats
            ),
        }
        rows["killed worker"] = {
            "procspawn": killed(
                lambda: ex.submit(exit_now, 1).result(timeout=30),
                lambda: [f.result(timeout=10) for f in [ex.submit(nap, 0.5) for _ in range(2)]],
            ),
            "ray Pool": killed(
                lambda: theirs.apply_async(exit_now, (1,)).get(timeout=30),
                lambda: [
                    r.get(timeout=10) for r in [theirs.apply_async(nap, (0.5,)) for _ in range(2)]
                ],
            ),
        }
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
        pool.terminate()
        theirs.terminate()
    return rows


def killed(die: Any, two_naps: Any) -> dict[str, Any]:
    """Seconds until a killed worker's call fails (None: no error within 30 s), and the
    seconds two 0.5 s calls take right after (None: they fail or hang)."""
    start = time.perf_counter()
    try:
        die()
        seconds: float | None = None
    except Exception as exc:
        seconds = None if "imeout" in type(exc).__name__ else time.perf_counter() - start
    start = time.perf_counter()
    try:
        two_naps()
        after: float | None = time.perf_counter() - start
    except Exception:
        after = None
    return {"seconds": seconds, "two_naps_after": after}


def print_pools(pools: dict[str, dict[str, Any]], repeats: int) -> None:
    headers = ["workload", *(f"{p} (ms)" for p in POOLS), "procspawn x ray Pool"]
    lines = []
    for row, values in pools.items():
        if row == "killed worker":
            cells = []
            for p in POOLS:
                v = values.get(p)
                if v is None:
                    cells.append("-")
                    continue
                error = "hangs" if v["seconds"] is None else f"{v['seconds'] * 1e3:.0f}"
                after = v["two_naps_after"]
                naps = "stuck" if after is None else f"{after:.1f} s"
                cells.append(f"{error}; two 0.5 s calls after: {naps}")
            lines.append([row, *cells, ""])
            continue
        lines.append(
            [
                row,
                *(f"{values[p] * 1e3:.1f}" for p in POOLS),
                ratio(values["procspawn"], values["ray Pool"]),
            ]
        )
    print(f"\n## pools of 2 workers on the local Ray cluster (median of {repeats})\n")
    print(markdown_table(headers, lines))


if __name__ == "__main__":
    main()
