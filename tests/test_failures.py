"""The crash matrix, out-of-order failures, stopping siblings, Ctrl-C and parent death."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _helpers import Boom, BreaksInChild, crash, fail_if_rank, identity, script_env

import procspawn as mp

pytestmark = pytest.mark.timeout(120)

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
    ctx = mp.spawn(identity, nprocs=1, join=False)
    with pytest.raises(ValueError, match="PROCSPAWN_GRACE_PERIOD='soon' is not valid: use a"):
        ctx.join()
    monkeypatch.delenv("PROCSPAWN_GRACE_PERIOD")
    _settings.reload("PROCSPAWN_GRACE_PERIOD")
    assert ctx.join() is True


def _script(body: str) -> str:
    return textwrap.dedent(body)


def _wait_gone(pids, seconds=15.0):
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.05)
    return alive


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
