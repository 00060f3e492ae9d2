"""Slabs: small shared arrays carved out of one segment, never overlapping, freed with
their last array, and cheap in descriptors and mappings when very many are alive."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from _helpers import run_script, script_env

import procspawn as mp
from procspawn import sharing
from procspawn.sharing.segments._segment import segment_of
from procspawn.sharing.segments._slabs import _linger, threshold

LINGER, THRESHOLD = _linger(), threshold()


def _span(array: np.ndarray) -> tuple[int, int]:
    start = array.__array_interface__["data"][0]
    return start, start + array.nbytes


def _memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/memfd:procspawn" in line)


def _fill_and_check(rank: int, arrays: list[np.ndarray], view: np.ndarray) -> list[int]:
    """In a rank: every received array reaches only its own bytes; write its index + 100."""
    for i, a in enumerate(arrays):
        assert np.all(a == i), (i, a[:4])
        assert np.asarray(a.base).nbytes == a.nbytes, "the base reaches past the array"
        a[...] = i + 100
    assert np.asarray(view.base).nbytes == 8 * 64 * 8  # its matrix, no further
    view[:] = -1
    return len({id(segment_of(a)[0]) for a in arrays})  # type: ignore[index]


def test_small_arrays_share_slabs_and_never_overlap(strategy):
    sizes = [1, 7, 64, 100, 4096, 65_536, THRESHOLD - 1] * 30
    arrays = [sharing.zeros(n, dtype=np.uint8) for n in sizes]
    segments = {segment_of(a)[0].key for a in arrays}
    assert len(segments) < len(arrays) / 10  # carved out of a few slabs
    spans = sorted(_span(a) for a in arrays)
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start, "two arrays of one slab overlap"
    for i, a in enumerate(arrays):
        assert not a.any(), "a fresh array is not zero"
        assert np.asarray(a.base).nbytes == a.nbytes  # .base reaches no neighbour
        assert np.asarray(a[::2].base).nbytes == a.nbytes  # so does a view's
        a[...] = i % 251
    for i, a in enumerate(arrays):
        assert np.all(a == i % 251), f"array {i} was overwritten by a neighbour"
    big = sharing.zeros(THRESHOLD, dtype=np.uint8)
    assert segment_of(big)[0].key not in segments  # from the threshold on: its own segment


def test_slab_arrays_cross_processes_as_themselves(strategy, start_method):
    arrays = [sharing.zeros(64, dtype=np.int64) for _ in range(20)]
    for i, a in enumerate(arrays):
        a[...] = i
    matrix = sharing.zeros((8, 64), dtype=np.int64)
    [slabs] = mp.spawn(
        _fill_and_check, args=(arrays, matrix[3]), nprocs=1, start_method=start_method
    )
    assert slabs == len({segment_of(a)[0].key for a in arrays})  # one mapping per slab
    for i, a in enumerate(arrays):
        assert np.all(a == i + 100)
    assert np.all(matrix[3] == -1) and not matrix[[0, 1, 2, 4, 5, 6, 7]].any()


def _wait_for_maps(count: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _memfd_maps() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_slab_goes_when_its_last_array_goes():
    gc.collect()
    before = _memfd_maps()
    arrays = [sharing.zeros(8) for _ in range(10)]
    assert _memfd_maps() == before + 1  # ten arrays, one slab (even a first one, of a page)
    keep = arrays[7][2:5]  # a view keeps the slab, like any array over it
    del arrays
    time.sleep(LINGER + 0.5)  # the allocator lets go of it a second after the last carve
    gc.collect()
    assert _memfd_maps() == before + 1
    del keep
    assert _wait_for_maps(before, 1.0)  # at once: nothing else holds it


def test_an_unused_slab_goes_within_seconds_without_trim():
    gc.collect()
    before = _memfd_maps()
    array = sharing.zeros(100)
    del array  # the allocator still holds the slab for further small arrays...
    assert _memfd_maps() == before + 1
    assert _wait_for_maps(before, LINGER + 2.0)  # ...a second or so, no longer


def test_an_unused_file_system_slab_leaves_dev_shm_within_seconds():
    def mine() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")}

    mp.set_sharing_strategy("file_system")
    try:
        before = mine()
        array = sharing.zeros(100)
        assert len(mine() - before) == 1
        del array
        deadline = time.monotonic() + LINGER + 2.0
        while mine() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mine() == before
    finally:
        mp.set_sharing_strategy("file_descriptor")


def _carve_send_drop(q, n):
    for i in range(n):
        array = sharing.zeros(64, dtype=np.float32)
        array[0] = i
        q.put(array)
        del array  # made, sent, dropped: the next one still comes from the same slab
    q.close()
    q.join_thread()


def test_a_producer_that_drops_each_array_fills_its_slabs(monkeypatch):
    # the default linger: the full queue pauses the producer longer than the suite's
    monkeypatch.setenv("PROCSPAWN_SLAB_LINGER", "1")
    q = mp.get_context("spawn").Queue(maxsize=64)
    p = mp.get_context("spawn").Process(target=_carve_send_drop, args=(q, 3000))
    p.start()
    held = [q.get(timeout=30) for _ in range(3000)]
    p.join(30)
    assert [int(a[0]) for a in held] == list(range(3000))
    slabs = {segment_of(a)[0].key: segment_of(a)[0].size for a in held}
    # 3000 x 256 B, made by a new process: its first slab a page, each next one twice the
    # last, filled before it (4 KiB holds 16 arrays, ..., 512 KiB the last 968), not one
    # per array
    assert sorted(slabs.values()) == [mmap.PAGESIZE << k for k in range(8)]
    del held


def _dev_shm_bytes_of_others() -> int:
    """What the procspawn names other processes made take in /dev/shm (blocks, as df
    counts them)."""
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith("procspawn_") and not name.startswith(f"procspawn_{os.getpid()}_"):
            try:
                total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@pytest.mark.timeout(120)
def test_small_results_of_one_task_workers_take_their_size_not_a_slab_each(strategy):
    # each worker sends one small array and exits: its slab holds that array alone
    block = np.arange(9_000, dtype=np.float64)  # 72 KB: under the slab threshold
    with mp.Pool(2, maxtasksperchild=1) as pool:
        results = pool.map(np.negative, [block] * 24, chunksize=1)
        assert all(np.array_equal(r, -block) for r in results)
        page_rounded = -(-block.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        sizes = {segment_of(r)[0].key: segment_of(r)[0].size for r in results}
        assert len(sizes) == 24 and set(sizes.values()) == {page_rounded}  # not 4 MiB each
        if strategy == "file_system":  # from outside, where a segment's size is reserved
            # (each with a page for its holder table): 1.9 MB, not 24 x 4 MiB
            assert _dev_shm_bytes_of_others() <= 24 * (page_rounded + mmap.PAGESIZE)
        del results


def _new_small_array_segment(rank: int) -> object:
    return segment_of(sharing.zeros(8))[0].key  # type: ignore[index]


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="no fork here")
def test_forked_child_never_carves_from_its_parents_slab():
    mine = sharing.zeros(8)  # the slab being filled when the child is forked
    [child_key] = mp.spawn(_new_small_array_segment, nprocs=1, start_method="fork")
    assert child_key != segment_of(mine)[0].key


def test_many_live_small_arrays_under_a_low_fd_limit():
    code = textwrap.dedent(
        """
        import os
        import resource
        import numpy as np
        import procspawn as mp
        from procspawn import sharing

        def producer(q, n):
            for i in range(0, n, 1000):
                batch = [sharing.zeros(64, dtype=np.float32) for _ in range(1000)]
                for j, a in enumerate(batch):
                    a[0] = i + j
                q.put(batch)
            q.close()
            q.join_thread()

        if __name__ == "__main__":
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
            assert mp.get_sharing_strategy() == "file_descriptor"
            ctx = mp.get_context("spawn")
            q = ctx.Queue(maxsize=4)
            p = ctx.Process(target=producer, args=(q, 30_000))
            p.start()
            held = []
            while len(held) < 30_000:
                held.extend(q.get(timeout=60))
            p.join()
            assert [float(a[0]) for a in held] == list(map(float, range(30_000)))
            held[29_999][1] = 5
            with open("/proc/self/maps") as f:
                maps = sum(1 for line in f if "/memfd:procspawn" in line)
            print(len(held), len(os.listdir("/proc/self/fd")), maps)
        """
    )
    result = run_script(code, timeout=110)
    assert result.returncode == 0, result.stderr
    held, fds, maps = map(int, result.stdout.split())
    assert held == 30_000
    assert fds < 64 and maps < 64  # 30,000 arrays of 256 bytes: a few 4 MiB slabs


def test_slabs_can_be_turned_off():
    code = textwrap.dedent(
        """
        import os
        from procspawn import sharing

        before = len(os.listdir("/proc/self/fd"))
        arrays = [sharing.zeros(8) for _ in range(5)]
        print(len(os.listdir("/proc/self/fd")) - before)
        """
    )
    result = run_script(code, env_extra={"PROCSPAWN_SLAB_THRESHOLD": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["5"]  # one memfd each, as before slabs


FD_FALLBACK = """
import resource
import sys
import warnings
import numpy as np
import procspawn as mp
from procspawn import sharing
from procspawn.sharing.segments._segment import segment_of

