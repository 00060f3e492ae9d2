"""procspawn.Pool and the executors as a user of the stdlib's would use them, and what goes
wrong around a task: initializers that raise, results that cannot travel, Ctrl-C, many
threads at once. Every wait has a deadline."""

from __future__ import annotations

import concurrent.futures
import functools
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool, _RemoteTraceback
from multiprocessing.pool import MaybeEncodingError, RemoteTraceback

import numpy as np
import pytest
from _helpers import ROOT, run_file, run_script, script_env
from _pool_workers import (
    add,
    array_sum,
    bad_initializer,
    exit_initializer,
    get_state,
    interrupt_on,
    interrupt_or_touch,
    make_array,
    nested_executor_and_spawn,
    nested_pool_map,
    pid_of,
    raise_value_error,
    return_generators,
    return_lock,
    return_unrebuildable,
    set_state,
    sleep_forever,
    slow_square,
    square,
    wait_for_file,
)

import procspawn as mp
from procspawn import sharing

DEADLINE = 30.0


@pytest.mark.timeout(60)
def test_the_stdlib_api(start_method):
    with mp.Pool(2, context=start_method) as p:
        assert p.apply(add, (1, 2)) == 3
        assert p.apply(add, (), {"x": 1, "y": 5}) == 6
        assert p.map(square, range(50)) == [x * x for x in range(50)]
        assert p.map(square, range(50), chunksize=7) == [x * x for x in range(50)]
        assert p.starmap(add, [(1, 2), (3, 4)]) == [3, 7]
        assert p.starmap_async(add, [(1, 2)]).get(DEADLINE) == [3]
        assert list(p.imap(square, iter(range(20)), chunksize=3)) == [x * x for x in range(20)]
        assert sorted(p.imap_unordered(square, range(20))) == [x * x for x in range(20)]
        r = p.apply_async(square, (4,))
        assert r.get(DEADLINE) == 16 and r.ready() and r.successful()
        assert p.map(lambda x: x + 1, [1, 2]) == [2, 3]  # lambdas travel by cloudpickle
        # more functions than a worker keeps: each call still runs its own
        adders = [lambda x, k=k: x + k for k in range(40)]
        assert [p.apply(f, (1,)) for f in adders] == [1 + k for k in range(40)]
        assert [p.apply(f, (2,)) for f in reversed(adders)] == [2 + k for k in range(39, -1, -1)]
        seen = []
        p.map_async(square, [3], callback=seen.append).wait(DEADLINE)
        assert seen == [[9]]
    p.join()
    with pytest.raises(ValueError, match="Pool not running"):
        p.apply(square, (1,))


@pytest.mark.timeout(60)
def test_a_task_error_is_the_tasks_own_with_the_remote_traceback():
    with mp.Pool(1, context="fork") as p:
        with pytest.raises(ValueError, match="bad value 3") as info:
            p.map(raise_value_error, [3])
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "raise ValueError" in info.value.__cause__.tb
        errors = []
        p.apply_async(raise_value_error, (1,), error_callback=errors.append).wait(DEADLINE)
        assert isinstance(errors[0], ValueError)


@pytest.mark.timeout(60)
def test_a_tasks_own_keyboard_interrupt_is_a_task_error_not_the_callers_ctrl_c(tmp_path):
    """A task that raises KeyboardInterrupt: its caller gets it with the worker's traceback
    as its cause, as any task error (not stripped, nor handled, as a Ctrl-C of its own)."""
    with mp.Pool(1, context="fork") as p:
        pid = p.apply(pid_of)
        bad = functools.partial(interrupt_on, bad=3)
        for call in (lambda: p.apply(bad, (3,)), lambda: p.map(bad, [3])):
            with pytest.raises(KeyboardInterrupt, match="the task's own, at 3") as info:
                call()
            assert isinstance(info.value.__cause__, RemoteTraceback)
            assert "raise KeyboardInterrupt" in info.value.__cause__.tb
        it = p.imap(bad, range(6))
        seen = []
        for _ in range(6):
            try:
                seen.append(it.next(DEADLINE))
            except KeyboardInterrupt as exc:
                seen.append(str(exc))
        assert seen == [0, 1, 2, "the task's own, at 3", 4, 5]  # the imap went on
        assert p.apply(pid_of) == pid  # no worker was stopped
    touched = tmp_path / "touched"
    with pytest.raises(KeyboardInterrupt):
        with mp.ProcessPoolExecutor(2, mp_context="fork") as ex:
            f = ex.submit(interrupt_on, 3, 3)
            stored = f.exception(DEADLINE)
            with pytest.raises(KeyboardInterrupt) as info:
                f.result()
            assert info.value is stored and isinstance(stored.__cause__, _RemoteTraceback)
            assert isinstance(f.exception().__cause__, _RemoteTraceback)  # kept in the future
            with pytest.raises(KeyboardInterrupt, match="at 0"):
                list(ex.map(interrupt_or_touch, [0, 1], [str(touched)] * 2, chunksize=1))
            later = ex.submit(slow_square, 5, 0.3)
            ex.submit(interrupt_on, 3, 3).result(DEADLINE)
    # leaving `with` on a task's KeyboardInterrupt waited for the calls still running, as
    # on any error: the rest of the map, and the call submitted last
    assert touched.exists()
    assert later.result(0) == 25


@pytest.mark.timeout(60)
def test_arrays_go_both_ways_through_shared_memory(start_method):
    with mp.Pool(2, context=start_method) as p:
        arrays = [np.arange(100_000, dtype=np.float64) * i for i in range(4)]
        assert p.map(array_sum, arrays) == [float(a.sum()) for a in arrays]
        out = p.apply(make_array, (1 << 18,))
        assert out.shape == (1 << 18,) and float(out[0]) == 7.0
        assert sharing.is_shared(out)  # the result's memory was not copied through a pipe
        del out


