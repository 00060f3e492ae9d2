"""No fixed limit a slow consumer can make a producer reach: backlogs and holder tables."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

import procspawn as mp
from procspawn import sharing
from procspawn.sharing.daemon import _table
from procspawn.sharing.daemon._table import holders, messages

pytestmark = pytest.mark.timeout(180)


def _my_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")}


def _keep_all(q, n, out, all_put):
    all_put.wait(120)  # a slow consumer: it starts once the whole backlog is queued
    kept = [q.get(timeout=60) for _ in range(n)]
    out.put((len(kept), all(int(a[0]) == i and a.shape == (16,) for i, a in enumerate(kept))))


# the same soak under the other strategy: out of the default run
@pytest.mark.parametrize(
    "strategy", [pytest.param("file_descriptor", marks=pytest.mark.slow), "file_system"]
)
def test_a_backlog_of_20000_small_shared_arrays_waits_for_a_slow_consumer(strategy):
    # A replay buffer: a producer puts 20,000 fresh 16-element shared arrays (all carved
    # from one slab) into an unbounded Queue; the consumer starts reading once all are
    # put, and keeps what it gets. Every put succeeds, every array arrives intact, and once both
    # let go nothing is left in /dev/shm (the leak check looks from outside).
    n = 20_000
    mp.set_sharing_strategy(strategy)
    try:
        ctx = mp.get_context("spawn")
        q, out, all_put = ctx.Queue(), ctx.Queue(), ctx.Event()
        consumer = ctx.Process(target=_keep_all, args=(q, n, out, all_put))
        consumer.start()
        try:
            for i in range(n):
                a = sharing.empty(16, np.float32)
                a[:] = i
                q.put(a)
            del a
            all_put.set()
            assert out.get(timeout=120) == (n, True)
        finally:
            consumer.join(30)
            if consumer.is_alive():
                consumer.kill()
                consumer.join(10)
        assert consumer.exitcode == 0
        for channel in (q, out):
            channel.close()
            channel.join_thread()
    finally:
        mp.set_sharing_strategy("file_descriptor")


def test_unreceived_messages_of_one_segment_are_counted_without_limit():
    # 3,000 messages of one file_system segment wait in a Queue (1,024 was the old
    # table's size): they are a count in its table, the sender its only holder, and
    # draining the queue gives every one back; dropping the array frees the name.
    mp.set_sharing_strategy("file_system")
    try:
        before = _my_names()
        shared = sharing.zeros(40_000)  # above the slab threshold: a segment of its own
        shared[0] = 7
        [name] = _my_names() - before
        q = mp.Queue()
        for _ in range(3000):
            q.put(shared)
        assert messages(name) == (3000, 0)
        assert holders(name) == [os.getpid()]
        got = [q.get(timeout=30) for _ in range(3000)]
        assert all(g[0] == 7 for g in got) and q.empty()
        assert messages(name) == (0, 0)
        assert holders(name) == [os.getpid()]  # it maps the segment once
        del got, shared
        gc.collect()
        assert not os.path.exists(f"/dev/shm/{name}")
        q.close()
        q.join_thread()
    finally:
        mp.set_sharing_strategy("file_descriptor")


def _sum_and_pid(q, out):
    a = q.get(timeout=60)
    out.put((float(a.sum()), os.getpid()))


def test_the_holder_table_grows_past_its_first_page_and_shrinks_back_to_nothing():
    # 3,000 holders of one segment (pids of processes that are not running: the table
    # cannot tell) need three more pages: the table grows at the end of the file, the
    # array over the data is untouched, a receiver maps it and takes a slot among them,
    # and the daemon takes that slot out when the receiver exits.
    mp.set_sharing_strategy("file_system")
    try:
        before = _my_names()
        shared = sharing.zeros(100_000, dtype=np.int64)
        shared[:] = np.arange(100_000)
        [name] = _my_names() - before
        size = os.stat(f"/dev/shm/{name}").st_size
        fake = list(range(4_000_001, 4_003_001))  # above any pid_max: never running
        fd = _table.open_segment(name)
        try:
            with _table._Locked(fd) as table:
                for pid in fake:
                    table.add(pid)
        finally:
            os.close(fd)
        assert holders(name) == [os.getpid(), *fake]
        assert os.stat(f"/dev/shm/{name}").st_size > size  # pages past the data
        assert int(shared.sum()) == sum(range(100_000))

        ctx = mp.get_context("spawn")
        q, out = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_sum_and_pid, args=(q, out))
        child.start()
        q.put(shared)
        total, pid = out.get(timeout=60)
        assert total == sum(range(100_000))
        child.join(30)
        assert child.exitcode == 0
        deadline = time.monotonic() + 10
        while pid in holders(name) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert holders(name) == [os.getpid(), *fake]
        for pid in fake:
            assert _table.let_go(name, pid)
        assert holders(name) == [os.getpid()]
        del shared
        gc.collect()
        assert not os.path.exists(f"/dev/shm/{name}")
        for channel in (q, out):
            channel.close()
            channel.join_thread()
    finally:
        mp.set_sharing_strategy("file_descriptor")


_PRODUCER_AT_A_LOW_LIMIT = """
import resource, sys, time
import numpy as np
import procspawn as mp
from procspawn import sharing

