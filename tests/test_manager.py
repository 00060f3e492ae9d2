"""The file_system cleanup daemon: one per tree, private, cleans after SIGKILL, restarts."""

from __future__ import annotations

import os
import socket
import textwrap
import time

import pytest
from _helpers import run_script

import procspawn as mp
from procspawn import sharing
from procspawn.sharing import _manager

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
    result = run_script(code, env_extra={"PROCSPAWN_MANAGER_GRACE": "0.5"})
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
    result = run_script(code, env_extra={"PROCSPAWN_MANAGER_GRACE": "60"})
    assert result.stdout.strip() == "0", result.stderr
    # the daemon of that tree is still waiting out its grace: stop it
    for pid in _daemon_pids():
        if "--grace 60" in _cmd(pid).replace("\0", " "):
            os.kill(pid, 9)


def _daemon_pids():
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and "_manager_main" in _cmd(e)]


@pytest.mark.skipif(os.geteuid() != 0, reason="checking a peer of another uid needs root")
def test_daemon_is_detached_private_and_keeps_only_valid_names():
    mp.set_sharing_strategy("file_system")
    try:
        a = sharing.zeros(10)
        address = _manager.ensure()
        [name] = [n for n in _segments() if n.startswith(f"procspawn_{os.getpid()}_")]
        assert name in _manager.query(address)
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and _cmd(e).count(address)]
        assert len(pids) == 1
        assert _sid(pids[0]) == pids[0] != _sid(os.getpid())  # its own session

        # a record with a name procspawn could not have made is ignored
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + address)
            for bad in (b"../etc/passwd", b"procspawn_1_zz", b"procspawn_1_0123456789abcdef/x"):
                s.sendall((b"R" + bad).ljust(64, b"\0"))
        assert _wait(lambda: _manager.query(address) == [name])

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
        assert _manager.query(address) == [name]
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
        from procspawn.sharing import _manager

        mp.set_sharing_strategy("file_system")
        a = sharing.zeros(1000)
        address = _manager.ensure()

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
        while name not in (_manager.query(address) or []) and time.monotonic() < deadline:
            time.sleep(0.02)   # the process re-registers as soon as the new daemon runs
        [new] = daemons()   # one new daemon, at the tree's same address
        print(new != old)
        print(name in (_manager.query(address) or []))
        os.kill(os.getpid(), signal.SIGKILL)   # the segment is left to the new daemon
        """
    )
    before = _segments()
    result = run_script(code, env_extra={"PROCSPAWN_MANAGER_GRACE": "0.5"})
    assert result.stdout.split() == ["True", "True"], result.stderr
    assert _wait(lambda: not (_segments() - before))
