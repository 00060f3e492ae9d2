"""The crash matrix of the pools: each way a worker can die x each call x each start method.

A death fails exactly the task its worker was running, with a ProcessExitedException that
names the pid, the signal or exit code, the call and the worker's last stderr lines; the
tasks it had not started are not lost; a new worker takes its place and the pool goes on.
The executor breaks as the stdlib's does, with a TerminatedWorkerError (a
BrokenProcessPool). Every wait has a deadline: a hang is a failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import textwrap
import time
from concurrent.futures.process import BrokenProcessPool

import pytest
from _helpers import ROOT, run_file, run_script
from _pool_workers import die, maybe_die, pid_of, record_pid_and_sleep, slow_square, square

import procspawn as mp

WAYS = {
    # how: (exit code, signal name)
    "sigkill": (-signal.SIGKILL, "SIGKILL"),
    "os_exit": (3, None),
    "segfault": (-signal.SIGSEGV, "SIGSEGV"),
}
DEADLINE = 30.0  # seconds: only a real hang gets near it


@pytest.fixture(params=mp.get_all_start_methods())
def pool(request):
    """A Pool of two workers; after the test it must have two live workers again and
    compute right (it survived the death), then it is stopped."""
    p = mp.Pool(2, context=request.param)
    try:
        yield p
        assert p.map_async(square, range(20)).get(DEADLINE) == [x * x for x in range(20)]
        deadline = time.monotonic() + DEADLINE
        while not (len(p._pool) == 2 and all(w.is_alive() for w in p._pool)):
            assert time.monotonic() < deadline, "the pool did not get back to two workers"
            time.sleep(0.02)
    finally:
        p.terminate()
        p.join()


def _check(err: BaseException, how: str, call: str) -> None:
    code, name = WAYS[how]
    assert isinstance(err, mp.ProcessExitedException), repr(err)
    assert err.exit_code == code
    assert err.signal_name == name
    assert err.pid > 0 and f"pid {err.pid}" in str(err)
    assert call in str(err), str(err)
    assert f"last words of pid {err.pid} before {how}" in str(err), str(err)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", WAYS)
def test_map_raises_the_death_and_the_pool_goes_on(pool, how):
    beside = pool.map_async(slow_square, range(8), chunksize=1)  # another call meanwhile
    with pytest.raises(mp.ProcessExitedException) as info:
        pool.map_async(_die_at_5, [(x, how) for x in range(8)], chunksize=1).get(DEADLINE)
    _check(info.value, how, "_die_at_5((5,")
    assert beside.get(DEADLINE) == [x * x for x in range(8)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", WAYS)
def test_imap_unordered_loses_only_the_dead_task(pool, how):
    it = pool.imap_unordered(_die_at_5, [(x, how) for x in range(12)])
    values, errors = [], []
    while True:
        try:
            values.append(it.next(timeout=DEADLINE))
        except StopIteration:
            break
        except mp.ProcessExitedException as err:
            errors.append(err)
    assert len(errors) == 1
    _check(errors[0], how, "_die_at_5((5,")
    assert sorted(values) == sorted(x * x for x in range(12) if x != 5)


def _die_at_5(pair):
    x, how = pair
    return maybe_die(x, 5, how)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", WAYS)
def test_apply_async_of_a_dying_task_fails_it(pool, how):
    others = [pool.apply_async(slow_square, (x,)) for x in range(4)]
    doomed = pool.apply_async(die, (how,))
    with pytest.raises(mp.ProcessExitedException) as info:
        doomed.get(DEADLINE)
    _check(info.value, how, f"die('{how}')")
    assert not doomed.successful()
    assert [r.get(DEADLINE) for r in others] == [0, 1, 4, 9]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["sigkill"])  # every way: see imap_unordered's test
def test_imap_raises_at_the_dead_tasks_place(pool, how):
    it = pool.imap(_die_at_5, [(x, how) for x in range(8)])
    got = [it.next(timeout=DEADLINE) for _ in range(5)]
    assert got == [0, 1, 4, 9, 16]
    with pytest.raises(mp.ProcessExitedException) as info:
        it.next(timeout=DEADLINE)
    _check(info.value, how, "_die_at_5((5,")
    assert [it.next(timeout=DEADLINE) for _ in range(2)] == [36, 49]
    with pytest.raises(StopIteration):
        it.next(timeout=DEADLINE)


@pytest.mark.timeout(90)
def test_a_worker_killed_from_outside_while_idle_fails_nothing(pool):
    victim = pool._pool[0]
    victim.kill()
    assert pool.map(square, range(10)) == [x * x for x in range(10)]


@pytest.mark.timeout(90)
def test_a_worker_killed_from_outside_mid_task_fails_that_task(pool, tmp_path):
    marker = tmp_path / "pid"
    result = pool.apply_async(record_pid_and_sleep, (str(marker), 60))
    deadline = time.monotonic() + DEADLINE
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the task did not start"
        time.sleep(0.01)
    pid = int(marker.read_text())
    assert pool.map(square, range(10)) == [x * x for x in range(10)]  # not stuck behind it
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(mp.ProcessExitedException) as info:
        result.get(DEADLINE)
    assert info.value.signal_name == "SIGKILL" and info.value.pid == pid
    assert "record_pid_and_sleep(" in str(info.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", mp.get_all_start_methods())
@pytest.mark.parametrize("how", WAYS)
def test_executor_breaks_as_the_stdlibs_does(method, how):
    ex = mp.ProcessPoolExecutor(2, mp_context=method)
    try:
        assert ex.submit(square, 3).result(DEADLINE) == 9
        doomed = ex.submit(die, how)
        with pytest.raises(BrokenProcessPool) as info:
            doomed.result(DEADLINE)
        err = info.value
        assert isinstance(err, mp.TerminatedWorkerError)
        _check(err, how, f"die('{how}')")
        with pytest.raises(BrokenProcessPool):
            ex.submit(square, 2)
    finally:
        ex.shutdown(wait=True)
    assert ex._processes == {}


@pytest.mark.timeout(120)
def test_executor_fails_every_pending_future_on_a_death():
    with mp.ProcessPoolExecutor(1, mp_context="fork") as ex:
        doomed = ex.submit(maybe_die, 1, 1, "sigkill", 0.2)
        pending = [ex.submit(square, x) for x in range(5)]
        done, not_done = cf.wait([doomed, *pending], timeout=DEADLINE)
        assert not not_done
        for f in [doomed, *pending]:
            assert isinstance(f.exception(), mp.TerminatedWorkerError)


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


@pytest.mark.timeout(120)
def test_a_broken_executor_fails_its_futures_before_it_stops_the_other_workers(tmp_path):
    """The callers learn of the death first, as with the stdlib's executor: a future's
    callback runs while the worker busy with another call is still alive (it is stopped
    after, and reaped before shutdown returns)."""
    path = str(tmp_path / "pid")
    seen = {}
    with mp.ProcessPoolExecutor(2, mp_context="fork") as ex:
        busy = ex.submit(record_pid_and_sleep, path, 30.0)
        deadline = time.monotonic() + DEADLINE
        while not _read_text(path):
            assert time.monotonic() < deadline, "the busy call never started"
            time.sleep(0.01)
        other = int(_read_text(path))

        def on_done(future):
            with open(f"/proc/{other}/stat") as f:
                seen["state"] = f.read().rsplit(")", 1)[1].split()[0]

        busy.add_done_callback(on_done)
        doomed = ex.submit(die, "sigkill")
        with pytest.raises(mp.TerminatedWorkerError):
            doomed.result(DEADLINE)
        with pytest.raises(mp.TerminatedWorkerError):
            busy.result(DEADLINE)
    assert seen["state"] in ("S", "R"), seen  # alive, sleeping in its call: not stopped yet
    assert not os.path.exists(f"/proc/{other}")  # and reaped by shutdown


@pytest.mark.timeout(90)
def test_a_pool_of_one_survives_a_death_in_every_chunk():
    with mp.Pool(1, context="fork") as p:
        for _ in range(3):
            with pytest.raises(mp.ProcessExitedException):
                p.starmap(maybe_die, [(x, 2, "os_exit") for x in range(4)], chunksize=1)
        assert p.map(square, range(5)) == [0, 1, 4, 9, 16]


@pytest.mark.timeout(90)
def test_maxtasksperchild_replaces_workers_and_deaths_still_fail_one_task():
    with mp.Pool(2, maxtasksperchild=2, context="fork") as p:
        pids = set(p.map(pid_of, range(12), chunksize=1))
        assert len(pids) >= 6  # every worker ran at most two tasks
        with pytest.raises(mp.ProcessExitedException):
            p.starmap(maybe_die, [(x, 4, "sigkill") for x in range(8)], chunksize=1)
        assert p.map(square, range(6), chunksize=1) == [0, 1, 4, 9, 16, 25]


# -- exit statuses taken by someone else -------------------------------------------------

_REAPED_ELSEWHERE = """
import signal, sys
sys.path.insert(0, {tests!r})
import procspawn as mp
from _pool_workers import die, maybe_die, square