def produce(q, n, all_put):
    for i in range(n):
        q.put(np.full(32_768, float(i)))  # 256 KiB, fresh: a segment of its own each
    q.put(None)
    all_put.set()

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    strategy = sys.argv[1]
    if strategy != "default":
        sharing.set_sharing_strategy(strategy)
    q, all_put = mp.Queue(), mp.Event()
    producer = mp.Process(target=produce, args=(q, 2000, all_put))
    producer.start()
    # a slow consumer: it starts once the producer's whole backlog waits in its feeder
    while not all_put.wait(0.05) and producer.is_alive():
        pass
    got = []
    while (item := q.get(timeout=60)) is not None:
        got.append(float(item[0]))
    producer.join(60)
    print(producer.exitcode, got == [float(i) for i in range(2000)])
"""


@pytest.mark.parametrize(
    "strategy", ["file_system", pytest.param("default", marks=pytest.mark.slow)]
)
def test_a_producer_at_a_low_descriptor_limit_far_ahead_of_its_consumer(strategy, tmp_path):
    """2,000 fresh arrays put while the consumer waits, at a limit of 64 descriptors: the
    messages waiting in the producer name their segments once it has used half its
    descriptors (each carried one: the producer died of EMFILE, a bare OSError, once its
    channel was full, and the consumer waited for the rest). By default the producer
    moves to file_system segments as it nears its limit, then the same."""
    from _helpers import run_file

    script = tmp_path / "producer.py"
    script.write_text(_PRODUCER_AT_A_LOW_LIMIT.replace("sys.argv[1]", repr(strategy)))
    result = run_file(str(script), timeout=150)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"], result.stdout + result.stderr


_SLOW_IMAP_CONSUMER = """
import resource, sys, time
import numpy as np
import procspawn as mp

def double(x):
    return x * 2

def big(i):
    return np.full(100_000, float(i))

if __name__ == "__main__":
    limit = 128 if sys.argv[1] == "made" else 64  # (a range goes 32 per worker ahead)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    n = 400 if sys.argv[1] == "generator" else 150
    with mp.Pool(2) as pool:
        arrays = (np.full(100_000, float(i)) for i in range(n))  # 800 KiB: a segment each
        if sys.argv[1] == "list":  # handed out in batches, not chunk by chunk
            arrays = list(arrays)
        if sys.argv[1] == "made":  # only the results are arrays
            results = pool.imap(big, range(n))
        else:
            results = (r / 2 for r in pool.imap(double, arrays))
        firsts = []
        for i, result in enumerate(results):
            firsts.append(float(result[0]))
            del result
            if i == 5:
                time.sleep(0.8)  # the workers go on; their results wait for us
            elif i < 40:
                time.sleep(0.02)  # each one taken closes its descriptor: holes below
        print(firsts == [float(i) for i in range(n)], pool.apply(sum, ([1, 2],)))
