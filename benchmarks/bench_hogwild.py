"""Benchmark: Hogwild training, procspawn against NumPy + SharedMemory by hand and torch.

Run::

    python benchmarks/bench_hogwild.py [--ranks N] [--epochs E] [--repeats R] [--quick]
                                       [--progress] [--json out.json]

Softmax regression on scikit-learn's digits (the data of ``examples/hogwild.py``; the demo
itself trains a wider network), minibatch SGD, batch 16, learning rate 0.1, trained by N
ranks (default min(4, CPUs)) that update one shared model in place with no lock, each on
its own shard, three ways:

* procspawn -- ``procspawn.sharing.share_memory_`` on the parameter and data dicts, a
  shared ``stats`` array from ``procspawn.sharing.zeros``, then
  ``procspawn.spawn(train_numpy, args=(...), nprocs=N)``;
* numpy     -- the same ``train_numpy`` (``_hogwild_common.py``) in plain
  ``multiprocessing.get_context("spawn").Process`` ranks: the parent copies every array
  into its own ``multiprocessing.shared_memory.SharedMemory`` block, each rank attaches
  the blocks by name and builds ``np.ndarray`` views over them;
* torch     -- the same arithmetic in torch ops (explicit gradient, in-place update under
  ``torch.no_grad()``, ``torch.set_num_threads(1)`` in each rank) on tensors made shared
  with ``.share_memory_()``, started with ``torch.multiprocessing.spawn``; only when
  torch imports.

All three start ranks with the "spawn" start method, pass the same ``multiprocessing``
Barrier and use the same shards and shuffles. This script sets ``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` to 1 at its top, which every rank runs
before it imports NumPy or torch.

Rows (median of ``--repeats`` runs, the methods interleaved run by run, after one untimed
warm-up run of each):

* ``steps/s (in ranks)`` -- minibatch updates of all ranks together divided by the
  training time, measured inside the ranks: from the moment the first rank leaves the
  start barrier to the moment the last rank finishes its last step (process start-up and
  teardown excluded; before the barrier each rank makes 20 untimed steps on a private
  copy of the parameters, so first-call costs are excluded too). Higher is better.
* ``training s (in ranks)`` -- that training time.
* ``wall s (with start-up)`` -- the parent's time for the whole run: sharing the arrays,
  starting the ranks, training, joining them.
* ``test accuracy`` -- of the final shared model on the held-out 25 %.

Ratio columns are procspawn's value divided by the other's: above 1 is better for
procspawn in the steps/s row, below 1 in the time rows. Goals, printed under the
table: procspawn steps/s >= 0.9x the hand-written NumPy ones (the library adds nothing to
the training loop: the same arrays over shared memory) and >= 5x torch's (the same
arithmetic, on tiny arrays, where the per-operation overhead of torch dominates).

``--progress`` makes the procspawn ranks call ``procspawn.progress()`` after every step
and the parent pass ``spawn(..., progress=total)``, as the example does (the bar is drawn
only when stderr is a terminal).
"""

import os

# Before NumPy or torch is imported, here and in every rank (each re-runs this top level as
# __mp_main__): one BLAS/OpenMP thread per process.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from multiprocessing import shared_memory  # noqa: E402
from pathlib import Path  # noqa: E402

BENCH_DIR = str(Path(__file__).resolve().parent)
if BENCH_DIR not in sys.path:  # spawn children get the parent's sys.path
    sys.path.insert(0, BENCH_DIR)

import _bench_common as common  # noqa: E402
import _hogwild_common as hw  # noqa: E402
import numpy as np  # noqa: E402

METHODS = ("procspawn", "numpy", "torch")
ROWS = ("steps/s (in ranks)", "training s (in ranks)", "wall s (with start-up)", "test accuracy")
EPOCHS = 200
QUICK_EPOCHS = 20
STEPS_GOAL_NUMPY = 0.9
STEPS_GOAL_TORCH = 5.0


def _barrier(nranks: int):
    return multiprocessing.get_context("spawn").Barrier(nranks)


def _summary(stats: np.ndarray, wall: float, acc: float) -> dict[str, float]:
    """One run's numbers from the ranks' ``(start, end, steps)`` rows."""
    if not (stats[:, 1] > 0).all():
        raise common.ChildError(f"a rank did not report its timings: {stats.tolist()}")
    train = float(stats[:, 1].max() - stats[:, 0].min())
    steps = float(stats[:, 2].sum())
    return {
        "steps": steps,
        "steps_per_s": steps / train,
        "train_s": train,
        "wall_s": wall,
        "accuracy": acc,
    }


