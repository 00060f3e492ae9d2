"""Recycled segments (the producer-side segment cache): a segment that carried a copy is
reused only once nobody, anywhere, holds it: not a consumer keeping the array, not a
message still unread, not a consumer it was passed on to, not one of several ranks that
got it at start."""

from __future__ import annotations

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
from procspawn.sharing.daemon._table import holders
from procspawn.sharing.segments import _recycled
from procspawn.sharing.segments._file_system import KEPT_NAMES
from procspawn.sharing.segments._segment import segment_of

MIB = 1 << 20
ctx = mp.get_context("spawn")


def _recycled_maps() -> int:
    """Bytes of recycled segments this process keeps, seen in /proc/self/maps (``---s``
    mappings of memfds and of /dev/shm names)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[1] == "---s" and _RECYCLED in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                total += end - start
    return total


_RECYCLED = "procspawn"  # in "/memfd:procspawn (deleted)" and "/dev/shm/procspawn_..."


@pytest.fixture(params=["file_descriptor", "file_system"])
def recycling(request):
    """Each strategy whose send copies are recycled, made the current one."""
    previous = mp.get_sharing_strategy()
    sharing.trim()  # what earlier tests' sends left to recycle is not this test's
    mp.set_sharing_strategy(request.param)
    yield request.param
    sharing.trim()
    mp.set_sharing_strategy(previous)


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


def test_recycling_works_here():
    assert _recycled.usable(), "the kernel here does not count holders as recycling needs"


def test_steady_stream_reuses_a_segment(recycling):
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
    assert 0 < _recycled_maps() <= 3 * MIB


def test_segments_held_by_consumers_are_never_reused(recycling):
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


def test_an_unread_message_keeps_its_segment(recycling):
    unread = ctx.Queue()
    _send_all(unread, 1, start=77)  # nobody reads it until the end
    _stream_to_a_consumer(10)
    value, array = unread.get(timeout=30)
    assert value == 77 and np.all(array == 77)


def _hold_then_wait(q, out):
    value, array = q.get()
    out.put((_key(array), os.getpid()))
    q.get()  # held until killed


def test_a_killed_consumer_gives_its_segment_back(recycling):
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
    if recycling == "file_system":  # the daemon takes a dead holder out: wait until it has
        deadline = time.monotonic() + 30
        while pid in holders(held_key) and time.monotonic() < deadline:
            time.sleep(0.02)
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


def test_a_start_message_read_by_several_ranks_keeps_its_segment(recycling):
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


def test_trim_gives_everything_back(recycling):
    _stream_to_a_consumer(3)
    assert _recycled_maps() > 0
    assert sharing.trim() >= MIB
    assert _recycled_maps() == 0
    assert sharing.trim() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_segment_alive_at_a_fork_is_never_reused(recycling):
    before = _recycled_maps()
    kind = _recycled.MEMFDS if recycling == "file_descriptor" else KEPT_NAMES
    segment = _recycled.take(MIB, kind)
    assert segment is not None
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    del segment  # the child had a copy of its mapping: it must not come back for reuse
    assert _recycled_maps() == before


# the bytes of recycled segments a script keeps, as /proc/self/maps shows them (no access: ---s)
_RECYCLED_BYTES = textwrap.dedent(
    """
    def recycled_bytes():
        total = 0
        for line in open("/proc/self/maps"):
            f = line.split(None, 5)
            if len(f) == 6 and f[1] == "---s" and "procspawn" in f[5]:
                a, b = (int(x, 16) for x in f[0].split("-"))
                total += b - a
        return total
    """
)


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_recycling_is_bounded_and_can_be_turned_off(strategy_name):
    code = _RECYCLED_BYTES + textwrap.dedent(
        """
        import numpy as np
        import procspawn as mp

        def hold(q, n, done):
            held = [q.get() for _ in range(n)]
            done.get()

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
            print(recycled_bytes())
        """
    )
    env = {"PROCSPAWN_SHARING_STRATEGY": strategy_name}
    bounded = run_script(code, env_extra={**env, "PROCSPAWN_POOL_BYTES": str(2 * MIB)})
    assert bounded.returncode == 0, bounded.stderr
    assert 0 < int(bounded.stdout) <= 2 * MIB
    off = run_script(code, env_extra={**env, "PROCSPAWN_POOL_BYTES": "0"})
    assert off.returncode == 0, off.stderr
    assert int(off.stdout) == 0
    bad = run_script(code, env_extra={**env, "PROCSPAWN_POOL_BYTES": "lots"})
    assert bad.returncode != 0 and "PROCSPAWN_POOL_BYTES='lots'" in bad.stderr


_STREAM = _RECYCLED_BYTES + textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import procspawn as mp

    def drop(q):
        while q.get() is not None:
            pass

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue(maxsize=1)
        p = ctx.Process(target=drop, args=(q,))
        p.start()
        for i in range(5):
            q.put(np.full(1 << 20, i, np.uint8))
        q.put(None)
        p.join()
        deadline = time.monotonic() + 10
        while recycled_bytes() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the consumer's last drop reaches the cache
        print(recycled_bytes(), flush=True)
        prefix = f"procspawn_{os.getpid()}_"
        mine = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
        if sys.argv[1] == "idle":  # given back after 0.3 s idle: at most 1.5 s
            deadline = time.monotonic() + 1.5
            while (recycled_bytes() or mine()) and time.monotonic() < deadline:
                time.sleep(0.02)
            print(recycled_bytes(), mine())
        else:
            print(mine(), flush=True)
            if sys.argv[1] == "wait":
                sys.stdin.read()
    """
)