"""


@pytest.mark.parametrize(
    "source",
    [
        "generator",
        pytest.param("list", marks=pytest.mark.slow),
        pytest.param("made", marks=pytest.mark.slow),
    ],
)
def test_an_imap_over_arrays_with_a_slow_consumer_at_a_low_descriptor_limit(source, tmp_path):
    """Each result waiting for the caller holds a descriptor (file_descriptor): the
    results done ahead are kept under a quarter of the limit, so a caller that holds
    one result at a time gets them all (it got FdLimitError after about 40 at 64).
    A list's chunks go in batches, each sent once a quarter of the bound is free. The
    descriptors in use are counted, not guessed from the lowest free one: the results
    taken leave holes below those waiting (made in the workers, they ran past the bound)."""
    from _helpers import run_file

    script = tmp_path / "slow_imap.py"
    script.write_text(_SLOW_IMAP_CONSUMER)
    result = run_file(str(script), timeout=150, args=[source])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "3"], result.stdout + result.stderr


_IMAP_CLOSE_JOIN = """
import resource, sys
import numpy as np
import procspawn as mp

def square(x):
    return x * x

def big(i):
    return np.full(100_000, float(i))  # 800 KiB: a segment, a descriptor each

if __name__ == "__main__":
    limit, arrays = int(sys.argv[1]), sys.argv[2] == "arrays"
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    n = 200 if arrays else 2000
    pool = mp.Pool(2)
    results = pool.imap(big if arrays else square, range(n))
    pool.close()
    pool.join()  # every task done, their results waiting here
    got, errors = [], set()
    while True:
        try:
            item = next(results)
        except StopIteration:
            break
        except mp.FdLimitError as exc:  # a result past the descriptor limit
            errors.add(type(exc).__name__)
            got.append(None)
        else:
            got.append(float(item[0]) if arrays else item)
            del item
    expected = [float(i) if arrays else i * i for i in range(n)]
    print(len(got), all(g is None or g == e for g, e in zip(got, expected)), sorted(errors))
"""


@pytest.mark.parametrize("kind", ["values", "arrays"])
def test_imap_then_close_and_join_returns_with_every_result_waiting(kind, tmp_path):
    """``imap(); close(); join()``, then the results: join returns as the stdlib's does.
    The results waiting for a slow caller are bounded by descriptors (see the test
    above), and this caller waits in join: values hold none, so all arrive (join waited
    forever, at any limit under 4 x 2,000); arrays past a limit of 64 are each a clear
    FdLimitError, never a hang."""
    from _helpers import run_file

    script = tmp_path / "imap_close_join.py"
    script.write_text(_IMAP_CLOSE_JOIN)
    limit = "64" if kind == "arrays" else "1024"
    result = run_file(str(script), timeout=120, args=[limit, kind])
    assert result.returncode == 0, result.stderr
    count, right, errors = result.stdout.strip().split(maxsplit=2)
    assert (count, right) == ("200" if kind == "arrays" else "2000", "True"), result.stdout
    if kind == "values":
        assert errors == "[]"


_LOST_RESULTS = """
import os, sys
import numpy as np
import procspawn as mp
from procspawn import sharing


def _refuse():
    raise RuntimeError("this result cannot be rebuilt here")


class BadOnLoad:
    def __reduce__(self):
        return (_refuse, ())


def many(i):
    # 40 segments: a message carries a descriptor for 32 of them, the rest by name only
    return [np.full(131_072, float(i + k)) for k in range(40)]


def bad_first(i):
    class Local:  # travels by value: the give-back walks past its instance too
        pass

    return (Local(), BadOnLoad(), many(i))


