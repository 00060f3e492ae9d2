"""Arrays through shared memory: every strategy x every start method, every channel."""

from __future__ import annotations

import os
import queue as queue_mod
import textwrap

import numpy as np
import pytest
from _helpers import ARRAY_KINDS, add_rank_in_place, make_array, run_script, write_into

import procspawn as mp
from procspawn import sharing

pytestmark = pytest.mark.timeout(120)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.hasobject:
        return a.tolist() == b.tolist()
    return np.array_equal(a, b)


# -- spawn arguments and results -----------------------------------------------------------


def test_writes_visible_both_ways_through_spawn_args(strategy, start_method):
    shared = sharing.zeros(4, dtype=np.int64)
    shared[3] = 100

    def fn(rank, array):
        seen = int(array[3])
        array[rank] += rank + 1
        return seen, sharing.is_shared(array), mp.get_sharing_strategy()

    results = mp.spawn(fn, args=(shared,), nprocs=3, start_method=start_method)
    assert results == [(100, True, strategy)] * 3
    assert shared.tolist() == [1, 2, 3, 100]


def test_unshared_argument_is_copied_once_and_left_alone(strategy, start_method):
    plain = np.arange(100_000, dtype=np.float64)
    mp.spawn(add_rank_in_place, args=(plain,), nprocs=2, start_method=start_method)
    assert not sharing.is_shared(plain)
    assert plain[0] == 0 and plain[1] == 1  # the ranks wrote into their shared copy only

    def fn(rank, array):
        array[0] = -1  # the ranks share one copy with each other
        return sharing.is_shared(array)

    assert mp.spawn(fn, args=(plain,), nprocs=2, start_method=start_method) == [True, True]


def test_views_alias_in_the_child(strategy, start_method):
    base = sharing.zeros((10, 10))
    view = base[2:5, ::2]

    def fn(rank, base, view):
        view[0, 0] = 7.0  # base[2, 0]
        return bool(np.shares_memory(base, view)), float(base[2, 0])

    assert mp.spawn(fn, args=(base, view), nprocs=1, start_method=start_method) == [(True, 7.0)]
    assert base[2, 0] == 7.0


@pytest.mark.parametrize("kind", ARRAY_KINDS)
def test_dtype_and_layout_round_trip_through_spawn(strategy, kind):
    array = make_array(kind)

    def fn(rank, a):
        return a, a.flags.writeable, a.flags.f_contiguous, a.flags.c_contiguous

    [(back, writeable, f_contig, c_contig)] = mp.spawn(fn, args=(array,), nprocs=1)
    assert _same(back, array)
    assert writeable == array.flags.writeable == back.flags.writeable
    if kind == "fortran":
        assert f_contig and not c_contig and back.flags.f_contiguous


def test_shared_noncontiguous_view_keeps_strides(strategy):
    base = sharing.zeros((64, 64))
    base[:] = np.arange(64 * 64).reshape(64, 64)
    view = base[::3, ::-2]

    def fn(rank, v):
        return v.strides, v.copy()

    [(strides, values)] = mp.spawn(fn, args=(view,), nprocs=1)
    assert strides == view.strides
    assert np.array_equal(values, view)


def test_results_come_back_through_shared_memory(strategy, start_method):
    def fn(rank):
        return np.full(200_000, rank, dtype=np.int32)

    results = mp.spawn(fn, nprocs=2, start_method=start_method)
    assert [int(r.sum()) for r in results] == [0, 200_000]
    assert all(sharing.is_shared(r) for r in results)


# -- queues and pipes ----------------------------------------------------------------------


def _producer(q, shared):
    shared[0] = 1.0  # the parent sees this
    q.put(("plain", np.arange(50_000, dtype=np.float32)))
    q.put(("shared", shared, shared[10:20]))


