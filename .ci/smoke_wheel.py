"""Smoke test of the installed wheel, run from outside the checkout by .ci/run: the package
imports from site-packages, spawn and a Pool work, an array is shared under both
strategies (the cleanup daemon, run by path, must be in the wheel), and the command line
answers."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import procspawn
from procspawn import sharing


def _fill(rank: int, array: np.ndarray) -> int:
    array[rank] = rank + 1
    return rank


def _square(x: int) -> int:
    return x * x


def main() -> None:
    where = os.path.dirname(procspawn.__file__)
    assert "site-packages" in where, f"procspawn imported from {where}, not the wheel"
    assert os.path.isfile(os.path.join(where, "py.typed")), "py.typed is not in the wheel"
    for strategy in sharing.get_all_sharing_strategies():
        sharing.set_sharing_strategy(strategy)
        array = sharing.zeros(4)
        assert procspawn.spawn(_fill, args=(array,), nprocs=2) == [0, 1]
        assert array.tolist() == [1.0, 2.0, 0.0, 0.0], (strategy, array)
    with procspawn.Pool(2) as pool:
        assert pool.map(_square, range(10)) == [x * x for x in range(10)]
    with procspawn.ProcessPoolExecutor(2) as executor:
        assert list(executor.map(_square, range(5))) == [0, 1, 4, 9, 16]
    cli = os.path.join(os.path.dirname(sys.executable), "procspawn")
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True)
    assert procspawn.__version__ in out.stdout, out.stdout
    print(f"wheel smoke test: procspawn {procspawn.__version__} from {where}: ok")


if __name__ == "__main__":
    main()