# -- (a) procspawn ---------------------------------------------------------------------------


def run_procspawn(data: dict, nranks: int, epochs: int, tick: bool) -> dict[str, float]:
    import procspawn
    from procspawn import sharing

    start = time.perf_counter()
    params = sharing.share_memory_(hw.init_params(data))
    shared_data = sharing.share_memory_(dict(data))
    stats = sharing.zeros((nranks, hw.STATS_COLUMNS), dtype=np.float64)
    total = hw.total_steps(len(data["x_train"]), nranks, epochs) if tick else None
    procspawn.spawn(
        hw.train_numpy,
        args=(nranks, params, shared_data, stats, _barrier(nranks), epochs),
        kwargs={"tick": tick},
        nprocs=nranks,
        start_method="spawn",
        progress=total,
    )
    wall = time.perf_counter() - start
    return _summary(stats, wall, hw.accuracy(params, data))


# -- (b) NumPy + multiprocessing.shared_memory by hand -------------------------------------


def run_numpy(data: dict, nranks: int, epochs: int, tick: bool) -> dict[str, float]:
    del tick  # procspawn-only
    start = time.perf_counter()
    arrays = {**hw.init_params(data), **data, "stats": hw.new_stats(nranks)}
    blocks: dict[str, shared_memory.SharedMemory] = {}
    views: dict[str, np.ndarray] = {}
    specs = {}
    ctx = multiprocessing.get_context("spawn")
    procs = []
    try:
        for key, array in arrays.items():
            blocks[key] = shared_memory.SharedMemory(create=True, size=max(1, array.nbytes))
            views[key] = np.ndarray(array.shape, dtype=array.dtype, buffer=blocks[key].buf)
            views[key][...] = array
            specs[key] = (blocks[key].name, array.shape, array.dtype.str)
        barrier = _barrier(nranks)
        procs = [
            ctx.Process(
                target=hw.stdlib_rank,
                args=(rank, nranks, specs, barrier, epochs, hw.BATCH_SIZE, hw.LEARNING_RATE),
                name=f"numpy-rank-{rank}",
            )
            for rank in range(nranks)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        wall = time.perf_counter() - start
        codes = [proc.exitcode for proc in procs]
        if any(codes):
            raise common.ChildError(f"numpy ranks exited with {codes}")
        params = {key: views[key] for key in ("W", "b")}
        summary = _summary(views["stats"].copy(), wall, hw.accuracy(params, data))
        del params
    finally:
        common.finish(procs)
        views.clear()
        for block in blocks.values():
            block.close()
            block.unlink()
    return summary


# -- (c) torch ------------------------------------------------------------------------------


def run_torch(data: dict, nranks: int, epochs: int, tick: bool) -> dict[str, float]:
    del tick  # procspawn-only
    import torch
    import torch.multiprocessing

    start = time.perf_counter()
    params = {
        k: torch.from_numpy(v).clone().share_memory_() for k, v in hw.init_params(data).items()
    }
    shared_data = {k: torch.from_numpy(v).clone().share_memory_() for k, v in data.items()}
    stats = torch.zeros((nranks, hw.STATS_COLUMNS), dtype=torch.float64).share_memory_()
    torch.multiprocessing.spawn(
        hw.train_torch,
        args=(nranks, params, shared_data, stats, _barrier(nranks), epochs),
        nprocs=nranks,
        start_method="spawn",
    )
    wall = time.perf_counter() - start
    final = {k: v.numpy() for k, v in params.items()}
    return _summary(stats.numpy().copy(), wall, hw.accuracy(final, data))


# -- measuring -------------------------------------------------------------------------------


def available_methods() -> tuple[dict[str, Callable], dict[str, str]]:
    """The runners to use, and why a method is missing (its table cells)."""
    runners: dict[str, Callable] = {"procspawn": run_procspawn, "numpy": run_numpy}
    missing: dict[str, str] = {}
    problem = common.torch_problem()  # imports torch once, outside the timings
    if problem is None:
        runners["torch"] = run_torch
    elif problem == "torch is not installed":
        missing["torch"] = "not installed"
    else:
        missing["torch"] = "cannot import"
        print(f"note: {problem}", file=sys.stderr)
    return runners, missing


def measure(
    runners: dict[str, Callable], data: dict, nranks: int, epochs: int, repeats: int, tick: bool
) -> dict[str, list[dict[str, float]]]:
    """``{method: [run summary, ...]}``; one untimed warm-up each, then interleaved."""
    for run in runners.values():
        run(data, nranks, 1, tick)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            samples[name].append(run(data, nranks, epochs, tick))
    return samples


def medians(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for name, runs in samples.items()
    }


# -- reporting -------------------------------------------------------------------------------

_ROW_KEYS = {
    "steps/s (in ranks)": ("steps_per_s", "{:,.0f}"),
    "training s (in ranks)": ("train_s", "{:.3f}"),
    "wall s (with start-up)": ("wall_s", "{:.2f}"),
    "test accuracy": ("accuracy", "{:.3f}"),
}


def table(results: dict[str, dict[str, float]], missing: dict[str, str]) -> str:
    headers = ["", "procspawn", "numpy + SharedMemory", "torch"]
    headers += ["procspawn/numpy", "procspawn/torch"]
    rows = []
    for row in ROWS:
        key, fmt = _ROW_KEYS[row]
        values = [results.get(name, {}).get(key) for name in METHODS]
        cells = [
            missing.get(name, "-") if value is None else fmt.format(value)
            for name, value in zip(METHODS, values, strict=True)
        ]
        if key == "accuracy":
            ratios = ["-", "-"]
        else:
            ratios = [common.ratio(values[0], values[1]), common.ratio(values[0], values[2])]
        rows.append([row, *cells, *ratios])
    return common.markdown_table(headers, rows)


def goals(results: dict[str, dict[str, float]], missing: dict[str, str]) -> list[str]:
    ours = results["procspawn"]["steps_per_s"]
    lines = []
    for name, label, goal in (
        ("numpy", "hand-written NumPy", STEPS_GOAL_NUMPY),
        ("torch", "torch", STEPS_GOAL_TORCH),
    ):
        prefix = f"goal: procspawn steps/s >= {goal:g}x {label}:"
        if name not in results:
            lines.append(f"{prefix} - ({missing.get(name, 'not run')})")
            continue
        got = ours / results[name]["steps_per_s"]
        lines.append(f"{prefix} {got:.3g}x ({'met' if got >= goal else 'NOT met'})")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks", type=int, default=min(4, os.cpu_count() or 1), help="default min(4, CPUs)"
    )
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {EPOCHS})")
    parser.add_argument("--repeats", type=int, default=5, help="runs per method (median)")
    parser.add_argument("--quick", action="store_true", help=f"1 repeat of {QUICK_EPOCHS} epochs")
    parser.add_argument(
        "--progress",
        action="store_true",
        help="procspawn ranks call procspawn.progress() every step (spawn(progress=...))",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if args.ranks < 1 or args.repeats < 1 or (args.epochs is not None and args.epochs < 1):
        parser.error("--ranks, --repeats and --epochs must be >= 1")
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else EPOCHS
    if args.quick:
        args.repeats = 1
    return args


def main() -> None:
    args = parse_args()
    data = hw.load_data()
    runners, missing = available_methods()
    samples = measure(runners, data, args.ranks, args.epochs, args.repeats, args.progress)
    results = medians(samples)
    steps = hw.total_steps(len(data["x_train"]), args.ranks, args.epochs)
    print(
        f"## Hogwild benchmark: {args.ranks} ranks, {args.epochs} epochs ({steps} steps in "
        f"all), batch {hw.BATCH_SIZE}, start_method='spawn', median of {args.repeats}"
        f"{', procspawn with progress()' if args.progress else ''}\n"
    )
    print(table(results, missing))
    print()
    for line in goals(results, missing):
        print(line)
    if args.json:
        common.write_json(
            args.json,
            {
                "ranks": args.ranks,
                "epochs": args.epochs,
                "steps": steps,
                "batch_size": hw.BATCH_SIZE,
                "repeats": args.repeats,
                "progress": args.progress,
                "missing": missing,
                "median": results,
                "samples": samples,
            },
        )


if __name__ == "__main__":
    main()