def test_queue_writes_visible_both_ways_and_views_alias(strategy, start_method):
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    shared = sharing.zeros(1000)
    p = ctx.Process(target=_producer, args=(q, shared))
    p.start()
    tag, plain = q.get(timeout=60)
    assert tag == "plain" and np.array_equal(plain, np.arange(50_000, dtype=np.float32))
    tag, again, view = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert shared[0] == 1.0
    again[5] = 5.0  # the parent's original sees writes made through the received handle
    assert shared[5] == 5.0
    assert np.shares_memory(again, view) and np.shares_memory(shared, view)
    q.close()
    q.join_thread()


def _pipe_child(conn):
    array = conn.recv()
    array *= 2
    conn.send(array[1:3])
    conn.close()


def test_pipe_writes_visible_both_ways(strategy, start_method):
    ctx = mp.get_context(start_method)
    parent, child = ctx.Pipe()
    shared = sharing.zeros(8)
    shared[:] = 1
    p = ctx.Process(target=_pipe_child, args=(child,))
    p.start()
    child.close()
    parent.send(shared)
    back = parent.recv()
    p.join(60)
    assert shared.tolist() == [2.0] * 8
    back[0] = 9
    assert shared[1] == 9
    parent.close()


def _send_and_exit(q, n):
    for i in range(n):
        q.put(np.full(100_000, i, dtype=np.int64))
    q.close()
    q.join_thread()


def test_producer_exits_before_the_consumer_gets(strategy, start_method):
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    p = ctx.Process(target=_send_and_exit, args=(q, 3))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    got = [q.get(timeout=30) for _ in range(3)]
    assert [int(a[0]) for a in got] == [0, 1, 2]
    assert all(sharing.is_shared(a) for a in got)
    with pytest.raises(queue_mod.Empty):
        q.get(timeout=0.1)
    q.close()
    q.join_thread()


def test_two_handles_give_arrays_that_share_memory(strategy):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shared = sharing.zeros(100)
    q.put(shared)
    q.put(shared[50:])
    first, second = q.get(timeout=30), q.get(timeout=30)
    first[60] = 3.0
    assert second[10] == 3.0
    assert np.shares_memory(first, second)
    q.close()
    q.join_thread()


def test_received_array_sent_on_goes_as_its_handle(strategy):
    r1, w1 = mp.Pipe(duplex=False)
    r2, w2 = mp.Pipe(duplex=False)
    original = sharing.zeros(1000)
    w1.send(original)
    received = r1.recv()
    w2.send(received)
    forwarded = r2.recv()
    forwarded[0] = 42
    assert original[0] == 42
    for c in (r1, w1, r2, w2):
        c.close()


def test_joinable_and_simple_queue(strategy):
    jq = mp.JoinableQueue()
    jq.put(np.ones(100_000))
    assert jq.get(timeout=30).sum() == 100_000
    jq.task_done()
    jq.join()
    jq.close()
    jq.join_thread()
    sq = mp.SimpleQueue()
    assert sq.empty()
    sq.put(sharing.zeros(3))
    assert sharing.is_shared(sq.get())
    sq.close()


def test_unpicklable_put_raises_in_the_caller():
    import threading

    q = mp.Queue()
    with pytest.raises(TypeError):
        q.put(threading.Lock())
    q.put(1)  # the semaphore slot was given back
    assert q.get(timeout=10) == 1
    q.close()
    q.join_thread()


def test_pool_map_with_arrays(strategy, start_method):
    ctx = mp.get_context(start_method)
    arrays = [np.full(100_000, i, dtype=np.float64) for i in range(6)]
    # close + join, not terminate: a worker SIGTERMed while it holds a file_system segment
    # leaves it for the cleanup daemon, which is not what this test is about
    pool = ctx.Pool(2)
    sums = pool.map(np.sum, arrays)
    doubled = pool.map(lambda a: a * 2, arrays[:2])
    pool.close()
    pool.join()
    assert sums == [100_000.0 * i for i in range(6)]
    assert [float(d[0]) for d in doubled] == [0.0, 2.0]
    assert all(sharing.is_shared(d) for d in doubled)


# -- share_memory_ -------------------------------------------------------------------------


