"""What a user sees of a program from outside, the one look every leak check takes: the
test's conftest after each test, the crash matrix after each cell, and tests/torture.py.

Child processes (this process is made a child subreaper by its callers, so orphaned
grandchildren count too), ``/dev/shm/procspawn*`` names, open descriptors and shared
mappings, but for the recycled segments (memory kept on purpose, bounded, which a user sees
as mappings with no access, ``---s``)."""

from __future__ import annotations

import multiprocessing
import os


def children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == me:  # ppid
            if fields[0] == "Z":
                _reap(int(entry))
                continue
            found.add(int(entry))
    return found


def _reap(pid: int) -> None:
    # Only orphans reparented to us are reaped here; multiprocessing reaps its own.
    if any(p.pid == pid for p in multiprocessing.active_children()):
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("procspawn")}
    except FileNotFoundError:
        return set()


def recycled_kept() -> dict[tuple[int, int] | str, int]:
    """The recycled segments this process keeps, seen as mappings with no access (``---s``):
    (device, inode) of each memfd, or the /dev/shm name -> bytes."""
    kept: dict[tuple[int, int] | str, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) < 6 or fields[1] != "---s":
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5].strip()
            if "/memfd:procspawn" in path:
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                key: tuple[int, int] | str = (os.makedev(major, minor), int(fields[4]))
            elif path.startswith("/dev/shm/procspawn_"):
                key = path[len("/dev/shm/") :]
            else:
                continue
            kept[key] = kept.get(key, 0) + end - start
    return kept


def is_socket(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False


def fds() -> set[int]:
    kept = recycled_kept()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed by now: the listing's own descriptor, say
        if (st.st_dev, st.st_ino) not in kept:
            fds.add(int(fd))
    return fds


def shared_mappings() -> set[str]:
    """This process' mappings of shared-memory files (/dev/shm names and memfds), but for
    the recycled segments' (``---s``)."""
    with open("/proc/self/maps") as f:
        return {
            line.split()[0] + " " + line.split(None, 5)[-1].strip()
            for line in f
            if ("/dev/shm/" in line or "/memfd:" in line) and line.split()[1] != "---s"
        }
