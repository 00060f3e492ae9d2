"""procspawn's joblib backend as scikit-learn and ``joblib.Parallel`` users meet it (issue 38,
point 1): ``parallel_config(backend="procspawn")`` after ``procspawn.joblib.register()``."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import procspawn
from procspawn import sharing

joblib = pytest.importorskip("joblib", reason="the joblib extra is not installed")
import procspawn.joblib  # noqa: E402 -- needs joblib

pytestmark = pytest.mark.timeout(120)

procspawn.joblib.register()


@pytest.fixture(autouse=True)
def stop_workers():
    yield
    procspawn.joblib.shutdown(wait=True)


def parallel(n_jobs=2, **kwargs):
    return joblib.Parallel(n_jobs=n_jobs, **kwargs)


def delayed(fn):
    return joblib.delayed(fn)


def square(x):
    return x * x


def total(x, i):
    return float(x.sum()) + i


def pid_of(_):
    time.sleep(0.05)
    return os.getpid()


def kill_self_at(i, at):
    if i == at:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
    return i


def nap(seconds):
    time.sleep(seconds)
    return seconds


def write_at(x, i, value):
    x[i] = value
    return float(x[i])


def write_and_read_back(x, i):
    """Write slot ``i`` and wait to see every other task's write (only one shared copy
    shows them all); returns whether it saw them within a deadline."""
    x[i] = 1
    deadline = time.monotonic() + 20
    while x.sum() < len(x):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def first_after_writing(x, value):
    x[0] = value
    time.sleep(0.05)
    return float(x[0]), float(x[1])


def writeable(x):
    return x.flags.writeable


def nested(i):
    return sum(joblib.Parallel(n_jobs=2)(joblib.delayed(square)(j) for j in range(i)))


def blas_threads(_):
    from threadpoolctl import threadpool_info

    return sorted({info["num_threads"] for info in threadpool_info()})


def failing(i):
    if i == 2:
        raise ValueError(f"task {i} says no")
    time.sleep(1)
    return i


@pytest.mark.parametrize("start_method", procspawn.get_all_start_methods())
def test_results_equal_the_sequential_ones_under_every_start_method(start_method):
    X = np.arange(400_000, dtype=np.float64)  # 3.2 MB: above max_nbytes, through a copy
    with joblib.parallel_config(backend="procspawn", start_method=start_method):
        got = parallel()(delayed(total)(X, i) for i in range(8))
    assert got == [total(X, i) for i in range(8)]


def test_results_equal_joblibs_own():
    X = np.random.default_rng(0).random((300, 300))
    with joblib.parallel_config(backend="sequential"):
        expected = parallel()(delayed(np.linalg.norm)(X[i:]) for i in range(10))
    with joblib.parallel_config(backend="procspawn"):
        got = parallel()(delayed(np.linalg.norm)(X[i:]) for i in range(10))
    # (SIMD sums round by the data's alignment, which a copy may change: within an ulp)
    np.testing.assert_allclose(got, expected, rtol=1e-14)


def test_the_backend_runs_in_worker_processes_it_reuses():
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        first = set(parallel()(delayed(pid_of)(i) for i in range(6)))
        second = set(parallel()(delayed(pid_of)(i) for i in range(6)))
    assert os.getpid() not in first
    assert first & second  # the next call's workers are the same processes


def test_a_killed_worker_is_an_error_from_parallel_and_the_next_call_works():
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        parallel()(delayed(square)(i) for i in range(2))  # workers up
        start = time.monotonic()
        with pytest.raises(procspawn.ProcessExitedException) as info:
            parallel(batch_size=1)(delayed(kill_self_at)(i, 3) for i in range(8))
        elapsed = time.monotonic() - start
        assert parallel()(delayed(square)(i) for i in range(5)) == [0, 1, 4, 9, 16]
    message = str(info.value)
    assert "SIGKILL" in message and "kill_self_at(3, 3)" in message, message
    assert elapsed < 5, elapsed  # (within milliseconds; the bound only catches a hang)


def test_the_first_error_stops_this_calls_tasks_and_is_raised():
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        start = time.monotonic()
        with pytest.raises(ValueError, match="task 2 says no"):
            parallel(batch_size=1)(delayed(failing)(i) for i in range(20))
        # 20 tasks of 1 s on 2 workers would take 10 s; the error stops them
        assert time.monotonic() - start < 7
        assert parallel()(delayed(square)(i) for i in range(3)) == [0, 1, 4]


def test_task_timeout_through_parallel_config():
    with joblib.parallel_config(backend="procspawn", n_jobs=2, task_timeout=0.5):
        with pytest.raises(procspawn.TaskTimeoutError):
            parallel(batch_size=1)(delayed(nap)(s) for s in (0.01, 30))
        assert parallel()(delayed(nap)(0.01) for _ in range(2)) == [0.01, 0.01]


def test_retries_through_parallel_config_run_a_task_again_after_a_death(tmp_path):
    marker = tmp_path / "died-once"
    with joblib.parallel_config(backend="procspawn", n_jobs=2, retries=1):
        got = parallel(batch_size=1)(delayed(die_once)(str(marker), i) for i in range(4))
    assert got == [0, 1, 2, 3] and marker.exists()


def die_once(marker, i):
    if i == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def test_a_wrong_option_is_refused_where_it_is_given():
    with pytest.raises(TypeError, match="no option 'task_timeot'.*task_timeout"):
        joblib.parallel_config(backend="procspawn", task_timeot=5)
    with pytest.raises(ValueError, match="task_timeout must be"):
        joblib.parallel_config(backend="procspawn", task_timeout=-1)
    with pytest.raises(ValueError, match="max_tasks_per_child must be"):
        joblib.parallel_config(backend="procspawn", max_tasks_per_child=0)
    with pytest.raises(ValueError, match="idle_worker_timeout must be"):
        joblib.parallel_config(backend="procspawn", idle_worker_timeout="300")


def test_mmap_mode_r_gives_read_only_views():
    X = np.zeros(200_000)
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        assert parallel()(delayed(writeable)(X) for _ in range(2)) == [False, False]
        with pytest.raises(ValueError, match="read-only"):
            parallel()(delayed(write_at)(X, 0, 1.0) for _ in range(2))
        # under max_nbytes: by value, a private writable copy
        assert parallel()(delayed(writeable)(np.zeros(10)) for _ in range(2)) == [True, True]


def test_mmap_mode_r_plus_tasks_see_each_others_writes():
    X = np.zeros(150_000)  # 1.2 MB, one copy for the call
    X[2:] = 1  # every slot but the two the tasks write
    with joblib.parallel_config(backend="procspawn", n_jobs=2, mmap_mode="r+"):
        seen = parallel(batch_size=1)(delayed(write_and_read_back)(X, i) for i in (0, 1))
    assert seen == [True, True]
    assert X[0] == 0 and X[1] == 0  # a plain array of the caller's: a copy was written


def test_mmap_mode_r_plus_writes_reach_an_array_already_in_shared_memory():
    X = sharing.zeros(200_000)
    with joblib.parallel_config(backend="procspawn", n_jobs=2, mmap_mode="r+"):
        parallel()(delayed(write_at)(X, i, i + 1.0) for i in range(4))
    assert list(X[:5]) == [1.0, 2.0, 3.0, 4.0, 0.0]


def test_mmap_mode_c_gives_each_task_a_private_copy():
    X = np.zeros(200_000)
    with joblib.parallel_config(backend="procspawn", n_jobs=2, mmap_mode="c"):
        got = parallel(batch_size=1)(delayed(first_after_writing)(X, v) for v in (1.0, 2.0))
    assert got == [(1.0, 0.0), (2.0, 0.0)]
    assert X[0] == 0


def test_max_nbytes_none_sends_arrays_by_value():
    X = np.zeros(200_000)
    with joblib.parallel_config(backend="procspawn", n_jobs=2, max_nbytes=None):
        assert parallel()(delayed(writeable)(X) for _ in range(2)) == [True, True]


def test_a_generator_input_and_generator_outputs():
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        ordered = parallel(return_as="generator")(delayed(square)(i) for i in range(10))
        assert list(ordered) == [i * i for i in range(10)]
        unordered = parallel(return_as="generator_unordered")(delayed(square)(i) for i in range(10))
        assert sorted(unordered) == [i * i for i in range(10)]


def test_nested_parallel_inside_a_task():
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        got = parallel()(delayed(nested)(i) for i in range(4))
    assert got == [sum(j * j for j in range(i)) for i in range(4)]


def test_n_jobs_one_runs_in_this_process():
    with joblib.parallel_config(backend="procspawn", n_jobs=1):
        assert parallel(n_jobs=1)(delayed(pid_of)(i) for i in range(2)) == [os.getpid()] * 2


def test_inner_threads_are_limited_in_the_workers():
    pytest.importorskip("threadpoolctl")
    with joblib.parallel_config(backend="procspawn", n_jobs=2, inner_max_num_threads=1):
        got = parallel()(delayed(blas_threads)(i) for i in range(2))
    assert got[0] == [1] and got[1] == [1]


def test_scikit_learn_grid_search_scores_equal_the_sequential_ones():
    datasets = pytest.importorskip("sklearn.datasets")
    from sklearn.model_selection import GridSearchCV
    from sklearn.svm import SVC

    X, y = datasets.load_digits(return_X_y=True)
    X, y = X[:300], y[:300]
    grid = {"C": [1, 10], "gamma": [0.001]}
    scores = {}
    for backend in ("sequential", "procspawn"):
        with joblib.parallel_config(backend=backend):
            search = GridSearchCV(SVC(), grid, cv=3, n_jobs=2).fit(X, y)
        scores[backend] = search.cv_results_["mean_test_score"]
    np.testing.assert_array_equal(scores["procspawn"], scores["sequential"])


def test_import_procspawn_imports_no_joblib():
    import subprocess
    import sys

    code = (
        "import sys, procspawn\n"
        "names = ('joblib', 'threadpoolctl', 'tqdm', 'dask')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[-1] in names or 'joblib' in m))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def loky_inside(n):
    return sum(
        joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(square)(j) for j in range(n))
    )


@pytest.mark.parametrize("n_jobs", [2, 4])
def test_a_long_batch_holds_no_short_one_behind_it(n_jobs):
    with joblib.parallel_config(backend="procspawn", n_jobs=n_jobs):
        # (batches measured short: the pool would hold the next one behind a busy
        # worker if every batch counted as one function)
        parallel(batch_size=1)(delayed(nap)(0.001) for _ in range(20))
        naps = [0.01, 30] + [0.01] * 8
        results = parallel(return_as="generator_unordered", batch_size=1, pre_dispatch="all")(
            delayed(nap)(s) for s in naps
        )
        start = time.monotonic()
        firsts = [next(results) for _ in range(9)]
        elapsed = time.monotonic() - start
        with pytest.warns(UserWarning, match="cancelled"):  # joblib's, as under loky
            results.close()  # joblib aborts the call: the 30 s task's worker is killed
    assert firsts == [0.01] * 9
    assert elapsed < 15, elapsed  # not behind the 30 s task


def test_workers_that_ran_a_nested_loky_call_stop_at_once():
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        assert parallel()(delayed(loky_inside)(i) for i in (3, 4)) == [5, 14]
    start = time.monotonic()
    procspawn.joblib.shutdown(wait=True)  # loky's workers idle 300 s unless stopped
    assert time.monotonic() - start < 30


def loky_then_fail(i, mark, started):
    """Task 1 starts a loky executor (its workers marked), says so, and sleeps; task 0
    waits for that, then fails: joblib's abort kills task 1."""
    if i == 1:
        os.environ["PROCSPAWN_TEST_MARK"] = mark  # inherited by what the task starts
        big = np.zeros(300_000)  # over max_nbytes: loky memory-maps it in /dev/shm
        joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(np.sum)(big) for _ in range(4))
        open(started, "w").close()
        time.sleep(60)
        return i
    deadline = time.monotonic() + 60
    while not os.path.exists(started) and time.monotonic() < deadline:
        time.sleep(0.01)
    raise ValueError("task 0 fails once task 1's loky workers run")


