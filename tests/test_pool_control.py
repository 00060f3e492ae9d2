"""What procspawn's pools add to the stdlib's: a per-task timeout, retries of tasks lost to
a death, stopping a running call (``Future.kill()``), a memory guard.

Each is checked under every start method, for ``Pool`` and ``ProcessPoolExecutor``: the
right task fails (or is run again), the others finish, the pool goes on, and no worker
is left over. Every wait has a deadline: a hang is a failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
from concurrent.futures.process import BrokenProcessPool

import pytest
from _pool_workers import (
    die,
    die_once,
    eat_memory_in_cgroup,
    grow_then_pid,
    nap_then_wait_for_file,
    pid_of,
    resident_bytes,
    sleep_then_pid,
    slow_square,
    square,
    wait_for_file,
)

import procspawn as mp

DEADLINE = 30.0
pytestmark = pytest.mark.timeout(120)


def _gone(pids, within=DEADLINE):
    """Whether every pid has exited (and was reaped) within the deadline."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(params=mp.get_all_start_methods())
def method(request):
    return request.param


def test_the_options_are_checked_in_the_caller():
    for make in (mp.Pool, mp.ProcessPoolExecutor):
        with pytest.raises(ValueError, match="task_timeout must be a number of seconds > 0"):
            make(1, task_timeout=0)
        with pytest.raises(ValueError, match="retries must be an int >= 0"):
            make(1, retries=-1)
        with pytest.raises(ValueError, match=r"max_memory_per_child must be a number of bytes"):
            make(1, max_memory_per_child="2G")


def test_pool_task_timeout_fails_the_late_task_only(method):
    with mp.Pool(2, context=method, task_timeout=0.6) as p:
        p.map(square, range(4))  # both workers up: the limit is not spent on a start
        late = p.apply_async(sleep_then_pid, (60,))
        quick = p.map_async(slow_square, range(8), chunksize=1)
        with pytest.raises(mp.TaskTimeoutError) as info:
            late.get(DEADLINE)
        assert quick.get(DEADLINE) == [x * x for x in range(8)]
        err = info.value
        assert isinstance(err, TimeoutError) and err.timeout == 0.6
        assert "sleep_then_pid(60)" in str(err) and "task_timeout of 0.6 s" in str(err)
        assert _gone([err.pid])
        assert p.map(square, range(6)) == [x * x for x in range(6)]  # it goes on
        workers = [w.pid for w in p._pool]
        assert len(workers) == 2 and err.pid not in workers
    assert _gone(workers)


def test_executor_task_timeout_and_kill_leave_it_working(method):
    with mp.ProcessPoolExecutor(2, mp_context=method, task_timeout=0.8) as ex:
        assert ex.submit(square, 3).result(DEADLINE) == 9
        late = ex.submit(sleep_then_pid, 60)
        with pytest.raises(mp.TaskTimeoutError, match="sleep_then_pid"):
            late.result(DEADLINE)
        # kill(): a running call fails with CancelledError, its worker is replaced
        running = ex.submit(sleep_then_pid, 60)
        deadline = time.monotonic() + DEADLINE
        while not running.running():  # handed to a worker (which may not have started it)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        pids_before = set(ex._processes)
        assert running.kill() is True
        with pytest.raises(cf.CancelledError, match="sleep_then_pid was killed"):
            running.result(DEADLINE)
        assert not running.cancelled()  # it had started: failed, not cancelled
        done = ex.submit(square, 5)
        assert done.result(DEADLINE) == 25
        assert done.kill() is False  # finished already
        assert not ex._broken
        assert [f.result(DEADLINE) for f in [ex.submit(square, i) for i in range(6)]] == [
            i * i for i in range(6)
        ]
        workers = set(ex._processes)
        assert pids_before - workers  # the killed one is gone, a new one came
    assert _gone(workers | pids_before)


def test_kill_of_a_call_not_started_cancels_it():
    with mp.ProcessPoolExecutor(1, mp_context="fork") as ex:
        busy = ex.submit(sleep_then_pid, 0.5)
        queued = [ex.submit(square, i) for i in range(4)]
        assert queued[-1].kill() is True
        assert queued[-1].cancelled()
        assert isinstance(busy.result(DEADLINE), int)
        assert [f.result(DEADLINE) for f in queued[:-1]] == [0, 1, 4]


