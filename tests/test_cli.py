"""`procspawn info` and `procspawn cleanup`, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from _helpers import script_env

import procspawn as mp
from procspawn import sharing
from procspawn.sharing.daemon import _client

pytestmark = pytest.mark.timeout(60)

STRAY = "procspawn_999999999_0123456789abcdef"


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "procspawn", *args],
        capture_output=True,
        text=True,
        timeout=50,
        env=script_env(),
    )


@pytest.fixture
def stray():
    path = f"/dev/shm/{STRAY}"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    old = time.time() - 60
    os.utime(path, (old, old))  # left by a process that died a minute ago
    yield STRAY
    if os.path.exists(path):
        os.unlink(path)


def _stop(holder: subprocess.Popen) -> None:
    """Let a holder script exit (it waits for its stdin to close); kill it if it hangs."""
    holder.stdin.close()
    try:
        holder.wait(timeout=50)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdout.close()


def test_info_json():
    mp.set_sharing_strategy("file_system")
    try:
        held = sharing.zeros(1000)
        [mine] = [n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")]
        result = _cli("info", "--json")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["version"] == mp.__version__
        assert {"file_system", "file_descriptor"} <= set(data["strategies"])
        assert data["dev_shm"]["size"] > 0 and data["dev_shm"]["free"] > 0
        assert data["rlimit_nofile"]["soft"] > 0
        [seg] = [s for s in data["segments"] if s["name"] == mine]
        assert seg["owner_pid"] == os.getpid() and seg["owner_alive"]
        assert os.getpid() in seg["used_by"]
        assert seg["bytes"] >= held.nbytes
        [daemon] = [d for d in data["daemons"] if d["address"] == _client.ensure()]
        assert mine in daemon["names"] and daemon["clients"] >= 1
        text = _cli("info")
        assert text.returncode == 0 and mine in text.stdout and "RLIMIT_NOFILE" in text.stdout
        del held
    finally:
        mp.set_sharing_strategy("file_descriptor")


def test_cleanup_dry_run_then_for_real(stray):
    mp.set_sharing_strategy("file_system")
    try:
        held = sharing.zeros(10)  # mapped by a live process and tracked: must be kept
        [mine] = [n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")]
        dry = _cli("cleanup", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f"would free {stray}" in dry.stdout and os.path.exists(f"/dev/shm/{stray}")
        real = json.loads(_cli("cleanup", "--json").stdout)
        # (another program's leaked names on this machine are freed as well)
        freed = {s["name"]: s for s in real["freed"]}
        assert stray in freed and mine not in freed, real
        assert freed[stray]["bytes"] == 4096 and real["freed_bytes"] >= 4096
        assert not os.path.exists(f"/dev/shm/{stray}")
        assert os.path.exists(f"/dev/shm/{mine}")
        assert mine in [s["name"] for s in real["kept"]]
        del held
    finally:
        mp.set_sharing_strategy("file_descriptor")


def test_a_message_in_flight_survives_cleanup(stray):
    # The sender let go of the array after putting it: nobody maps the segment; the
    # message's own slot keeps the name, and its descriptor keeps the memory, so neither
    # cleanup (which frees only what is old, unused and untracked: the stray) nor the
    # sender's drop can hurt it. The receiver takes the name over; dropped, it goes.
    mp.set_sharing_strategy("file_system")
    try:
        q = mp.SimpleQueue()
        sent = sharing.zeros(100_000)
        sent[:] = 5
        [name] = [n for n in os.listdir("/dev/shm") if n.startswith(f"procspawn_{os.getpid()}_")]
        q.put(sent)
        del sent
        assert os.path.exists(f"/dev/shm/{name}")  # held by the message
        result = json.loads(_cli("cleanup", "--json").stdout)
        assert [s["name"] for s in result["freed"]] == [stray]
        got = q.get()
        assert got.sum() == 500_000
        del got
        assert not os.path.exists(f"/dev/shm/{name}")
        q.close()
    finally:
        mp.set_sharing_strategy("file_descriptor")


def test_bad_usage_exits_2():
    result = _cli("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_cleanup_keeps_a_segment_being_made_right_now(stray):
    os.utime(f"/dev/shm/{stray}")  # as if created a moment ago, not yet registered
    result = json.loads(_cli("cleanup", "--json").stdout)
    assert stray in [s["name"] for s in result["kept"]]
    assert os.path.exists(f"/dev/shm/{stray}")


def test_version():
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"procspawn {mp.__version__}\n"


@pytest.mark.parametrize("command", [[], ["info"], ["cleanup"], ["run"]])
def test_help_is_plain_text(command):
    result = _cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: procspawn")
    assert "``" not in result.stdout
    if not command:
        for name in ("run", "info", "cleanup", "--version"):
            assert name in result.stdout


MEMFD_HOLDER = """\
import os, sys
import procspawn
from procspawn import sharing

