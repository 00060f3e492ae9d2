"""Polling running ranks yourself: progress, a rank failing midway, the error handled.

``spawn(..., join=False)`` returns a ``ProcessContext`` at once. Here the parent polls it
with ``join(timeout)`` while it draws its own status line from the ranks' progress
counters, and one rank fails halfway through. The failure arrives as a
``ProcessRaisedException`` naming the rank, its pid and its traceback; the other ranks
have been stopped by then, and the results of ranks that had finished are kept.

Run: python examples/join_false.py [--quick]
"""

import argparse
import time

import procspawn


def simulate(rank, steps, fail_rank, pause):
    """A rank's work: `steps` steps; rank `fail_rank`, slower than the others, hits a bad
    input halfway, after the others have finished."""
    for step in range(steps):
        time.sleep(pause * (3 if rank == fail_rank else 1))
        if rank == fail_rank and step == steps // 2:
            raise ValueError(f"bad input at step {step}")
        procspawn.progress()
    return f"rank {rank} finished {steps} steps"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a short run for the tests")
    args = parser.parse_args()
    steps, pause = (40, 0.005) if args.quick else (200, 0.01)
    fail_rank = args.ranks - 1
    bar = procspawn.Progress(steps * args.ranks, show=False)
    with procspawn.spawn(
        simulate,
        args=(steps, fail_rank, pause),
        nprocs=args.ranks,
        join=False,
        progress=bar,
        grace_period=1.0,
    ) as ctx:
        try:
            while not ctx.join(timeout=0.2):
                print(f"  {ctx.progress.count}/{bar.total} steps, by rank {bar.counts}")
        except procspawn.ProcessRaisedException as err:
            print(f"rank {err.error_index} (pid {err.pid}) failed; its error:")
            print(err.__cause__.__class__.__name__, err.__cause__)
            print("traceback from the rank:")
            print(str(err).split("\n", 1)[1].rstrip())
            done = [r for r, value in enumerate(err.results) if value is not None]
            print(f"ranks that had finished and kept their results: {done}")
            for value in err.results:
                if value is not None:
                    print("  ", value)
        else:
            print("every rank finished:", ctx.results)


if __name__ == "__main__":
    main()