@pytest.mark.parametrize("make", ["pool", "executor"])
# (a worker replaced under spawn: the timeout tests above; test_pool_deaths)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_retries_save_a_task_a_death_lost_and_give_up_on_a_poison_task(method, make, tmp_path):
    flag = str(tmp_path / "died")
    if make == "pool":
        ex = mp.Pool(2, context=method, retries=2)
        run = lambda fn, *args: ex.apply_async(fn, args).get(DEADLINE)  # noqa: E731
    else:
        ex = mp.ProcessPoolExecutor(2, mp_context=method, retries=2)
        run = lambda fn, *args: ex.submit(fn, *args).result(DEADLINE)  # noqa: E731
    try:
        assert run(die_once, flag, 7) == 49  # its first worker died; the retry ran it
        assert os.path.exists(flag)
        started = time.monotonic()
        with pytest.raises(mp.ProcessExitedException) as info:
            run(die, "sigkill")  # kills every worker it meets
        err = info.value
        assert err.signal_name == "SIGKILL"
        assert "the task ran 3 times (retries=2)" in str(err)
        assert "die('sigkill')" in str(err)
        assert time.monotonic() - started < DEADLINE
        if make == "executor":
            assert not isinstance(err, BrokenProcessPool)
            assert not ex._broken
        assert run(square, 4) == 16  # it goes on
        assert run(pid_of) > 0
    finally:
        if make == "pool":
            ex.terminate()
            ex.join()
        else:
            ex.shutdown(wait=True)


def test_a_worker_past_max_memory_is_replaced_between_tasks(method, caplog, monkeypatch):
    from procspawn import _log

    monkeypatch.setattr(_log, "ENABLED", True)  # as PROCSPAWN_DEBUG=1 does
    # a fresh worker's own size first: a forked one shares its parent's pages, as large
    # as the test process has grown by then (the whole suite's imports)
    with mp.Pool(1, context=method) as probe:
        start = probe.apply(resident_bytes)
    limit = start + (150 << 20)
    with caplog.at_level(logging.DEBUG, logger="procspawn"):
        with mp.Pool(1, context=method, max_memory_per_child=limit) as p:
            first = p.apply(pid_of)
            assert p.apply(pid_of) == first  # small: it stays
            assert p.apply(grow_then_pid, (250 << 20,)) == first  # grows past the limit
            second = p.apply(pid_of)
            assert second != first  # replaced before its next task
            assert _gone([first])
            assert p.apply(pid_of) == second
    assert any("max_memory_per_child" in r.getMessage() for r in caplog.records)
    assert _gone([second])


def test_the_executor_memory_guard(method):
    with mp.ProcessPoolExecutor(1, mp_context=method, max_memory_per_child=150 << 20) as ex:
        first = ex.submit(grow_then_pid, 200 << 20).result(DEADLINE)
        assert ex.submit(pid_of).result(DEADLINE) != first
        assert not ex._broken


def _memory_cgroup(name: str, limit: int) -> str | None:
    """A new memory cgroup limited to ``limit`` bytes, without swap (v2 or v1), or None
    where this machine does not let us make one."""
    v2 = "/sys/fs/cgroup"
    try:
        with open(os.path.join(v2, "cgroup.controllers")) as f:
            has_v2_memory = "memory" in f.read().split()
    except OSError:
        has_v2_memory = False
    candidates = (
        [(os.path.join(v2, name), {"memory.max": limit, "memory.swap.max": 0})]
        if has_v2_memory
        else []
    )
    candidates.append(
        (os.path.join(v2, "memory", name), {"memory.limit_in_bytes": limit, "memory.swappiness": 0})
    )
    for path, settings in candidates:
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            for key, value in settings.items():
                if os.path.exists(os.path.join(path, key)):
                    with open(os.path.join(path, key), "w") as f:
                        f.write(str(value))
            return path
        except OSError:
            os.rmdir(path)
    return None