assert procspawn.get_sharing_strategy() == "file_descriptor"
array = sharing.empty(1 << 20)  # a mapped memfd segment of 8 MiB (and its descriptor)
array[:] = 1
raw = os.memfd_create("procspawn", os.MFD_CLOEXEC)  # open, never mapped
os.ftruncate(raw, 4096)
r, w = procspawn.Pipe()
w.send(array.copy())  # an unshared copy: its segment (1 MiB) is kept for recycling, ---s
del r, w
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def test_info_shows_named_segments_kept_for_recycling():
    code = MEMFD_HOLDER.replace(
        'assert procspawn.get_sharing_strategy() == "file_descriptor"',
        'procspawn.set_sharing_strategy("file_system")',
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=script_env(),
    )
    try:
        assert holder.stdout.readline() == "ready\n"
        result = _cli("info", "--json")
        assert result.returncode == 0, result.stderr
        mine = [s for s in json.loads(result.stdout)["segments"] if s["owner_pid"] == holder.pid]
        assert len(mine) == 2  # the array it holds, and the send's copy it keeps for recycling
        [kept] = [s for s in mine if s["kept_by"]]
        assert kept["kept_by"] == [holder.pid] and kept["bytes"] == (8 << 20) + 4096
        text = _cli("info")
        assert text.returncode == 0, text.stderr
        assert f"kept for recycling by [{holder.pid}]" in text.stdout
    finally:
        _stop(holder)


def test_info_lists_memfd_segments_per_process():
    env = script_env()
    env.pop("PROCSPAWN_SHARING_STRATEGY", None)  # the default strategy
    holder = subprocess.Popen(
        [sys.executable, "-c", MEMFD_HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout.readline() == "ready\n"
        result = _cli("info", "--json")
        assert result.returncode == 0, result.stderr
        memfd = json.loads(result.stdout)["memfd"]
        [mine] = [p for p in memfd["processes"] if p["pid"] == holder.pid]
        assert mine["segments"] == 3 and len(mine["inodes"]) == 3
        assert mine["mapped"] == 2 and mine["fd_only"] == 1
        assert mine["recycled"] == 1 and mine["recycled_bytes"] == 8 << 20
        assert mine["bytes"] >= (16 << 20) + 4096  # a segment may be rounded up
        assert mine["command"].startswith("python")
        assert memfd["segments"] >= 2 and memfd["bytes"] >= mine["bytes"]
        assert len(memfd["processes"]) >= 1

        text = _cli("info")
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        [summary] = [s for s in lines if s.startswith("memfd segments (file_descriptor")]
        assert summary.endswith(" MiB") and " process(es), " in summary
        mib = f"{mine['bytes'] / 2**20:.1f} MiB"
        assert (
            f"  pid {holder.pid} ({mine['command']}): 3 segment(s), {mib}, 1 open without "
            f"a mapping, 1 kept for recycling (8.0 MiB)"
        ) in lines
        [recycled] = [s for s in lines if s.startswith("recycled segments: up to ")]
        assert "PROCSPAWN_POOL_BYTES" in recycled and "trim()" in recycled
    finally:
        _stop(holder)