@pytest.mark.parametrize("strategy_name", ["file_descriptor", "file_system"])
def test_a_segment_nobody_reuses_is_given_back_after_the_idle_time(strategy_name):
    env = {"PROCSPAWN_SHARING_STRATEGY": strategy_name, "PROCSPAWN_POOL_IDLE": "0.3"}
    result = run_script(_STREAM, env_extra=env, args=["idle"])
    assert result.returncode == 0, result.stderr
    kept, after = result.stdout.splitlines()
    assert int(kept) > 0
    assert after == "0 []"  # nothing kept, and no name of this process left in /dev/shm


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_recycled_names_go_when_their_process_does(how):
    env = {"PROCSPAWN_SHARING_STRATEGY": "file_system", "PROCSPAWN_POOL_IDLE": "60"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _STREAM, "wait" if how == "sigkill" else "names"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**script_env(), **env},
    )
    try:
        kept = int(proc.stdout.readline())
        names = eval(proc.stdout.readline())  # a list of strings, printed by the script
        assert kept > 0 and names, "the script kept no recycled named segment"
        if how == "sigkill":
            proc.kill()
        else:
            proc.stdin.close()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    deadline = time.monotonic() + 20
    while any(os.path.exists(f"/dev/shm/{n}") for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)  # after a SIGKILL, the tree's daemon frees them
    assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]


