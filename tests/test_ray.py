"""spawn(..., backend="ray"): the same rank function on a Ray cluster, with spawn's
semantics. One local cluster for the module (2 CPUs, no dashboard, a small object store),
shut down at the end; every test checks that nothing is left running on it."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _helpers import run_script, script_env

import procspawn as mp
from procspawn import sharing

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'procspawn[ray]')")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 << 20,
        logging_level="warning",
        log_to_driver=True,
    )
    # Warm up: the driver's connections, the object store mapping, a worker or two, so
    # that the leak check's baseline of each test sees them.
    mp.spawn(_rank_and_world, nprocs=2, backend="ray", args=(np.ones(1 << 18),))
    # and the driver's connections to the workers that run a pool's tasks
    with mp.ProcessPoolExecutor(2, backend="ray") as ex:
        list(ex.map(_inc, range(4)))
        list(ex.map(_sum_and_writable, [np.ones(1 << 18)] * 2))  # (put in the store)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def nothing_left_on_the_cluster():
    yield
    deadline = time.monotonic() + 10
    while True:
        actors = [a["State"] for a in ray._private.state.actors().values()]
        groups = [g["state"] for g in ray.util.placement_group_table().values()]
        alive = [s for s in actors if s != "DEAD"] + [s for s in groups if s != "REMOVED"]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not alive, f"left on the cluster: actors {actors}, placement groups {groups}"


def _rank_and_world(rank, *args):
    return rank, os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]


def _echo(rank, array, scale=1):
    return rank, array.sum() * scale, array.flags.writeable, np.full(4, rank)


def _fail_in(rank, bad_rank, slow_seconds):
    if rank == bad_rank:
        raise KeyError(f"rank {rank} lost its key")
    time.sleep(slow_seconds)  # a sibling that would run on: it must be stopped
    return rank


def _pid_then_wait(rank, seconds):
    time.sleep(seconds)
    return os.getpid()


def test_results_by_rank_and_rank_environment():
    assert mp.spawn(_rank_and_world, nprocs=2, backend="ray") == [
        (0, "0", "2", "0"),
        (1, "1", "2", "1"),
    ]


def test_arrays_in_read_only_and_out_writable():
    array = np.arange(1 << 20, dtype=np.float64)  # 8 MiB, through the object store
    results = mp.spawn(_echo, args=(array,), kwargs={"scale": 2}, nprocs=2, backend="ray")
    for rank, (r, total, writeable, out) in enumerate(results):
        assert r == rank and total == array.sum() * 2
        assert writeable is False  # what a rank reads from Ray's object store is read-only
        assert out.flags.writeable and np.array_equal(out, np.full(4, rank))


def test_a_failing_rank_surfaces_with_its_traceback_and_the_others_stop():
    started = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_fail_in, args=(1, 60), nprocs=2, backend="ray")
    assert time.monotonic() - started < 20  # rank 0 (60 s of sleep) was not waited for
    err = info.value
    assert err.error_index == 1 and err.pid > 0
    assert isinstance(err.__cause__, KeyError)
    assert "Traceback (most recent call last)" in str(err) and "lost its key" in str(err)
    assert "_fail_in" in str(err)
    assert err.results == [None, None]


def test_an_actor_killed_is_an_exited_rank():
    ctx = mp.spawn(_pid_then_wait, args=(60,), nprocs=2, backend="ray", join=False)
    assert not ctx.join(timeout=0.5)
    os.kill(ctx.pids()[0], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(mp.ProcessExitedException) as info:
        ctx.join(timeout=30)
    assert time.monotonic() - started < 20
    assert info.value.error_index == 0 and info.value.pid == ctx.pids()[0]
    assert "actor died" in str(info.value)
    with pytest.raises(mp.ProcessExitedException):
        ctx.join()  # later joins raise it again


def test_timeout_stops_every_rank():
    with pytest.raises(mp.ProcessTimeoutError) as info:
        mp.spawn(_pid_then_wait, args=(60,), nprocs=2, backend="ray", timeout=1.0)
    assert info.value.ranks == [0, 1] and isinstance(info.value, TimeoutError)


def test_timeout_running_out_while_starting_is_a_timeout_too():
    # 1 ms cannot cover reserving CPUs and starting actors: spawn's timeout, not
    # PROCSPAWN_RAY_READY_TIMEOUT, is what ran out, so it is the same error as later
    with pytest.raises(mp.ProcessTimeoutError, match="while starting") as info:
        mp.spawn(_pid_then_wait, args=(60,), nprocs=2, backend="ray", timeout=0.001)
    assert info.value.ranks == [0, 1] and info.value.results == [None, None]
    # nothing is left reserved: the next spawn gets both CPUs at once
    assert mp.spawn(_rank_and_world, nprocs=2, backend="ray") == [
        (r, str(r), "2", str(r)) for r in (0, 1)
    ]


def test_join_false_polls_and_terminate_stops():
    with mp.spawn(_pid_then_wait, args=(0.2,), nprocs=2, backend="ray", join=False) as ctx:
        while not ctx.join(timeout=0.1):
            pass
        assert ctx.results == ctx.pids()
    ctx = mp.spawn(_pid_then_wait, args=(60,), nprocs=2, backend="ray", join=False)
    ctx.terminate()
    assert ctx.join() is True and ctx.results == [None, None]


def test_more_ranks_than_the_cluster_has_cpus_is_a_clear_error():
    with pytest.raises(RuntimeError, match="2 CPU.*3 ranks"):
        mp.spawn(_rank_and_world, nprocs=3, backend="ray")


def test_shared_memory_arrays_are_refused_in_the_parent():
    shared = sharing.zeros(16)
    with pytest.raises(ValueError, match="one machine only") as info:
        mp.spawn(_echo, args=({"w": [shared]},), nprocs=1, backend="ray")
    assert "args[0]['w'][0]" in str(info.value)


class _Slotted:
    __slots__ = ("weights",)

    def __init__(self, weights):
        self.weights = weights


def test_shared_arrays_in_slots_and_object_arrays_are_refused_too():
    shared = sharing.zeros(16)
    with pytest.raises(ValueError, match=r"args\[0\]\.weights"):
        mp.spawn(_echo, args=(_Slotted(shared),), nprocs=1, backend="ray")
    boxed = np.empty(2, dtype=object)
    boxed[1] = shared
    with pytest.raises(ValueError, match=r"kwargs\['scale'\]\.flat\[1\]"):
        mp.spawn(_echo, args=(np.ones(2),), kwargs={"scale": boxed}, nprocs=1, backend="ray")


def _exit_with(rank, code):
    sys.exit(code)


def test_sys_exit_in_a_rank_is_its_exit_code_as_with_processes():
    with pytest.raises(mp.ProcessExitedException, match="exit code 3") as info:
        mp.spawn(_exit_with, args=(3,), nprocs=1, backend="ray")
    assert info.value.exit_code == 3
    assert mp.spawn(_exit_with, args=(0,), nprocs=1, backend="ray") == [None]


def _return_a_lock(rank):
    import threading

    return threading.Lock()


def _raise_on_load():
    raise RuntimeError("this result cannot be rebuilt here")


class _BadOnLoad:
    def __reduce__(self):
        return (_raise_on_load, ())


def _return_bad_on_load(rank):
    return _BadOnLoad()


def test_results_that_cannot_travel_are_errors_that_say_so():
    with pytest.raises(mp.ProcessRaisedException, match="return value of rank 0 could not be"):
        mp.spawn(_return_a_lock, nprocs=1, backend="ray")
    with pytest.raises(mp.ProcessRaisedException, match="could not unpickle") as info:
        mp.spawn(_return_bad_on_load, nprocs=1, backend="ray")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_context_dropped_without_join_stops_its_ranks():
    ctx = mp.spawn(_pid_then_wait, args=(60,), nprocs=2, backend="ray", join=False)
    assert len(ctx.pids()) == 2
    del ctx
    gc.collect()
    groups = [g["state"] for g in ray.util.placement_group_table().values()]
    assert all(state == "REMOVED" for state in groups), groups  # at once, not later
    # (and the autouse check waits for every actor to be DEAD)


def test_options_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="start_method"):
        mp.spawn(_rank_and_world, nprocs=1, backend="ray", start_method="fork")
    with pytest.raises(ValueError, match="unknown backend"):
        mp.spawn(_rank_and_world, nprocs=1, backend="dask")
    with pytest.raises(ValueError, match="ray_address"):
        mp.spawn(_rank_and_world, nprocs=1, ray_address="auto")


def test_without_ray_the_error_says_how_to_install_it_and_procspawn_never_imports_it():
    code = textwrap.dedent(
        """
        import sys
        import procspawn as mp

        def f(rank):
            return rank

        if __name__ == "__main__":
            assert mp.spawn(f, nprocs=1) == [0]
            assert "ray" not in sys.modules, "import procspawn imported Ray"
            sys.modules["ray"] = None  # as if it were not installed
            try:
                mp.spawn(f, nprocs=1, backend="ray")
            except ImportError as exc:
                print(type(exc).__name__, exc)
        """
    )
    result = run_script(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("RayMissingError")
    assert "pip install 'procspawn[ray]'" in result.stdout


@pytest.mark.slow  # a second cluster's start and stop (6 s)
def test_a_local_cluster_of_its_own_is_shut_down_after():
    code = textwrap.dedent(
        """
        import time
        import procspawn as mp
        import ray

        def f(rank):
            return rank * 10

        def slow(rank):
            time.sleep(1.0)
            return "slow"

        if __name__ == "__main__":
            # two contexts on the cluster procspawn started: the first to finish must
            # not shut it down under the other
            a = mp.spawn(f, nprocs=1, backend="ray", join=False)
            b = mp.spawn(slow, nprocs=1, backend="ray", join=False)
            assert a.join(60) and a.results == [0]
            assert ray.is_initialized(), "the cluster went with the first context"
            assert b.join(60) and b.results == ["slow"]
            print(ray.is_initialized())
        """
    )
    env = dict(script_env())
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1:] == ["False"]


def test_ctrl_c_while_joining_stops_every_rank():
    ctx = mp.spawn(_pid_then_wait, args=(60,), nprocs=2, backend="ray", join=False)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            ctx.join()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(mp.ProcessException, match="KeyboardInterrupt"):
        ctx.join()  # stopped: later joins say why


# -- the pools on Ray: ProcessPoolExecutor(backend="ray"), Pool(backend="ray") ---------------


@pytest.fixture
def cluster_idle_after():
    """After a pool test: every CPU of the cluster free again (no task left running)."""
    yield
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.available_resources().get("CPU", 0) == 2, ray.available_resources()


def _inc(x):
    return x + 1


def _raise_value_error(x):
    raise ValueError(f"bad item {x}")


def _exit_abruptly(x):
    os._exit(3)


def _sleep_then(seconds):
    time.sleep(seconds)
    return seconds


def _sum_and_writable(array):
    return float(array.sum()), array.flags.writeable


def _ones(n):
    return np.ones(n)


@pytest.mark.ray_tasks
def test_an_executor_on_ray_gives_results_and_the_tasks_own_errors(cluster_idle_after):
    with mp.ProcessPoolExecutor(2, backend="ray") as ex:
        assert ex.submit(_inc, 1).result(timeout=60) == 2
        assert list(ex.map(_inc, range(50), chunksize=7, timeout=60)) == list(range(1, 51))
        with pytest.raises(ValueError, match="bad item 3") as info:
            ex.submit(_raise_value_error, 3).result(timeout=60)
        # the remote traceback is the cause, as with the stdlib's executor
        assert "_raise_value_error" in str(info.value.__cause__)


@pytest.mark.ray_tasks
def test_a_task_that_exits_is_an_exited_error_and_the_executor_goes_on(cluster_idle_after):
    with mp.ProcessPoolExecutor(2, backend="ray") as ex:
        with pytest.raises(mp.ProcessExitedException, match=r"_exit_abruptly\(1\) died"):
            ex.submit(_exit_abruptly, 1).result(timeout=60)
        assert ex.submit(_inc, 5).result(timeout=60) == 6  # one death breaks nothing
    with mp.ProcessPoolExecutor(2, backend="ray", retries=1) as ex:
        with pytest.raises(mp.ProcessExitedException, match=r"ran 2 times \(retries=1\)"):
            ex.submit(_exit_abruptly, 1).result(timeout=60)
        assert ex.submit(_inc, 6).result(timeout=60) == 7


@pytest.mark.ray_tasks
def test_task_timeout_and_kill_stop_a_running_task_on_ray(cluster_idle_after):
    with mp.ProcessPoolExecutor(2, backend="ray", task_timeout=2.0) as ex:
        started = time.monotonic()
        with pytest.raises(mp.TaskTimeoutError, match="task_timeout of 2 s"):
            ex.submit(_sleep_then, 60).result(timeout=60)
        assert time.monotonic() - started < 30
    # a call's own timeout; the pool goes on (its next call has none: a call's clock counts
    # from its turn, so Ray's start of a new worker for it, seconds on a busy machine,
    # would be in it)
    with mp.Pool(2, backend="ray") as pool:
        with pytest.raises(mp.TaskTimeoutError, match="task_timeout of 2 s"):
            pool.apply_async(_sleep_then, (60,), task_timeout=2.0).get(timeout=60)
        assert pool.apply(_inc, (7,)) == 8
    with mp.ProcessPoolExecutor(2, backend="ray") as ex:
        future = ex.submit(_sleep_then, 60)
        time.sleep(0.5)
        future.kill()
        with pytest.raises(Exception, match="killed"):
            future.result(timeout=30)
        assert ex.submit(_inc, 8).result(timeout=60) == 9


@pytest.mark.ray_tasks
def test_a_pool_on_ray_maps_and_arrays_go_in_read_only_and_come_back_writable(
    cluster_idle_after,
):
    big = np.ones(1 << 18)  # 2 MiB: put in the object store once, read there
    with mp.Pool(2, backend="ray") as pool:
        assert pool.map(_inc, range(20)) == list(range(1, 21))
        assert pool.apply(_inc, (3,)) == 4
        assert sorted(pool.imap_unordered(_inc, range(5))) == [1, 2, 3, 4, 5]
        assert pool.map(_sum_and_writable, [big, big]) == [(float(1 << 18), False)] * 2
        big += 1  # a writable array goes anew with each call: the change is seen
        assert pool.apply(_sum_and_writable, (big,)) == (float(2 << 18), False)
        big.flags.writeable = False  # a read-only one goes once, for every call
        assert pool.apply(_sum_and_writable, (big,)) == (float(2 << 18), False)
        result = pool.apply(_ones, (10,))
        result[0] = 5.0  # a result is the caller's own, writable
        with pytest.raises(ValueError, match="bad item 2"):
            pool.apply(_raise_value_error, (2,))


def test_options_that_do_not_apply_on_ray_are_refused_in_the_caller():
    with pytest.raises(ValueError, match="max_tasks_per_child do\\(es\\) not apply"):
        mp.ProcessPoolExecutor(2, backend="ray", max_tasks_per_child=3)
    with pytest.raises(ValueError, match="unknown backend 'dask'"):
        mp.Pool(2, backend="dask")
    with pytest.raises(ValueError, match="ray_address applies to backend='ray' only"):
        mp.Pool(2, ray_address="auto")


@pytest.mark.ray_tasks
def test_a_shared_array_is_refused_with_the_reason(cluster_idle_after):
    shared = sharing.zeros(16)
    with mp.ProcessPoolExecutor(1, backend="ray") as ex:
        with pytest.raises(ValueError, match="shared-memory array .* one machine only"):
            ex.submit(_sum_and_writable, shared).result(timeout=60)
    del shared


@pytest.mark.ray_tasks
def test_ctrl_c_while_waiting_on_a_ray_executor_stops_its_tasks(cluster_idle_after):
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        with pytest.raises(KeyboardInterrupt):
            with mp.ProcessPoolExecutor(2, backend="ray") as ex:
                futures = [ex.submit(_sleep_then, 60) for _ in range(2)]
                futures[0].result(timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert all(f.done() for f in futures)


def _span(seconds):
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


@pytest.mark.ray_tasks
def test_at_most_max_workers_run_at_once_and_a_queued_call_s_timeout_waits_its_turn(
    cluster_idle_after,
):
    # one CPU for the pool, its Ray worker started (a first call, with no timeout: the
    # worker's start is in a call's clock), then four calls of 1 s each with a task_timeout
    # of 2.5 s: they run one after another, and the last, queued 3 s, is not late
    with mp.Pool(1, backend="ray") as pool:
        assert pool.apply(_inc, (0,)) == 1
        calls = [pool.apply_async(_span, (1.0,), task_timeout=2.5) for _ in range(4)]
        spans = sorted(call.get(timeout=60) for call in calls)
    assert all(spans[i][1] <= spans[i + 1][0] + 0.01 for i in range(3)), spans


@pytest.mark.ray_tasks
def test_the_reusable_executor_on_ray_is_reused_until_its_size_changes(cluster_idle_after):
    first = mp.get_reusable_executor(max_workers=1, backend="ray")
    try:
        assert first.submit(_inc, 1).result(timeout=60) == 2
        assert mp.get_reusable_executor(max_workers=1, backend="ray") is first
        second = mp.get_reusable_executor(max_workers=2, backend="ray")
        assert second is not first  # Ray's reservation has its size: a new executor
        assert list(second.map(_inc, range(4), timeout=60)) == [1, 2, 3, 4]
    finally:
        for executor in (first, mp.get_reusable_executor(max_workers=2, backend="ray")):
            executor.shutdown(wait=True)


@pytest.mark.slow  # a local cluster of its own (5 s)
def test_a_ray_executor_s_calls_are_waited_for_as_the_program_ends(tmp_path):
    out = tmp_path / "done"
    code = textwrap.dedent(
        f"""
        import time
        import procspawn

        def slow(x):
            time.sleep(1.0)
            with open({str(out)!r}, "a") as f:
                f.write(f"{{x}}\\n")
            return x

        if __name__ == "__main__":
            ex = procspawn.ProcessPoolExecutor(2, backend="ray")
            futures = [ex.submit(slow, i) for i in range(2)]
        """
    )
    env = dict(script_env())
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env
    )
    assert result.returncode == 0, result.stderr
    assert sorted(out.read_text().split()) == ["0", "1"]  # as the stdlib's executor does


_SETTING = None


def _set_setting(value):
    global _SETTING
    _SETTING = value


def _read_setting(_):
    return _SETTING


def _refuse_to_start():
    raise RuntimeError("no config file")


@pytest.mark.ray_tasks
def test_an_initializer_runs_in_each_ray_worker_and_one_that_raises_breaks_the_pool(
    cluster_idle_after,
):
    with mp.ProcessPoolExecutor(1, backend="ray", initializer=_set_setting, initargs=(7,)) as ex:
        assert ex.submit(_read_setting, 0).result(timeout=60) == 7
    with mp.ProcessPoolExecutor(1, backend="ray", initializer=_refuse_to_start) as ex:
        with pytest.raises(mp.InitializerError, match="initializer raised in a Ray worker"):
            ex.submit(_inc, 1).result(timeout=60)
        with pytest.raises(mp.InitializerError):
            ex.submit(_inc, 2)  # broken: refused at once


def _negate(x):
    return -x


@pytest.mark.ray_tasks
def test_joblib_on_ray_through_procspawn_s_backend(cluster_idle_after):
    joblib = pytest.importorskip("joblib", reason="joblib is not installed")
    import procspawn.joblib

    procspawn.joblib.register("procspawn_ray_test", backend="ray")
    try:
        with joblib.parallel_config(backend="procspawn_ray_test", n_jobs=2):
            assert joblib.Parallel()(joblib.delayed(_negate)(i) for i in range(20)) == [
                -i for i in range(20)
            ]
            with pytest.raises(ValueError, match="bad item [45]"):
                joblib.Parallel()(joblib.delayed(_raise_value_error)(i) for i in range(5, 3, -1))
        with pytest.raises(ValueError, match="start_method do\\(es\\) not apply"):
            with joblib.parallel_config(backend="procspawn_ray_test", start_method="fork"):
                pass
    finally:
        executor = mp.pool._reusable.current_reusable_executor(break_on_death=False)
        if executor is not None:
            executor.shutdown(wait=True)