if __name__ == "__main__":
    how = sys.argv[1]
    sharing.set_sharing_strategy("file_system")
    with mp.Pool(1) as pool:
        pool.apply(many, (0,))
        if how == "unpickling fails":
            try:
                pool.apply(bad_first, (1,))
            except Exception as exc:
                print(type(exc).__name__)
        else:
            held = []
            try:
                while True:  # not one descriptor left for the result's
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            result = pool.apply_async(many, (1,))
            result.wait(30)
            for fd in held:
                os.close(fd)
            try:
                result.get(0)
            except mp.FdLimitError as exc:
                print(type(exc).__name__)
        if how != "then it exits":
            print(sum(float(a[0]) for a in pool.apply(many, (2,))))
"""


def _new_segment_names(before: set[str]) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("procspawn_")} - before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["then another call", "then it exits", "unpickling fails"])
def test_a_result_that_is_never_received_leaves_no_segment_behind(how, tmp_path):
    """A result of 40 file_system segments the caller cannot receive (it has no descriptor
    left for them, or unpickling it fails first): 8 of them travel by name, and their
    names stayed in /dev/shm after every process had exited (nothing counted them
    back). The caller now gives back what the lost message held for it, at once, at its
    next message or at exit if it is out of descriptors."""
    from _helpers import run_file

    before = {n for n in os.listdir("/dev/shm") if n.startswith("procspawn_")}
    script = tmp_path / "lost.py"
    script.write_text(_LOST_RESULTS)
    result = run_file(str(script), timeout=90, args=[how])
    assert result.returncode == 0, result.stderr
    expected = ["UnpicklingError" if how == "unpickling fails" else "FdLimitError"]
    if how != "then it exits":
        expected.append(str(float(sum(range(2, 42)))))
    assert result.stdout.split() == expected, result.stdout + result.stderr
    deadline = time.monotonic() + 10  # the daemon sweeps what the dead held
    while _new_segment_names(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _new_segment_names(before)
    for name in left:  # (for the next tests: this one fails)
        os.unlink(os.path.join("/dev/shm", name))
    assert not left, f"{len(left)} segments outlived the program: {sorted(left)[:4]}"


def test_a_forked_child_does_not_give_back_what_its_parent_still_owes():
    """A lost message whose counts a process could not give back yet (out of descriptors)
    waits in a list; a child forked meanwhile starts without it, or the counts would go
    back twice (once per process) and free a segment another message still needs."""
    from procspawn.sharing.segments import _file_system
    from procspawn.sharing.wire import _pickler

    _pickler._owed.append((b"a lost message", set()))
    _file_system.undropped.append(("procspawn_0_0", "inflight"))
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            os._exit(len(_pickler._owed) * 10 + len(_file_system.undropped))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        _pickler._owed.clear()
        _file_system.undropped.clear()


def _raise_with(arrays):
    raise ValueError(arrays)


def test_an_error_carrying_arrays_leaves_another_message_of_them_its_counts():
    """A worker checks that a task's exception loads before sending it: that check took
    over what the message's segments counted for their receiver, the counts of another
    message of the same segments then went with it, and that message could not be
    received once its sender let go of the arrays."""
    mp.set_sharing_strategy("file_system")
    try:
        arrays = [sharing.zeros(40_000) for _ in range(40)]  # 8 of them go by name
        for k, array in enumerate(arrays):
            array[:] = k
        a_end, b_end = mp.Pipe()
        a_end.send(arrays)  # in flight until read below
        with mp.Pool(1) as pool:
            with pytest.raises(ValueError) as info:
                pool.apply(_raise_with, (arrays,))
        assert len(info.value.args[0]) == 40
        del arrays, info
        gc.collect()
        got = b_end.recv()
        assert [float(a[0]) for a in got] == [float(k) for k in range(40)]
        del got
        a_end.close()
        b_end.close()
    finally:
        mp.set_sharing_strategy("file_descriptor")
