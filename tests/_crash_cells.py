"""The crash matrix, where x how: one cell crashes a rank (or a pool worker) at one place
in one way and returns what the caller saw. Used by tests/test_crash_matrix.py and by
``tests/torture.py --matrix`` (the soak)."""

from __future__ import annotations

import gc
import os
import queue as queue_mod
import signal
import sys
import threading
import time

from _leaks import children, fds, segments, shared_mappings

import procspawn as mp
from procspawn import sharing

WHERE = ("before_fn", "in_fn", "sending_result", "queue_feeder", "holding_segment", "pool_worker")
HOW = ("exception", "sys_exit", "os_exit", "sigkill", "sigsegv", "sigterm")


class CrashError(Exception):
    """What a cell raises for "exception"."""


def crash(how: str) -> None:
    if how == "exception":
        raise CrashError(f"crashed on purpose ({how})")
    if how == "sys_exit":
        sys.exit(3)
    if how == "os_exit":
        os._exit(4)
    if how == "sigsegv":
        import ctypes

        ctypes.string_at(0)  # a real segfault
    signum = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}[how]
    os.kill(os.getpid(), signum)
    time.sleep(10)  # the signal ends it first


class CrashOnLoad:
    """Crashes the process that unpickles it: a rank dies before its function runs."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self):
        return (crash, (self.how,))


class CrashOnSend:
    """Crashes the process that pickles it: a rank dies while sending its result."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __reduce__(self):
        crash(self.how)
        return (str, ())


def _rank(rank, where, how, shared, queue, _load):
    if where == "in_fn":
        crash(how)
    if where == "holding_segment":
        mine = sharing.zeros(300_000)  # a segment of its own, and the parent's mapped
        mine[0] = shared[0]
        crash(how)
    if where == "sending_result":
        return CrashOnSend(how)
    if where == "queue_feeder":
        queue.put(b"x" * (32 << 20))  # the feeder thread writes into a pipe nobody reads
        time.sleep(0.05)
        crash(how)
    return None


def _task(how, shared):
    shared[1] += 1
    crash(how)


def run_cell(where: str, how: str, grace_period: float = 1.0) -> tuple[type, float]:
    """Crash one rank (or pool worker) at ``where`` in the way ``how``; return the type of
    the error the caller got and the seconds from the call to it."""
    shared = sharing.zeros(100_000)
    shared[0] = 7
    queue = mp.Queue()
    stop = threading.Event()

    def consume() -> None:  # a reader, as a program that uses a queue has one
        while not stop.is_set():
            try:
                queue.get(timeout=0.05)
            except (queue_mod.Empty, EOFError, OSError):
                continue

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        started = time.monotonic()
        try:
            if where == "pool_worker":
                with mp.Pool(1) as pool:
                    pool.apply(_task, (how, shared))
            else:
                load = CrashOnLoad(how) if where == "before_fn" else None
                mp.spawn(_rank, args=(where, how, shared, queue, load), grace_period=grace_period)
        except Exception as exc:
            return type(exc), time.monotonic() - started
        raise AssertionError(f"{where} x {how}: the caller saw no error")
    finally:
        stop.set()
        reader.join(10)
        queue.close()
        queue.join_thread()


def snapshot() -> tuple[set, ...]:
    """What a user sees from outside: child processes, /dev/shm, descriptors, mappings."""
    return (children(), segments(), fds(), shared_mappings())


def left_after(before: tuple[set, ...], seconds: float) -> list[str]:
    """What is still there, beyond ``before``, ``seconds`` from now at the latest."""
    deadline = time.monotonic() + seconds
    collected = False
    while True:
        if collected:  # a pool's error and its traceback make a cycle, as the stdlib's do
            gc.collect()
        collected = True
        now = snapshot()
        kinds = ("processes", "/dev/shm", "descriptors", "mappings")
        left = [
            f"{k}: {sorted(n - b)}" for k, n, b in zip(kinds, now, before, strict=True) if n - b
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
