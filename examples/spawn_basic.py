"""procspawn in one page: ranks, shared arrays, results and errors.

Run: python examples/spawn_basic.py
"""

import numpy as np

import procspawn as mp
from procspawn import sharing


def train(rank, weights, data):
    # Hogwild-style: every rank writes into the same shared weights, no copy anywhere.
    rows = data[rank::4]
    weights[rank] = rows.mean()
    return {"rank": rank, "rows": len(rows), "shared": sharing.is_shared(data)}


def flaky(rank):
    if rank == 2:
        raise ValueError("rank 2 found bad data")
    return rank


def main():
    weights = sharing.zeros(4)  # lives in shared memory from the start
    data = np.arange(1_000_000, dtype=np.float64)  # copied into shared memory once
    results = mp.spawn(train, args=(weights, data), nprocs=4)
    for r in results:
        print("result:", r)
    print("weights written by the ranks:", weights)
    assert np.allclose(weights, [data[r::4].mean() for r in range(4)])

    # a lambda works too (pickled with cloudpickle)
    print("squares:", mp.spawn(lambda rank: rank * rank, nprocs=3))

    # the first failure stops the siblings and tells you exactly what went wrong
    try:
        mp.spawn(flaky, nprocs=4)
    except mp.ProcessRaisedException as err:
        print(f"rank {err.error_index} (pid {err.pid}) failed; its exception:", repr(err.__cause__))


if __name__ == "__main__":
    main()