def test_share_memory_ndarray_returns_shared_copy(strategy):
    a = np.arange(10.0)
    s = sharing.share_memory_(a)
    assert sharing.is_shared(s) and not sharing.is_shared(a)
    assert np.array_equal(a, s)
    assert sharing.share_memory_(s) is s


def test_share_memory_dict_list_object_in_place(strategy):
    base = np.arange(100.0)
    params = {"w": base, "head": base[:10], "tail": base[90:], "name": "model"}
    sharing.share_memory_(params)
    assert all(sharing.is_shared(params[k]) for k in ("w", "head", "tail"))
    assert params["name"] == "model"
    assert np.shares_memory(params["w"], params["head"])  # views stayed views
    params["w"][0] = -1
    assert params["head"][0] == -1

    items = [np.zeros(3), 5]
    sharing.share_memory_(items)
    assert sharing.is_shared(items[0]) and items[1] == 5

    class Model:
        def __init__(self):
            self.weights = np.ones((4, 4))
            self.bias = self.weights[0]
            self.steps = 0

    model = Model()
    assert sharing.share_memory_(model) is model
    assert sharing.is_shared(model.weights) and np.shares_memory(model.weights, model.bias)

    def fn(rank, m):
        m.weights[rank] += 1  # Hogwild: every rank updates the shared parameters
        return m.steps

    assert mp.spawn(fn, args=(model,), nprocs=2) == [0, 0]
    assert model.weights[:2].tolist() == [[2.0] * 4, [2.0] * 4]
    assert model.bias.tolist() == [2.0] * 4

    with pytest.raises(TypeError, match="share_memory_"):
        sharing.share_memory_(5)


class Model:
    pass


@pytest.mark.timeout(60)
def test_share_memory_reaches_nested_arrays_and_ranks_write_them(start_method):
    model = Model()
    model.layers = [{"w": np.zeros(2)}, (np.zeros(2), "bias")]
    model.by_name = {"b": np.zeros(2)}
    model.myself = model  # a cycle
    model.layers.append(model.layers)  # another
    assert sharing.share_memory_(model) is model
    assert sharing.is_shared(model.layers[0]["w"])
    assert sharing.is_shared(model.layers[1][0]) and model.layers[1][1] == "bias"
    assert sharing.is_shared(model.by_name["b"])
    mp.spawn(write_into, args=(model,), nprocs=2, start_method=start_method)
    assert model.layers[0]["w"].tolist() == [1, 2]
    assert model.layers[1][0].tolist() == [-1, -2]
    assert model.by_name["b"].tolist() == [100, 101]


class Frozen:
    __slots__ = ()


@pytest.mark.timeout(60)
def test_share_memory_refuses_what_it_cannot_share():
    with pytest.raises(TypeError, match="a tuple cannot be changed in place"):
        sharing.share_memory_((np.zeros(2),))
    with pytest.raises(TypeError, match="share_memory_ takes"):
        sharing.share_memory_(Frozen())
    holder = Model()
    holder.inner = type("P", (), {"__setattr__": _no_setattr, "w": None})()
    object.__setattr__(holder.inner, "w", np.zeros(3))
    with pytest.raises(TypeError, match="writes made by other processes would be lost"):
        sharing.share_memory_(holder)


def _no_setattr(self, name, value):
    raise AttributeError(f"{name} is read-only")


class Tagged(np.ndarray):
    def __array_finalize__(self, obj):
        self.tag = getattr(obj, "tag", None)


class Slotted:
    __slots__ = ("w", "empty")

    def __init__(self):
        self.w = np.ones(4)


class Node:
    def __init__(self, nxt):
        self.nxt = nxt
        self.value = np.zeros(1)


