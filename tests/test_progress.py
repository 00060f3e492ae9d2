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
