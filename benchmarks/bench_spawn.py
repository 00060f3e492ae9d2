"""Benchmark: starting ranks, and how fast a rank's exception reaches the parent.

Run::

    python benchmarks/bench_spawn.py [--repeats N] [--quick] [--json out.json]

Ways to run ``fn(rank)`` in new processes, side by side:

* procspawn -- ``procspawn.spawn(fn, nprocs=N, start_method="spawn")``;
* procspawn fs -- ``procspawn.spawn(fn, nprocs=N, start_method="forkserver")``: procspawn's
  fork server, with NumPy, cloudpickle and procspawn imported once; it is started before
  the timings (its start-up is reported on a line of its own);
* stdlib    -- a plain ``multiprocessing.get_context("spawn").Process`` loop (start N,
  join N); its rank function lives in ``_bench_workers.py``, which imports numpy as
  every procspawn child does, so both columns' children import about as much;
* stdlib fs -- the same loop with ``multiprocessing.get_context("forkserver")`` (the
  stdlib's server preloads this script, hence numpy, too);
* torch     -- ``torch.multiprocessing.spawn(fn, nprocs=N, start_method="spawn")``, when
  torch can be imported (its children import torch, which is part of its cost).

Cases (each a row of the table, milliseconds, median of ``--repeats`` runs, the three
methods interleaved run by run):

* ``spawn+join N ranks`` -- wall time of one call that starts N trivial ranks (each
  returns its rank) and waits for all of them;
* ``raise -> parent (1 rank)`` -- one rank writes ``time.time()`` to a file and raises at
  once; the time from that stamp until the parent has the failure in hand: procspawn's
  and torch's ``ProcessRaisedException`` caught around the call, or, for the stdlib, the
  process sentinel becoming ready in ``multiprocessing.connection.wait`` (a plain
  Process does not carry the exception to the parent, only its exit, so that column
  includes the child's interpreter shutdown).

The ratio columns are a procspawn time divided by another's: below 1 procspawn is
faster. Every method gets one untimed warm-up run first. Goals (issue 10): procspawn's
forkserver spawn+join of 8 ranks <= 0.15x the stdlib spawn loop; procspawn's default
spawn <= 1.1x that loop.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

BENCH_DIR = str(Path(__file__).resolve().parent)
if BENCH_DIR not in sys.path:  # spawn children get the parent's sys.path
    sys.path.insert(0, BENCH_DIR)

import _bench_common as common  # noqa: E402
import _bench_workers as workers  # noqa: E402

RANKS = (1, 2, 4, 8)
QUICK_RANKS = (1, 2)
RAISE_CASE = "raise -> parent (1 rank)"


@dataclass(frozen=True)
class Method:
    """One way to start ranks: ``spawn_join(n)`` runs n trivial ranks to completion;
    ``raise_seen(path)`` runs a rank that raises and returns ``time.time()`` at the
    moment the parent knows."""

    name: str
    spawn_join: Callable[[int], None]
    raise_seen: Callable[[str], float]


# -- procspawn ------------------------------------------------------------------------------


def procspawn_spawn_join(nprocs: int, start_method: str = "spawn") -> None:
    import procspawn

    results = procspawn.spawn(workers.return_rank, nprocs=nprocs, start_method=start_method)
    if results != list(range(nprocs)):
        raise AssertionError(f"procspawn.spawn returned {results!r}")


def procspawn_raise_seen(stamp_path: str, start_method: str = "spawn") -> float:
    import procspawn

    try:
        procspawn.spawn(workers.raise_stamped, args=(stamp_path,), start_method=start_method)
    except procspawn.ProcessRaisedException as exc:
        seen = time.time()
        _check_raised(exc)
        return seen
    raise AssertionError("procspawn.spawn returned although the rank raised")


def procspawn_server_start_ms() -> float:
    """Milliseconds of the first forkserver spawn+join of 1 rank: procspawn's fork server
    starts and imports its preload list (once per program)."""
    start = time.perf_counter()
    procspawn_spawn_join(1, "forkserver")
    return (time.perf_counter() - start) * 1e3


# -- stdlib multiprocessing -------------------------------------------------------------------


def stdlib_spawn_join(nprocs: int, start_method: str = "spawn") -> None:
    ctx = multiprocessing.get_context(start_method)
    procs = [ctx.Process(target=workers.return_rank, args=(rank,)) for rank in range(nprocs)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    codes = [proc.exitcode for proc in procs]
    if any(codes):
        raise AssertionError(f"stdlib ranks exited with {codes}")


def stdlib_raise_seen(stamp_path: str, start_method: str = "spawn") -> float:
    proc = multiprocessing.get_context(start_method).Process(
        target=workers.raise_stamped, args=(0, stamp_path)
    )
    proc.start()
    wait([proc.sentinel])
    seen = time.time()
    proc.join()
    if proc.exitcode != 1:
        raise AssertionError(f"the raising stdlib rank exited with {proc.exitcode}")
    return seen


# -- torch.multiprocessing ------------------------------------------------------------------


def torch_spawn_join(nprocs: int) -> None:
    import torch.multiprocessing

    torch.multiprocessing.spawn(workers.return_rank, nprocs=nprocs, start_method="spawn")


def torch_raise_seen(stamp_path: str) -> float:
    import torch.multiprocessing

    try:
        torch.multiprocessing.spawn(workers.raise_stamped, args=(stamp_path,), start_method="spawn")
    except torch.multiprocessing.ProcessRaisedException as exc:
        seen = time.time()
        _check_raised(exc)
        return seen
    raise AssertionError("torch.multiprocessing.spawn returned although the rank raised")


def _check_raised(exc: Exception) -> None:
    if "benchmark raise in rank 0" not in str(exc):
        raise AssertionError(f"caught another exception than the rank's: {exc}")


# -- measuring -----------------------------------------------------------------------------


def available_methods() -> tuple[list[Method], str | None]:
    """The methods to run, and a note when torch cannot be imported."""
    methods = [
        Method("procspawn", procspawn_spawn_join, procspawn_raise_seen),
        Method(
            "procspawn fs",
            lambda n: procspawn_spawn_join(n, "forkserver"),
            lambda path: procspawn_raise_seen(path, "forkserver"),
        ),
        Method("stdlib", stdlib_spawn_join, stdlib_raise_seen),
        Method(
            "stdlib fs",
            lambda n: stdlib_spawn_join(n, "forkserver"),
            lambda path: stdlib_raise_seen(path, "forkserver"),
        ),
    ]
    problem = common.torch_problem()  # imports torch once, outside the timings
    if problem is not None:
        return methods, f"{problem}: the torch column is skipped"
    methods.append(Method("torch", torch_spawn_join, torch_raise_seen))
    return methods, None


def time_spawn_join(method: Method, nprocs: int) -> float:
    """Milliseconds for one spawn+join of ``nprocs`` trivial ranks."""
    start = time.perf_counter()
    method.spawn_join(nprocs)
    return (time.perf_counter() - start) * 1e3


def time_raise(method: Method, tmpdir: str) -> float:
    """Milliseconds from a rank's raise to the parent knowing of it."""
    stamp_path = str(Path(tmpdir) / f"stamp-{method.name}")
    seen = method.raise_seen(stamp_path)
    raised = float(Path(stamp_path).read_text())
    return (seen - raised) * 1e3


