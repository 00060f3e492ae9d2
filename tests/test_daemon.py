"""The file_system cleanup daemon: one per tree, private, cleans after SIGKILL, restarts."""

from __future__ import annotations

import os
import signal
import socket
import textwrap
import time

import pytest
from _helpers import run_script

import procspawn as mp
from procspawn import sharing
from procspawn.sharing.daemon import _client

pytestmark = pytest.mark.timeout(120)


def _wait(predicate, seconds=15.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("procspawn_")}


def _sid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[3])


def test_a_long_lived_parent_gets_back_what_killed_ranks_held(start_method):
    # A parent that keeps running (a notebook, a trainer restarting failed ranks) runs 10
    # rounds of spawn in which every rank maps the parent's array, makes one of its own
    # and is SIGKILLed: after each round /dev/shm is back to the parent's own array within
    # 2 s, while the parent lives and still holds that array.
    code = textwrap.dedent(
        f"""
        import os, signal, time
        import procspawn as mp
        from procspawn import sharing

        def work(rank, data):
            keep = sharing.zeros(10_000)   # this rank's own segment, never released
            data[rank] += 1
            os.kill(os.getpid(), signal.SIGKILL)

        def names():
            return sorted(n for n in os.listdir("/dev/shm") if n.startswith("procspawn_"))

        if __name__ == "__main__":
            mp.set_sharing_strategy("file_system")
            baseline = names()
            data = sharing.zeros(100_000)
            mine = sorted(set(names()) - set(baseline))
            for round in range(10):
                try:
                    mp.spawn(work, args=(data,), nprocs=2, start_method={start_method!r})
                except mp.ProcessExitedException as exc:
                    assert exc.signal_name == "SIGKILL", exc
                deadline = time.monotonic() + 2.0
                while sorted(set(names()) - set(baseline)) != mine:
                    if time.monotonic() > deadline:
                        print("left after round", round, sorted(set(names()) - set(baseline)))
                        raise SystemExit(1)
                    time.sleep(0.02)
            print(int(data[0]) >= 1, len(mine))
        """
    )
    before = _segments()
    result = run_script(code, env_extra={"PROCSPAWN_DAEMON_GRACE": "0.5"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["True", "1"]
    assert _wait(lambda: not (_segments() - before)), "the parent's own array outlived it"


def test_join_returns_promptly_after_a_file_system_producer_exits():
    # The daemon the producer starts must hold nothing of the producer's (torch's daemon
    # keeps its starter's sentinel, so Process.join() never returns). A fresh tree, and a
    # daemon grace of 60 s: if the daemon held the sentinel, join(20) would time out.
    code = textwrap.dedent(
        """
        import os
        import procspawn as mp
        from procspawn import sharing

        def produce():
            mp.set_sharing_strategy("file_system")
            a = sharing.zeros(1000)   # starts the tree's daemon
            a[0] = 1

        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=produce)
            p.start()
            p.join(20)
            print(p.exitcode)
        """
    )
    result = run_script(code, env_extra={"PROCSPAWN_DAEMON_GRACE": "60"})
    assert result.stdout.strip() == "0", result.stderr
    # the daemon of that tree is still waiting out its grace: stop it
    for pid in _daemon_pids():
        if "--grace 60" in _cmd(pid).replace("\0", " "):
            os.kill(pid, 9)


def _daemon_pids():
    return [
        int(e) for e in os.listdir("/proc") if e.isdigit() and "sharing/daemon/_main.py" in _cmd(e)
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="checking a peer of another uid needs root")
def test_daemon_is_detached_private_and_keeps_only_valid_names():
    mp.set_sharing_strategy("file_system")
    try:
        a = sharing.zeros(10)
        address = _client.ensure()
        [name] = [n for n in _segments() if n.startswith(f"procspawn_{os.getpid()}_")]
        assert name in _client.query(address)
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and _cmd(e).count(address)]
        assert len(pids) == 1
        assert _sid(pids[0]) == pids[0] != _sid(os.getpid())  # its own session

        # a record with a name procspawn could not have made is ignored
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + address)
            for bad in (b"../etc/passwd", b"procspawn_1_zz", b"procspawn_1_0123456789abcdef/x"):
                s.sendall((b"R" + bad).ljust(64, b"\0"))
        assert _wait(lambda: _client.query(address) == [name])

        # a peer of another uid is refused
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect("\0" + address)
                    s.settimeout(5)
                    try:
                        s.sendall(b"R" + b"procspawn_1_0123456789abcdef".ljust(63, b"\0"))
                        code = 0 if s.recv(1) == b"" else 1  # the daemon closed on us
                    except (BrokenPipeError, ConnectionResetError):
                        code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _client.query(address) == [name]
        del a
    finally:
        mp.set_sharing_strategy("file_descriptor")


