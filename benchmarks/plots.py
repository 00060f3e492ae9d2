"""The benchmarks page's figures, tables and plots, and the README's picture, in one command.

Run::

    python benchmarks/plots.py             # draw from the figures kept in docs/benchmarks/
    python benchmarks/plots.py --measure   # run bench_pool.py first (fork and forkserver,
                                           # ~15 minutes each, alone on an idle machine)

``--measure`` writes ``bench_pool.py``'s JSON for each start method into
``docs/benchmarks/pool_<method>.json``; the peers (loky, joblib, mpire, pebble, torch) are
measured where they are installed in this interpreter, so run it from the benchmarks'
environment (``benchmarks/README.md``). Then, from every JSON file there, it writes the
pages' tables and plots into ``docs/_generated/`` (as the documentation's build does) and
the README's picture, ``docs/_static/headline.svg`` (arrays through a pool: procspawn, the
standard library and the best peer), which is kept in the repository so that the README
shows it; a test checks that it is the picture the kept figures make.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "benchmarks"
OUT = ROOT / "docs" / "_generated"


def _bench_plots():
    spec = importlib.util.spec_from_file_location(
        "bench_plots", ROOT / "docs" / "_scripts" / "bench_plots.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(methods: list[str], repeats: int) -> None:
    for method in methods:
        out = DATA / f"pool_{method}.json"
        command = [sys.executable, str(ROOT / "benchmarks" / "bench_pool.py")]
        command += ["--start-method", method, "--repeats", str(repeats), "--json", str(out)]
        print("$", " ".join(command), file=sys.stderr)
        subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="run bench_pool.py first")
    parser.add_argument(
        "--start-methods", default="fork,forkserver", help="for --measure (comma-separated)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="for --measure")
    args = parser.parse_args()
    if args.measure:
        measure(args.start_methods.split(","), args.repeats)
    plots = _bench_plots()
    for path in plots.build(str(DATA), str(OUT)):
        print(path)
    print(plots.write_headline(str(DATA)))


if __name__ == "__main__":
    main()