def measure(methods: list[Method], ranks: tuple[int, ...], repeats: int) -> dict:
    """``{case: {method name: [ms, ...]}}``; methods interleaved within each repeat."""
    cases: dict[str, Callable[[Method], float]] = {
        f"spawn+join {n} rank{'s' if n > 1 else ''}": (
            lambda method, n=n: time_spawn_join(method, n)
        )
        for n in ranks
    }
    samples: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_spawn_") as tmpdir:
        cases[RAISE_CASE] = lambda method: time_raise(method, tmpdir)
        for method in methods:
            method.spawn_join(1)  # warm-up: imports, page cache
        for case, run in cases.items():
            samples[case] = {method.name: [] for method in methods}
            for _ in range(repeats):
                for method in methods:
                    samples[case][method.name].append(run(method))
    return samples


# -- reporting -----------------------------------------------------------------------------


def medians(samples: dict) -> dict[str, dict[str, float]]:
    return {
        case: {name: statistics.median(values) for name, values in by_method.items()}
        for case, by_method in samples.items()
    }


COLUMNS = ("procspawn", "procspawn fs", "stdlib", "stdlib fs", "torch")


def table(results: dict[str, dict[str, float]]) -> str:
    headers = [
        "case",
        *(f"{name} ms" for name in COLUMNS),
        "procspawn/stdlib",
        "procspawn fs/stdlib",
        "procspawn fs/stdlib fs",
        "procspawn/torch",
    ]
    rows = []
    for case, by_method in results.items():
        t = {name: by_method.get(name) for name in COLUMNS}
        cells = ["-" if t[name] is None else f"{t[name]:.1f}" for name in COLUMNS]
        ratios = [
            common.ratio(t["procspawn"], t["stdlib"]),
            common.ratio(t["procspawn fs"], t["stdlib"]),
            common.ratio(t["procspawn fs"], t["stdlib fs"]),
            common.ratio(t["procspawn"], t["torch"]),
        ]
        rows.append([case, *cells, *ratios])
    return common.markdown_table(headers, rows)


def goals(results: dict[str, dict[str, float]]) -> list[str]:
    eight = results.get("spawn+join 8 ranks")
    if not eight:
        return []
    fast = eight["procspawn fs"] / eight["stdlib"]
    default = eight["procspawn"] / eight["stdlib"]
    return [
        f"goal: procspawn forkserver 8 ranks <= 0.15x stdlib spawn loop: {fast:.3g}x "
        f"({'met' if fast <= 0.15 else 'NOT met'})",
        f"goal: procspawn spawn 8 ranks <= 1.1x stdlib spawn loop: {default:.3g}x "
        f"({'met' if default <= 1.1 else 'NOT met'})",
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per case (median)")
    parser.add_argument("--quick", action="store_true", help="1 and 2 ranks, 1 repeat")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    repeats = 1 if args.quick else args.repeats
    ranks = QUICK_RANKS if args.quick else RANKS
    methods, note = available_methods()
    server_ms = procspawn_server_start_ms()
    samples = measure(methods, ranks, repeats)
    results = medians(samples)
    print(f"## spawn benchmark (median of {repeats}, milliseconds)\n")
    print(table(results))
    print(
        f"\nfirst procspawn forkserver spawn of 1 rank, server start included: {server_ms:.0f} ms"
    )
    for line in goals(results):
        print(line)
    if note:
        print(f"\nnote: {note}")
    if sys.flags.dont_write_bytecode:
        print(
            "\nnote: PYTHONDONTWRITEBYTECODE is set: every rank compiles procspawn's modules "
            "and the main module from source (most users have a bytecode cache)"
        )
    if args.json:
        common.write_json(
            args.json,
            {
                "repeats": repeats,
                "note": note,
                "server_start_ms": server_ms,
                "median_ms": results,
                "samples_ms": samples,
            },
        )


if __name__ == "__main__":
    main()
