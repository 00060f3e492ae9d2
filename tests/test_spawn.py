"""spawn() / start_processes() / ProcessContext: the happy paths, argument checks, the ranks'
environment, terminate() and a context dropped unclosed."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import textwrap
import threading
import time

import pytest
from _helpers import (
    big_result,
    identity,
    leave_grandchild,
    nested,
    pipe_writer,
    queue_and_event,
    quick_or_slow,
    rank_environment,
    run_file,
    running,
    scaled,
    sleep_then_return,
    square,
)

import procspawn as mp
from procspawn.context import _process_context

pytestmark = pytest.mark.timeout(120)


def test_results_by_rank(start_method):
    assert mp.spawn(square, args=(1,), nprocs=4, start_method=start_method) == [1, 2, 5, 10]


def test_start_processes_is_spawn(start_method):
    assert mp.start_processes(square, nprocs=2, start_method=start_method) == [0, 1]


def test_lambda_and_closure(start_method):
    factor = 7
    assert mp.spawn(lambda rank: rank * factor, nprocs=3, start_method=start_method) == [0, 7, 14]

    def inner(rank, text):
        return f"{text}{rank}{factor}"

    assert mp.spawn(inner, args=("r",), nprocs=2, start_method=start_method) == ["r07", "r17"]


def test_function_defined_in_main_script(tmp_path):
    from _helpers import run_script

    code = (
        "import procspawn as mp\n"
        "def work(rank, x):\n"
        "    return rank + x\n"
        "if __name__ == '__main__':\n"
        "    print(mp.spawn(work, args=(10,), nprocs=2))\n"
    )
    script = tmp_path / "main_script.py"
    script.write_text(code)
    result = run_script(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[10, 11]"


def test_join_false_returns_context(start_method):
    ctx = mp.spawn(sleep_then_return, args=(0.2,), nprocs=2, join=False, start_method=start_method)
    assert isinstance(ctx, mp.ProcessContext)
    assert len(ctx.pids()) == 2 and all(isinstance(pid, int) for pid in ctx.pids())
    assert len(ctx.processes) == 2
    with pytest.raises(RuntimeError, match="join"):
        _ = ctx.results
    assert ctx.join() is True
    assert ctx.results == [0, 1]
    assert ctx.join() is True  # again, after success


def test_join_timeout_false_then_true():
    ctx = mp.spawn(sleep_then_return, args=(0.6,), nprocs=2, join=False)
    assert ctx.join(timeout=0.05) is False
    assert ctx.join(timeout=0) is False
    assert ctx.join(timeout=60) is True
    assert ctx.results == [0, 1]


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, "2", None, True])
def test_bad_nprocs(nprocs):
    with pytest.raises(ValueError, match="nprocs must be an int >= 1"):
        mp.spawn(square, nprocs=nprocs)


def test_not_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        mp.spawn(42, nprocs=1)


def test_args_not_a_tuple():
    with pytest.raises(TypeError, match="args must be a tuple"):
        mp.spawn(square, args=5, nprocs=1)


def test_unknown_start_method():
    with pytest.raises(ValueError, match="unknown start method 'threads'.*spawn"):
        mp.spawn(square, nprocs=1, start_method="threads")


def test_unpicklable_argument_fails_in_parent(start_method):
    before = set(multiprocessing.active_children())
    lock = threading.Lock()
    with pytest.raises(pickle.PicklingError, match=r"args\[1\] \(of type _thread.lock\)") as info:
        mp.spawn(identity, args=(1, lock), nprocs=2, start_method=start_method)
    assert "No process was started" in str(info.value)
    assert set(multiprocessing.active_children()) == before


def test_large_results_do_not_deadlock(start_method):
    nbytes = 50 * 1024 * 1024
    results = mp.spawn(big_result, args=(nbytes,), nprocs=2, start_method=start_method)
    assert [len(r) for r in results] == [nbytes, nbytes]
    assert results[1][:3] == b"\x01\x01\x01"


def test_nested_spawn(start_method):
    # a rank starts ranks of its own (non-daemonic ranks may)
    assert mp.spawn(nested, args=(start_method,), nprocs=2, start_method=start_method) == [
        [0, 1],
        [1, 2],
    ]


def test_multiprocessing_objects_in_args(start_method):
    ctx_mp = multiprocessing.get_context(start_method)
    queue = ctx_mp.Queue()
    event = ctx_mp.Event()
    lock = ctx_mp.Lock()
    ctx = mp.spawn(
        queue_and_event, args=(queue, event, lock), nprocs=3, join=False, start_method=start_method
    )
    got = sorted(queue.get(timeout=30) for _ in range(3))
    event.set()
    assert ctx.join(timeout=60) is True
    assert got == [0, 1, 2]
    assert ctx.results == [0, 1, 2]
    queue.close()
    queue.join_thread()


@pytest.mark.timeout(90)
def test_the_top_level_primitives_go_to_ranks_under_the_default_start_method(tmp_path):
    """``mp.Lock()``, ``mp.Barrier()``... as a user of ``import procspawn as mp`` writes
    them: made by procspawn's default context, they go to its ranks (the stdlib's default
    context made them for fork, and procspawn's fork server refused them). A script: the
    stdlib keeps the heap arena of ``Value``/``Array`` for the life of the process."""
    script = tmp_path / "primitives.py"
    script.write_text(
        textwrap.dedent(
            """
            import procspawn as mp

            def work(rank, barrier, value, array, condition, semaphore, event, rlock):
                barrier.wait(30)  # every rank got here
                with value.get_lock():
                    value.value += 1
                with semaphore:
                    array[rank] = rank + 1
                with condition:
                    condition.notify_all()
                if rank == 0:
                    with rlock, rlock:
                        event.set()
                return rank

            if __name__ == "__main__":
                assert mp.get_start_method() == "forkserver"
                event = mp.Event()
                value, array = mp.Value("i", 0), mp.Array("i", 2)
                args = (mp.Barrier(2), value, array, mp.Condition(mp.Lock()),
                        mp.BoundedSemaphore(1), event, mp.RLock())
                print(mp.spawn(work, args=args, nprocs=2), value.value, list(array),
                      event.is_set())
            """
        )
    )
    result = run_file(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 1] 2 [1, 2] True"


def test_pipe_in_args(start_method):
    ctx_mp = multiprocessing.get_context(start_method)
    reader, writer = ctx_mp.Pipe(duplex=False)
    assert mp.spawn(pipe_writer, args=(writer,), nprocs=1, start_method=start_method) == [0]
    writer.close()
    assert reader.recv() == ("hello", 0)
    reader.close()


def test_sys_exit_zero_is_success():
    import sys

    assert mp.spawn(lambda rank: sys.exit(0), nprocs=2) == [None, None]


def test_results_arrive_in_rank_order_whatever_finishes_first():
    def work(rank):
        time.sleep(0.3 * (2 - rank))
        return rank

    assert mp.spawn(work, nprocs=3) == [0, 1, 2]


def _announce_then_wait(rank, up, go):
    up.put(rank)
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:  # (a file: an Event's
        time.sleep(0.01)  # set() would wait for a waiter killed in it)
    return rank


def test_ranks_started_from_a_thread_outlive_the_thread(start_method, tmp_path):
    # the kernel's parent-death signal follows the forking *thread*: it must not be used there
    box = {}
    ctx = mp.get_context(start_method)
    up, go = ctx.SimpleQueue(), tmp_path / "go"

    def starter():
        box["ctx"] = mp.spawn(
            _announce_then_wait, args=(up, str(go)), nprocs=2, join=False, start_method=start_method
        )
        assert sorted([up.get(), up.get()]) == [0, 1]  # up (the signal would be armed)

    thread = threading.Thread(target=starter)
    thread.start()
    thread.join()
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + 10
    while os.path.exists(task) and time.monotonic() < deadline:  # gone in the kernel too
        time.sleep(0.01)
    assert not os.path.exists(task)
    time.sleep(0.1)  # a signal sent as it went has reached the ranks
    go.touch()
    assert box["ctx"].join(timeout=60) is True
    assert box["ctx"].results == [0, 1]


@pytest.mark.timeout(60)
def test_terminate_from_another_thread_during_join_is_not_a_failure(start_method):
    ctx = mp.spawn(sleep_then_return, args=(30,), nprocs=2, join=False, start_method=start_method)
    outcome = []

    def joiner():
        try:
            outcome.append(ctx.join(timeout=40))
        except BaseException as exc:  # what the test is about: no ProcessExitedException
            outcome.append(exc)

    thread = threading.Thread(target=joiner)
    thread.start()
    time.sleep(0.3)  # the joiner is waiting
    ctx.terminate(grace_period=5)
    thread.join(20)
    assert not thread.is_alive()
    assert outcome == [True]
    assert ctx.results == [None, None]
    assert all(p.exitcode is not None for p in ctx.processes)
    assert ctx.join() is True  # and later joins too


@pytest.mark.timeout(60)
def test_a_context_dropped_while_its_ranks_run_stops_them(start_method):
    """Nothing can join them or read their results any more, and their output goes with
    the context: they are stopped, as terminate() would, not left running (the program's
    exit waited for them, and a rank that printed died of a broken pipe)."""
    ctx = mp.spawn(sleep_then_return, args=(30,), nprocs=2, join=False, start_method=start_method)
    pids = ctx.pids()
    with pytest.warns(ResourceWarning, match="dropped while 2 of its ranks ran"):
        del ctx
        gc.collect()
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(running(pid) for pid in pids)


def _kill_listed(pid_file, nprocs):
    import os
    import signal

    for rank in range(nprocs):
        try:
            with open(f"{pid_file}.{rank}") as f:
                os.kill(int(f.read()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "start_method, code",
    [("fork", 0), ("fork", 3), ("spawn", 3), ("forkserver", 3)],  # (spawn's sentinel: fork's)
)
def test_a_grandchild_holding_a_ranks_pipes_does_not_hold_up_join(
    tmp_path, start_method, code, monkeypatch
):
    """A rank's exit is seen by its pidfd, not by EOF on pipes a grandchild it forked
    still holds (the grandchild sleeps 60 s: the suite's timeout would catch a wait).
    The output's drain (how long the last words of a rank are waited for, bounded) is
    the default in the failing fork cell, shortened in the others."""
    if (start_method, code) != ("fork", 3):
        monkeypatch.setattr(_process_context, "_OUTPUT_DRAIN", 0.2)
    pid_file = str(tmp_path / "grandchild")
    began = time.monotonic()
    try:
        if code:
            with pytest.raises(mp.ProcessExitedException, match="exit code 3"):
                mp.spawn(
                    leave_grandchild, args=(pid_file, code), nprocs=2, start_method=start_method
                )
        else:
            out = mp.spawn(
                leave_grandchild, args=(pid_file, 0), nprocs=2, start_method=start_method
            )
            assert out == [0, 1]
        assert time.monotonic() - began < 30  # not the grandchild's 60 s
    finally:
        _kill_listed(pid_file, 2)


# -- spawn(kwargs=...), argument checks, PROCSPAWN_START_METHOD ----------------------------


@pytest.mark.timeout(60)
def test_kwargs_reach_fn(start_method):
    out = mp.spawn(
        scaled, args=(5,), kwargs={"scale": 3, "shift": 1}, nprocs=2, start_method=start_method
    )
    assert out == [16, 19]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kwargs, message",
    [([("scale", 3)], "kwargs must be a dict"), ({1: 2}, "kwargs keys must be strings")],
)
def test_bad_kwargs_is_a_type_error_before_anything_starts(kwargs, message):
    with pytest.raises(TypeError, match=message):
        mp.spawn(scaled, args=(1,), kwargs=kwargs, nprocs=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options, message",
    [
        ({"timeout": 0}, "timeout must be a number of seconds > 0"),
        ({"timeout": "5"}, "timeout must be a number"),
        ({"timeout": 5, "join": False}, "timeout applies to join=True"),
        ({"grace_period": -1}, "grace_period must be a number of seconds >= 0"),
    ],
)
def test_bad_timeout_or_grace_period(options, message):
    with pytest.raises(ValueError, match=message):
        mp.spawn(scaled, args=(1,), nprocs=1, **options)


def _read_first_line(rank, f):
    return f.readline()


@pytest.mark.timeout(60)
def test_an_open_file_in_args_is_refused_like_the_stdlib(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("line\n")
    with open(path) as f:
        with pytest.raises(pickle.PicklingError, match=r"args\[0\].*open file"):
            mp.spawn(_read_first_line, args=(f,), nprocs=1)
    with open(path) as f:
        q = mp.get_context("spawn").Queue()
        try:
            with pytest.raises(pickle.PicklingError, match="Send its path"):
                q.put(f)
        finally:
            q.close()
            q.join_thread()


@pytest.mark.timeout(60)
def test_start_method_from_the_environment(monkeypatch):
    from procspawn import _settings

    monkeypatch.setenv("PROCSPAWN_START_METHOD", "fork")
    _settings.reload("PROCSPAWN_START_METHOD")  # read once: a program that changes it says so
    ctx = mp.spawn(scaled, args=(1,), nprocs=1, join=False)
    assert type(ctx.processes[0]).__name__ == "ForkProcess"
    ctx.join()
    monkeypatch.setenv("PROCSPAWN_START_METHOD", "threads")
    _settings.reload("PROCSPAWN_START_METHOD")
    with pytest.raises(ValueError, match="PROCSPAWN_START_METHOD='threads'"):
        mp.spawn(scaled, args=(1,), nprocs=1)


# -- the ranks' environment ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ranks_have_torchrun_environment(start_method):
    out = mp.spawn(rank_environment, nprocs=2, start_method=start_method)
    assert out == [
        {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        for r in range(2)
    ]


# -- ProcessContext: terminate(), a context dropped unclosed -------------------------------


@pytest.mark.timeout(60)
def test_terminate_stops_running_ranks():
    ctx = mp.spawn(quick_or_slow, args=([1], 60), nprocs=2, join=False)
    deadline = time.monotonic() + 30
    while ctx.processes[0].exitcode is None and time.monotonic() < deadline:
        ctx.join(timeout=0.1)
    ctx.terminate(grace_period=0.5)
    assert all(p.exitcode is not None for p in ctx.processes)
    assert ctx.processes[1].exitcode == -signal.SIGTERM
    assert ctx.join() is True
    assert ctx.results == [0, None]
    ctx.terminate()  # idempotent


@pytest.mark.timeout(60)
def test_a_context_dropped_unclosed_releases_what_it_held():
    import gc
    import threading

    before = {t for t in threading.enumerate() if t.name == "procspawn-output"}
    ctx = mp.spawn(scaled, args=(1,), nprocs=2, join=False)
    for p in ctx.processes:  # torch-style: join the processes by hand, never the context
        p.join(30)
    del ctx, p
    gc.collect()
    deadline = time.monotonic() + 10
    while {t for t in threading.enumerate() if t.name == "procspawn-output"} - before:
        assert time.monotonic() < deadline, "the output thread outlived its context"
        time.sleep(0.05)
    # the leak check then sees no descriptor left open
