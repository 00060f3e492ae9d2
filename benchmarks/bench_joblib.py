"""Benchmark: joblib on procspawn's backend against its default, loky; dask on procspawn's
executor against dask's own local schedulers.

Run::

    python benchmarks/bench_joblib.py [--repeats N] [--quick] [--json out.json]

Needs joblib, scikit-learn and dask (``pip install '.[joblib,dask,examples]'``); a case
whose library is missing is left out with a note. One process, the backends taken in turn
in every round (side by side, one run); each backend's workers are started by a first,
untimed call, as a program's second ``Parallel`` call finds them. The tables give the
median of ``--repeats`` rounds (default 5). Cases, 2 workers each:

* ``GridSearchCV`` -- ``GridSearchCV(SVC(), 8 candidates, cv=5, n_jobs=2).fit`` on
  scikit-learn's digits, under ``parallel_config(backend=...)``; the mean test scores of
  the two backends are compared (they must be equal);
* ``256 MiB argument`` -- ``Parallel(n_jobs=2)(delayed(f)(X, i) for i in range(64))``, ``X``
  a 256 MiB float64 array, ``f`` the sum of one row of it (joblib's defaults: ``X`` is over
  ``max_nbytes``, memory-mapped by loky into a temporary folder, one shared copy per call
  under procspawn); after the rounds, what each backend left in ``/dev/shm`` and in the
  temporary folder is listed;
* ``64 results of 8 MiB`` -- ``Parallel(n_jobs=2)`` of 64 tasks each returning a new 8 MiB
  float64 array (loky pickles them back; procspawn's come through shared memory);
* ``dask (x @ x.T).sum()`` -- a 4000x4000 float64 ``dask.array`` in 1000x1000 chunks:
  ``scheduler=procspawn.get_reusable_executor(2)`` against dask's ``"processes"``
  (``num_workers=2``) and ``"threads"`` schedulers (``num_workers=2``).

Goals (issue 38): grid search <= 1.0x loky, the 256 MiB argument <= 0.3x, the results
<= 0.2x.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402

BACKENDS = ("loky", "procspawn")


def row_sum(X: np.ndarray, i: int) -> float:
    return float(X[i].sum())


def new_array(i: int) -> np.ndarray:
    return np.full(1 << 20, float(i))  # 8 MiB


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _left_behind() -> list[str]:
    """What joblib, loky or procspawn have in /dev/shm and the temporary folder now."""
    names = glob.glob("/dev/shm/*") + glob.glob(os.path.join(tempfile.gettempdir(), "*"))
    keys = ("joblib", "loky", "procspawn", "psm_")
    return sorted(n for n in names if any(k in os.path.basename(n) for k in keys))


def joblib_cases(repeats: int, quick: bool) -> dict[str, Any]:
    import joblib

    import procspawn.joblib

    procspawn.joblib.register()
    out: dict[str, Any] = {}
    rows = 8 if quick else 64
    X = np.random.default_rng(0).random((rows, (256 << 20) // 8 // 64))
    cases: dict[str, Any] = {
        "256 MiB argument (s)": lambda: joblib.Parallel(n_jobs=2)(
            joblib.delayed(row_sum)(X, i) for i in range(rows)
        ),
        "64 results of 8 MiB (s)": lambda: joblib.Parallel(n_jobs=2)(
            joblib.delayed(new_array)(i) for i in range(rows)
        ),
    }
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import GridSearchCV
        from sklearn.svm import SVC
    except ImportError:
        out["note"] = "scikit-learn is not installed: no grid search"
    else:
        digits_X, digits_y = load_digits(return_X_y=True)
        grid = {"C": [0.1, 1, 10, 100], "gamma": [1e-3, 1e-4]}

        def grid_search() -> Any:
            search = GridSearchCV(SVC(), grid, cv=5, n_jobs=2)
            return search.fit(digits_X, digits_y).cv_results_["mean_test_score"]

        cases = {"GridSearchCV, 8 candidates x 5 folds (s)": grid_search, **cases}
    before = _left_behind()
    times: dict[str, dict[str, list[float]]] = {c: {b: [] for b in BACKENDS} for c in cases}
    scores: dict[str, Any] = {}
    for backend in BACKENDS:  # workers up
        with joblib.parallel_config(backend=backend):
            joblib.Parallel(n_jobs=2)(joblib.delayed(abs)(-i) for i in range(4))
    for _ in range(repeats):
        for case, fn in cases.items():
            for backend in BACKENDS:
                with joblib.parallel_config(backend=backend):
                    seconds, value = _timed(fn)
                times[case][backend].append(seconds)
                if case.startswith("GridSearchCV"):
                    scores[backend] = [float(s) for s in value]
                del value
    procspawn.joblib.shutdown()
    from joblib.externals.loky import get_reusable_executor

    get_reusable_executor().shutdown(wait=True)
    time.sleep(1)
    new = sorted(set(_left_behind()) - set(before))
    left = {
        "procspawn": [n for n in new if "procspawn" in n],
        "loky": [n for n in new if "joblib" in n or "loky" in n],
    }
    out["medians"] = {
        case: {b: statistics.median(v) for b, v in per.items()} for case, per in times.items()
    }
    out["scores equal"] = scores.get("loky") == scores.get("procspawn") if scores else None
    out["left behind"] = left
    return out


def dask_case(repeats: int, quick: bool) -> dict[str, Any]:
    try:
        import dask
        import dask.array as da
    except ImportError:
        return {"note": "dask is not installed"}
    import procspawn

    n = 2000 if quick else 4000
    x = da.random.RandomState(0).random_sample((n, n), chunks=n // 4)
    expr = (x @ x.T).sum()
    executor = procspawn.get_reusable_executor(max_workers=2)
    schedulers: dict[str, dict[str, Any]] = {
        "threads": {"scheduler": "threads", "num_workers": 2},
        "processes": {"scheduler": "processes", "num_workers": 2},
        "procspawn executor": {"scheduler": executor},
    }
    times: dict[str, list[float]] = {name: [] for name in schedulers}
    values = {}
    for _ in range(repeats):
        for name, options in schedulers.items():
            with dask.config.set(**options):
                seconds, values[name] = _timed(expr.compute)
            times[name].append(seconds)
    executor.shutdown(wait=True)
    return {
        "medians": {name: statistics.median(v) for name, v in times.items()},
        "equal": len({round(float(v), 3) for v in values.values()}) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller arrays, 1 round")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    results = {"joblib": joblib_cases(repeats, args.quick), "dask": dask_case(repeats, args.quick)}
    medians = results["joblib"].get("medians", {})
    rows = [
        [case, f"{m['loky']:.3f}", f"{m['procspawn']:.3f}", common.ratio(m["procspawn"], m["loky"])]
        for case, m in medians.items()
    ]
    print(f"joblib, 2 workers, medians of {repeats} ({common.machine()})\n")
    print(common.markdown_table(["case", "loky", "procspawn", "procspawn / loky"], rows))
    print(f"\nGridSearchCV mean test scores equal: {results['joblib'].get('scores equal')}")
    print(f"left in /dev/shm and {tempfile.gettempdir()}: {results['joblib'].get('left behind')}")
    dask_medians = results["dask"].get("medians")
    if dask_medians:
        reference = dask_medians["processes"]
        print(f"\ndask (x @ x.T).sum(), 2 workers, medians of {repeats}\n")
        print(
            common.markdown_table(
                ["scheduler", "s", "/ processes"],
                [[k, f"{v:.3f}", common.ratio(v, reference)] for k, v in dask_medians.items()],
            )
        )
        print(f"\nresults equal: {results['dask']['equal']}")
    for part in ("joblib", "dask"):
        if "note" in results[part]:
            print(f"note: {results[part]['note']}")
    if args.json:
        results["kind"] = "bench_joblib"
        results["source"] = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "date": time.strftime("%Y-%m-%d"),
            "machine": common.machine(),
            "versions": common.versions(
                ["procspawn", "joblib", "scikit-learn", "dask", "numpy", "threadpoolctl"]
            ),
        }
        common.write_json(args.json, results)


if __name__ == "__main__":
    main()
