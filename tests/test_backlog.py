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


def _keep_all(q, n, out):
    time.sleep(2)  # a slow consumer: the producer is far ahead when it starts
    kept = [q.get(timeout=60) for _ in range(n)]
    out.put((len(kept), all(int(a[0]) == i and a.shape == (16,) for i, a in enumerate(kept))))


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_backlog_of_20000_small_shared_arrays_waits_for_a_slow_consumer(strategy):
    # A replay buffer: a producer puts 20,000 fresh 16-element shared arrays (all carved
    # from one slab) into an unbounded Queue; the consumer starts reading 2 s later and
    # keeps what it gets. Every put succeeds, every array arrives intact, and once both
    # let go nothing is left in /dev/shm (the leak check looks from outside).
    n = 20_000
    mp.set_sharing_strategy(strategy)
    try:
        ctx = mp.get_context("spawn")
        q, out = ctx.Queue(), ctx.Queue()
        consumer = ctx.Process(target=_keep_all, args=(q, n, out))
        consumer.start()
        try:
            for i in range(n):
                a = sharing.empty(16, np.float32)
                a[:] = i
                q.put(a)
            del a
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