def marked_pids(mark):
    """The processes whose environment has this test's mark: what the task started."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"PROCSPAWN_TEST_MARK={mark}".encode() in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def lokys_files():
    return {name for name in os.listdir("/dev/shm") if "loky" in name or "joblib" in name}


def test_a_killed_task_takes_what_it_started_with_it(tmp_path):
    mark, started = os.urandom(8).hex(), str(tmp_path / "started")
    files = lokys_files()
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        with pytest.raises(ValueError, match="loky workers run"):
            parallel(batch_size=1)(delayed(loky_then_fail)(i, mark, started) for i in range(2))
    assert os.path.exists(started)
    deadline = time.monotonic() + 10
    while (marked_pids(mark) or lokys_files() - files) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not marked_pids(mark)  # loky's workers and tracker went with their parent
    assert not lokys_files() - files  # and the tracker removed loky's files first


def total_at(x, i):
    return float(x[i])


def test_each_call_of_a_managed_parallel_sends_the_array_as_it_is_now():
    X = np.zeros(200_000)
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        with joblib.Parallel() as p:
            first = p(delayed(total_at)(X, 0) for _ in range(2))
            X[0] = 5.0  # changed in place between two calls of one Parallel
            second = p(delayed(total_at)(X, 0) for _ in range(2))
    assert first == [0.0, 0.0] and second == [5.0, 5.0]


def shared_and_writeable(x):
    return sharing.is_shared(x), x.flags.writeable, type(x).__name__


def test_a_memmap_argument_goes_as_one_shared_copy(tmp_path):
    data = np.memmap(tmp_path / "data", dtype=float, mode="w+", shape=(200_000,))
    data[:] = 1.0
    with joblib.parallel_config(backend="procspawn", n_jobs=2):
        got = parallel()(delayed(shared_and_writeable)(data) for _ in range(2))
    assert got == [(True, False, "ndarray")] * 2
    del data


def test_mmap_mode_r_plus_gives_writable_views_of_a_read_only_array():
    X = np.zeros(200_000)
    X.flags.writeable = False
    with joblib.parallel_config(backend="procspawn", n_jobs=2, mmap_mode="r+"):
        assert parallel()(delayed(writeable)(X) for _ in range(2)) == [True, True]