def _cmd(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_killed_daemon_is_replaced_and_names_registered_again():
    code = textwrap.dedent(
        """
        import os, signal, time
        import procspawn as mp
        from procspawn import sharing
        from procspawn.sharing.daemon import _client

        mp.set_sharing_strategy("file_system")
        a = sharing.zeros(1000)
        address = _client.ensure()

        def cmdline(pid):
            try:  # a process listed a moment ago may be gone by now
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return f.read().decode(errors="replace")
            except OSError:
                return ""

        def daemons():
            return [int(e) for e in os.listdir("/proc") if e.isdigit() and address in cmdline(e)]

        [old] = daemons()
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while daemons() in ([], [old]) and time.monotonic() < deadline:
            time.sleep(0.02)
        [name] = [n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")]
        while name not in (_client.query(address) or []) and time.monotonic() < deadline:
            time.sleep(0.02)   # the process re-registers as soon as the new daemon runs
        [new] = daemons()   # one new daemon, at the tree's same address
        print(new != old)
        print(name in (_client.query(address) or []))
        os.kill(os.getpid(), signal.SIGKILL)   # the segment is left to the new daemon
        """
    )
    before = _segments()
    result = run_script(code, env_extra={"PROCSPAWN_DAEMON_GRACE": "0.5"})
    assert result.stdout.split() == ["True", "True"], result.stderr
    assert _wait(lambda: not (_segments() - before))


# -- a daemon that cannot die of its clients ---------------------------------------------

MANY_CLIENTS = """
import json, os, resource, sys, time
import procspawn as mp
from procspawn import sharing
from procspawn.sharing.daemon import _client
from procspawn.sharing.daemon._table import holders


def hold(q, ready, stop):
    a = q.get(timeout=120)   # maps the parent's array: a client of the tree's daemon
    ready.put((os.getpid(), int(a[0])))
    stop.get(timeout=120)


def daemons(address):
    found = []
    for e in os.listdir("/proc"):
        try:
            with open(f"/proc/{e}/cmdline", "rb") as f:
                if address.encode() in f.read():
                    found.append(int(e))
        except OSError:
            pass
    return found


if __name__ == "__main__":
    n, soft, daemon_limit = (int(x) for x in sys.argv[1:4])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    mp.set_sharing_strategy("file_system")
    a = sharing.zeros(1000)   # the first share: the daemon starts, with this soft limit
    a[0] = 5
    address = _client.ensure()
    [daemon] = daemons(address)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))   # the parent's own needs
    if daemon_limit:   # a daemon already at its hard limit
        resource.prlimit(daemon, resource.RLIMIT_NOFILE, (daemon_limit, daemon_limit))
    ctx = mp.get_context("fork")
    q, ready, stop = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=hold, args=(q, ready, stop)) for _ in range(n)]
    for p in procs:
        p.start()
    for _ in range(n):
        q.put(a)
    got = [ready.get(timeout=120) for _ in range(n)]
    [name] = [x for x in os.listdir("/dev/shm") if x.startswith(f"procspawn_{os.getpid()}_")]
    mapped = len(set(holders(name)))
    for _ in range(n):
        stop.put(None)
    for p in procs:
        p.join(60)
    deadline = time.monotonic() + 10
    while holders(name) != [os.getpid()] and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(f"/proc/{daemon}/limits") as f:
        [limit] = [line.split()[3] for line in f if line.startswith("Max open files")]
    print(json.dumps({
        "values": sorted({v for _, v in got}), "mapped": mapped,
        "after": holders(name) == [os.getpid()], "codes": sorted({p.exitcode for p in procs}),
        "daemons": daemons(address) == [daemon], "limit": int(limit), "hard": hard,
    }))
"""


def _many_clients(n: int, soft: int, daemon_limit: int = 0) -> dict:
    import json

    result = run_script(MANY_CLIENTS, timeout=150, args=[str(n), str(soft), str(daemon_limit)])
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _hard_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.skipif(_hard_limit() < 1024, reason="needs a hard RLIMIT_NOFILE of 1024")
def test_a_daemon_started_with_a_low_descriptor_limit_serves_60_clients():
    # The program: the parent's soft limit is 48 when it first shares (the daemon
    # inherits it), then 60 processes map one of its arrays. The daemon lifted its own
    # soft limit to the hard one, and the one that started serves to the end.
    got = _many_clients(60, 48)
    assert got["values"] == [5] and got["mapped"] == 61 and got["codes"] == [0]
    assert got["after"] and got["daemons"]
    assert got["limit"] == got["hard"]


def test_a_daemon_at_its_hard_descriptor_limit_pauses_and_serves_everyone():
    # A daemon that cannot have more than 40 descriptors, and 60 clients at once: it stops
    # accepting while it has none to spare (the others wait in the listen backlog), takes
    # them as descriptors come back, and never dies: the same daemon cleans up after all.
    got = _many_clients(60, 1024, daemon_limit=40)
    assert got["values"] == [5] and got["mapped"] == 61 and got["codes"] == [0]
    assert got["after"] and got["daemons"]


@pytest.mark.slow  # 14 s: out of the default run (pytest -m slow)
@pytest.mark.timeout(200)
@pytest.mark.skipif(_hard_limit() < 4096, reason="1,100 processes need 4096 descriptors")
def test_1100_clients_under_the_default_descriptor_limit_one_daemon_one_table():
    # 1,100 processes map one array at once, under the default soft limit of 1024 the
    # daemon starts with: it serves them all, and the segment's table of holders (1,020
    # places on its first page) grows to list the 1,101 processes.
    got = _many_clients(1100, 1024)
    assert got["values"] == [5] and got["mapped"] == 1101 and got["codes"] == [0]
    assert got["after"] and got["daemons"]


def _close_daemon_connection_then_wait(name_out, stop):
    from procspawn.sharing.daemon import _client as client

    mp.set_sharing_strategy("file_system")
    keep = sharing.zeros(100_000)
    keep[0] = 1
    with client._lock:  # as a program that closes descriptors it does not know of
        conn, client._conn = client._conn, None
        conn.close()
    name_out.put(next(n for n in _segments() if n.startswith(f"procspawn_{os.getpid()}_")))
    stop.get(timeout=60)


def test_a_client_that_closes_its_connection_keeps_its_names_until_it_exits():
    # EOF on a client's socket is not its death: the daemon watches its pid, leaves what
    # it holds alone while it runs, and takes it out of the holders at once when it dies.
    from procspawn.sharing.daemon._table import holders

    ctx = mp.get_context("fork")
    name_out, stop = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_close_daemon_connection_then_wait, args=(name_out, stop))
    child.start()
    try:
        name = name_out.get(timeout=30)
        time.sleep(1.0)  # the daemon has long seen the EOF
        assert holders(name) == [child.pid]
        os.kill(child.pid, 9)
        child.join(10)
        assert _wait(lambda: not os.path.exists(f"/dev/shm/{name}"), 2.0)
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        for q in (name_out, stop):
            q.close()
            q.join_thread()