def rank(r):
    return r * 3

if __name__ == "__main__":
    # every child is reaped by the kernel as it exits: no exit status for anyone
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with mp.Pool(2, maxtasksperchild=1, context="fork") as pool:
        assert pool.map(square, range(12), chunksize=1) == [x * x for x in range(12)]
        try:
            pool.starmap(maybe_die, [(x, 2, "sigkill") for x in range(4)], chunksize=1)
        except mp.ProcessExitedException as exc:
            print("death:", exc)
        assert pool.map(square, range(6)) == [x * x for x in range(6)]
    with mp.ProcessPoolExecutor(2, mp_context="fork", max_tasks_per_child=1) as ex:
        assert list(ex.map(square, range(8))) == [x * x for x in range(8)]
    print(mp.spawn(rank, nprocs=2, start_method="fork"))
"""


@pytest.mark.timeout(90)
def test_workers_whose_exit_status_nobody_can_read():
    """SIGCHLD ignored: the kernel reaps every child and no exit code exists. Workers that
    retire are replaced, a worker's death still fails its task (its status unknown, said
    so), and spawn returns its results."""
    result = run_script(_REAPED_ELSEWHERE.format(tests=os.path.join(ROOT, "tests")), timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("death: pool worker (pid "), lines
    assert "unknown exit status" in lines[0] and "maybe_die(2, 2, 'sigkill')" in lines[0]
    assert lines[-1] == "[0, 3]"
    assert "dispatcher thread failed" not in result.stderr, result.stderr


_CLOSED_WITHOUT_JOIN = """
import sys
sys.path.insert(0, {tests!r})
import procspawn as mp
from _pool_workers import square