def test_running_out_of_descriptors_gives_back_recycled_segments_first():
    code = textwrap.dedent(
        """
        import os, resource
        import numpy as np
        import procspawn as mp
        from procspawn import sharing

        def hold_all(q, n, done):
            held = [q.get() for _ in range(n)]
            done.put(len(held))
            done.get()

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_descriptor")  # explicit: no fallback, an error
            ctx = mp.get_context("spawn")
            q, done, back = ctx.Queue(), ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=hold_all, args=(q, 20, back))
            p.start()
            for i in range(20):  # 20 recycled memfds held by the consumer, then all kept here
                q.put(np.full(1 << 20, i, np.uint8))
            back.get()
            back.put(None)
            p.join()
            while sharing.segments._recycled.kept_bytes() < 20 << 20:
                pass
            fds = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (fds + 8, fds + 8))
            held = [sharing.zeros(1 << 20, np.uint8) for _ in range(15)]
            print(len(held), sharing.segments._recycled.kept_bytes())
        """
    )
    result = run_script(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["15", "0"]


def test_a_failure_in_the_second_copy_thread_is_raised(monkeypatch):
    from procspawn.sharing.segments import _ndarray

    real = np.copyto
    source = np.arange(4 << 20, dtype=np.float32)  # 16 MiB: copied in two threads
    target = np.empty_like(source)

    def copyto(dst, src, **kwargs):
        if dst.ctypes.data != target.ctypes.data:  # the second half
            raise MemoryError("the second half failed")
        real(dst, src, **kwargs)

    monkeypatch.setattr(_ndarray.np, "copyto", copyto)
    with pytest.raises(MemoryError, match="second half"):
        _ndarray._copy(target, source)


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
    q[1].send(source)  # the send's own copy (a recycled segment), received in this process
    received = q[0].recv()
    assert np.array_equal(received, source)
    for end in q:
        end.close()


def _resident_kib(address: int) -> int:
    """Rss of the mapping that starts at or contains ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _kernel() -> tuple[int, ...]:
    return tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])


@pytest.mark.skipif(_kernel() < (5, 14), reason="MADV_POPULATE_WRITE came in Linux 5.14")
def test_populate_faults_in_a_new_segment_in_one_call():
    from procspawn.sharing.segments import _strategy
    from procspawn.sharing.segments._segment import populate

    segment = _strategy.allocate(4 << 20)
    assert _resident_kib(segment.address) == 0  # nothing touched yet
    populate(segment.address, segment.size)
    assert _resident_kib(segment.address) >= 4 << 10


def _recycled_resident_kib() -> int:
    """Rss of the recycled segments this process keeps (its ``---s`` mappings)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split(None, 5)
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) == 6 and fields[1] == "---s" and _RECYCLED in fields[5]
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_a_send_writes_a_new_segment_through_its_file_and_maps_it_on_first_reuse(
    recycling, monkeypatch
):
    """A copy into a new segment is written to its file (pwrite): the sender maps none of
    its pages, only the receiver does. The first reuse of the segment maps its pages
    here in one madvise before copying; later reuses find them mapped and ask nothing."""
    from procspawn.sharing.segments import _ndarray

    calls = []
    real = _ndarray.populate
    monkeypatch.setattr(
        _ndarray, "populate", lambda address, length: (calls.append(length), real(address, length))
    )
    array = np.arange(1 << 19, dtype=np.float64)  # 4 MiB
    ends = mp.Pipe()
    try:
        resident = []
        for i in range(4):
            ends[1].send(array + i)
            assert np.array_equal(ends[0].recv(), array + i)  # dropped: its segment comes back
            assert _recycled_maps() >= array.nbytes  # kept for the next send
            resident.append(_recycled_resident_kib())
    finally:
        for end in ends:
            end.close()
    assert resident[0] == 0  # written through the file: nothing mapped by the sender
    assert all(kib >= array.nbytes >> 10 for kib in resident[1:])  # the first reuse mapped it
    assert calls == [array.nbytes]  # once, at the first reuse


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(1 << 18, dtype=np.float64),  # 2 MiB, C order
        lambda: np.asfortranarray(np.arange(1 << 18, dtype=np.int32).reshape(512, 512)),
        lambda: np.arange(1 << 20, dtype=np.int16).reshape(1024, 1024)[:, ::2],  # strided
        lambda: np.zeros(1 << 16, dtype=[("a", "<i4"), ("b", ">f8"), ("c", "S5")]),
        lambda: np.arange(1 << 18).astype("datetime64[ms]"),  # no buffer protocol export
        lambda: np.arange(1 << 18, dtype=">i8"),  # not the machine's byte order
    ],
    ids=["c", "fortran", "strided", "structured", "datetime", "big-endian"],
)
def test_copies_into_new_segments_are_exact_for_any_layout_and_dtype(recycling, make):
    source = make()
    if source.dtype.names:
        source["a"] = np.arange(len(source))
        source["b"] = -np.arange(len(source)) / 3
        source["c"] = b"abcde"
    shared = sharing.share_memory_(source)
    assert sharing.is_shared(shared) and shared.dtype == source.dtype
    assert shared.flags.f_contiguous == source.flags.f_contiguous
    assert np.array_equal(shared, source)
    ends = mp.Pipe()
    try:
        ends[1].send(source)  # the send's own copy, into a recycled segment
        assert np.array_equal(ends[0].recv(), source)
    finally:
        for end in ends:
            end.close()


def test_a_segment_whose_file_cannot_be_written_is_filled_through_its_mapping():
    """A strategy that keeps a read-only descriptor (pwrite gets EBADF): the copy goes
    through the mapping instead, and is exact."""
    from procspawn.sharing.segments import _strategy
    from procspawn.sharing.segments._segment import Segment, map_fd

    class ReadOnlyFd(_strategy.SharingStrategy):
        def allocate(self, nbytes):
            length = max(nbytes, 1)
            fd = os.memfd_create("procspawn-test-readonly", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, length)
                st = os.fstat(fd)
                address = map_fd(fd, length)
                kept = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            finally:
                os.close(fd)
            return Segment(
                address=address,
                size=nbytes,
                strategy=self.name,
                key=(st.st_dev, st.st_ino),
                map_address=address,
                map_length=length,
                fd=kept,  # the one it keeps is read-only
            )

        def reduce(self, segment):
            raise AssertionError("not sent in this test")

        def rebuild(self, handle):
            raise AssertionError("not sent in this test")

    sharing.register_strategy("readonly-fd", ReadOnlyFd())
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("readonly-fd")
    try:
        source = np.arange(1 << 18, dtype=np.float64)
        shared = sharing.share_memory_(source)
        assert np.array_equal(shared, source)
        del shared
    finally:
        mp.set_sharing_strategy(previous)