def _daemon_of(address):
    [pid] = [int(e) for e in os.listdir("/proc") if e.isdigit() and address in _cmd(e)]
    return pid


@pytest.mark.slow  # a soak: 10,000 connections
def test_the_daemon_survives_garbage_stopped_readers_and_10000_connections():
    from procspawn.sharing.daemon._table import PREFIX, SHM_DIR

    address = _client.ensure()
    daemon = _daemon_of(address)

    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\0" + address)
        return s

    # garbage, half a record, a leftover that starts like a query: ignored
    with connect() as s:
        s.sendall(os.urandom(10_000) + b"R" + b"procspawn_1_")
        s.sendall(b"L" * 63)
    # 10,000 connections over its life, each registering a name and closing
    for i in range(10_000):
        with connect() as s:
            s.sendall(f"Rprocspawn_1_{i:016x}".encode().ljust(64, b"\0"))
    # a reader stopped in the middle of a long answer: 10,000 names held (files made
    # here, registered by this process) are more than a socket buffer holds
    names = [f"{PREFIX}{os.getpid()}_{i:016x}" for i in range(10_000)]
    holder = connect()
    try:
        for name in names:
            fd = os.open(f"{SHM_DIR}/{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.close(fd)
        holder.sendall(b"".join(f"R{n}".encode().ljust(64, b"\0") for n in names))
        pid = os.fork()
        if pid == 0:  # asks, then stops without reading the answer
            try:
                s = connect()
                s.sendall(b"L")
                os.kill(os.getpid(), signal.SIGSTOP)
            finally:
                os._exit(0)
        try:
            assert _wait(lambda: _state(pid) == "T", 10)
            started = time.monotonic()
            answer = _client.query(address, timeout=10)  # the daemon is not stuck on it
            assert time.monotonic() - started < 5
            assert answer is not None and set(names) <= set(answer)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        holder.sendall(b"".join(f"U{n}".encode().ljust(64, b"\0") for n in names))
    finally:
        holder.close()
        for name in names:
            try:
                os.unlink(f"{SHM_DIR}/{name}")
            except FileNotFoundError:
                pass
    assert _daemon_of(address) == daemon  # the same daemon serves
    assert len(os.listdir(f"/proc/{daemon}/fd")) < 64  # and holds no descriptor per client


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