@pytest.mark.timeout(60)
def test_the_initializer_runs_in_every_worker(start_method):
    with mp.Pool(2, initializer=set_state, initargs=("ready",), context=start_method) as p:
        assert set(p.map(get_state, range(8), chunksize=1)) == {"ready"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", ["pool", "executor"])
def test_an_initializer_that_raises_fails_the_calls_with_its_traceback(make):
    if make == "pool":
        pool = mp.Pool(2, initializer=bad_initializer, context="fork")
        with pytest.raises(mp.InitializerError) as info:
            # raised by get(), or by map_async() itself once the pool knows
            pool.map_async(square, range(4)).get(DEADLINE)
        with pytest.raises(mp.InitializerError):
            pool.apply(square, (1,))
        pool.terminate()
    else:
        ex = mp.ProcessPoolExecutor(2, mp_context="fork", initializer=bad_initializer)
        with pytest.raises(BrokenProcessPool) as info:
            # raised by result(), or by submit() itself once the executor knows
            ex.submit(square, 2).result(DEADLINE)
        ex.shutdown()
    assert isinstance(info.value, mp.InitializerError)
    assert "the initializer failed on purpose" in str(info.value)
    assert "bad_initializer" in str(info.value)  # the traceback


@pytest.mark.timeout(60)
def test_workers_that_die_before_they_are_ready_break_the_pool_instead_of_looping():
    pool = mp.Pool(2, initializer=exit_initializer, context="fork")
    try:
        with pytest.raises(mp.InitializerError, match="died before they were ready"):
            pool.map_async(square, range(4)).get(DEADLINE)
    finally:
        pool.terminate()


@pytest.mark.timeout(60)
def test_results_that_cannot_travel_fail_their_task_only():
    with mp.Pool(2, context="fork") as p:
        for _ in range(3):
            with pytest.raises(MaybeEncodingError, match="Error sending result.*lock"):
                p.apply(return_lock)
        with pytest.raises(Exception, match="could not be unpickled in the parent") as info:
            p.apply(return_unrebuildable)
        assert "return_unrebuildable()" in str(info.value)
        assert p.map(square, range(4)) == [0, 1, 4, 9]


@pytest.mark.timeout(60)
def test_a_result_that_cannot_travel_is_shown_once_and_named():
    with mp.Pool(1) as p:
        with pytest.raises(MaybeEncodingError) as info:
            p.apply(return_generators)
    text = str(info.value)
    assert "''" not in text  # shown once, not repr'd twice
    assert "<generator object return_generators.<locals>." in text  # its name, not cut
    assert " from return_generators" in text
    with mp.ProcessPoolExecutor(1) as executor:
        with pytest.raises(TypeError, match="generator") as caught:
            executor.submit(return_generators).result(timeout=DEADLINE)
    said = "".join(traceback.format_exception_only(caught.value))
    assert "the result of return_generators() could not be pickled" in said


@pytest.mark.timeout(60)
def test_arguments_that_cannot_be_pickled_fail_the_call():
    with mp.Pool(1, context="fork") as p:
        with pytest.raises(TypeError, match="lock"):
            p.map(square, [threading.Lock()])
        assert p.apply(square, (3,)) == 9


@pytest.mark.timeout(60)
def test_terminate_fails_what_is_not_done_and_leaves_nothing():
    p = mp.Pool(2, context="fork")
    pending = p.map_async(sleep_forever, range(10), chunksize=1)
    started = time.monotonic()
    p.terminate()
    p.join()
    assert time.monotonic() - started < DEADLINE
    with pytest.raises(RuntimeError, match="terminated"):
        pending.get(DEADLINE)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("maxtasksperchild", [None, 1])
def test_terminate_during_imap_fails_the_rest_with_the_same_error(maxtasksperchild):
    """The input still being fed when terminate() comes fails as the tasks handed out
    did (it was ValueError('Pool not running') from the feeding thread)."""
    p = mp.Pool(2, context="fork", maxtasksperchild=maxtasksperchild)
    it = p.imap_unordered(slow_square, range(2000))
    assert len([next(it) for _ in range(6)]) == 6
    p.terminate()
    with pytest.raises(RuntimeError, match="terminated before this task finished"):
        list(it)
    p.join()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["imap", "imap_unordered"])
def test_terminate_fails_an_imap_whose_input_waits(kind):
    """A pipeline's imap over a queue that is not fed again: after terminate(), next()
    raises at once (it waited forever for the input the feeder was still reading)."""
    import queue

    source: queue.Queue = queue.Queue()
    source.put(3)
    p = mp.Pool(2, context="fork")
    try:
        it = getattr(p, kind)(square, iter(source.get, None))
        assert next(it) == 9
        p.terminate()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="terminated"):
            next(it)
        assert time.monotonic() - started < DEADLINE
    finally:
        source.put(None)  # the feeder thread, still reading, ends
        p.terminate()
        p.join()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["imap", "imap_unordered"])
def test_an_imap_runs_what_its_input_gave_while_the_next_item_waits(kind):
    """A pipeline over a queue fed now and then: each item goes to the pool as soon as
    it was read (the feeder reads an iterator's items in batches of several chunks, and
    would hold the ones read while it waits for the next)."""
    import queue

    source: queue.Queue = queue.Queue()
    p = mp.Pool(2, context="fork")
    try:
        it = getattr(p, kind)(square, iter(source.get, None))
        for burst in ([1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11, 12, 13]):
            for x in burst:
                source.put(x)
            got = []
            for _ in burst:
                got.append(it.next(timeout=DEADLINE))  # TimeoutError: held back
            assert sorted(got) == [x * x for x in burst]
        source.put(None)
        assert list(it) == []
    finally:
        source.put(None)
        p.terminate()
        p.join()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["terminate", "break"])
def test_an_endless_imap_input_is_no_longer_read_once_its_pool_or_caller_stops(how):
    """An imap over an endless input, then terminate() (it read on, each chunk failing
    at once, and kept every failure), or the caller leaves its loop and drops the
    iterator (the feeder held it: the pool computed for ever): the input is read no
    more."""
    read = [0]

    def endless():
        while True:
            read[0] += 1
            yield read[0]

    p = mp.Pool(2, context="fork")
    try:
        it = p.imap(square, endless())
        assert [it.next(timeout=DEADLINE) for _ in range(5)] == [1, 4, 9, 16, 25]
        if how == "terminate":
            p.terminate()
        else:
            for value in it:
                if value > 100:
                    break
            del it  # no collection needed: nothing else holds it
        deadline = time.monotonic() + DEADLINE
        while any(t.name == "procspawn-pool-imap-feeder" for t in threading.enumerate()):
            assert time.monotonic() < deadline, f"the feeder still reads: {read[0]} items"
            time.sleep(0.01)
        count = read[0]
        time.sleep(0.2)
        assert read[0] == count
    finally:
        p.terminate()
        p.join()


def _input_raising_at(n):
    yield from range(n)
    raise KeyError("the input broke")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ["list", "generator"])
@pytest.mark.parametrize("chunksize", [1, 7])
def test_an_imap_gives_every_result_of_a_long_input_in_order(source, chunksize):
    """Past the chunks handed out at once (a list's go in batches, an iterator's one by
    one as room comes), every result comes, in order, and an input that raises ends the
    results there with its error (the items of a chunk it did not finish are lost with
    it, as with the stdlib's)."""
    n = 3000
    items = list(range(n)) if source == "list" else iter(range(n))
    with mp.Pool(2, context="fork") as p:
        assert list(p.imap(square, items, chunksize)) == [x * x for x in range(n)]
        it = p.imap(square, _input_raising_at(100), chunksize)
        whole = 100 // chunksize * chunksize
        assert [it.next(timeout=DEADLINE) for _ in range(whole)] == [x * x for x in range(whole)]
        with pytest.raises(KeyError, match="the input broke"):
            it.next(timeout=DEADLINE)


