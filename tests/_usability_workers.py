"""Rank functions for test_usability (module level, so every start method finds them)."""

from __future__ import annotations

import os
import time

import procspawn


def scaled(rank, base, *, scale=1, shift=0):
    return (base + rank) * scale + shift


def rank_environment(rank):
    return {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}


def quick_or_slow(rank, slow_ranks, seconds):
    if rank in slow_ranks:
        time.sleep(seconds)
    return rank * 10


def quick_or_fail(rank, bad_rank, delay):
    if rank == bad_rank:
        time.sleep(delay)
        raise ValueError(f"rank {rank} failed on purpose")
    return rank * 10


def count_steps(rank, steps):
    for _ in range(steps):
        procspawn.progress()
    return rank


def write_into(rank, model):
    model.layers[0]["w"][rank] = rank + 1
    model.layers[1][0][rank] = -(rank + 1)
    model.by_name["b"][rank] = 100 + rank


def sleep_forever(rank):
    time.sleep(120)


def ignore_sigterm_then_sleep(rank, folder):
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(folder, f"ready{rank}"), "w").close()
    time.sleep(120)


def raise_when_ready(rank, folder, nranks):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(folder, f"ready{r}")) for r in range(1, nranks)):
            break
        time.sleep(0.02)
    raise ValueError("rank 0 fails once the others are ready")
