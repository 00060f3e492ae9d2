"""What a new user meets first: spawn's options, ProcessContext control, rank environment,
errors that explain a rank dying before ``fn``, progress, and share_memory_ on nested
objects."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _helpers import run_file, run_script, run_stdin_script, script_env
from _usability_workers import (
    count_steps,
    quick_or_fail,
    quick_or_slow,
    rank_environment,
    scaled,
    sleep_forever,
    write_into,
)

import procspawn as mp
from procspawn import sharing

# -- spawn(kwargs=..., timeout=..., grace_period=...) ------------------------------------


def test_kwargs_reach_fn(start_method):
    out = mp.spawn(
        scaled, args=(5,), kwargs={"scale": 3, "shift": 1}, nprocs=2, start_method=start_method
    )
    assert out == [16, 19]


@pytest.mark.parametrize(
    "kwargs, message",
    [([("scale", 3)], "kwargs must be a dict"), ({1: 2}, "kwargs keys must be strings")],
)
def test_bad_kwargs_is_a_type_error_before_anything_starts(kwargs, message):
    with pytest.raises(TypeError, match=message):
        mp.spawn(scaled, args=(1,), kwargs=kwargs, nprocs=2)


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


@pytest.mark.timeout(60)
def test_timeout_stops_the_ranks_still_running_and_keeps_finished_results():
    start = time.monotonic()
    with pytest.raises(mp.ProcessTimeoutError) as info:
        mp.spawn(quick_or_slow, args=([1, 2], 60), nprocs=3, timeout=2.0, grace_period=0.5)
    took = time.monotonic() - start
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, mp.ProcessException)
    assert err.ranks == [1, 2]
    assert err.error_index == 1
    assert err.elapsed >= 2.0
    assert err.results == [0, None, None]
    assert "rank(s) 1 (pid" in str(err) and "still running" in str(err)
    assert took < 30  # stopped, not waited for (60 s of sleep)
    clone = pickle.loads(pickle.dumps(err))
    assert clone.ranks == [1, 2] and clone.results == [0, None, None]


# -- results kept after a failure; terminate(); context manager --------------------------


@pytest.mark.timeout(60)
def test_results_of_finished_ranks_survive_a_failure():
    ctx = mp.spawn(quick_or_fail, args=(2, 1.0), nprocs=3, join=False)
    with pytest.raises(mp.ProcessRaisedException) as info:
        while not ctx.join(timeout=5):
            pass
    assert info.value.results == [0, 10, None]
    assert ctx.results == [0, 10, None]
    assert f"(pid {ctx.pids()[2]})" in str(info.value)  # str() names the pid


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
def test_leaving_the_with_block_stops_the_ranks():
    with pytest.raises(RuntimeError, match="user loop failed"):
        with mp.spawn(sleep_forever, nprocs=2, join=False, grace_period=0.5) as ctx:
            pids = ctx.pids()
            raise RuntimeError("user loop failed")
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) is False


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return False


# -- rank environment and output ---------------------------------------------------------


def test_ranks_have_torchrun_environment(start_method):
    out = mp.spawn(rank_environment, nprocs=2, start_method=start_method)
    assert out == [
        {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        for r in range(2)
    ]


@pytest.mark.timeout(90)
def test_prefix_output_and_stderr_pass_through(start_method):
    code = textwrap.dedent(
        f"""
        import sys
        import procspawn

        def talk(rank):
            print(f"out {{rank}}", flush=True)
            print(f"err {{rank}}", file=sys.stderr, flush=True)

        if __name__ == "__main__":
            procspawn.spawn(talk, nprocs=2, prefix_output=True, start_method={start_method!r})
            procspawn.spawn(talk, nprocs=1, start_method={start_method!r})
            print("parent done")
        """
    )
    result = run_script(code, timeout=80)
    assert result.returncode == 0, result.stderr
    out_lines = result.stdout.splitlines()
    err_lines = result.stderr.splitlines()
    assert "[rank 0] out 0" in out_lines and "[rank 1] out 1" in out_lines
    assert "[rank 0] err 0" in err_lines and "[rank 1] err 1" in err_lines
    # without prefix_output: stdout is the parent's own, stderr passes through unchanged
    assert "out 0" in out_lines and "err 0" in err_lines
    assert out_lines[-1] == "parent done"


# -- a rank that dies before fn runs -----------------------------------------------------


@pytest.mark.timeout(90)
def test_missing_main_guard_is_explained(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import procspawn\n\ndef f(rank):\n    return rank\n\nprint(procspawn.spawn(f, nprocs=2))\n"
    )
    result = run_file(script)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()
    message = result.stderr[result.stderr.rindex("ProcessExitedException") :]
    assert "exited with exit code 1" in message
    assert "its last output on stderr was:" in message
    assert '`if __name__ == "__main__":` guard' in message
    assert last  # the live stream was not swallowed: the child's traceback is there too
    assert result.stderr.count("was called while this process was still starting") >= 2


@pytest.mark.timeout(90)
def test_script_on_stdin_runs():
    code = textwrap.dedent(
        """
        import procspawn

        def f(rank):
            return rank * 7

        if __name__ == "__main__":
            print(procspawn.spawn(f, nprocs=2))
        """
    )
    result = run_stdin_script(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 7]"


# -- Ctrl-C -------------------------------------------------------------------------------


def _start_in_own_group(code):
    """A script in a process group of its own, as a terminal's job."""
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(),
        start_new_session=True,
    )