_FORK_DURING_FIRST_USE = """
import os, sys, threading

import procspawn

def inc(x):
    return x + 1

if __name__ == "__main__":
    threading.Thread(target=lambda: procspawn.Pool(1, context="fork").terminate()).start()
    while "procspawn.pool._dispatcher" not in sys.modules:  # its import has begun
        pass
    pid = os.fork()
    if pid == 0:
        import faulthandler
        faulthandler.dump_traceback_later(20, exit=True)  # a hang: its stack, exit 1
        with procspawn.Pool(2, context="fork") as pool:
            print("child", pool.map(inc, range(3)), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_fork_while_another_thread_first_makes_a_pool_leaves_the_child_working():
    """One thread makes the program's first pool, which imports procspawn's pool modules,
    while another forks: the fork waits for the import to finish (the child had them
    half-imported, their import locks held by a thread it has not, and hung at its first
    pool)."""
    result = run_script(_FORK_DURING_FIRST_USE, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "child [1, 2, 3]" in result.stdout, result.stdout + result.stderr
    assert "child exit 0" in result.stdout, result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_close_lets_the_work_given_finish():
    p = mp.Pool(2, context="fork")
    it = p.imap(square, range(30), chunksize=2)
    result = p.map_async(square, range(10))
    p.close()
    p.join()
    assert result.get(0) == [x * x for x in range(10)]
    assert list(it) == [x * x for x in range(30)]


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused_in_the_caller():
    with pytest.raises(ValueError, match="at least 1"):
        mp.Pool(0)
    with pytest.raises(ValueError, match="maxtasksperchild"):
        mp.Pool(1, maxtasksperchild=0)
    with pytest.raises(TypeError, match="initializer must be a callable"):
        mp.Pool(1, initializer=3)
    with pytest.raises(ValueError, match="unknown start method"):
        mp.Pool(1, context="nonsense")
    with pytest.raises(ValueError, match="max_workers"):
        mp.ProcessPoolExecutor(0)
    with pytest.raises(ValueError, match="max_workers"):
        mp.get_reusable_executor(0)
    with pytest.raises(ValueError, match="timeout"):
        mp.get_reusable_executor(1, timeout=-1)


@pytest.mark.timeout(60)
def test_the_drop_in_context_pool_is_procspawns():
    with mp.get_context("fork").Pool(1) as p:
        assert isinstance(p, mp.Pool)
        assert p.apply(square, (5,)) == 25


# -- the executor --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_executor_api(start_method):
    with mp.ProcessPoolExecutor(2, mp_context=start_method) as ex:
        assert ex.submit(add, 2, y=3).result(DEADLINE) == 5
        assert list(ex.map(square, range(10))) == [x * x for x in range(10)]
        assert list(ex.map(add, range(10), range(10), chunksize=3)) == [2 * x for x in range(10)]
        assert ex.submit(lambda: 7).result(DEADLINE) == 7
        f = ex.submit(raise_value_error, 1)
        assert isinstance(f.exception(DEADLINE), ValueError)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(square, 1)


@pytest.mark.timeout(60)
def test_executor_map_timeout_and_cancel_futures():
    ex = mp.ProcessPoolExecutor(1, mp_context="fork")
    try:
        it = ex.map(sleep_forever, [1], timeout=0.2)
        # (the builtin TimeoutError from 3.11; its own class before, as the stdlib's)
        with pytest.raises(concurrent.futures.TimeoutError):
            next(it)
    finally:
        ex._dispatcher.terminate(grace_period=0)
    ex = mp.ProcessPoolExecutor(1, mp_context="fork")
    running = ex.submit(time.sleep, 0.5)
    deadline = time.monotonic() + DEADLINE
    while not running.running():  # handed out (only a pending future can be cancelled)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    queued = [ex.submit(square, x) for x in range(5)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert running.result(0) is None
    assert all(f.cancelled() or f.result(0) is not None for f in queued)
    assert any(f.cancelled() for f in queued)


@pytest.mark.timeout(60)
def test_calls_cancelled_by_shutdown_wake_wait_and_as_completed(tmp_path):
    """``shutdown(cancel_futures=True)`` from one thread while another waits in
    ``as_completed()`` on those futures: the waiter gets every one (done or cancelled);
    ``wait()`` afterwards sees them all done (they waited forever, as with the stdlib's
    executor: ``Future.cancel()`` alone does not tell them)."""
    import concurrent.futures as cf

    release = str(tmp_path / "release")
    ex = mp.ProcessPoolExecutor(1, mp_context="fork")
    try:
        running = ex.submit(wait_for_file, release, DEADLINE)  # runs until released
        queued = [ex.submit(square, x) for x in range(20)]
        seen: list[object] = []

        def wait_all():
            for f in cf.as_completed([running, *queued], timeout=DEADLINE):
                seen.append(f)

        waiter = threading.Thread(target=wait_all)
        waiter.start()
        deadline = time.monotonic() + DEADLINE
        while not running.running():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        threading.Timer(0.3, lambda: open(release, "w").close()).start()
        ex.shutdown(wait=True, cancel_futures=True)  # cancels before the release
        waiter.join(DEADLINE)
        assert not waiter.is_alive()
        assert len(seen) == 21
        assert any(f.cancelled() for f in queued)
        done, not_done = cf.wait(queued, timeout=0)
        assert not not_done
    finally:
        open(release, "w").close()
        ex.shutdown(wait=False)


@pytest.mark.timeout(60)
def test_max_tasks_per_child_replaces_workers_even_under_fork():
    with mp.ProcessPoolExecutor(1, mp_context="fork", max_tasks_per_child=2) as ex:
        pids = [ex.submit(pid_of).result(DEADLINE) for _ in range(6)]
    assert len(set(pids)) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_max_tasks_per_child_of_one_over_a_map(method):
    """A map hands out two tasks per worker when it can: never past a worker's budget
    (its extra tasks would wait on a worker that exits, which broke the executor)."""
    with mp.ProcessPoolExecutor(2, mp_context=method, max_tasks_per_child=1) as ex:
        pids = list(ex.map(pid_of, range(40), timeout=DEADLINE))
    assert len(set(pids)) == 40  # one task per worker, and every task ran


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "method, strategy",
    [
        ("fork", "file_descriptor"),
        # the same soak under another start method, another strategy: out of the default run
        pytest.param("forkserver", "file_descriptor", marks=pytest.mark.slow),
        pytest.param("fork", "file_system", marks=pytest.mark.slow),
    ],
)
def test_hundreds_of_worker_lifetimes_under_a_limit_of_64_descriptors(method, strategy):
    """Workers replaced after every task, arrays in every result, a process allowed 64
    open descriptors: every result arrives, and after the pools the parent has the
    descriptors, children and /dev/shm entries it had before them (seen from outside)."""
    code = textwrap.dedent(
        """
        import os, resource, sys
        import numpy as np
        import procspawn

        def ones(i):
            return os.getpid(), np.full(100, i)

        def ours(pids):  # /dev/shm names of this process or its workers
            return {n for n in os.listdir("/dev/shm")
                    if n.startswith("procspawn_") and int(n.split("_")[1]) in pids}

        def children():
            return [t for t in os.listdir("/proc") if t.isdigit()
                    and open(f"/proc/{t}/stat").read().rsplit(")", 1)[1].split()[1]
                    == str(os.getpid())]

        if __name__ == "__main__":
            method = sys.argv[1]
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
            pids = {os.getpid()}
            start = os.listdir("/proc/self/fd")
            with procspawn.Pool(2, maxtasksperchild=1, context=method) as pool:
                out = pool.map(ones, range(90), chunksize=1)
                assert [int(a[0]) for _, a in out] == list(range(90))
                pids.update(pid for pid, _ in out)
                del out
            with procspawn.ProcessPoolExecutor(2, mp_context=method,
                                               max_tasks_per_child=1) as ex:
                out = list(ex.map(ones, range(60), timeout=60))
                assert [int(a[0]) for _, a in out] == list(range(60))
                pids.update(pid for pid, _ in out)
                del out
            extra = {
                fd: os.readlink(f"/proc/self/fd/{fd}")
                for fd in set(os.listdir("/proc/self/fd")) - set(start)
            }
            if method == "fork":
                assert children() == [], children()
                assert extra == {}, extra
            else:  # the fork server's alive pipe and the resource tracker's: until exit
                assert len(extra) <= 2 and all(
                    link.startswith("pipe:") for link in extra.values()), extra
            assert len(pids) > 120  # a worker per task: 150 lifetimes at a limit of 64
            assert ours(pids) == set(), ours(pids)
            print("ok")
        """
    )
    env = {"PROCSPAWN_SHARING_STRATEGY": strategy}
    result = run_script(code, timeout=110, args=[method], env_extra=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("make", ["pool", pytest.param("executor", marks=pytest.mark.slow)])
def test_a_pool_made_with_too_few_descriptors_left_says_so_and_the_fork_server_lives(make):
    """A pool made while the process is (nearly) out of descriptors, for every count from
    none to enough left: it works, or the caller gets an FdLimitError (what ran out, what
    to do), never a bare EMFILE from deep inside; the fork server is not killed by a
    request cut short (it printed a traceback and died), and a pool made afterwards works."""
    code = textwrap.dedent(
        """
        import os, resource, sys
        import procspawn
        from procspawn.context.launch import _forkserver

        def run(make):
            if make == "pool":
                with procspawn.Pool(1, context="forkserver") as p:
                    return p.apply(abs, (-1,))
            with procspawn.ProcessPoolExecutor(1, mp_context="forkserver") as ex:
                return ex.submit(abs, -1).result(timeout=30)

        if __name__ == "__main__":
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
            assert run(sys.argv[1]) == 1
            server = _forkserver._server._forkserver_pid
            outcomes = set()
            for free in range(26):
                held = []
                try:
                    while True:
                        held.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    pass
                for fd in held[:free]:
                    os.close(fd)
                try:
                    outcomes.add("ok" if run(sys.argv[1]) == 1 else "wrong")
                except procspawn.FdLimitError:
                    outcomes.add("FdLimitError")
                finally:
                    for fd in held[free:]:
                        os.close(fd)
            assert outcomes == {"ok", "FdLimitError"}, outcomes
            assert _forkserver._server._forkserver_pid == server
            assert run(sys.argv[1]) == 1
            print("ok")
        """
    )
    result = run_script(code, timeout=80, args=[make])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


_FD_LIMIT_SCRIPT = """
import os, resource, sys
import numpy as np
import procspawn

