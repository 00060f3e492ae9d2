"""The producer-side pool: a segment that carried a copy is reused only once nobody,
anywhere, holds it: not a consumer keeping the array, not a message still unread, not a
consumer it was passed on to, not one of several ranks that got it at start."""

from __future__ import annotations

import os
import signal
import textwrap

import numpy as np
import pytest
from _helpers import run_script

import procspawn as mp
from procspawn import sharing
from procspawn.sharing import _pool
from procspawn.sharing._segment import segment_of

MIB = 1 << 20
ctx = mp.get_context("spawn")


def _pool_maps() -> int:
    """Bytes of pool segments this process keeps, seen in /proc/self/maps (``---s``)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[1] == "---s" and "/memfd:procspawn" in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                total += end - start
    return total


def _key(array: np.ndarray) -> object:
    return segment_of(array)[0].key  # type: ignore[index]


def _consume(q, out, hold_every, forward=None):
    """Get items until None: check each, report its segment key, keep every
    ``hold_every``-th (or pass it on to ``forward``), then check the kept ones again."""
    held = []
    while True:
        item = q.get()
        if item is None:
            break
        value, array = item
        assert np.all(array == value), f"item {value} arrived overwritten"
        out.put(_key(array))
        if hold_every and value % hold_every == 0:
            if forward is not None:
                forward.put((value, array))
            else:
                held.append((value, array))
        del item, array
    if forward is not None:
        forward.put(None)
    for value, array in held:
        assert np.all(array == value), f"kept item {value} was overwritten by a later send"
    out.put(("kept", sorted(v for v, _ in held)))


def _send_all(q, n, nbytes=MIB, start=0):
    source = np.empty(nbytes, np.uint8)
    for value in range(start, start + n):
        source[:] = value % 256
        q.put((value % 256, source))


def _keys(out, n):
    return [out.get(timeout=30) for _ in range(n)]


def _stream_to_a_consumer(n, start=0):
    """Send n items to a consumer that drops each; return the segment keys it saw."""
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consume, args=(q, out, 0))
    p.start()
    _send_all(q, n, start=start)
    q.put(None)
    keys = _keys(out, n)
    assert out.get(timeout=30) == ("kept", [])
    p.join(30)
    assert p.exitcode == 0
    return keys


def test_the_pool_works_here():
    assert _pool.usable(), "the kernel here does not count holders as the pool needs"


def test_steady_stream_reuses_a_segment():
    q, out = ctx.Queue(maxsize=1), ctx.Queue()
    p = ctx.Process(target=_consume, args=(q, out, 0))
    p.start()
    _send_all(q, 40)
    q.put(None)
    keys = _keys(out, 40)
    assert out.get(timeout=30) == ("kept", [])
    p.join(30)
    assert p.exitcode == 0
    assert len(set(keys)) <= 3  # reused (one in the queue, one being read, one spare)
    assert 0 < _pool_maps() <= 3 * MIB


def test_segments_held_by_consumers_are_never_reused():
    q, out, forward, out2 = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    holder = ctx.Process(target=_consume, args=(q, out, 3))  # keeps every third
    passer_q = ctx.Queue()
    passer = ctx.Process(target=_consume, args=(passer_q, out2, 4, forward))
    out3 = ctx.Queue()
    keeper = ctx.Process(target=_consume, args=(forward, out3, 1))
    for p in (holder, passer, keeper):
        p.start()
    for value in range(30):  # a writer racing two readers, one of which passes items on
        source = np.full(MIB, value, np.uint8)
        q.put((value, source))
        passer_q.put((value, source))
    q.put(None)
    passer_q.put(None)
    keys = _keys(out, 30)
    assert out.get(timeout=30) == ("kept", list(range(0, 30, 3)))
    _keys(out2, 30)
    assert out2.get(timeout=30) == ("kept", [])
    _keys(out3, 8)
    assert out3.get(timeout=30) == ("kept", list(range(0, 30, 4)))
    for p in (holder, passer, keeper):
        p.join(30)
        assert p.exitcode == 0, "a consumer saw a kept or passed-on array overwritten"
    kept = {keys[v] for v in range(0, 30, 3)}
    assert len(kept) == 10  # each kept array had a segment of its own


def test_an_unread_message_keeps_its_segment():
    unread = ctx.Queue()
    _send_all(unread, 1, start=77)  # nobody reads it until the end
    _stream_to_a_consumer(10)
    value, array = unread.get(timeout=30)
    assert value == 77 and np.all(array == 77)


def _hold_then_wait(q, out):
    value, array = q.get()
    out.put((_key(array), os.getpid()))
    q.get()  # held until killed


def test_a_killed_consumer_gives_its_segment_back():
    sharing.trim()  # so that the oldest kept segment is the one the victim holds
    q, out = ctx.Queue(), ctx.Queue()
    victim = ctx.Process(target=_hold_then_wait, args=(q, out))
    victim.start()
    _send_all(q, 1)
    held_key, pid = out.get(timeout=30)
    q2, out2 = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_consume, args=(q2, out2, 0))
    reader.start()
    _send_all(q2, 1, start=5)
    assert out2.get(timeout=30) != held_key  # still held by the victim: a new segment
    os.kill(pid, signal.SIGKILL)
    victim.join(30)
    _send_all(q2, 3, start=6)
    q2.put(None)
    later = _keys(out2, 3)
    out2.get(timeout=30)
    reader.join(30)
    assert reader.exitcode == 0
    assert held_key in later  # the kernel dropped the victim's file: reused


def _rank_holds_argument(rank, array, q, out, go):
    if rank == 0:
        _consume(q, out, 0)
    else:
        go.get(timeout=30)  # wait until rank 0 has had all of its items
    assert np.all(array == 7), "a rank's argument was overwritten by a later send"
    return _key(array)


def test_a_start_message_read_by_several_ranks_keeps_its_segment():
    q, out, go = ctx.Queue(), ctx.Queue(), ctx.Queue()
    argument = np.full(MIB, 7, np.uint8)
    context = mp.spawn(_rank_holds_argument, args=(argument, q, out, go), nprocs=3, join=False)
    del argument
    _send_all(q, 10, start=8)
    q.put(None)
    keys = _keys(out, 10)
    assert out.get(timeout=30) == ("kept", [])
    for _ in range(2):
        go.put("done")
    assert context.join(60)
    arg_keys = set(context.results)
    assert len(arg_keys) == 1 and not arg_keys & set(keys)


def test_trim_gives_everything_back():
    _stream_to_a_consumer(3)
    assert _pool_maps() > 0
    assert sharing.trim() >= MIB
    assert _pool_maps() == 0
    assert sharing.trim() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_segment_alive_at_a_fork_is_never_reused():
    before = _pool_maps()
    segment = _pool.take(MIB)
    assert segment is not None
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    del segment  # the child had a copy of its mapping: it must not come back for reuse
    assert _pool_maps() == before


def test_the_pool_is_bounded_and_can_be_turned_off():
    code = textwrap.dedent(
        """
        import numpy as np
        import procspawn as mp

        def hold(q, n, done):
            held = [q.get() for _ in range(n)]
            done.get()

        def pool_bytes():
            total = 0
            for line in open("/proc/self/maps"):
                f = line.split(None, 5)
                if len(f) == 6 and f[1] == "---s" and "/memfd:procspawn" in f[5]:
                    a, b = (int(x, 16) for x in f[0].split("-"))
                    total += b - a
            return total

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q, done = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=hold, args=(q, 6, done))
            p.start()
            for i in range(6):
                q.put(np.full(1 << 20, i, np.uint8))
            while not q.empty():
                pass
            done.put(None)
            p.join()
            print(pool_bytes())
        """
    )
    bounded = run_script(code, env_extra={"PROCSPAWN_POOL_BYTES": str(2 * MIB)})
    assert bounded.returncode == 0, bounded.stderr
    assert 0 < int(bounded.stdout) <= 2 * MIB
    off = run_script(code, env_extra={"PROCSPAWN_POOL_BYTES": "0"})
    assert off.returncode == 0, off.stderr
    assert int(off.stdout) == 0
    bad = run_script(code, env_extra={"PROCSPAWN_POOL_BYTES": "lots"})
    assert bad.returncode != 0 and "PROCSPAWN_POOL_BYTES='lots'" in bad.stderr


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(3 << 20, dtype=np.float32),  # 12 MiB, 1-D
        lambda: np.asfortranarray(np.arange(6 << 20, dtype=np.int16).reshape(3072, 2048)),
        lambda: np.arange(32 << 20, dtype=np.uint8).reshape(4, 8192, 1024)[:, ::2, 1:],
        lambda: np.arange(2 << 20, dtype=np.complex64).reshape(2, -1)[::-1],
    ],
    ids=["1d", "fortran", "strided-3d", "reversed"],
)
def test_large_copies_split_in_two_threads_are_exact(make):
    source = make()
    shared = sharing.share_memory_(source)
    assert shared.nbytes >= 8 << 20 and sharing.is_shared(shared)
    assert np.array_equal(shared, source)

    def fortran_only(a):
        return a.flags.f_contiguous and not a.flags.c_contiguous

    assert fortran_only(shared) == fortran_only(source)  # the order is kept
    q = mp.Pipe()
    q[1].send(source)  # the send's own copy (a pool segment), received in this process
    received = q[0].recv()
    assert np.array_equal(received, source)
    for end in q:
        end.close()