def _kill_group(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(90)
def test_double_ctrl_c_gives_one_traceback_and_runs_finally_blocks(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, sys, time
        import procspawn

        def work(rank, folder):
            try:
                open(os.path.join(folder, f"started{{rank}}"), "w").close()
                time.sleep(60)
            finally:
                time.sleep(0.3)  # a second interrupt here would cut this short
                open(os.path.join(folder, f"finally{{rank}}"), "w").close()

        if __name__ == "__main__":
            procspawn.spawn(work, args=({str(tmp_path)!r},), nprocs=2, grace_period=10)
        """
    )
    proc = _start_in_own_group(code)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "ranks did not start"
            assert proc.poll() is None
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        os.kill(proc.pid, signal.SIGINT)  # and once more to the parent (timeout -s INT)
        _, err = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    assert proc.returncode != 0
    assert all((tmp_path / f"finally{r}").exists() for r in range(2)), err
    parent_tracebacks = [line for line in err.splitlines() if line.startswith("KeyboardInterrupt")]
    assert len(parent_tracebacks) == 1, err
    assert "_stop_all" not in err and "_sigint_held" not in err, err
    # the traceback shows the user's line, and one line of procspawn's at most
    frames = [line for line in err.splitlines() if line.startswith('  File "')]
    assert frames[0].startswith('  File "<string>", line 14, in <module>'), err  # the call
    assert len([f for f in frames if "/procspawn/" in f]) <= 1, err


# -- progress -----------------------------------------------------------------------------


def test_progress_counts_by_rank(start_method):
    ctx = mp.spawn(
        count_steps,
        args=(250,),
        nprocs=2,
        join=False,
        start_method=start_method,
        progress=mp.Progress(500, show=False),
    )
    while not ctx.join(timeout=5):
        pass
    assert ctx.progress.counts == [250, 250]
    assert ctx.progress.count == 500


def _count_from_threads(rank, threads, steps):
    import threading

    def count():
        for _ in range(steps):
            mp.progress()

    workers = [threading.Thread(target=count) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)


def test_progress_from_many_threads_of_a_rank_loses_no_count():
    ctx = mp.spawn(
        _count_from_threads,
        args=(4, 20_000),
        nprocs=1,
        join=False,
        progress=mp.Progress(show=False),
    )
    while not ctx.join(timeout=30):
        pass
    assert ctx.progress.count == 80_000


def test_progress_without_a_parent_request_is_a_no_op():
    mp.progress(5)  # not in a rank, nothing asked: nothing happens
    assert mp.spawn(count_steps, args=(10,), nprocs=1) == [0]


@pytest.mark.timeout(90)
def test_progress_display_plain_and_forced():
    code = textwrap.dedent(
        """
        import procspawn

        def steps(rank):
            for _ in range(1000):
                procspawn.progress()

        if __name__ == "__main__":
            bar = procspawn.Progress(2000, show=True, per_rank=True, use_tqdm=False,
                                     desc="train")
            procspawn.spawn(steps, nprocs=2, progress=bar)
            procspawn.spawn(steps, nprocs=2, progress=2000)  # not a terminal: nothing shown
        """
    )
    result = run_script(code, timeout=80)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("train:")]
    assert lines and lines[-1].startswith("train: 2000/2000 (100.0%)"), result.stderr
    assert "r0 " in lines[-1] and "r1 " in lines[-1]
    assert result.stderr.count("2000/2000") == 1


@pytest.mark.parametrize("bad", ["10", 2.5, -1])
def test_bad_progress_argument(bad):
    with pytest.raises((TypeError, ValueError), match="progress"):
        mp.spawn(count_steps, args=(1,), nprocs=1, progress=bad)


# -- share_memory_ on nested objects, files in arguments ----------------------------------


class Model:
    pass


def test_share_memory_reaches_nested_arrays_and_ranks_write_them(start_method):
    model = Model()
    model.layers = [{"w": np.zeros(2)}, (np.zeros(2), "bias")]
    model.by_name = {"b": np.zeros(2)}
    model.myself = model  # a cycle
    model.layers.append(model.layers)  # another
    assert sharing.share_memory_(model) is model
    assert sharing.is_shared(model.layers[0]["w"])
    assert sharing.is_shared(model.layers[1][0]) and model.layers[1][1] == "bias"
    assert sharing.is_shared(model.by_name["b"])
    mp.spawn(write_into, args=(model,), nprocs=2, start_method=start_method)
    assert model.layers[0]["w"].tolist() == [1, 2]
    assert model.layers[1][0].tolist() == [-1, -2]
    assert model.by_name["b"].tolist() == [100, 101]


class Frozen:
    __slots__ = ()


def test_share_memory_refuses_what_it_cannot_share():
    with pytest.raises(TypeError, match="a tuple cannot be changed in place"):
        sharing.share_memory_((np.zeros(2),))
    with pytest.raises(TypeError, match="share_memory_ takes"):
        sharing.share_memory_(Frozen())
    holder = Model()
    holder.inner = type("P", (), {"__setattr__": _no_setattr, "w": None})()
    object.__setattr__(holder.inner, "w", np.zeros(3))
    with pytest.raises(TypeError, match="writes made by other processes would be lost"):
        sharing.share_memory_(holder)


def _no_setattr(self, name, value):
    raise AttributeError(f"{name} is read-only")


def _read_first_line(rank, f):
    return f.readline()


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


# -- PROCSPAWN_START_METHOD ---------------------------------------------------------------


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


# -- stopping is never cut short; results sent are kept; nothing held by a dropped context --


@pytest.mark.timeout(90)
def test_ctrl_c_during_the_grace_period_still_kills_and_reaps_every_rank(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, signal, sys, time
        import procspawn

        def work(rank, folder):
            if rank == 0:
                while not os.path.exists(os.path.join(folder, "ready1")):
                    time.sleep(0.02)
                raise ValueError("rank 0 fails")
            def on_term(signum, frame):  # outlive the grace period, say we got it
                open(os.path.join(folder, "got_sigterm"), "w").close()

            signal.signal(signal.SIGTERM, on_term)
            open(os.path.join(folder, f"pid{{rank}}"), "w").write(str(os.getpid()))
            os.rename(os.path.join(folder, f"pid{{rank}}"), os.path.join(folder, "ready1"))
            time.sleep(120)

        if __name__ == "__main__":
            try:
                procspawn.spawn(work, args=({str(tmp_path)!r},), nprocs=2, grace_period=60)
            except procspawn.ProcessRaisedException as err:
                print("raised", err.error_index, flush=True)
        """
    )
    proc = _start_in_own_group(code)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready1").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never ready"
            time.sleep(0.05)
        rank1 = int((tmp_path / "ready1").read_text())
        while not (tmp_path / "got_sigterm").exists():  # the parent is stopping the ranks
            assert time.monotonic() < deadline and proc.poll() is None, "no SIGTERM sent"
            time.sleep(0.05)
        time.sleep(1.5)  # later than a duplicate of one Ctrl-C: a user asking to hurry
        os.kill(proc.pid, signal.SIGINT)  # cuts the 60 s grace period short
        out, err = proc.communicate(timeout=30)
    finally:
        _kill_group(proc)
    assert out.strip() == "raised 0", err
    assert "KeyboardInterrupt" not in err, err
    assert not os.path.exists(f"/proc/{rank1}") or _is_zombie(rank1) is False


@pytest.mark.timeout(60)
def test_results_already_sent_are_kept_when_another_rank_failed():
    ctx = mp.spawn(quick_or_fail, args=(0, 0.0), nprocs=3, join=False)
    for p in ctx.processes:  # every rank has exited and sent what it sends
        p.join(30)
    with pytest.raises(mp.ProcessRaisedException) as info:
        ctx.join()
    assert info.value.error_index == 0
    assert info.value.results == [None, 10, 20]
    assert ctx.results == [None, 10, 20]


@pytest.mark.timeout(90)
def test_ctrl_c_in_the_with_block_lets_the_ranks_finally_blocks_run(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, time
        import procspawn

        def work(rank, folder):
            try:
                open(os.path.join(folder, f"started{{rank}}"), "w").close()
                time.sleep(60)
            finally:
                time.sleep(0.5)
                open(os.path.join(folder, f"finally{{rank}}"), "w").close()

        if __name__ == "__main__":
            with procspawn.spawn(work, args=({str(tmp_path)!r},), nprocs=2, join=False,
                                 grace_period=20) as ctx:
                while True:
                    time.sleep(0.05)
        """
    )
    proc = _start_in_own_group(code)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, "ranks did not start"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    assert all((tmp_path / f"finally{r}").exists() for r in range(2)), err
    assert err.count("KeyboardInterrupt") == 1, err


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


def test_a_progress_object_shows_each_run(capsys):
    bar = mp.Progress(20, show=True, use_tqdm=False, desc="steps")
    mp.spawn(count_steps, args=(10,), nprocs=2, progress=bar)
    mp.spawn(count_steps, args=(10,), nprocs=2, progress=bar)
    err = capsys.readouterr().err
    assert err.count("steps: 20/20 (100.0%)") == 2, err


# -- share_memory_: subclasses, masked arrays, slots, depth --------------------------------


class Tagged(np.ndarray):
    def __array_finalize__(self, obj):
        self.tag = getattr(obj, "tag", None)


class Slotted:
    __slots__ = ("w", "empty")

    def __init__(self):
        self.w = np.ones(4)


class Node:
    def __init__(self, nxt):
        self.nxt = nxt
        self.value = np.zeros(1)


def test_share_memory_keeps_subclasses_and_refuses_masked_arrays():
    tagged = np.arange(4.0).view(Tagged)
    tagged.tag = "weights"
    holder = {"t": tagged}
    sharing.share_memory_(holder)
    assert type(holder["t"]) is Tagged and sharing.is_shared(holder["t"])
    assert holder["t"].tag == "weights" and holder["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    masked = {"x": np.ma.masked_array([1.0, 2.0], mask=[True, False])}
    with pytest.raises(TypeError, match="masked array"):
        sharing.share_memory_(masked)
    assert type(masked["x"]) is np.ma.MaskedArray and not sharing.is_shared(masked["x"].data)


def test_share_memory_searches_slots_and_deep_structures():
    holder = {"s": Slotted()}
    sharing.share_memory_(holder)
    assert sharing.is_shared(holder["s"].w)
    chain = None
    for _ in range(3000):  # deeper than Python's recursion limit
        chain = Node(chain)
    sharing.share_memory_(chain)
    node, count = chain, 0
    while node is not None:
        assert sharing.is_shared(node.value)
        node, count = node.nxt, count + 1
    assert count == 3000
    del chain, node


@pytest.mark.timeout(90)
def test_rank_variables_are_set_before_the_main_module_is_imported_again(tmp_path):
    script = tmp_path / "main_reads_rank.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import sys
            import procspawn

            if __name__ == "__mp_main__":  # a rank importing the main module again
                folder = os.path.dirname(os.path.abspath(__file__))
                open(os.path.join(folder, f"imported_as_{os.environ.get('RANK')}"), "w").close()

            def f(rank):
                return rank

            if __name__ == "__main__":
                print(procspawn.spawn(f, nprocs=2, start_method="spawn"))
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=80,
        env={k: v for k, v in script_env().items() if k != "RANK"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 1]"
    assert sorted(p.name for p in tmp_path.glob("imported_as_*")) == [
        "imported_as_0",
        "imported_as_1",
    ]
