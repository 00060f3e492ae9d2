"""Module-level task functions for the pool tests (importable by workers under spawn)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import numpy as np


def square(x):
    return x * x


def add(x, y):
    return x + y


def slow_square(x, seconds=0.05):
    time.sleep(seconds)
    return x * x


def sleep_forever(x):
    time.sleep(600)
    return x


def die(how: str) -> None:
    """End this process the way a task can: a signal, os._exit, a segfault."""
    sys.stderr.write(f"last words of pid {os.getpid()} before {how}\n")
    sys.stderr.flush()
    if how == "sigkill":  # as the OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "os_exit":
        os._exit(3)
    elif how == "segfault":
        ctypes.string_at(0)  # a real SIGSEGV, not a signal sent
    elif how == "sys_exit":
        sys.exit(5)
    time.sleep(60)


def maybe_die(x, bad, how, pause=0.0):
    """x * x, except that the task with x == bad kills its worker."""
    if x == bad:
        time.sleep(pause)
        die(how)
    return x * x


def pid_of(_=None):
    return os.getpid()


def array_sum(a):
    return float(a.sum())


def make_array(n):
    return np.full(n, 7.0)


def raise_value_error(x):
    raise ValueError(f"bad value {x}")


def interrupt_on(x, bad):
    if x == bad:
        raise KeyboardInterrupt(f"the task's own, at {x}")
    return x


def interrupt_or_touch(x, path):
    if x == 0:
        raise KeyboardInterrupt("the task's own, at 0")
    time.sleep(0.3)
    with open(path, "w"):
        return x


def return_generators():
    return [(i for i in range(3)) for _ in range(2)]


def return_lock():
    import threading

    return threading.Lock()


class _Unrebuildable:
    def __reduce__(self):
        return (_refuse_in_parent, (os.getpid(),))


def _refuse_in_parent(worker_pid):
    if os.getpid() != worker_pid:
        raise RuntimeError("this object cannot be rebuilt outside its worker")
    return None


def return_unrebuildable():
    return _Unrebuildable()


def bad_initializer():
    raise ZeroDivisionError("the initializer failed on purpose")


def exit_initializer():
    os._exit(7)


_state = {}


def set_state(value):
    _state["value"] = value


def get_state(_=None):
    return _state.get("value")


def record_pid_and_sleep(path, seconds):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return seconds


def die_once(flag_path, x):
    """Kill this worker the first time any worker runs it (the flag file says so); then
    return x * x: a task a retry saves."""
    try:
        fd = os.open(flag_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return x * x
    os.close(fd)
    die("sigkill")


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()


_hoard = []


def resident_bytes():
    """This worker's resident memory now (under fork, what it shares with its parent too)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def grow_then_pid(nbytes):
    """Keep ``nbytes`` more resident in this worker (touched), return the pid."""
    block = bytearray(nbytes)
    block[::4096] = b"x" * len(block[::4096])
    _hoard.append(block)
    return os.getpid()


def eat_memory_in_cgroup(procs_file, nbytes):
    """Join the memory cgroup whose ``cgroup.procs`` is ``procs_file``, then touch
    ``nbytes`` of memory: more than the cgroup allows, so its OOM killer kills us."""
    with open(procs_file, "w") as f:
        f.write(str(os.getpid()))
    blocks = []
    for _ in range(nbytes >> 20):
        block = bytearray(1 << 20)
        block[::4096] = b"x" * len(block[::4096])
        blocks.append(block)
    return len(blocks)


def nested_pool_map(n):
    """A pool of its own, inside a pool's worker: its results, or the error's text."""
    import procspawn

    try:
        with procspawn.Pool(2) as pool:
            return pool.map(square, range(n))
    except RuntimeError as exc:
        return str(exc)


def nested_executor_and_spawn(n):
    import procspawn

    with procspawn.ProcessPoolExecutor(2) as ex:
        mapped = list(ex.map(square, range(n)))
    reusable = procspawn.get_reusable_executor(2, timeout=5)  # kept after the call
    return mapped, reusable.submit(square, n).result(), procspawn.spawn(add, args=(n,), nprocs=2)


def nap_then_wait_for_file(nap, path, seconds):
    """Sleep ``nap`` seconds, then ``wait_for_file``."""
    time.sleep(nap)
    return wait_for_file(path, seconds)


def wait_for_file(path, seconds):
    """Run until ``path`` exists (at most ``seconds``); its name."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.basename(path)