@pytest.mark.parametrize("make", ["pool", "executor"])
def test_an_oom_kill_is_reported_as_such(make):
    cgroup = _memory_cgroup(f"procspawn-test-{os.getpid()}", 64 << 20)
    if cgroup is None:
        pytest.skip("this machine does not let the tests make a memory cgroup")
    procs = os.path.join(cgroup, "cgroup.procs")
    try:
        if make == "pool":
            with mp.Pool(1, context="fork") as p:
                with pytest.raises(mp.ProcessExitedException) as info:
                    p.apply_async(eat_memory_in_cgroup, (procs, 512 << 20)).get(DEADLINE)
                assert p.apply(square, (3,)) == 9
        else:
            with mp.ProcessPoolExecutor(1, mp_context="fork") as ex:
                with pytest.raises(mp.TerminatedWorkerError) as info:
                    ex.submit(eat_memory_in_cgroup, procs, 512 << 20).result(DEADLINE)
        err = info.value
        assert err.signal_name == "SIGKILL"
        assert "out-of-memory killer" in str(err) and "not the kernel's" not in str(err)
        assert "eat_memory_in_cgroup(" in str(err)
    finally:
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                os.rmdir(cgroup)
                break
            except OSError:  # the killed worker is still being torn down
                assert time.monotonic() < deadline
                time.sleep(0.05)


def test_a_sigkill_from_another_process_is_not_blamed_on_the_oom_killer():
    with mp.Pool(1, context="fork") as p:
        with pytest.raises(mp.ProcessExitedException) as info:
            p.apply_async(die, ("sigkill",)).get(DEADLINE)
    assert "not the kernel's out-of-memory killer" in str(info.value)


def test_progress_counts_finished_items_of_every_kind_of_call(capfd):
    bar = mp.Progress(show=True, use_tqdm=False, desc="items")
    with mp.Pool(2, context="fork") as p:
        assert p.map(slow_square, range(30), chunksize=4, progress=bar) == [
            x * x for x in range(30)
        ]
        assert (bar.count, bar.total) == (30, 30)
        assert "items: 30/30 (100.0%)" in capfd.readouterr().err
        for call in (p.imap, p.imap_unordered):
            shown = mp.Progress(show=False)
            assert sorted(call(square, range(25), chunksize=3, progress=shown)) == sorted(
                x * x for x in range(25)
            )
            assert (shown.count, shown.total) == (25, 25)
        shown = mp.Progress(7, show=False)  # a total given is kept
        assert p.starmap(pow, [(2, 3), (3, 2)], progress=shown) == [8, 9]
        assert (shown.count, shown.total) == (2, 7)
        assert p.map(square, [1, 2], progress=True) == [1, 4]  # stderr is not a terminal
    with mp.ProcessPoolExecutor(2, mp_context="fork") as ex:
        shown = mp.Progress(show=False)
        assert list(ex.map(square, range(12), chunksize=5, progress=shown)) == [
            x * x for x in range(12)
        ]
        assert (shown.count, shown.total) == (12, 12)


def test_progress_counts_a_retried_task_once(tmp_path):
    shown = mp.Progress(show=False)
    flag = str(tmp_path / "died")
    with mp.Pool(2, context="fork", retries=1) as p:
        out = p.starmap(die_once, [(flag, x) for x in range(6)], chunksize=1, progress=shown)
    assert out == [x * x for x in range(6)]
    assert (shown.count, shown.total) == (6, 6)


def _two_calls_on_one_worker(ex, seconds, then):
    """Two calls sleeping ``seconds`` on a one-worker executor, both handed to the worker
    (the second queued behind the first), and a third call, ``then``, waiting: the three
    futures."""
    first = ex.submit(sleep_then_pid, seconds)
    second = ex.submit(sleep_then_pid, seconds)
    third = ex.submit(*then)  # more waiting than workers: the worker prefetches
    deadline = time.monotonic() + DEADLINE
    while not (first.running() and second.running()):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return first, second, third


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_killing_a_running_call_and_the_one_queued_behind_it_leaves_the_rest_running(
    start_method,
):
    """The killed worker held a second call, killed too (at once, while queued): that
    call fails once and is not handed out again when its worker dies (the dispatcher
    thread died on it, breaking the executor); the calls after it run."""
    with mp.ProcessPoolExecutor(1, mp_context=start_method) as ex:
        first, second, third = _two_calls_on_one_worker(ex, 5.0, (square, 3))
        assert second.kill() is True
        assert first.kill() is True
        for killed in (first, second):
            with pytest.raises(cf.CancelledError):
                killed.result(DEADLINE)
        assert third.result(DEADLINE) == 9
        assert ex.submit(square, 4).result(DEADLINE) == 16


