"""The crash matrix, out-of-order failures, stopping siblings, spawn's timeout, the results
of finished ranks kept after a failure, Ctrl-C and parent death."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _helpers import (
    Boom,
    BreaksInChild,
    crash,
    fail_if_rank,
    identity,
    quick_or_fail,
    quick_or_slow,
    running,
    script_env,
    sleep_forever,
)

import procspawn as mp

pytestmark = pytest.mark.timeout(120)


# -- the crash matrix, out-of-order failures, stopping siblings ----------------------------

# how the rank fails -> (exception type, exit code or None, signal name, text in the message)
CRASHES = {
    "raise": (mp.ProcessRaisedException, None, None, "Boom: boom 1"),
    "sys_exit": (mp.ProcessExitedException, 3, None, "exited with exit code 3"),
    "os_exit": (mp.ProcessExitedException, 4, None, "exited with exit code 4"),
    "sigkill": (mp.ProcessExitedException, -9, "SIGKILL", "out-of-memory killer"),
    "sigsegv": (mp.ProcessExitedException, -11, "SIGSEGV", "terminated by signal SIGSEGV"),
    "sigterm": (mp.ProcessExitedException, -15, "SIGTERM", "terminated by signal SIGTERM"),
    "keyboard_interrupt": (mp.ProcessRaisedException, None, None, "KeyboardInterrupt"),
    "unpicklable_result": (mp.ProcessRaisedException, None, None, "could not be pickled"),
}


@pytest.mark.parametrize("how", sorted(CRASHES))
def test_crash_matrix(start_method, how):
    exc_type, exit_code, sig, text = CRASHES[how]

    def fn(rank):
        if rank == 1:
            return crash(rank, how)
        return rank

    with pytest.raises(exc_type) as info:
        mp.spawn(fn, nprocs=2, start_method=start_method)
    err = info.value
    assert type(err) is exc_type
    assert err.error_index == 1
    assert isinstance(err.pid, int) and err.pid > 0
    assert text in str(err)
    if exc_type is mp.ProcessRaisedException:
        assert "process 1 (pid " in str(err) and "terminated with the following error" in str(err)
        assert "Traceback (most recent call last)" in str(err)
    else:
        assert err.exit_code == exit_code
        assert err.signal_name == sig
    if how == "raise":
        assert isinstance(err.__cause__, Boom) and err.__cause__.code == 1
        assert "in crash\n    raise Boom(rank)" in str(err)


def test_error_while_unpickling_args_in_child(start_method):
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(identity, args=(BreaksInChild(),), nprocs=2, start_method=start_method)
    assert "while unpickling the arguments in the child" in str(info.value)
    assert "cannot rebuild this argument" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_exceptions_pickle():
    raised = mp.ProcessRaisedException("process 2 terminated with the following error:\nx", 2, 77)
    exited = mp.ProcessExitedException("msg", 1, 88, -9, "SIGKILL")
    again = pickle.loads(pickle.dumps(raised))
    assert (type(again), str(again), again.error_index, again.pid) == (
        mp.ProcessRaisedException,
        str(raised),
        2,
        77,
    )
    again = pickle.loads(pickle.dumps(exited))
    assert (again.error_index, again.pid, again.exit_code, again.signal_name) == (
        1,
        88,
        -9,
        "SIGKILL",
    )
    assert issubclass(mp.ProcessRaisedException, mp.ProcessException)
    assert issubclass(mp.ProcessException, Exception)


def test_first_failure_out_of_order_stops_sleeping_sibling(start_method):
    # rank 0 sleeps 60 s; rank 1 fails at once: the error must not wait for rank 0
    ctx = mp.spawn(fail_if_rank, args=(1,), nprocs=3, join=False, start_method=start_method)
    pids = ctx.pids()
    started = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose") as info:
        ctx.join(grace_period=5)
    assert info.value.error_index == 1
    assert time.monotonic() - started < 30  # far below rank 0's 60 s sleep
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert all(p.exitcode is not None for p in ctx.processes)
    # the siblings were stopped by SIGTERM (they had no reason to ignore it)
    assert ctx.processes[0].exitcode == -signal.SIGTERM
    with pytest.raises(mp.ProcessRaisedException):
        ctx.join()  # the failure is sticky


def test_sibling_ignoring_sigterm_is_killed_after_grace():
    def fn(rank):
        if rank == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(60)
        time.sleep(0.5)
        raise ValueError("late failure")

    ctx = mp.spawn(fn, nprocs=2, join=False)
    with pytest.raises(mp.ProcessRaisedException, match="late failure"):
        ctx.join(grace_period=0.5)
    assert ctx.processes[0].exitcode == -signal.SIGKILL


def test_grace_period_env_is_checked(monkeypatch):
    from procspawn import _settings

    monkeypatch.setenv("PROCSPAWN_GRACE_PERIOD", "soon")
    _settings.reload("PROCSPAWN_GRACE_PERIOD")  # read once: a program that changes it says so
    # refused before any rank starts (it was found only when a join needed it)
    with pytest.raises(mp.SettingError, match="PROCSPAWN_GRACE_PERIOD='soon' is not valid"):
        mp.spawn(identity, nprocs=1, join=False)
    monkeypatch.delenv("PROCSPAWN_GRACE_PERIOD")
    _settings.reload("PROCSPAWN_GRACE_PERIOD")
    ctx = mp.spawn(identity, nprocs=1, join=False)
    assert ctx.join(60) is True


# -- spawn(timeout=...); the results of finished ranks kept after a failure ----------------


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
def test_results_already_sent_are_kept_when_another_rank_failed():
    ctx = mp.spawn(quick_or_fail, args=(0, 0.0), nprocs=3, join=False)
    for p in ctx.processes:  # every rank has exited and sent what it sends
        p.join(30)
    with pytest.raises(mp.ProcessRaisedException) as info:
        ctx.join()
    assert info.value.error_index == 0
    assert info.value.results == [None, 10, 20]
    assert ctx.results == [None, 10, 20]


# -- parent death and Ctrl-C ---------------------------------------------------------------


def _script(body: str) -> str:
    return textwrap.dedent(body)


def _wait_gone(pids, seconds=15.0):
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if running(pid)]
        time.sleep(0.05)
    return alive


def _start_parent(tmp_path, start_method, extra=""):
    pidfile = tmp_path / "pids"
    code = _script(
        f"""
        import os, sys, time
        import procspawn as mp

        def work(rank, path):
            with open(path + str(rank), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)

        if __name__ == "__main__":
            {extra}
            mp.spawn(work, args=({str(pidfile)!r},), nprocs=2, start_method={start_method!r})
        """
    )
    script = tmp_path / "parent.py"
    script.write_text(code)
    env = script_env()
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    paths = [tmp_path / f"pids{r}" for r in range(2)]
    while time.monotonic() < deadline:
        if all(p.exists() and p.read_text() for p in paths):
            break
        time.sleep(0.05)
    else:
        proc.kill()
        proc.communicate()
        pytest.fail("the ranks did not start")
    return proc, [int(p.read_text()) for p in paths]


def test_children_die_with_sigkilled_parent(tmp_path, start_method):
    proc, pids = _start_parent(tmp_path, start_method)
    proc.kill()
    proc.communicate()
    assert _wait_gone(pids) == [], "ranks outlived their SIGKILLed parent"


def test_ctrl_c_in_parent_stops_children_and_reraises(tmp_path, start_method):
    proc, pids = _start_parent(tmp_path, start_method)
    proc.send_signal(signal.SIGINT)  # the parent only, as a worst case of Ctrl-C
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert _wait_gone(pids, 1.0) == []


# -- stopping the ranks on the user's error or Ctrl-C, never cut short ---------------------


@pytest.mark.timeout(60)
def test_leaving_the_with_block_stops_the_ranks():
    with pytest.raises(RuntimeError, match="user loop failed"):
        with mp.spawn(sleep_forever, nprocs=2, join=False, grace_period=0.5) as ctx:
            pids = ctx.pids()
            raise RuntimeError("user loop failed")
    for pid in pids:
        # stopped and reaped: neither running nor a zombie
        assert not os.path.exists(f"/proc/{pid}"), f"rank pid {pid} is left: {_state(pid)}"


def _state(pid):
    """The process state letter of ``pid`` (``Z``: a zombie), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # (ESRCH: being reaped as we read)
        return "gone"


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
    # killed: gone, or a zombie reparented to this test process (a subreaper) until reaped
    assert _state(rank1) in ("gone", "Z"), f"rank 1 (pid {rank1}) is still running"


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


