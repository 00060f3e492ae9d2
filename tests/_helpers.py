"""Module-level worker functions (rank functions children import by name, under every start
method), crash objects and script runners shared by the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def square(rank, offset=0):
    return rank * rank + offset


def identity(rank, *args):
    return args


def sleep_then_return(rank, seconds):
    time.sleep(seconds)
    return rank


def big_result(rank, nbytes):
    return bytes([rank]) * nbytes


def fail_if_rank(rank, bad_rank, delay=0.0):
    if rank == bad_rank:
        time.sleep(delay)
        raise ValueError(f"rank {rank} failed on purpose")
    time.sleep(60)
    return rank


class Boom(Exception):
    """A custom exception type, to check it comes back as the cause."""

    def __init__(self, code):
        super().__init__(f"boom {code}")
        self.code = code

    def __reduce__(self):
        return (Boom, (self.code,))


def crash(rank, how):
    if how == "raise":
        raise Boom(rank)
    if how == "sys_exit":
        sys.exit(3)
    if how == "os_exit":
        os._exit(4)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "keyboard_interrupt":
        raise KeyboardInterrupt
    if how == "unpicklable_result":
        return threading.Lock()
    time.sleep(60)


def _fail_to_unpickle():
    raise RuntimeError("cannot rebuild this argument")


class BreaksInChild:
    """Pickles fine, fails when the child unpickles it."""

    def __reduce__(self):
        return (_fail_to_unpickle, ())


def nested(rank, start_method):
    import procspawn

    return procspawn.spawn(square, args=(rank,), nprocs=2, start_method=start_method)


def queue_and_event(rank, queue, event, lock):
    with lock:
        queue.put(rank)
    event.wait(30)
    return rank


def pipe_writer(rank, conn):
    conn.send(("hello", rank))
    conn.close()
    return rank


def leave_grandchild(rank, pid_file, code):
    """Fork a grandchild that holds every descriptor this rank inherited (its channel,
    its output pipes, the Process sentinel's write end) for 60 s, then return or exit."""
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    with open(f"{pid_file}.{rank}", "w") as f:
        f.write(str(child))
    if code:
        os._exit(code)
    return rank


def array_sum(rank, array):
    return float(array.sum())


def add_rank_in_place(rank, array):
    array[rank] += rank + 1
    return None


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
    import procspawn

    for _ in range(steps):
        procspawn.progress()
    return rank


def write_into(rank, model):
    model.layers[0]["w"][rank] = rank + 1
    model.layers[1][0][rank] = -(rank + 1)
    model.by_name["b"][rank] = 100 + rank


def sleep_forever(rank):
    time.sleep(120)


def running(pid: int) -> bool:
    """Running, as /proc shows it (a zombie is dead: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (ESRCH: being reaped as we read)
        return False


def script_env() -> dict:
    """The environment for a script run as a user would run it: the repository on the
    path, everything else as it is."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_script(
    code: str,
    timeout: float = 60,
    env_extra: dict | None = None,
    args: list[str] | None = None,
    **kwargs,
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the repository on sys.path (``args``:
    its ``sys.argv[1:]``)."""
    env = script_env()
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", code, *(args or [])],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


def run_file(
    path: str, timeout: float = 80, args: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run the script file ``path`` in a fresh interpreter, as ``python path`` (its main
    module is a file the children of spawn and forkserver import again); ``args``: its
    ``sys.argv[1:]``."""
    return subprocess.run(
        [sys.executable, str(path), *(args or [])],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=script_env(),
    )


def run_stdin_script(code: str, timeout: float = 80) -> subprocess.CompletedProcess:
    """Run ``code`` fed on stdin (``python -``), as a user piping a script would."""
    return subprocess.run(
        [sys.executable, "-"],
        input=code,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=script_env(),
        cwd=ROOT,
    )


def make_array(kind: str) -> np.ndarray:
    """Arrays of every dtype and layout the sharing path must bring back exactly."""
    rng = np.random.default_rng(0)
    if kind == "float64":
        return rng.random((300, 200))
    if kind == "float16":
        return rng.random(50_000).astype(np.float16)
    if kind == "complex":
        return (rng.random(40_000) + 1j * rng.random(40_000)).astype(np.complex128)
    if kind == "bool":
        return rng.random(100_000) > 0.5
    if kind == "datetime":
        return np.arange(20_000).astype("datetime64[s]")
    if kind == "structured":
        dt = np.dtype([("x", "<f8"), ("n", "<i4"), ("tag", "S3")])
        a = np.zeros(10_000, dtype=dt)
        a["x"] = np.arange(10_000) / 3
        a["n"] = np.arange(10_000)
        a["tag"] = b"abc"
        return a
    if kind == "fortran":
        return np.asfortranarray(rng.random((256, 128)))
    if kind == "noncontiguous":
        return rng.random((400, 300))[::3, ::-2]
    if kind == "zero_d":
        return np.array(3.5)
    if kind == "zero_size":
        return np.zeros((0, 5))
    if kind == "readonly":
        a = rng.random(20_000)
        a.flags.writeable = False
        return a
    if kind == "object":
        return np.array([{"a": 1}, "x", None], dtype=object)
    if kind == "small":
        return np.arange(10, dtype=np.int32)
    raise ValueError(kind)


ARRAY_KINDS = [
    "float64",
    "float16",
    "complex",
    "bool",
    "datetime",
    "structured",
    "fortran",
    "noncontiguous",
    "zero_d",
    "zero_size",
    "readonly",
    "object",
    "small",
]


class CountingStrategy:
    """A user-written strategy built on the public API: memfd segments, fds sent along."""

    def __new__(cls):
        from procspawn import sharing

        class _Counting(sharing.SharingStrategy):
            allocated = 0

            def allocate(self, nbytes):
                type(self).allocated += 1
                fd = os.memfd_create("custom-test")
                os.ftruncate(fd, nbytes)
                return sharing.Segment.map(
                    fd,
                    nbytes,
                    strategy=self.name,
                    key=("custom", os.fstat(fd).st_ino),
                    keep_fd=True,
                )

            def reduce(self, segment):
                return (sharing.attach_fd(segment.fd, segment), segment.size, segment.key)

            def rebuild(self, handle):
                index, size, key = handle
                fd = os.dup(sharing.received_fd(index))
                return sharing.Segment.map(fd, size, strategy=self.name, key=key, keep_fd=True)

        return _Counting()