def test_kill_of_a_call_queued_behind_another_fails_it_alone():
    """A worker may hold a second call of the same function, queued behind the one it
    runs: killing that one fails it at once and leaves the running call alone."""
    with mp.ProcessPoolExecutor(1, mp_context="fork") as ex:
        first, second, third = _two_calls_on_one_worker(ex, 0.5, (sleep_then_pid, 0.1))
        assert second.kill() is True
        with pytest.raises(cf.CancelledError):
            second.result(DEADLINE)
        worker = first.result(DEADLINE)  # not killed: it finished on its worker
        assert third.result(DEADLINE) == worker
        assert ex.submit(pid_of).result(DEADLINE) == worker


def _none_waits_behind_the_long_call(make, ex, fn, release, long_args, others_args):
    """Submit ``fn(*long_args)``, which runs until ``release`` exists, then a call of
    ``fn`` per item of ``others_args``: every other call finishes while the long one still
    runs; then release it. Shuts ``ex`` down."""
    if make == "executor":
        submit = lambda args: ex.submit(fn, *args)  # noqa: E731
        is_done = lambda call: call.done()  # noqa: E731
    else:
        submit = lambda args: ex.apply_async(fn, args)  # noqa: E731
        is_done = lambda call: call.ready()  # noqa: E731
    try:
        long = submit(long_args)
        others = [submit(args) for args in others_args]
        deadline = time.monotonic() + DEADLINE
        while not all(is_done(call) for call in others) and time.monotonic() < deadline:
            time.sleep(0.01)
        finished = sum(is_done(call) for call in others)
        assert finished == len(others), f"{finished} of {len(others)} calls done"
        assert not is_done(long)
        open(release, "w").close()
        value = long.result(DEADLINE) if make == "executor" else long.get(DEADLINE)
        assert value == "release"
    finally:
        open(release, "w").close()
        if make == "executor":
            ex.shutdown()
        else:
            ex.close()
            ex.join()


@pytest.mark.parametrize("make", ["executor", "pool"])
def test_a_call_of_a_deep_backlog_never_waits_behind_a_long_one_of_its_function(make, tmp_path):
    """A backlog of calls that are not tiny (50 ms), the first of them long: no call is
    held behind the long one (a worker running a call is handed the next only for a
    function whose calls were measured short; it held one there, which finished only
    with the long call while the other worker had run all the rest)."""
    release, done = str(tmp_path / "release"), str(tmp_path / "done")
    open(done, "w").close()
    if make == "executor":
        ex = mp.ProcessPoolExecutor(2)
    else:
        ex = mp.Pool(2)
        ex.map(square, range(4))  # both workers up
    _none_waits_behind_the_long_call(
        make,
        ex,
        nap_then_wait_for_file,
        release,
        (0, release, DEADLINE),
        [(0.05, done, DEADLINE)] * 12,
    )


@pytest.mark.parametrize("make", ["executor", "pool"])
def test_a_short_call_never_waits_behind_a_long_one_while_a_worker_is_idle(make, tmp_path):
    """A worker running a call may be handed the next call of the same function to hold
    behind it (a stream of tiny calls never waits for a round trip), but not with so few
    calls waiting that another worker would go idle: the short calls all run on the
    other worker while the long one runs, as with the stdlib's shared queue. (An
    executor starts its workers as calls come: the first one up took the next call while
    the second booted; a Pool held one of four calls behind the long one.)"""
    release, done = str(tmp_path / "release"), str(tmp_path / "done")
    open(done, "w").close()
    if make == "executor":
        ex = mp.ProcessPoolExecutor(2)
        ex.submit(square, 2).result(DEADLINE)  # one worker up
        count = 3
    else:
        ex = mp.Pool(2)
        ex.map(square, range(4))  # both workers up
        count = 4
    _none_waits_behind_the_long_call(
        make, ex, wait_for_file, release, (release, DEADLINE), [(done, DEADLINE)] * count
    )


def test_shutdown_right_after_a_cancelled_submit_returns():
    """CPython's test_hang_gh94440: a call cancelled just before ``shutdown(wait=True)``
    was dropped by the hand-out, and nothing woke the pool's thread again: the shutdown
    waited for ever (1 time in 3 here, on every Python)."""
    import threading

    for attempt in range(20):
        ex = mp.ProcessPoolExecutor(max_workers=1)
        assert ex.submit(int).result(timeout=30) == 0
        ex.submit(int).cancel()
        stopping = threading.Thread(target=ex.shutdown, kwargs={"wait": True})
        stopping.start()
        stopping.join(10)
        if stopping.is_alive():
            ex.shutdown(wait=False, cancel_futures=True)
            pytest.fail(f"shutdown(wait=True) after a cancelled call hangs (attempt {attempt})")