@pytest.mark.timeout(60)
def test_share_memory_keeps_subclasses_and_refuses_masked_arrays():
    tagged = np.arange(4.0).view(Tagged)
    tagged.tag = "weights"
    holder = {"t": tagged}
    sharing.share_memory_(holder)
    assert type(holder["t"]) is Tagged and sharing.is_shared(holder["t"])
    assert holder["t"].tag == "weights" and holder["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    masked = {"x": np.ma.masked_array([1.0, 2.0], mask=[True, False])}
    with pytest.raises(TypeError, match="masked array"):
        sharing.share_memory_(masked)
    assert type(masked["x"]) is np.ma.MaskedArray and not sharing.is_shared(masked["x"].data)


def _write_subclasses(rank, rec, tagged, plain_rec):
    rec["a"][0] = 42
    tagged[0] = 42
    return (
        [type(a).__name__ for a in (rec, tagged, plain_rec)],
        tagged.tag,
        [sharing.is_shared(a) for a in (rec, tagged)],
        float(plain_rec["a"][1]),
    )


@pytest.mark.timeout(60)
def test_shared_arrays_of_subclasses_reach_ranks_and_pool_workers_shared():
    """A shared np.recarray or subclass of the user's is the same memory in a
    rank (writes seen by the parent), of its type, with its attributes; an unshared
    recarray arrives as a recarray that works (its class by name, not a copy of it)."""
    rec = sharing.share_memory_(np.zeros(4, dtype=[("a", "f8")]).view(np.recarray))
    tagged = np.zeros(4).view(Tagged)
    tagged.tag = "weights"
    tagged = sharing.share_memory_(tagged)
    plain_rec = np.ones(4, dtype=[("a", "f8")]).view(np.recarray)
    args = (rec, tagged, plain_rec)
    expected = (["recarray", "Tagged", "recarray"], "weights", [True, True], 1.0)
    [out] = mp.spawn(_write_subclasses, args=args, nprocs=1)  # (pickling: any start method)
    assert out == expected
    assert (rec["a"][0], tagged[0]) == (42, 42)  # the rank's writes
    rec["a"][0] = tagged[0] = 0
    with mp.Pool(1) as pool:
        assert pool.apply(_write_subclasses, (0, *args)) == expected
    assert (rec["a"][0], tagged[0]) == (42, 42)


def _object_items(rank, labels):
    return labels.tolist()


@pytest.mark.timeout(60)
def test_arrays_of_python_objects_are_refused_by_sharing_and_travel_by_value():
    for make in (sharing.zeros, sharing.empty):
        for dtype in (object, [("x", "f8"), ("label", "O")]):
            with pytest.raises(TypeError, match="holds references to Python objects"):
                make(3, dtype=dtype)
    labels = np.array(["cat", None, 3] * 10_000, dtype=object)  # 240 KB of pointers
    holder = {"labels": labels, "w": np.zeros(3)}
    with pytest.raises(TypeError, match=r"dict\['labels'\].*Python objects"):
        sharing.share_memory_(holder)
    assert holder["labels"] is labels and not sharing.is_shared(holder["w"])  # unchanged
    with pytest.raises(TypeError, match="Python objects"):
        sharing.share_memory_(labels)
    # sent as it is: a copy, by value (a rank reading this process's pointers would crash)
    [items] = mp.spawn(_object_items, args=(labels,), nprocs=1)
    assert items == labels.tolist()


@pytest.mark.timeout(60)
def test_share_memory_searches_slots_and_deep_structures():
    holder = {"s": Slotted()}
    sharing.share_memory_(holder)
    assert sharing.is_shared(holder["s"].w)
    chain = None
    for _ in range(3000):  # deeper than Python's recursion limit
        chain = Node(chain)
    sharing.share_memory_(chain)
    node, count = chain, 0
    while node is not None:
        assert sharing.is_shared(node.value)
        node, count = node.nxt, count + 1
    assert count == 3000
    del chain, node


# -- strategies ----------------------------------------------------------------------------


def test_strategy_registry():
    assert {"file_system", "file_descriptor"} <= mp.get_all_sharing_strategies()
    before = mp.get_sharing_strategy()
    with pytest.raises(ValueError, match="unknown sharing strategy 'nope'.*file_system"):
        mp.set_sharing_strategy("nope")
    assert mp.get_sharing_strategy() == before
    with pytest.raises(TypeError):
        sharing.register_strategy("x", object())


def test_strategy_env_default():
    result = run_script(
        "import procspawn as mp; print(mp.get_sharing_strategy())",
        env_extra={"PROCSPAWN_SHARING_STRATEGY": "file_system"},
    )
    assert result.stdout.strip() == "file_system", result.stderr


def test_custom_strategy_registered_and_used(start_method):
    from _helpers import CountingStrategy

    strat = CountingStrategy()
    sharing.register_strategy("counting", strat)
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("counting")
    try:
        shared = sharing.zeros(100_000)
        assert strat.allocated == 1
        shared[0] = 3

        def fn(rank, a):
            a[1] = 4
            return mp.get_sharing_strategy(), float(a[0])

        assert mp.spawn(fn, args=(shared,), nprocs=1, start_method=start_method) == [
            ("counting", 3.0)
        ]
        assert shared[1] == 4
    finally:
        mp.set_sharing_strategy(previous)


def test_arrays_of_a_strategy_class_defined_in_a_function_travel(start_method):
    """The C pickler cannot name such a class; the message goes by cloudpickle instead,
    from the parent and from a rank that received the strategy by value."""
    from _helpers import CountingStrategy

    strat = CountingStrategy()  # its class is local to CountingStrategy.__new__
    sharing.register_strategy("counting_local", strat)
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("counting_local")
    try:
        shared = sharing.zeros(50_000)
        shared[:] = 2.0
        message = sharing.dumps({"a": shared})
        try:
            back = sharing.loads(message.data, [os.dup(fd) for fd in message.fds])["a"]
        finally:
            message.close()
        assert np.shares_memory(back, shared) or back[0] == 2.0

        def fn(rank, a):
            out = sharing.zeros(50_000)  # made by the rank's copy of the strategy
            out[:] = a[0] + rank
            return out

        [result] = mp.spawn(fn, args=(shared,), nprocs=1, start_method=start_method)
        assert float(result[0]) == 2.0 and sharing.is_shared(result)
        del back, result
    finally:
        mp.set_sharing_strategy(previous)


def _my_names() -> set[str]:
    """This process' names in /dev/shm, as ls shows them."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")}


def test_file_system_segments_are_private_and_freed():
    mp.set_sharing_strategy("file_system")
    try:
        before = _my_names()  # the pool's
        a = sharing.zeros(40_000)  # above the slab threshold: a segment of its own
        [name] = _my_names() - before
        assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
        del a
        import gc

        gc.collect()
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        mp.set_sharing_strategy("file_descriptor")


def test_many_live_arrays_under_file_system_with_low_fd_limit():
    code = textwrap.dedent(
        """
        import resource, numpy as np
        import procspawn as mp
        from procspawn import sharing

        def shared(value):
            a = sharing.zeros(16)
            a[0] = value
            return a

        def producer(q, n):
            for i in range(0, n, 500):
                q.put([shared(j) for j in range(i, i + 500)])
            q.close()
            q.join_thread()

        if __name__ == "__main__":
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
            mp.set_sharing_strategy("file_system")
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=producer, args=(q, 10_000))
            p.start()
            held = []
            while len(held) < 10_000:
                held.extend(q.get(timeout=60))
            p.join()
            assert all(sharing.is_shared(a) for a in held)
            assert [float(a[0]) for a in held[:3]] == [0.0, 1.0, 2.0]
            held[9999][1] = 5
            import os
            print(len(held), len(os.listdir("/proc/self/fd")))
        """
    )
    result = run_script(code, timeout=110)
    assert result.returncode == 0, result.stderr
    held, fds = map(int, result.stdout.split())
    assert held == 10_000
    assert fds < 64  # a live array under file_system costs no descriptor


def test_fd_exhaustion_gives_a_clear_error():
    code = textwrap.dedent(
        """
        import resource
        import procspawn as mp
        from procspawn import sharing

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_descriptor")
            r, w = mp.Pipe(duplex=False)
            # 512 KiB each, above the slab threshold: one memfd each
            arrays = [sharing.zeros(1 << 16) for _ in range(40)]
            resource.setrlimit(resource.RLIMIT_NOFILE, (60, 60))
            w.send(arrays)  # receiving needs 40 more descriptors at once
            try:
                r.recv()
            except OSError as exc:
                print(type(exc).__name__)
                print(exc)
        """
    )
    result = run_script(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("FdLimitError"), result.stdout
    assert "RLIMIT_NOFILE" in result.stdout and "ulimit -n" in result.stdout
    assert "set_sharing_strategy('file_system')" in result.stdout


def test_mapping_holds_no_descriptor():
    mp.set_sharing_strategy("file_system")
    try:
        before = len(os.listdir("/proc/self/fd"))
        arrays = [sharing.zeros(10) for _ in range(50)]
        assert len(os.listdir("/proc/self/fd")) == before
        del arrays
    finally:
        mp.set_sharing_strategy("file_descriptor")
    small = [sharing.zeros(10) for _ in range(50)]
    assert len(os.listdir("/proc/self/fd")) == before + 1  # one slab's memfd for them all
    large = [sharing.zeros(1 << 16) for _ in range(5)]  # above the slab threshold
    assert len(os.listdir("/proc/self/fd")) == before + 6  # exactly one memfd each
    del small, large


def test_full_dev_shm_is_an_error_at_allocation():
    st = os.statvfs("/dev/shm")
    too_much = st.f_blocks * st.f_frsize + (1 << 30)
    mp.set_sharing_strategy("file_system")
    try:
        with pytest.raises(sharing.SharedMemoryFullError) as info:
            sharing.empty(too_much, dtype=np.uint8)
    finally:
        mp.set_sharing_strategy("file_descriptor")
    msg = str(info.value)
    assert f"{too_much:,}" in msg and "free" in msg and "--shm-size" in msg
    assert isinstance(info.value, OSError)


def _relay(q_in, q_out):
    conn = q_in.get(timeout=30)  # a Connection that travelled inside a message
    conn.send(np.arange(100_000.0))
    conn.close()
    q_out.put("done")


def test_connection_inside_a_message(strategy, start_method):
    ctx = mp.get_context(start_method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    reader, writer = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_relay, args=(q_in, q_out))
    p.start()
    q_in.put(writer)
    writer.close()  # closing our end after put changes nothing: the message holds a dup
    assert reader.recv().sum() == np.arange(100_000.0).sum()
    assert q_out.get(timeout=30) == "done"
    p.join(30)
    assert p.exitcode == 0
    reader.close()
    for q in (q_in, q_out):
        q.close()
        q.join_thread()


def test_threads_sending_one_file_system_segment_keep_the_count_right():
    import threading

    mp.set_sharing_strategy("file_system")
    try:
        shared = sharing.zeros(1000)
        [name] = [n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")]
        pipes = [mp.Pipe(duplex=False) for _ in range(4)]

        def sender(writer):
            for _ in range(200):
                writer.send(shared)

        def receiver(reader, out):
            out.extend(reader.recv() for _ in range(200))

        got: list = []
        threads = [threading.Thread(target=sender, args=(w,)) for _, w in pipes]
        threads += [threading.Thread(target=receiver, args=(r, got)) for r, _ in pipes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(got) == 800
        from procspawn.sharing.daemon._table import holders

        assert holders(name) == [os.getpid()]  # this process, once: it maps it once
        del got
        for r, w in pipes:
            r.close()
            w.close()
    finally:
        mp.set_sharing_strategy("file_descriptor")


def _consumer_or_producer(rank, q, producer_done):
    import time

    mp.set_sharing_strategy("file_system")  # the parent never uses file_system
    if rank == 1:  # producer: put, flush, exit
        q.put(os.getpid())
        q.put(sharing.zeros(100_000) + 1)
        q.close()
        q.join_thread()
        producer_done.set()
        return None
    keep = sharing.zeros(10)  # the consumer is a client of the tree's daemon from here on
    producer = q.get(timeout=30)
    producer_done.wait(30)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{producer}") and time.monotonic() < deadline:
        time.sleep(0.01)  # gone (and reaped)
    time.sleep(0.5)  # then 2.5x the daemon grace: a daemon of the producer's own would
    return float(q.get(timeout=30).sum()), float(keep.sum())  # have unlinked it by now


def test_ranks_of_one_tree_share_one_daemon(start_method):
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import procspawn as mp
        from test_sharing import _consumer_or_producer

        if __name__ == "__main__":
            ctx = mp.get_context({start_method!r})
            q, done = ctx.Queue(), ctx.Event()
            print(mp.spawn(_consumer_or_producer, args=(q, done), nprocs=2,
                           start_method={start_method!r}))
        """
    )
    result = run_script(code, env_extra={"PROCSPAWN_DAEMON_GRACE": "0.2"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(100000.0, 0.0), None]"


def test_get_with_timeout_does_not_hang_on_a_half_sent_message():
    # a writer SIGKILLed in the middle of a message leaves half of it in the pipe
    import struct

    q = mp.Queue()
    q._writer._sock.sendall(struct.pack("<4sQI", b"PSPN", 1000, 0) + b"x" * 10)
    with pytest.raises(queue_mod.Empty):
        q.get(timeout=0.3)
    with pytest.raises(queue_mod.Empty):
        q.get_nowait()
    q.close()
    q.join_thread()


def test_put_sends_itself_in_order_and_hands_a_full_socket_to_the_feeder(monkeypatch, strategy):
    from procspawn.sharing.channels import _queues

    partial = []

    class CountingRest(_queues._Rest):
        def __init__(self, message, sent):
            partial.append(sent)
            super().__init__(message, sent)

    monkeypatch.setattr(_queues, "_Rest", CountingRest)
    q = mp.get_context("spawn").Queue()
    items = []
    for i in range(64):
        if i % 3:
            items.append(bytes([i]) * 60_000)
        else:
            shared = sharing.zeros(10)
            shared[:] = i
            items.append(shared)
    for item in items:  # nobody reads yet: the socket fills up part way
        q.put(item)
    assert partial, "no put found the socket full mid-message"
    for i, expected in enumerate(items):
        got = q.get(timeout=30)
        if i % 3:
            assert got == expected
        else:
            assert sharing.is_shared(got) and got.tolist() == [float(i)] * 10
    q.close()
    q.join_thread()


# -- multiprocessing's own channels: DupFd fallback --------------------------------------


def _stdlib_child(q, back):
    a, view = q.get(timeout=30), q.get(timeout=30)
    a += 1
    back.put((sharing.is_shared(a), np.shares_memory(a, view), float(view[0])))


def _stdlib_args_child(a, view, back):
    view[0] = 7
    back.put((sharing.is_shared(a), np.shares_memory(a, view)))


def _write_first(a):
    a[0] = 42
    return sharing.is_shared(a)


@pytest.fixture
def stop_resource_sharer():
    # multiprocessing's resource_sharer (DupFd outside process start) keeps a listening
    # socket and a thread for the life of the process: stop it so the test leaks nothing
    from multiprocessing import resource_sharer

    yield
    resource_sharer.stop()


def test_stdlib_queue_carries_shared_arrays_as_handles(
    strategy, start_method, stop_resource_sharer
):
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    q, back = ctx.Queue(), ctx.Queue()
    shared = sharing.zeros(100)
    p = ctx.Process(target=_stdlib_child, args=(q, back))
    p.start()
    q.put(shared)
    q.put(shared[10:])
    assert back.get(timeout=30) == (True, True, 1.0)
    p.join(30)
    assert p.exitcode == 0
    assert shared.tolist() == [1.0] * 100  # the child's writes, seen here
    for qq in (q, back):
        qq.close()
        qq.join_thread()


def test_stdlib_process_args_and_process_pool_share_arrays(
    strategy, start_method, stop_resource_sharer
):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context(start_method)
    back = ctx.Queue()
    shared = sharing.zeros(10)
    p = ctx.Process(target=_stdlib_args_child, args=(shared, shared[5:], back))
    p.start()
    assert back.get(timeout=30) == (True, True)
    p.join(30)
    assert p.exitcode == 0 and shared[5] == 7
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        assert pool.submit(_write_first, shared).result(timeout=60) is True
    assert shared[0] == 42
    back.close()
    back.join_thread()


def test_arrays_outside_segments_pickle_through_multiprocessing_as_numpy_pickles_them():
    import pickle
    from multiprocessing.reduction import ForkingPickler

    plain = np.arange(10.0)[::2]
    data = bytes(ForkingPickler.dumps(plain, protocol=4))
    assert data == pickle.dumps(plain, protocol=4)
    back = ForkingPickler.loads(data)
    assert back.tolist() == plain.tolist() and not sharing.is_shared(back)


def _put_and_exit(q):
    shared = sharing.zeros(10)
    q.put(shared)
    q.close()
    q.join_thread()  # the message is in the pipe; this process (and its sharer) then exits


def test_stdlib_queue_sender_gone_is_a_clear_error(start_method):
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    q = ctx.Queue()
    p = ctx.Process(target=_put_and_exit, args=(q,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    with pytest.raises(OSError) as info:
        q.get(timeout=30)
    msg = str(info.value)
    assert "could not be fetched from the process that sent it" in msg
    assert "procspawn's own channels" in msg
    q.close()
    q.join_thread()


def test_numpy_reducers_load_with_the_first_array_and_share_every_array_of_it():
    """A message without arrays imports nothing of the array path (a pool's start-up and
    its first plain calls); the first message with arrays loads the NumPy reducers in the
    middle of pickling, and every array of it goes through shared memory, by the C
    pickler (cloudpickle is never imported for plain data)."""
    code = textwrap.dedent(
        """
        import os, sys
        import numpy as np
        from procspawn import sharing
        from procspawn.sharing.wire import _pickler

        REDUCERS = "procspawn.sharing.wire._reductions"
        message = _pickler.dumps({"plain": (1, 2.5, "three", [b"four"])})
        message.close()
        assert REDUCERS not in sys.modules, "a plain message loaded the array reducers"

        arrays = [np.arange(100_000.0), np.arange(200_000), np.ones((300, 400))]
        message = _pickler.dumps({"first": arrays[0], "more": arrays[1:]})
        assert REDUCERS in sys.modules
        assert "cloudpickle" not in sys.modules, "plain data with arrays went by cloudpickle"
        assert len(message.fds) == 3, message.fds  # one segment per array
        back = _pickler.loads(message.data, [os.dup(fd) for fd in message.fds])
        message.close()
        arrived = [back["first"], *back["more"]]
        assert all(sharing.is_shared(a) for a in arrived)
        assert all(np.array_equal(a, b) for a, b in zip(arrived, arrays))
        print("ok")
        """
    )
    result = run_script(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_segment_larger_than_memory_and_swap_is_refused_up_front():
    """A memfd is sized without being filled: one for a broadcast view of 800 GB
    (np.broadcast_to, 8 bytes of data) was made, then filled page by page until the
    out-of-memory killer struck. It raises MemoryError at once, as the stdlib's pickle
    does, and nothing is allocated. (Only the segment is asked for here: an array that
    large sent through a pool would be filled, and take the machine down, if the check
    were gone.)"""
    from procspawn.sharing.segments._file_descriptor import FileDescriptorStrategy

    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(MemoryError, match="800,000,000,000 bytes cannot be made"):
        FileDescriptorStrategy().allocate(800_000_000_000)
    assert len(os.listdir("/proc/self/fd")) == fds
