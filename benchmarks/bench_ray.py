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
    if args.json:
        write_json(args.json, {"ranks": n, "cluster_seconds": cluster_seconds, **results})


if __name__ == "__main__":
    main()