@pytest.mark.parametrize("front", ["pool", "executor"])
def test_a_failure_of_the_pool_thread_with_a_result_in_hand_fails_the_call(
    monkeypatch, caplog, front
):
    """A bug of procspawn's in the thread that serves the pool, after it took a result off
    a worker and before it settled it, fails the call waiting for that result (the pool
    breaks) instead of leaving it waiting for ever: the result was in neither the worker's
    list nor the pending ones that the last-resort failure goes through."""
    from procspawn.pool import _prefetch

    def broken(self, fn, seconds):
        raise NameError("a bug in the pool's thread")

    monkeypatch.setattr(_prefetch.RunTimes, "note", broken)
    if front == "pool":
        with mp.Pool(1) as pool:
            with pytest.raises(RuntimeError, match="dispatcher thread failed"):
                pool.apply_async(abs, (-1,)).get(timeout=30)
    else:
        with mp.ProcessPoolExecutor(1) as ex:
            with pytest.raises(RuntimeError, match="dispatcher thread failed"):
                ex.submit(abs, -1).result(timeout=30)
    assert "a pool dispatcher thread failed" in caplog.text  # logged, with the bug's traceback
    # that record's traceback holds the thread's frames, the workers' process objects
    # among them (whose pipes close when they are collected): let go of it
    caplog.clear()
    import gc

    gc.collect()


# -- issue 38, point 5: a call's own task_timeout, over the pool's ---------------------


def test_a_pool_call_s_own_task_timeout_kills_it_and_the_pool_goes_on():
    with mp.Pool(1) as pool:  # no pool-wide limit
        with pytest.raises(mp.TaskTimeoutError, match="its call's task_timeout of 0.3 s"):
            pool.apply(sleep_then_pid, (60,), task_timeout=0.3)
        with pytest.raises(mp.TaskTimeoutError):
            pool.map(sleep_then_pid, [0.01, 60], chunksize=1, task_timeout=0.5)
        with pytest.raises(mp.TaskTimeoutError):
            list(pool.imap(sleep_then_pid, [60], task_timeout=0.3))
        with pytest.raises(mp.TaskTimeoutError):
            pool.starmap_async(sleep_then_pid, [(60,)], task_timeout=0.3).get(30)
        assert pool.apply(square, (7,)) == 49  # the pool goes on; other calls unlimited


def test_a_call_s_task_timeout_replaces_the_pool_s_for_that_call_only():
    with mp.Pool(1, task_timeout=0.3) as pool:
        pid = pool.apply(sleep_then_pid, (0.8,), task_timeout=10)  # longer than the pool's
        assert isinstance(pid, int)
        with pytest.raises(mp.TaskTimeoutError, match="the pool's task_timeout of 0.3 s"):
            pool.apply(sleep_then_pid, (0.8,))


def test_an_executor_call_s_own_task_timeout():
    with mp.ProcessPoolExecutor(1) as ex:
        future = ex.schedule(sleep_then_pid, (60,), task_timeout=0.3)
        with pytest.raises(mp.TaskTimeoutError, match="its call's task_timeout"):
            future.result(timeout=30)
        with pytest.raises(mp.TaskTimeoutError):
            list(ex.map(sleep_then_pid, [60], task_timeout=0.3, timeout=30))
        assert ex.schedule(square, (3,)).result(timeout=30) == 9
        assert ex.schedule(pow, (2,), {"exp": 5}).result(timeout=30) == 32


@pytest.mark.parametrize("bad", [0, -1, "1", True])
def test_a_bad_call_task_timeout_is_refused_in_the_caller(bad):
    with mp.Pool(1) as pool, mp.ProcessPoolExecutor(1) as ex:
        for call in (
            lambda: pool.apply_async(square, (1,), task_timeout=bad),
            lambda: pool.map_async(square, [1], task_timeout=bad),
            lambda: pool.imap(square, [1], task_timeout=bad),
            lambda: ex.schedule(square, (1,), task_timeout=bad),
            lambda: ex.map(square, [1], task_timeout=bad),
        ):
            with pytest.raises(ValueError, match="task_timeout must be a number of seconds"):
                call()