if __name__ == "__main__":
    pools = []
    for i in range(100):
        pool = mp.Pool(2, context="fork")
        assert pool.map(square, range(10)) == [x * x for x in range(10)]
        pool.close()  # its workers exit while the next pool starts its own
        pools.append(pool)
    for pool in pools:
        pool.join()
    print("ok")
"""


@pytest.mark.timeout(90)
def test_pools_closed_without_join_while_others_start():
    """Each Process.start() polls every multiprocessing child (the stdlib's _cleanup), so
    another pool's start reaps workers that are exiting: their pool must still read their
    exit codes (it found none and its dispatcher thread died, a few times per 100 pools)."""
    code = _CLOSED_WITHOUT_JOIN.format(tests=os.path.join(ROOT, "tests"))
    result = run_script(code, timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
    assert "dispatcher thread failed" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("main_waits", [True, False])
def test_an_executor_whose_program_is_leaving_still_reports_a_death(tmp_path, main_waits):
    """The errors of a broken pool (concurrent.futures.process) are imported by the pool's
    thread once it has answered and is idle, not on the way to the first result. Python
    refuses that import once the main thread has ended (the module registers an exit
    hook): an executor that has run a moment has it already, and one that breaks earlier,
    while its program leaves, imports it without the hook. Its thread failed there."""
    script = tmp_path / "leaving.py"
    script.write_text(
        "import os, sys, time\n"
        "import procspawn\n"
        "def die():\n"
        "    time.sleep(0.6)\n"
        "    os._exit(3)\n"
        "def report(future):\n"
        "    error = future.exception()\n"
        "    print(type(error).__name__, error.exit_code, flush=True)\n"
        "if __name__ == '__main__':\n"
        "    ex = procspawn.ProcessPoolExecutor(2, mp_context='fork')\n"
        "    ex.submit(die).add_done_callback(report)\n"
        f"    if {main_waits}:\n"
        "        assert ex.submit(abs, -1).result(30) == 1\n"
        "        time.sleep(0.3)  # the thread imports the errors meanwhile\n"
        "    # no shutdown: the program's exit waits for the work, as the stdlib's does\n"
    )
    result = run_file(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "TerminatedWorkerError 3", (result.stdout, result.stderr)
    assert "dispatcher thread failed" not in result.stderr


def test_a_fork_while_an_executor_imports_its_errors_leaves_the_child_whole(tmp_path):
    """The executor's thread imports its BrokenProcessPool errors in the background. A
    program that forked in the middle of that import handed its child a half-imported
    module, and the import lock of a thread the child has not: the child's own executor
    failed with 'the pool's dispatcher thread failed: AttributeError', or the child hung
    at its first use of the errors. A fork now waits for the import."""
    script = tmp_path / "fork_mid_import.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys, time
            import procspawn

            def ok(x):
                return x

            if __name__ == "__main__":
                sys.setswitchinterval(0.0001)  # the fork lands inside the import
                ex = procspawn.ProcessPoolExecutor(1, mp_context="fork")
                assert ex.submit(ok, 1).result(30) == 1
                deadline = time.monotonic() + 5
                while ("concurrent.futures.process" not in sys.modules
                       and time.monotonic() < deadline):
                    pass
                pid = os.fork()
                if pid == 0:
                    signal.alarm(10)  # a child stuck on an import lock dies
                    try:
                        with procspawn.ProcessPoolExecutor(1, mp_context="fork") as child_ex:
                            child_ex.submit(os._exit, 1).result(30)
                    except Exception as exc:
                        print(type(exc).__name__, flush=True)
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                print("child status", status, flush=True)
                ex.shutdown()
            """
        )
    )
    result = run_file(script, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["TerminatedWorkerError", "child status 0"], (
        result.stdout,
        result.stderr[-2000:],
    )
    assert "dispatcher thread failed" not in result.stderr


def test_a_late_import_in_one_thread_is_never_cut_in_half_by_a_fork_in_another(tmp_path):
    """What procspawn imports at first use (ctypes at the first array, logging at the
    first message, a broken pool's errors) may be imported by a pool's thread while
    another thread forks: the fork waits for the import, so the child has the module
    whole (it used to get it half imported, with the lock of a thread it has not)."""
    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(0.3)\nVALUE = 42\n")
    script = tmp_path / "fork_during_import.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys, threading, time
            from procspawn._late import late_import

            if __name__ == "__main__":
                importer = threading.Thread(target=late_import, args=("slow_module",))
                importer.start()
                deadline = time.monotonic() + 5
                while "slow_module" not in sys.modules and time.monotonic() < deadline:
                    time.sleep(0.001)
                pid = os.fork()  # the import is under way in the other thread
                if pid == 0:
                    signal.alarm(5)  # a child stuck on the import lock dies
                    import slow_module
                    print("child", slow_module.VALUE, flush=True)
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                importer.join(10)
                print("status", status, flush=True)
            """
        )
    )
    result = run_file(script, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["child 42", "status 0"], (result.stdout, result.stderr)
