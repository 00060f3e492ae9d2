"""Rank functions for bench_spawn.py, in a module that spawn children can import.

It imports numpy on purpose: every procspawn child imports numpy, so the plain
multiprocessing children of the stdlib column pay for the same import.
"""

import os
import sys
import time

import numpy  # noqa: F401  (imported for its start-up cost, see above)


def return_rank(rank: int) -> int:
    """The trivial rank: return the rank."""
    return rank


def raise_stamped(rank: int, stamp_path: str) -> None:
    """Write ``time.time()`` to ``stamp_path``, then raise at once.

    stderr goes to /dev/null first: a plain multiprocessing child prints the traceback,
    which would clutter the benchmark output (it is still formatted and written).
    """
    sys.stderr = open(os.devnull, "w")  # kept open until the process exits
    stamp = time.time()
    with open(stamp_path, "w") as out:
        out.write(repr(stamp))
    raise RuntimeError(f"benchmark raise in rank {rank} at {stamp!r}")
