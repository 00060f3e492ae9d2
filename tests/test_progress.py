"""Progress: ranks count with ``procspawn.progress()``, the parent gets the counts by rank
(from many threads of a rank too) and shows them; no parent asking is a no-op."""

from __future__ import annotations

import textwrap

import pytest
from _helpers import count_steps, run_script

import procspawn as mp


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


def test_a_progress_object_shows_each_run(capsys):
    bar = mp.Progress(20, show=True, use_tqdm=False, desc="steps")
    mp.spawn(count_steps, args=(10,), nprocs=2, progress=bar)
    mp.spawn(count_steps, args=(10,), nprocs=2, progress=bar)
    err = capsys.readouterr().err
    assert err.count("steps: 20/20 (100.0%)") == 2, err


try:  # tqdm makes a process-wide lock (a semaphore in /dev/shm) at its first bar: now,
    import tqdm  # before any test's leak check takes its baseline

    tqdm.tqdm.get_lock()
except ImportError:
    pass


def test_the_ranks_rates_add_up_to_the_bar_s(capsys):
    """Each rank's rate and the bar's are steps since the ranks started over the same
    seconds (tqdm's own rate was a recent average, and the ranks' did not add up to it)."""
    pytest.importorskip("tqdm", reason="the tqdm bar needs tqdm")
    import time

    bar = mp.Progress(total=1000, per_rank=True, use_tqdm=True, show=True)
    counters = bar._allocate(2)
    counters[0], counters[8] = 300, 100  # (slots of 8: each rank's count first)
    time.sleep(0.3)
    bar._draw_tqdm()
    shown = bar._bar.format_dict
    total_rate = shown["n"] / shown["elapsed"]
    assert sum(bar.rates()) == pytest.approx(total_rate, rel=0.05)
    assert bar.counts == [300, 100]
    bar.close()


# -- progress where people look: pool tasks, tqdm classes, callables, process_map --------


def report_steps(n):
    """A pool task that reports its own progress, one step at a time."""
    import time

    for _ in range(n):
        mp.progress()
        time.sleep(0.001)
    return n


def report_after_returning(n):
    """Reports steps from a thread that outlives the task (the worker's next answers must
    still arrive whole)."""
    import threading
    import time

    def keep_reporting():
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            mp.progress()

    threading.Thread(target=keep_reporting, daemon=True).start()
    return n


def square(x):
    return x * x


def recording(base):
    """A subclass of the tqdm class ``base`` that draws into a string, and the list of
    the bars made with it."""
    import io

    bars = []

    class Recording(base):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = io.StringIO()
            super().__init__(*args, **kwargs)
            bars.append(self)

    return Recording, bars


class Calls:
    """A progress callable that records what it was called with."""

    def __init__(self):
        self.calls = []

    def __call__(self, count, total):
        self.calls.append((count, total))


@pytest.mark.timeout(60)
def test_pool_tasks_report_steps_and_the_display_counts_them():
    seen = Calls()
    with mp.Pool(2) as pool:
        assert pool.map(report_steps, [40] * 4, chunksize=1, progress=seen) == [40] * 4
    # steps, not tasks: the total the pool took from the 4 items is dropped
    assert seen.calls[-1] == (160, None)
    assert all(b[0] >= a[0] for a, b in zip(seen.calls, seen.calls[1:], strict=False))


@pytest.mark.timeout(60)
def test_a_given_total_of_steps_is_kept_under_imap_and_the_executor():
    seen = Calls()
    shown = mp.Progress(total=90, callback=seen)
    with mp.Pool(2) as pool:
        assert sorted(pool.imap_unordered(report_steps, [30] * 3, progress=shown)) == [30] * 3
    assert seen.calls[-1] == (90, 90) and shown.count == 90
    seen = Calls()
    with mp.ProcessPoolExecutor(2) as executor:
        results = executor.map(report_steps, [25] * 2, progress=mp.Progress(50, callback=seen))
        assert list(results) == [25, 25]
    assert seen.calls[-1] == (50, 50)


@pytest.mark.timeout(60)
def test_tasks_that_report_nothing_are_counted_as_they_finish():
    seen = Calls()
    with mp.Pool(2) as pool:
        assert pool.map(square, range(10), progress=seen) == [x * x for x in range(10)]
    assert seen.calls[-1] == (10, 10)


@pytest.mark.timeout(60)
def test_steps_reported_after_a_task_returned_do_not_garble_the_next_answers():
    with mp.Pool(1) as pool:
        got = pool.map(report_after_returning, range(20), chunksize=1, progress=Calls())
    assert got == list(range(20))


@pytest.mark.timeout(60)
def test_progress_takes_a_tqdm_class():
    tqdm = pytest.importorskip("tqdm")
    Recording, bars = recording(tqdm.tqdm)
    with mp.Pool(2) as pool:
        assert pool.map(square, range(6), progress=Recording) == [x * x for x in range(6)]
    [bar] = bars
    assert (bar.n, bar.total) == (6, 6)


@pytest.mark.timeout(60)
def test_the_default_bar_is_tqdm_auto(monkeypatch):
    tqdm_auto = pytest.importorskip("tqdm.auto")
    Recording, made = recording(tqdm_auto.tqdm)
    monkeypatch.setattr(tqdm_auto, "tqdm", Recording)
    with mp.Pool(2) as pool:
        pool.map(square, range(3), progress=mp.Progress(show=True))
    assert len(made) == 1 and made[0].n == 3


def test_a_bad_progress_argument_says_what_it_takes():
    with mp.Pool(1) as pool:
        with pytest.raises(TypeError, match="a tqdm class or a callable"):
            pool.map(square, range(3), progress="yes")


@pytest.mark.timeout(60)
def test_process_map_has_tqdms_signature(capsys):
    got = mp.process_map(square, range(8), max_workers=2, chunksize=3, desc="squares")
    assert got == [x * x for x in range(8)]
    assert "squares" in capsys.readouterr().err
    got = mp.process_map(pow, [2, 3], [3, 2], max_workers=2, disable=True)
    assert got == [8, 9]
    assert capsys.readouterr().err == ""


@pytest.mark.timeout(60)
def test_process_map_counts_the_steps_its_tasks_report():
    tqdm = pytest.importorskip("tqdm")
    Recording, bars = recording(tqdm.tqdm)
    got = mp.process_map(report_steps, [20, 20], max_workers=2, tqdm_class=Recording)
    # steps, not items: the total taken from the 2 items is dropped
    assert got == [20, 20] and (bars[0].n, bars[0].total) == (40, None)