def total(rank, arrays):
    return [int(a[0]) for a in arrays]


if __name__ == "__main__":
    if sys.argv[1] == "explicit":
        mp.set_sharing_strategy("file_descriptor")
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays = []
        try:
            for i in range(100):  # 512 KiB each, above the slab threshold: one memfd each
                arrays.append(sharing.zeros(1 << 16))
                arrays[-1][0] = i
        except OSError as exc:
            print(type(exc).__name__, len(arrays))
            sys.exit(0)
    print(len(caught), caught[0].category.__name__, str(caught[0].message))
    print(sorted({segment_of(a)[0].strategy for a in arrays}))
    assert [int(a[0]) for a in arrays] == list(range(100))
    fs = [a for a in arrays if segment_of(a)[0].strategy == "file_system"]
    del arrays  # gives the memfds back: starting a process needs descriptors
    [got] = mp.spawn(total, args=(fs,))  # they travel like any shared array
    print(got == [int(a[0]) for a in fs])
"""


def _run_fallback_script(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", FD_FALLBACK, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(script_env(), PROCSPAWN_SHARING_STRATEGY=""),  # the default strategy
    )


def test_out_of_descriptors_falls_back_to_file_system_once():
    result = _run_fallback_script("default")
    assert result.returncode == 0, result.stderr
    first, strategies, received = result.stdout.splitlines()
    count, category, message = first.split(" ", 2)
    assert (count, category) == ("1", "RuntimeWarning")  # one warning, not one per array
    assert "ulimit -n" in message and "file_system" in message
    assert strategies == "['file_descriptor', 'file_system']"
    assert received == "True"
    explicit = _run_fallback_script("explicit")
    assert explicit.returncode == 0, explicit.stderr
    name, made = explicit.stdout.split()
    assert name == "FdLimitError" and 0 < int(made) < 64  # the user chose: an error
