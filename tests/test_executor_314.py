"""Python 3.14's additions to ``concurrent.futures``' process executor, on every Python
procspawn supports: ``map(..., buffersize=)``, ``terminate_workers()`` and
``kill_workers()`` (issue 38, point 3)."""

from __future__ import annotations

import itertools
import signal
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

import procspawn

pytestmark = pytest.mark.timeout(120)


def square(x):
    return x * x


def nap(seconds):
    time.sleep(seconds)
    return seconds


def stubborn(seconds):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this worker
    time.sleep(seconds)
    return seconds


@pytest.fixture
def executor():
    ex = procspawn.ProcessPoolExecutor(2)
    yield ex
    ex.shutdown(wait=True, cancel_futures=True)


class _Counting:
    """An input that counts how many items were read from it."""

    def __init__(self, items):
        self.read = 0
        self._items = iter(items)

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._items)
        self.read += 1
        return item


# -- map(buffersize=) --------------------------------------------------------------------


def test_map_with_buffersize_takes_an_endless_iterator(executor):
    results = executor.map(square, itertools.count(), buffersize=4, timeout=60)
    assert list(itertools.islice(results, 50)) == [x * x for x in range(50)]
    results.close()


@pytest.mark.parametrize("chunksize", [1, 3])
def test_map_with_buffersize_reads_its_input_as_results_are_taken(executor, chunksize):
    # as 3.14's: buffersize chunks submitted at once, then one more before each chunk's
    # values are waited for
    source = _Counting(range(100))
    results = executor.map(square, source, buffersize=2, chunksize=chunksize, timeout=60)
    assert source.read == 2 * chunksize
    taken = []
    for n in range(1, 4):
        for _ in range(chunksize):
            taken.append(next(results))
        assert source.read == (2 + n) * chunksize
    assert taken == [x * x for x in range(3 * chunksize)]
    assert list(results) == [x * x for x in range(3 * chunksize, 100)]
    assert source.read == 100


def test_map_without_buffersize_reads_its_input_at_once(executor):
    source = _Counting(range(20))
    results = executor.map(square, source, timeout=60)
    assert source.read == 20
    assert list(results) == [x * x for x in range(20)]


def test_map_with_buffersize_of_a_range_and_several_iterables(executor):
    assert list(executor.map(square, range(30), buffersize=3, chunksize=4, timeout=60)) == [
        x * x for x in range(30)
    ]
    assert list(executor.map(pow, [2, 3, 4], itertools.count(1), buffersize=1, timeout=60)) == [
        2,
        9,
        64,
    ]


def test_map_with_buffersize_raises_the_call_error_in_order(executor):
    results = executor.map(int, ["1", "2", "x", "4"], buffersize=2, timeout=60)
    assert next(results) == 1
    assert next(results) == 2
    with pytest.raises(ValueError, match="invalid literal"):
        next(results)


@pytest.mark.parametrize(
    ("buffersize", "error", "message"),
    [
        (0, ValueError, "buffersize must be None or > 0"),
        (-1, ValueError, "buffersize must be None or > 0"),
        (1.5, TypeError, "buffersize must be an integer or None"),
        ("2", TypeError, "buffersize must be an integer or None"),
    ],
)
def test_map_refuses_a_bad_buffersize_as_python_3_14_does(executor, buffersize, error, message):
    source = _Counting(range(10))
    with pytest.raises(error, match=message):
        executor.map(square, source, buffersize=buffersize)
    assert source.read == 0


def test_map_with_buffersize_after_shutdown_raises(executor):
    results = executor.map(square, range(10), buffersize=2, timeout=60)
    assert next(results) == 0
    executor.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="after shutdown"):
        list(results)


# -- terminate_workers() and kill_workers() --------------------------------------------


def _gone(pids, seconds=20.0):
    """Whether every pid is gone (or a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("how", ["terminate_workers", "kill_workers"])
def test_stopping_the_workers_fails_running_calls_and_cancels_the_rest(how):
    ex = procspawn.ProcessPoolExecutor(1)
    try:
        running = ex.submit(nap, 60)
        waiting = [ex.submit(nap, 60) for _ in range(3)]
        deadline = time.monotonic() + 30
        while not running.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = list(ex._processes)
        assert running.running() and pids
        getattr(ex, how)()
        with pytest.raises(BrokenProcessPool, match=how):
            running.result(timeout=20)
        # those not handed out are cancelled; one a worker already held behind the running
        # call (as the stdlib's call queue holds one) fails with it
        for future in waiting:
            if not future.cancelled():
                with pytest.raises(BrokenProcessPool, match=how):
                    future.result(timeout=20)
        assert waiting[-1].cancelled()
        with pytest.raises(RuntimeError):
            ex.submit(square, 2)
        assert _gone(pids), f"a worker outlived {how}()"
    finally:
        ex.shutdown(wait=True)


def test_kill_workers_stops_a_worker_that_ignores_sigterm():
    ex = procspawn.ProcessPoolExecutor(1)
    try:
        future = ex.submit(stubborn, 60)
        deadline = time.monotonic() + 30
        while not future.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # its handler is set
        pids = list(ex._processes)
        ex.kill_workers()
        with pytest.raises(BrokenProcessPool):
            future.result(timeout=10)
        assert _gone(pids, 10)
    finally:
        ex.shutdown(wait=True)


def test_stopping_an_executor_with_no_workers_yet_is_fine():
    ex = procspawn.ProcessPoolExecutor(2)
    ex.terminate_workers()
    with pytest.raises(RuntimeError):
        ex.submit(square, 2)
    ex.shutdown(wait=True)


@pytest.mark.parametrize("source", ["range", "iterator"])
def test_map_with_buffersize_counts_progress_over_the_whole_map(executor, source):
    items = range(40) if source == "range" else iter(range(40))
    bar = procspawn.Progress(show=False)
    results = executor.map(square, items, buffersize=3, chunksize=2, progress=bar, timeout=60)
    assert list(results) == [x * x for x in range(40)]
    assert bar.count == 40  # every chunk's calls, not the last chunk's
    assert bar.total == (40 if source == "range" else None)  # an iterator has no length


def test_progress_counts_in_this_process_through_its_public_api():
    # what the pools do for a call they show: reset with the total, then update
    bar = procspawn.Progress(show=False)
    bar.reset(10)
    bar.update(3)
    bar.update()
    assert (bar.count, bar.total) == (4, 10)
    bar.reset(5)  # a new call: counted from 0 (the total given first stays)
    assert (bar.count, bar.total) == (0, 10)