HELD = []


def arr(i):
    return np.full(40_000, float(i))  # 320 KB: a segment of its own, a descriptor each


def hold_every_descriptor():
    while True:
        try:
            HELD.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return len(HELD)


def total(a):
    return float(a.sum())


if __name__ == "__main__":
    procspawn.set_sharing_strategy("file_descriptor")  # chosen: no fallback
    side = sys.argv[1]
    if side == "parent":  # the caller cannot receive its results' descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        pool = procspawn.Pool(2, context="forkserver")
        call = lambda: pool.map(arr, range(200), chunksize=1)
    else:  # a worker cannot receive its arguments' descriptors
        pool = procspawn.Pool(1, context="forkserver", initializer=resource.setrlimit,
                              initargs=(resource.RLIMIT_NOFILE, (64, 64)))
        assert pool.apply(hold_every_descriptor) > 0
        call = lambda: pool.apply(total, (np.ones(100_000),))
    with pool:
        try:
            call()
        except procspawn.FdLimitError as exc:
            print("FdLimitError:", exc)
        print(pool.map(abs, [-1, -2, -3]))  # the pool goes on
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("side", ["parent", "worker"])
def test_a_process_at_its_descriptor_limit_fails_the_call_instead_of_hanging(side):
    """Under the file_descriptor strategy (chosen, so no fallback) a process at its hard
    limit cannot receive a message's descriptors: the call whose arrays they were fails
    with FdLimitError, which names the limit and the fixes, and the pool goes on (the
    caller's side hung before: the dispatcher took the error for the channel's end)."""
    result = run_script(_FD_LIMIT_SCRIPT, timeout=110, args=[side])
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = result.stdout.strip().splitlines()
    assert first.startswith("FdLimitError: [Errno 24] too many open files: the "), first
    what = "the result of arr(" if side == "parent" else "the arguments of a task"
    assert what in first, first
    who = "this process" if side == "parent" else "process "
    assert f"because {who}" in first and "(RLIMIT_NOFILE soft=64, hard=64)" in first, first
    assert "file_system" in first
    assert last == "[1, 2, 3]"


# -- the reusable executor -----------------------------------------------------------


@pytest.fixture
def reusable():
    yield mp.get_reusable_executor
    mp.get_reusable_executor().shutdown(wait=True)


@pytest.mark.timeout(90)
def test_the_reusable_executor_from_four_threads_at_once(reusable):
    errors = []
    results = {}

    def work(n):
        try:
            for i in range(40):
                ex = reusable(max_workers=2 + (i % 2))  # resized in place, never replaced
                results[(n, i)] = ex.submit(square, n * 100 + i).result(DEADLINE)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE * 2)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert results == {(n, i): (n * 100 + i) ** 2 for n in range(4) for i in range(40)}
    assert reusable(max_workers=2) is reusable(max_workers=2)