# -- remote tracebacks ---------------------------------------------------------------------


MAIN_SCRIPT_ERROR = """
import sys
import procspawn as mp


def helper(x):
    return 1 / x


def work(rank):
    return helper(rank)


if __name__ == "__main__":
    if sys.argv[1] == "spawn":
        mp.spawn(work, nprocs=1)
    else:
        with mp.Pool(1) as pool:
            pool.apply(work, (0,))
"""


@pytest.mark.parametrize("how", ["spawn", "pool"])
def test_a_remote_traceback_shows_the_main_script_s_file_and_lines(tmp_path, how):
    # Functions of the main script travel by value; their traceback in the parent still
    # names the script's file and shows its lines, as without procspawn.
    script = tmp_path / "main_script.py"
    script.write_text(MAIN_SCRIPT_ERROR)
    result = subprocess.run(
        [sys.executable, str(script), how],
        capture_output=True,
        text=True,
        timeout=60,
        env=script_env(),
    )
    assert result.returncode == 1
    assert "<dynamic-code>" not in result.stderr
    assert f'File "{script}", line 7, in helper\n    return 1 / x' in result.stderr, result.stderr
    assert f'File "{script}", line 11, in work\n    return helper(rank)' in result.stderr


def test_the_oom_kill_count_is_the_kernels():
    """What a SIGKILL's verdict compares: /proc/vmstat's oom_kill, read in one call."""
    from procspawn.context._watch import oom_kills

    with open("/proc/vmstat") as f:
        fields = dict(line.split() for line in f if line.strip())
    if "oom_kill" not in fields:
        assert oom_kills() is None
    else:
        assert oom_kills() == int(fields["oom_kill"])
