"""The lifetime rule, seen from outside as a user would see it.

A segment lives while an array over it or a message carrying it does, no longer: these
tests look at /dev/shm, /proc/self/maps and /proc/self/fd, and call nothing of procspawn
to clean up first.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time

import numpy as np
import pytest
from _helpers import run_script

import procspawn as mp
from procspawn import sharing
from procspawn.sharing.daemon import _client
from procspawn.sharing.daemon._table import holders

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def _names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("procspawn_")}


def _shared_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "/dev/shm/procspawn_" in line or "/memfd:procspawn" in line]


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _within(seconds: float, predicate) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _produce_fresh(q, count, nbytes, strategy):
    mp.set_sharing_strategy(strategy)
    for i in range(count):
        a = sharing.zeros(nbytes, np.uint8)
        a[0] = i
        q.put(a)
        del a  # only the message holds it now
    q.close()
    q.join_thread()


def test_a_receiver_gives_back_every_dropped_array_of_a_producer_that_exited(strategy):
    # 24 fresh 2 MiB arrays from a producer that has exited: while held they are mapped
    # here; once dropped, mappings, descriptors and names are back to the baseline within
    # 2 s, with nothing called to clean up.
    maps, names, fds = len(_shared_mappings()), _names(), _fds()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_produce_fresh, args=(q, 24, 2 * MIB, strategy))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    got = [q.get(timeout=30) for _ in range(24)]
    assert [int(a[0]) for a in got] == list(range(24))
    assert all(a.nbytes == 2 * MIB and sharing.is_shared(a) for a in got)
    assert len(_shared_mappings()) - maps == 24
    del got
    assert _within(2.0, lambda: len(_shared_mappings()) == maps), _shared_mappings()
    assert _names() == names
    q.close()
    q.join_thread()
    p.close()  # its sentinel: all the descriptors left are the queue's and the process'
    assert _within(2.0, lambda: _fds() == fds), _fds() - fds


def _put_then_die(q, strategy):
    mp.set_sharing_strategy(strategy)
    a = sharing.zeros(MIB // 8)
    a[:] = np.arange(MIB // 8)
    q.put(a)
    del a
    q.close()
    q.join_thread()  # the message is in the pipe
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_message_outlives_its_producer_killed_after_put(strategy, start_method):
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    p = ctx.Process(target=_put_then_die, args=(q, strategy))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    if strategy == "file_system":  # the daemon drops what the producer held: not the message's
        [name] = [n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{p.pid}_")]
        assert _within(10, lambda: p.pid not in holders(name)), holders(name)
    got = q.get(timeout=30)
    assert np.array_equal(got, np.arange(MIB // 8, dtype=float))
    got[0] = -1  # the memory is ours to write
    del got
    q.close()
    q.join_thread()


def test_a_program_started_with_subprocess_is_a_tree_of_its_own():
    # This process uses file_system and holds an array, so it is a client of its tree's
    # daemon. A program it starts with subprocess must not join that tree: what the
    # program's SIGKILLed ranks held is gone 2 s after the program exits.
    mp.set_sharing_strategy("file_system")
    try:
        mine = sharing.zeros(1000)
        baseline = _names()
        code = textwrap.dedent(
            """
            import os, signal
            import procspawn as mp
            from procspawn import sharing
            from procspawn.sharing.daemon import _client

            def work(rank):
                held = [sharing.zeros(10_000) for _ in range(3)]
                os.kill(os.getpid(), signal.SIGKILL)

            if __name__ == "__main__":
                mp.set_sharing_strategy("file_system")
                data = sharing.zeros(10_000)
                try:
                    mp.spawn(work, nprocs=3)
                except mp.ProcessExitedException:
                    pass
                print(_client.tree_address())
            """
        )
        result = run_script(code)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() != _client.tree_address()
        assert _within(2.0, lambda: _names() == baseline), _names() - baseline
        assert mine.sum() == 0
        del mine
    finally:
        mp.set_sharing_strategy("file_descriptor")


def _daemon_pids(address: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if address.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue  # exited since it was listed
    return found


@pytest.mark.timeout(90)
def test_names_of_a_rank_killed_right_after_its_daemon_go_while_the_program_runs():
    """The daemon SIGKILLed, then at once a rank holding names of its own: only the dead
    daemon knew them, and the next one's start-up sweep finds them too young (a name that
    young may be being made). That daemon looks again once they are old enough."""
    code = textwrap.dedent(
        """
        import os, signal, time
        import procspawn as mp
        from procspawn import sharing
        from procspawn.sharing.daemon import _client

        def holder(rank, ready):
            kept = [sharing.zeros(100_000) for _ in range(3)]
            ready.set()
            time.sleep(60)

        def daemons(address):
            found = []
            for entry in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if address.encode() in f.read():
                            found.append(int(entry))
                except OSError:
                    pass
            return found

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            data = sharing.zeros(100_000)  # this process is a client too
            ready = mp.Event()
            ctx = mp.spawn(holder, args=(ready,), nprocs=1, join=False)
            assert ready.wait(30)
            [rank] = ctx.pids()
            mine = lambda: [n for n in os.listdir("/dev/shm")
                            if n.startswith(f"procspawn_{rank}_")]
            assert len(mine()) == 3, mine()
            [daemon] = daemons(_client.tree_address())
            os.kill(daemon, signal.SIGKILL)
            os.kill(rank, signal.SIGKILL)
            try:
                ctx.join(20)
            except mp.ProcessExitedException:
                pass
            deadline = time.monotonic() + 10
            while mine() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not mine(), mine()
            assert float(data.sum()) == 0.0
            print("ok")
        """
    )
    result = run_script(code, timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_a_tree_killed_whole_is_swept_by_the_next_daemon(tmp_path):
    # Parent, rank and daemon all SIGKILLed at once: nobody is left to clean. The next
    # daemon this user starts frees what they left (once it is a few seconds old).
    ready = tmp_path / "ready"
    code = textwrap.dedent(
        f"""
        import os, time
        import procspawn as mp
        from procspawn import sharing
        from procspawn.sharing.daemon import _client

        def publish(path, text):  # whole or not at all: the test polls for it
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)

        def rank(r, path):
            keep = sharing.zeros(10_000)
            publish(path + ".rank", str(os.getpid()))
            time.sleep(60)

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            data = sharing.zeros(10_000)
            ctx = mp.spawn(rank, args=({str(ready)!r},), nprocs=1, join=False)
            while not os.path.exists({str(ready)!r} + ".rank"):
                time.sleep(0.02)
            publish({str(ready)!r}, _client.tree_address())
            time.sleep(60)
        """
    )
    import subprocess
    import sys

    from _helpers import script_env

    before = _names()
    proc = subprocess.Popen([sys.executable, "-c", code], env=script_env())
    try:
        assert _within(60, ready.exists)
        address = ready.read_text()
        rank_pid = int((tmp_path / "ready.rank").read_text())
        victims = [proc.pid, rank_pid, *_daemon_pids(address)]
        assert len(victims) == 3
        for pid in victims:  # stopped first, so none sees another die and cleans up
            os.kill(pid, signal.SIGSTOP)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        left = _names() - before
        assert len(left) == 2  # the parent's array and the rank's
    finally:
        proc.kill()
        proc.wait()
    for name in left:  # aged past the sweep's 2 s (a younger one may be being made)
        aged = time.time() - 10
        os.utime(os.path.join("/dev/shm", name), (aged, aged))
    fresh = run_script(
        "import procspawn as mp\n"
        "from procspawn import sharing\n"
        "mp.set_sharing_strategy('file_system')\n"
        "a = sharing.zeros(10)\n",
        env_extra={"PROCSPAWN_DAEMON_GRACE": "0.2"},
    )
    assert fresh.returncode == 0, fresh.stderr
    assert _within(5.0, lambda: not (_names() & left)), _names() & left


def _return_then_fail(rank):
    if rank == 0:
        a = sharing.zeros(100_000)
        a[:] = 1
        return a  # received by the parent before rank 1 fails
    time.sleep(0.3)  # rank 0's result is in the parent within milliseconds
    raise ValueError("rank 1 fails after rank 0 returned")


@pytest.mark.parametrize("how", ["join=True", "join=False"])
def test_a_failed_spawn_leaves_no_reference_cycle_holding_received_arrays(strategy, how):
    # After a failure the finished ranks' results must go when the user drops the error
    # (and the context), without waiting for the cyclic garbage collector.
    maps = len(_shared_mappings())
    gc_was_on = __import__("gc").isenabled()
    __import__("gc").disable()
    try:
        if how == "join=True":
            with pytest.raises(mp.ProcessRaisedException):
                mp.spawn(_return_then_fail, nprocs=2, start_method="fork")
        else:
            ctx = mp.spawn(_return_then_fail, nprocs=2, start_method="fork", join=False)
            with pytest.raises(mp.ProcessRaisedException):
                while not ctx.join():
                    pass
            with pytest.raises(mp.ProcessRaisedException):
                ctx.join()  # raised again, as before
            del ctx
        assert len(_shared_mappings()) == maps, _shared_mappings()
    finally:
        if gc_was_on:
            __import__("gc").enable()


def _produce_plain(q, count, strategy):
    mp.set_sharing_strategy(strategy)
    for i in range(count):
        q.put(np.full(MIB // 8, float(i)))  # not shared: copied into a segment at put
    q.close()
    q.join_thread()


def test_plain_arrays_received_under_file_system_hold_no_descriptor():
    # The copy made at put() is handed over whole to its receiver: it arrives as a named
    # segment, so holding it costs no descriptor (the point of file_system), after the
    # producer exited too; dropped, everything is back to the baseline.
    fds, names = _fds(), _names()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_produce_plain, args=(q, 20, "file_system"))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    got = [q.get(timeout=30) for _ in range(20)]
    assert [float(a[-1]) for a in got] == [float(i) for i in range(20)]
    assert len(_names() - names) == 20  # named, one each
    q.close()
    q.join_thread()
    p.close()
    assert _fds() == fds  # and no descriptor held for them
    del got
    assert _within(2.0, lambda: _names() == names), _names() - names


def test_messages_closed_unread_give_their_segments_back_while_the_program_lives():
    # A consumer died with items still in its queue: the queue is dropped unread. The
    # items' segments (file_system: each message holds a slot of its own) go back within
    # a few seconds, while this process, a client of the tree's daemon, keeps running.
    mp.set_sharing_strategy("file_system")
    try:
        names = _names()
        q = mp.SimpleQueue()
        for i in range(5):
            a = sharing.zeros(40_000)  # 320 KB, above the slab threshold: a segment each
            a[0] = i
            q.put(a)
            del a
        assert len(_names() - names) == 5  # held by the messages in the queue
        q.close()  # unread: the messages, and their descriptors, are gone
        del q
        assert _within(4.0, lambda: _names() == names), _names() - names
    finally:
        mp.set_sharing_strategy("file_descriptor")


@pytest.mark.timeout(30)
def test_a_release_inside_a_table_update_of_the_same_thread_does_not_deadlock():
    # The garbage collector may release a segment (a weak-reference callback) while this
    # thread is inside a holder-table update of that same segment: locking it again
    # through another open would wait for this very thread forever. It runs once the
    # update is done instead.
    from procspawn.sharing.daemon import _table

    mp.set_sharing_strategy("file_system")
    try:
        names = _names()
        a = sharing.zeros(40_000)  # above the slab threshold: a segment of its own
        [name] = _names() - names
        fd = _table.open_segment(name)
        try:
            with _table._Locked(fd):
                del a  # the last array: its segment is released right here
                assert os.path.exists(f"/dev/shm/{name}")  # deferred, not deadlocked
            assert not os.path.exists(f"/dev/shm/{name}")  # done once the lock was left
        finally:
            os.close(fd)
    finally:
        mp.set_sharing_strategy("file_descriptor")
