"""dask's local scheduler on procspawn's executor (issue 38, point 2):
``dask.config.set(scheduler=procspawn.get_reusable_executor(...))``."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import procspawn
from procspawn import sharing

dask = pytest.importorskip("dask", reason="the dask extra is not installed")
da = pytest.importorskip("dask.array", reason="the dask extra is not installed")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def executor():
    ex = procspawn.get_reusable_executor(max_workers=2, retries=1)
    yield ex
    ex.shutdown(wait=True)


def numbers(shape, chunks):
    # small whole numbers as floats: every sum is exact, in any order
    return da.random.RandomState(0).randint(0, 10, size=shape, chunks=chunks).astype(float)


def shared_flag(block):
    """1 where the block reached this worker in shared memory (a handle, not bytes)."""
    return np.full((1, 1), float(sharing.is_shared(block)))


def die_once(block, marker, parent):
    if os.getpid() == parent:
        raise RuntimeError("die_once must run in a worker")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return block * 2


def test_a_graph_computes_what_the_threaded_scheduler_does(executor):
    x = numbers((800, 800), 200)
    expr = (x @ x.T).sum()
    with dask.config.set(scheduler="threads"):
        expected = expr.compute()
    with dask.config.set(scheduler=executor):
        got = expr.compute()
    assert got == expected


def test_chunks_travel_as_shared_memory_handles(executor):
    with dask.config.set(scheduler=executor):
        # made in the workers, each chunk comes back to this process in shared memory
        x = numbers((400, 400), 200).persist()  # 320 KB chunks: above the inline size
        small = numbers((40, 40), 20).persist()  # 3.2 KB chunks: pickled as bytes
        chunks = [x.blocks[i, j].compute() for i in range(2) for j in range(2)]
        # and goes back to a worker as a handle to that memory
        flags = x.map_blocks(shared_flag, chunks=(1, 1)).compute()
        small_flags = small.map_blocks(shared_flag, chunks=(1, 1)).compute()
    assert all(sharing.is_shared(chunk) for chunk in chunks)
    assert flags.shape == (2, 2) and flags.all()
    assert not small_flags.any()


def test_with_retries_a_worker_killed_mid_graph_does_not_break_compute(executor, tmp_path):
    x = numbers((400, 400), 200)
    marker = str(tmp_path / "killed")
    with dask.config.set(scheduler=executor):
        # (meta given: dask would otherwise call die_once here, to learn its output type)
        doubled = x.map_blocks(die_once, marker, os.getpid(), meta=np.empty((0, 0)))
        total = doubled.sum().compute()
    assert os.path.exists(marker)  # one worker was killed, and its chunk ran again
    assert total == 2 * x.sum().compute(scheduler="threads")