@pytest.mark.timeout(90)
def test_the_reusable_executor_takes_lokys_arguments(reusable):
    """A user of loky's: context= (its name for mp_context), reuse=, timeout=None; its
    second positional argument (the context) is refused with the fix."""
    ex = reusable(max_workers=1, context="fork", timeout=None)
    assert ex._dispatcher.start_method == "fork"
    assert ex.submit(square, 3).result(DEADLINE) == 9
    assert reusable(max_workers=1, mp_context="fork", timeout=None) is ex
    fresh = reusable(max_workers=1, context="fork", timeout=None, reuse=False)
    assert fresh is not ex and fresh.submit(square, 4).result(DEADLINE) == 16
    with pytest.raises(ValueError, match="mp_context='loky'"):
        reusable(2, "loky")
    with pytest.raises(ValueError, match="not both"):
        reusable(max_workers=1, context="fork", mp_context="spawn")
    with pytest.raises(ValueError, match="reuse"):
        reusable(max_workers=1, reuse="sometimes")
    with pytest.raises(TypeError, match="max_workers must be an int"):
        mp.ProcessPoolExecutor(1.5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_an_executors_worker_may_start_processes_a_pools_may_not(start_method):
    """As the stdlib's: a call on an executor may run a pool, an executor, the reusable
    executor or spawn() of its own (the worker is not daemonic to itself); a Pool's
    worker is daemonic, and procspawn says so in the caller instead of asserting."""
    with mp.ProcessPoolExecutor(1, mp_context=start_method) as ex:
        assert ex.submit(nested_executor_and_spawn, 3).result(DEADLINE) == (
            [0, 1, 4],
            9,
            [3, 4],
        )
    with mp.Pool(1, context=start_method) as pool:
        message = pool.apply(nested_pool_map, (3,))
    assert "daemonic" in message and "ProcessPoolExecutor" in message, message


@pytest.mark.timeout(60)
def test_a_forked_child_using_its_parents_pool_is_told_at_once():
    """A program forks while it has a pool: the child's calls on that pool would never be
    answered (its workers and their thread stayed with the parent); they raise at once,
    and a pool made in the child works. The parent's pool is unharmed."""
    code = textwrap.dedent(
        """
        import os, sys
        import procspawn as mp
        from _pool_workers import square

        if __name__ == "__main__":
            pool = mp.Pool(1, context="fork")
            ex = mp.ProcessPoolExecutor(1, mp_context="fork")
            pid = os.fork()
            if pid == 0:
                told = []
                for call in (lambda: pool.map(square, [1]), lambda: ex.submit(square, 1)):
                    try:
                        call()
                    except RuntimeError as exc:
                        told.append("cannot use it" in str(exc))
                with mp.Pool(1, context="fork") as own:
                    told.append(own.apply(square, (4,)) == 16)
                print(told, flush=True)
                os._exit(0)
            os.waitpid(pid, 0)
            print(pool.apply(square, (3,)), ex.submit(square, 5).result(30), flush=True)
            pool.terminate()
            ex.shutdown()
        """
    )
    tests = os.path.join(ROOT, "tests")
    result = run_script(code, timeout=50, env_extra={"PYTHONPATH": os.pathsep.join([tests, ROOT])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[True, True, True]", "9 25"], result.stdout


@pytest.mark.timeout(60)
def test_a_pool_nobody_holds_works_as_long_as_its_results_are_held():
    """``Pool(2).apply_async(f)``: the stdlib's results hold their pool, so the call
    runs; ours terminated the pool the caller dropped (RuntimeError at get()). Once its
    last result goes too, the pool is terminated and its workers exit."""
    result = mp.Pool(2, context="fork").apply_async(slow_square, (3, 0.3))
    it = mp.Pool(2, context="fork").imap(slow_square, range(4))
    gc.collect()
    assert result.get(DEADLINE) == 9
    assert [it.next(DEADLINE) for _ in range(4)] == [0, 1, 4, 9]
    pids = [p.pid for r in (result, it) for p in r._pool._dispatcher.workers()]
    assert len(pids) == 4
    with pytest.warns(ResourceWarning, match="unclosed running"):
        del result, it
        gc.collect()
    deadline = time.monotonic() + DEADLINE
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        assert time.monotonic() < deadline, "the dropped pools' workers did not exit"
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_the_reusable_executor_with_an_array_in_initargs(reusable):
    """The same array in initargs is the same settings; another one (equal or not) makes
    a new executor, where comparing the settings raised (an array's == has no truth
    value)."""
    data = np.arange(4.0)
    ex = reusable(max_workers=1, initializer=set_state, initargs=(data,))
    assert ex.submit(get_state).result(DEADLINE).tolist() == [0, 1, 2, 3]
    assert reusable(max_workers=1, initializer=set_state, initargs=(data,)) is ex
    equal = reusable(max_workers=1, initializer=set_state, initargs=(np.arange(4.0),))
    assert equal.submit(get_state).result(DEADLINE).tolist() == [0, 1, 2, 3]
    other = reusable(max_workers=1, initializer=set_state, initargs=(np.arange(8.0),))
    assert other is not ex
    assert other.submit(get_state).result(DEADLINE).tolist() == list(range(8))


@pytest.mark.timeout(90)
def test_the_reusable_executor_is_replaced_after_it_broke(reusable):
    ex = reusable(max_workers=1)
    from _pool_workers import die

    with pytest.raises(mp.TerminatedWorkerError):
        ex.submit(die, "sigkill").result(DEADLINE)
    again = reusable(max_workers=1)
    assert again is not ex
    assert again.submit(square, 6).result(DEADLINE) == 36


@pytest.mark.timeout(90)
def test_idle_workers_of_the_reusable_executor_exit_and_come_back(reusable):
    ex = reusable(max_workers=2, timeout=0.3)
    assert ex.submit(square, 2).result(DEADLINE) == 4
    deadline = time.monotonic() + DEADLINE
    while ex._processes:
        assert time.monotonic() < deadline, "idle workers did not exit"
        time.sleep(0.05)
    assert ex.submit(square, 3).result(DEADLINE) == 9


# -- Ctrl-C --------------------------------------------------------------------------

_CTRL_C_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
import procspawn as mp
from _pool_workers import sleep_forever

if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "pool":
        with mp.Pool(2, context=sys.argv[2]) as pool:
            result = pool.map_async(sleep_forever, range(4), chunksize=1)
            print("running", flush=True)
            result.get()
    else:
        with mp.ProcessPoolExecutor(2, mp_context=sys.argv[2]) as ex:
            futures = [ex.submit(sleep_forever, i) for i in range(4)]
            print("running", flush=True)
            futures[0].result()
"""


def _group_alive(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "kind, start_method",
    [("pool", m) for m in mp.get_all_start_methods()] + [("executor", "forkserver")],
)
def test_ctrl_c_gives_one_traceback_and_leaves_nothing(kind, start_method):
    code = _CTRL_C_SCRIPT.format(tests=os.path.join(ROOT, "tests"))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, kind, start_method],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(script_env(), PROCSPAWN_GRACE_PERIOD="2"),
        start_new_session=True,  # its own process group, as a terminal's job
    )
    try:
        assert proc.stdout.readline() == "running\n"
        time.sleep(0.5)  # the tasks are running
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert err.count("Traceback") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    frames = [line for line in err.splitlines() if line.startswith('  File "')]
    assert len([f for f in frames if "/procspawn/" in f]) <= 1, err  # not our waiting loops
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid):
        assert time.monotonic() < deadline, f"left alive: {_group_alive(proc.pid)}"
        time.sleep(0.05)


_BOOT_SCRIPT = """
import sys, time
import procspawn as mp
from _pool_workers import square

if __name__ == "__mp_main__":  # a worker importing the script again, as a heavy one would
    with open("/proc/self/status") as status:
        blocked = [line.split()[1] for line in status if line.startswith("SigBlk:")][0]
    print("worker booting, SIGINT blocked:", bool(int(blocked, 16) & 2), flush=True)
    time.sleep(2)

if __name__ == "__main__":
    kind, method = sys.argv[1:]
    if method == "forkserver":
        mp.set_forkserver_preload(["_slow_preload"])  # the server is slow to start, too
    if kind == "pool":
        with mp.Pool(2, context=method) as pool:
            pool.apply(square, (3,))
    else:
        with mp.ProcessPoolExecutor(2, mp_context=method) as ex:
            ex.submit(square, 3).result()
"""

_SLOW_PRELOAD = """
import time
print("server preloading", flush=True)
time.sleep(1.5)
"""


def _run_and_ctrl_c(args: list[str], cue: str, tmp_path, env_extra: dict) -> tuple[str, str]:
    """Run ``args`` in a group of its own, Ctrl-C the group (as a terminal does) once
    ``cue`` is on its stdout; its output, once every process of the group is gone."""
    env = dict(script_env(), **env_extra)
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(tmp_path),
        start_new_session=True,
    )
    try:
        seen = []
        deadline = time.monotonic() + DEADLINE
        while cue not in "".join(seen):
            assert time.monotonic() < deadline, f"no {cue!r} in {seen}"
            line = proc.stdout.readline()
            assert line, f"the script ended before {cue!r}: {seen} {proc.stderr.read()}"
            seen.append(line)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=DEADLINE)
        deadline = time.monotonic() + 15
        while _group_alive(proc.pid):
            assert time.monotonic() < deadline, f"left alive: {_group_alive(proc.pid)}"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return "".join(seen) + out, err


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "kind, start_method, cue",
    [
        ("pool", "spawn", "worker booting"),
        ("executor", "forkserver", "server preloading"),
    ],
)
def test_ctrl_c_while_the_workers_start_gives_one_traceback(kind, start_method, cue, tmp_path):
    """A Ctrl-C that lands while a worker boots (its interpreter starting, the script
    imported again) or while the fork server imports its preload list: only the parent
    reports it. Neither process has its own SIGINT handler yet; they get SIGINT blocked
    from the parent and take it only once they have."""
    (tmp_path / "boot.py").write_text(_BOOT_SCRIPT)
    (tmp_path / "_slow_preload.py").write_text(_SLOW_PRELOAD)
    tests = os.path.join(ROOT, "tests")
    path = os.pathsep.join([str(tmp_path), tests, ROOT])
    out, err = _run_and_ctrl_c(
        [sys.executable, "boot.py", kind, start_method], cue, tmp_path, {"PYTHONPATH": path}
    )
    assert err.count("Traceback") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    if cue == "worker booting":  # whether its traceback reached us is a race: look inside
        assert "worker booting, SIGINT blocked: True" in out, out


_TERMINATE_SCRIPT = """
import signal, sys, time
import procspawn as mp

def stubborn(x):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)

if __name__ == "__main__":
    how, method = sys.argv[1:]
    pool = mp.Pool(1, context=method)
    pool.apply_async(stubborn, (1,))
    time.sleep(0.5)  # it runs, deaf to SIGTERM: terminate() waits out the grace period
    print("terminating", flush=True)
    begun = time.monotonic()
    try:
        if how == "with":
            with pool:
                pass
        else:
            pool.terminate()
    except KeyboardInterrupt:
        print("interrupted after", round(time.monotonic() - begun, 1), flush=True)
    else:
        print("returned", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["terminate", "with"])
def test_ctrl_c_while_terminate_waits_is_raised_once_the_workers_are_gone(how, tmp_path):
    """terminate() (or leaving ``with``) waits out the grace period for a worker deaf to
    SIGTERM; a Ctrl-C meanwhile kills it at once and is the caller's KeyboardInterrupt,
    not swallowed (the program went on as if nothing had been pressed)."""
    (tmp_path / "stubborn.py").write_text(_TERMINATE_SCRIPT)
    out, err = _run_and_ctrl_c(
        [sys.executable, "stubborn.py", how, "forkserver"],
        "terminating",
        tmp_path,
        {"PROCSPAWN_GRACE_PERIOD": "20"},
    )
    assert "returned" not in out, out + err
    seconds = float(out.split("interrupted after")[1].split()[0])
    assert seconds < 10, out  # the Ctrl-C cut the grace period short
    assert "Traceback" not in err, err


_EXIT_WAIT_SCRIPT = """
import sys
import procspawn as mp
from _pool_workers import sleep_forever

if __name__ == "__main__":
    ex = mp.ProcessPoolExecutor(2, mp_context=sys.argv[1])
    ex.submit(sleep_forever, 1)  # never shut down: the program's end waits for it
    print("ending", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_ctrl_c_while_the_programs_end_waits_for_an_executor_says_so_in_one_line(method, tmp_path):
    """The end of a program waits for its executor's work, as the stdlib's; a Ctrl-C
    there stops the workers, and one line says so (it was a traceback of procspawn's
    exit function; the stdlib's executor hangs there)."""
    (tmp_path / "ending.py").write_text(_EXIT_WAIT_SCRIPT)
    tests = os.path.join(ROOT, "tests")
    out, err = _run_and_ctrl_c(
        [sys.executable, "ending.py", method],
        "ending",
        tmp_path,
        {"PYTHONPATH": os.pathsep.join([tests, ROOT]), "PROCSPAWN_GRACE_PERIOD": "2"},
    )
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("KeyboardInterrupt: the program stopped"), err


_EXECUTOR_MAP_SCRIPT = """
import time
import procspawn as mp
from _pool_workers import sleep_forever, square

if __name__ == "__main__":
    ex = mp.ProcessPoolExecutor(2)  # no with: the program goes on after the Ctrl-C
    try:
        print("running", flush=True)
        list(ex.map(sleep_forever, range(4)))
    except KeyboardInterrupt:
        begun = time.monotonic()
        value = ex.submit(square, 3).result(timeout=60)
        print("next call", value, "after", round(time.monotonic() - begun, 1), flush=True)
    ex.shutdown()
"""


@pytest.mark.timeout(90)
def test_ctrl_c_during_an_executor_map_stops_the_chunks_it_was_running(tmp_path):
    """Nobody else holds a map's futures: its chunks running when Ctrl-C came are
    killed, and the executor's next call runs at once (they ran on, holding every
    worker, as the stdlib's do)."""
    (tmp_path / "exmap.py").write_text(_EXECUTOR_MAP_SCRIPT)
    tests = os.path.join(ROOT, "tests")
    out, err = _run_and_ctrl_c(
        [sys.executable, "exmap.py"],
        "running",
        tmp_path,
        {"PYTHONPATH": os.pathsep.join([tests, ROOT])},
    )
    assert "next call 9 after" in out, out + err
    assert float(out.split("after")[1].split()[0]) < 10, out
    assert "Traceback" not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forked", [True, False])
def test_a_worker_whose_parent_closed_its_channel_exits_quietly(forked):
    """The parent stopped (a Ctrl-C while the pool started) before this worker said it
    was ready: the worker's first message finds the channel closed, and it leaves
    without a BrokenPipeError traceback."""
    code = textwrap.dedent(
        f"""
        import os, socket
        from procspawn.pool import _worker
        from procspawn.sharing.segments import _strategy

        class Payload:
            def load(self):
                return None, (), _strategy.snapshot(), False, {forked}

        parent_end, child_end = socket.socketpair()
        parent_end.close()
        _worker.main(Payload(), child_end, os.getppid(), False, None)
        print("left quietly")
        """
    )
    result = run_script(code, timeout=50)
    assert (result.returncode, result.stdout, result.stderr) == (0, "left quietly\n", "")


@pytest.mark.timeout(60)
def test_one_default_start_method_and_get_start_method_tells_it(monkeypatch):
    monkeypatch.delenv("PROCSPAWN_START_METHOD", raising=False)
    stdlib_method = multiprocessing.get_start_method(allow_none=True)
    assert mp.get_start_method() == "forkserver"
    with mp.Pool(1) as p:
        assert p._dispatcher.start_method == "forkserver"
    assert mp.get_context().get_start_method() == "forkserver"
    proc = mp.Process(target=square, args=(2,))
    proc.start()
    proc.join(DEADLINE)
    assert proc.exitcode == 0
    assert type(proc._popen).__module__ == "multiprocessing.popen_forkserver"
    try:
        mp.set_start_method("spawn")
        assert mp.get_start_method() == "spawn"
        with pytest.raises(RuntimeError, match="set already"):
            mp.set_start_method("fork")
        with mp.ProcessPoolExecutor(1) as ex:
            assert ex.submit(square, 3).result(DEADLINE) == 9
            assert ex._dispatcher.start_method == "spawn"
    finally:
        mp.set_start_method(None, force=True)
    assert multiprocessing.get_start_method(allow_none=True) == stdlib_method  # untouched


@pytest.mark.timeout(90)
def test_a_missing_main_guard_fails_clearly_instead_of_looping(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import procspawn as mp\n"
        "def sq(x):\n"
        "    return x * x\n"
        "with mp.Pool(2) as p:\n"
        "    print(p.map(sq, range(4)))\n"
    )
    result = run_file(script)
    assert result.returncode == 1
    last = result.stderr[result.stderr.rindex("RuntimeError: ") :]
    assert last.startswith(
        f"RuntimeError: a procspawn pool or executor is called at {script}:4 when that file is "
        f'imported: put it under `if __name__ == "__main__":`'
    ), last
    assert "InitializerError" not in result.stderr  # there is no initializer
    assert len(result.stderr.strip().splitlines()) <= 25, result.stderr


@pytest.mark.timeout(90)
def test_a_pool_made_by_a_module_the_guarded_main_imports_is_explained(tmp_path):
    """The main module has its guard; a module it imports makes a pool at its top level.
    The hint names that case too (it spoke only of the main module's guard)."""
    (tmp_path / "helper.py").write_text(
        "import procspawn as mp\n"
        "def sq(x):\n"
        "    return x * x\n"
        "with mp.Pool(2, context='spawn') as _pool:\n"
        "    TABLE = _pool.map(sq, range(4))\n"
    )
    script = tmp_path / "main.py"
    script.write_text('import helper\nif __name__ == "__main__":\n    print(helper.TABLE)\n')
    result = run_file(script)
    assert result.returncode == 1
    last = result.stderr[result.stderr.rindex("RuntimeError: ") :]
    helper = tmp_path / "helper.py"
    assert f"is called at {helper}:4 when that file is imported" in last, last
    assert f"the main module imports {helper}: move that code into a function" in last


@pytest.mark.timeout(60)
def test_results_go_as_soon_as_the_caller_drops_them():
    """No reference cycle keeps a map's values (shared segments) until a collection."""
    import gc
    import weakref

    with mp.Pool(1, context="fork") as p:
        gc.disable()
        try:
            values = p.map(make_array, [1000] * 3, chunksize=1)
            refs = [weakref.ref(v) for v in values]
            del values
            assert [r() for r in refs] == [None, None, None]
            out = list(p.imap_unordered(make_array, [1000] * 2))
            refs = [weakref.ref(v) for v in out]
            del out
            assert [r() for r in refs] == [None, None]
        finally:
            gc.enable()


@pytest.mark.timeout(60)
def test_an_executors_results_go_as_soon_as_the_caller_drops_them():
    """Neither the future nor its value waits for a collection (the future's kill() must
    not make a cycle with the call's job)."""
    import gc
    import weakref

    with mp.ProcessPoolExecutor(1, mp_context="fork") as ex:
        gc.disable()
        try:
            future = ex.submit(make_array, 1000)
            value = future.result(DEADLINE)
            refs = [weakref.ref(value), weakref.ref(future)]
            del value, future
            assert [r() for r in refs] == [None, None]
        finally:
            gc.enable()


@pytest.mark.timeout(90)
def test_under_fork_a_scripts_functions_go_by_name_only_when_the_worker_has_them(tmp_path):
    """A forked worker has every function ``__main__`` had when it was forked: those go by
    name (no cloudpickle import, as the stdlib's Pool); one defined or redefined since
    goes by value, so the worker runs what the parent has now, never a stale copy."""
    script = tmp_path / "by_name.py"
    script.write_text(
        "import sys\n"
        "import procspawn as mp\n"
        "def tag(x):\n"
        "    return ('old', x)\n"
        "if __name__ == '__main__':\n"
        "    with mp.Pool(2, context='fork') as p:\n"
        "        assert p.map(tag, range(4)) == [('old', i) for i in range(4)]\n"
        "        assert 'cloudpickle' not in sys.modules, 'sent by value'\n"
        "        def tag(x):\n"
        "            return ('new', x)\n"
        "        assert p.map(tag, range(4)) == [('new', i) for i in range(4)]\n"
        "        def later(x):\n"
        "            return x * 3\n"
        "        assert p.apply(later, (5,)) == 15\n"
        "    with mp.ProcessPoolExecutor(1, mp_context='fork') as ex:\n"
        "        assert ex.submit(tag, 1).result(30) == ('new', 1)\n"
        "    print('ok')\n"
    )
    result = run_file(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


_MAIN_DEFINITIONS = """
import sys
import dataclasses
import procspawn

SCALE = 1


@dataclasses.dataclass
class Point:
    x: int


class Failure(Exception):
    pass


def setup(value):
    global STATE
    STATE = value


def read_state(x):
    return x + STATE


def check_point(p):
    return isinstance(p, Point) and p == Point(p.x), Point(p.x + 1)


def fail(x):
    raise Failure(x)


def scaled(x):
    return x * SCALE


if __name__ == "__main__":
    method = {method!r}
    SCALE = 10  # the workers' main module has SCALE = 1, as with the standard library

    class Local:  # under the guard: no worker has it, it goes by value
        def __init__(self, v):
            self.v = v

    def under_guard(x):
        return Local(x * 2)

    factor = 3
    out = []
    with procspawn.Pool(2, initializer=setup, initargs=(100,), context=method) as pool:
        out.append(pool.map(read_state, range(3)))
        ok, nxt = pool.apply(check_point, (Point(4),))
        out.append((ok, type(nxt) is Point, nxt))
        try:
            pool.apply(fail, (7,))
        except Failure as exc:
            out.append(("caught", exc.args))
        out.append([r.v for r in pool.map(under_guard, range(3))])
        out.append(pool.map(lambda x: x * factor, range(3)))
        out.append(pool.apply(scaled, (2,)))
    executor = procspawn.ProcessPoolExecutor
    with executor(2, mp_context=method, initializer=setup, initargs=(5,)) as ex:
        out.append(list(ex.map(read_state, range(3))))
        ok, nxt = ex.submit(check_point, Point(1)).result()
        out.append((ok, type(nxt) is Point))
    print(repr(out))
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_scripts_own_functions_and_classes_are_the_workers_own(tmp_path, method):
    """As with the standard library's pools: the initializer and the tasks run in the
    worker's main module (a global the initializer sets, the tasks read), and a class of
    the script is the same class in the worker and back in the parent (isinstance, ==,
    except). What the worker's main module does not have (a class or function defined
    under the guard, a lambda) still travels, by value. A global changed under the guard
    is the worker's own: the parent's at the fork, the script's top level otherwise."""
    script = tmp_path / "main_definitions.py"
    script.write_text(_MAIN_DEFINITIONS.format(method=method))
    result = run_file(script)
    assert result.returncode == 0, result.stderr[-3000:]
    scaled = 20 if method == "fork" else 2
    assert result.stdout.strip() == repr(
        [
            [100, 101, 102],
            (True, True, "Point(x=5)"),
            ("caught", (7,)),
            [0, 2, 4],
            [0, 3, 6],
            scaled,
            [5, 6, 7],
            (True, True),
        ]
    ).replace("'Point(x=5)'", "Point(x=5)")


def _collect_holding(*locks) -> None:
    """Run the garbage collector in this thread while it holds ``locks``, as an allocation
    inside any locked section may; a finalizer that waits for one of them hangs here."""
    import contextlib
    import gc

    with contextlib.ExitStack() as held:
        for lock in locks:
            held.enter_context(lock)
        gc.collect()


@pytest.mark.timeout(60)
def test_a_collected_imap_iterator_or_pool_never_waits_for_a_lock_its_thread_holds():
    """Finalizers hand their work to the dispatcher thread without a lock (an abandoned
    imap collected inside a locked section of the same thread hung CI's teardown)."""
    import warnings
    import weakref

    with mp.Pool(1, context="fork") as p:
        it = p.imap(square, [1, 2, 3, 4])
        assert next(it) == 1
        deadline = time.monotonic() + DEADLINE
        while it._settled < 4:  # its job (which holds it) is done, the rest is not taken
            assert time.monotonic() < deadline, "imap's results did not come"
            time.sleep(0.01)
        cycle: list = [it]
        cycle.append(cycle)  # the iterator is left to the collector
        ref = weakref.ref(it)
        del it, cycle
        held = (p._dispatcher._lock, p._dispatcher._watcher._state)
        runner = threading.Thread(target=_collect_holding, args=held)
        runner.start()
        runner.join(DEADLINE)
        assert not runner.is_alive(), "the iterator's finalizer waited for the pool's lock"
        assert ref() is None
        assert p.map(square, range(6)) == [x * x for x in range(6)]  # the pool still works

    for make in (lambda: mp.Pool(1, context="fork"), lambda: mp.ProcessPoolExecutor(1)):
        pool = make()
        dispatcher = pool._dispatcher
        cycle = [pool]
        cycle.append(cycle)
        del pool, cycle
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # unclosed on purpose
            held = (dispatcher._lock, dispatcher._watcher._state)
            runner = threading.Thread(target=_collect_holding, args=held)
            runner.start()
            runner.join(DEADLINE)
        assert not runner.is_alive(), "a pool's finalizer waited for its own lock"
        # and what the finalizer asked for happens: the workers end
        assert dispatcher.join(DEADLINE), "the dropped pool's dispatcher did not end"
        assert not [w for w in dispatcher.workers() if w.is_alive()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_maps_over_ranges_send_range_chunks_and_give_every_value(method):
    """A range is mapped in chunks that are ranges themselves (a few bytes on the wire):
    every value, in order, whatever the step, for the Pool and the executor."""
    ranges = [range(1000), range(3, 300, 7), range(50, -50, -3), range(0), range(5, 6)]
    with mp.Pool(2, context=method) as p:
        for r in ranges:
            assert p.map(square, r) == [x * x for x in r]
            assert p.map(square, r, chunksize=4) == [x * x for x in r]
            assert p.map_async(square, r, chunksize=1).get(DEADLINE) == [x * x for x in r]
        assert p.starmap(add, [(x, x) for x in range(5)]) == [0, 2, 4, 6, 8]
    with mp.ProcessPoolExecutor(2, mp_context=method) as ex:
        for r in ranges:
            assert list(ex.map(square, r, chunksize=9)) == [x * x for x in r]
        assert list(ex.map(add, range(4), range(10, 14))) == [10, 12, 14, 16]


def test_initargs_a_worker_cannot_rebuild_fail_with_the_reason(tmp_path):
    """An initarg whose unpickling raises in the worker: the pool fails with an
    InitializerError quoting that error (the worker hid it behind an UnboundLocalError
    of its own, and the caller got "3 pool workers in a row died before they were ready")."""
    script = tmp_path / "bad_initarg.py"
    script.write_text(
        textwrap.dedent(
            """
            import procspawn

            def boom():
                raise ValueError("cannot rebuild this initarg")

            class Bad:
                def __reduce__(self):
                    return (boom, ())

            def init(x):
                pass

            def square(x):
                return x * x

            if __name__ == "__main__":
                try:
                    with procspawn.Pool(1, initializer=init, initargs=(Bad(),)) as pool:
                        pool.map(square, range(3))
                except procspawn.InitializerError as exc:
                    print("cannot rebuild this initarg" in str(exc), "UnboundLocal" in str(exc))
            """
        )
    )
    result = run_file(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"], (result.stdout, result.stderr[-2000:])
    assert "UnboundLocalError" not in result.stderr


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_pool_and_an_executor_import_only_what_they_use(start_method, tmp_path):
    """A pool's start is mostly the modules it imports at its first use (a user's start-up
    figure counts them). A Pool imports none of concurrent.futures, cloudpickle for the
    script's own functions, shared memory's modules when no array moves, or, under fork,
    procspawn's fork-server machinery; the executor adds only concurrent.futures (its
    Futures are that module's). Only what procspawn decides to import is checked: which
    standard-library modules those pull in (tempfile, logging) differs between Pythons."""
    script = tmp_path / "imports.py"  # a file: its functions go by name (no cloudpickle)
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            import procspawn

            def inc(x):
                return x + 1

            if __name__ == "__main__":
                heavy = ["concurrent.futures", "cloudpickle",
                         "procspawn.context.launch._forkserver",
                         "procspawn.sharing.segments._strategy"]
                with procspawn.Pool(2, context={start_method!r}) as pool:
                    assert pool.apply(inc, (1,)) == 2
                pool.join()
                print(" ".join(m for m in heavy if m in sys.modules) or "-")
                with procspawn.ProcessPoolExecutor(2, mp_context={start_method!r}) as ex:
                    assert ex.submit(inc, 1).result(30) == 2
                print(" ".join(m for m in heavy if m in sys.modules) or "-")
            """
        )
    )
    result = run_file(script)
    assert result.returncode == 0, result.stderr
    pool, executor = result.stdout.splitlines()
    server = "procspawn.context.launch._forkserver"  # under forkserver, the server's module
    if start_method == "fork":
        assert pool == "-"
        assert executor == "concurrent.futures"
    else:
        assert pool == server
        assert executor == "concurrent.futures " + server


def test_a_range_chunk_is_plain_data_of_a_few_bytes():
    code = textwrap.dedent(
        """
        import sys
        from procspawn.sharing.wire import _pickler

        message = _pickler.dumps((7, None, 1, range(10**6, 2 * 10**6, 3)))
        assert len(message.data) < 100, len(message.data)
        assert "cloudpickle" not in sys.modules
        assert _pickler.loads(message.data, []) == (7, None, 1, range(10**6, 2 * 10**6, 3))
        print("ok")
        """
    )
    result = run_script(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_ctrl_c_right_after_sigint_is_blocked_leaves_it_unblocked(monkeypatch):
    """Children are started with SIGINT blocked in the starting thread. A Ctrl-C whose
    handler runs right after the blocking call returns raises there; the thread's mask
    must still be given back, or this process (and every child it starts) never sees
    SIGINT again: a suite run beside two CPU hogs lost every later Ctrl-C test to it."""
    import signal as signal_module

    from procspawn.context.launch import _posix

    real = signal_module.pthread_sigmask

    def interrupted(how, mask):
        previous = real(how, mask)
        if how == signal_module.SIG_BLOCK and signal_module.SIGINT in set(mask):
            raise KeyboardInterrupt  # what the Python-level handler does at that point
        return previous

    monkeypatch.setattr(_posix.signal, "pthread_sigmask", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt), _posix.sigint_blocked():
            pass
    finally:
        monkeypatch.undo()
        blocked = signal_module.SIGINT in real(signal_module.SIG_BLOCK, ())
        real(signal_module.SIG_UNBLOCK, (signal_module.SIGINT,))
    assert not blocked


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", ["pool", "executor"])
def test_a_callback_that_waits_for_the_pool_gets_an_error_not_a_hang(make):
    """A callback runs in the thread that serves the pool: one that waited there for the
    pool's work (pool.apply, get(), result() of a call not done, an executor map) hung
    it, and terminate() and the program's exit with it. It now raises RuntimeError in
    the callback; what is done already may still be read; the pool goes on."""
    caught: list[BaseException | object] = []
    done = threading.Event()
    if make == "pool":
        p = mp.Pool(2, context="fork")
        earlier = p.apply_async(square, (2,))
        earlier.get(DEADLINE)

        def callback(value):
            try:
                caught.append(earlier.get(0))  # done: fine
                p.apply(square, (3,))
            except BaseException as exc:
                caught.append(exc)
            finally:
                done.set()

        p.apply_async(square, (5,), callback=callback)
    else:
        p = mp.ProcessPoolExecutor(2, mp_context="fork")

        def callback(future):
            try:
                caught.append(future.result(0))  # done: fine
                caught.append(list(p.map(square, [5])))
            except BaseException as exc:
                caught.append(exc)
            try:
                p.submit(square, 3).result()
            except BaseException as exc:
                caught.append(exc)
            finally:
                done.set()

        p.submit(square, 2).add_done_callback(callback)
    try:
        assert done.wait(DEADLINE)
        assert caught[0] == 4
        errors = caught[1:]
        assert errors and all(isinstance(e, RuntimeError) for e in errors), errors
        assert all("callback of this pool" in str(e) for e in errors), errors
        if make == "pool":
            assert p.apply(square, (4,)) == 16  # it goes on
        else:
            assert p.submit(square, 4).result(DEADLINE) == 16
    finally:
        if make == "pool":
            p.terminate()
            p.join()
        else:
            p.shutdown(cancel_futures=True)
