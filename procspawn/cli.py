"""The procspawn command (also python -m procspawn): run ranks, look at and clean up
shared memory.

The help text the command prints is ``_DESCRIPTION`` and ``_EPILOG`` below (plain text:
this docstring is not shown to users).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from typing import Any

from . import _settings
from ._version import __version__
from .sharing.daemon._table import PREFIX, SHM_DIR, YOUNG, in_use

_DESCRIPTION = "Run ranks of a Python program, look at and clean up procspawn's shared memory."
_EPILOG = """\
commands:
  procspawn run -n N [options] script.py [args ...]
                      run N copies of a script (or -m module) like torchrun;
                      see procspawn run --help
  procspawn info [--json]
                      what this machine offers and what procspawn holds: cleanup
                      daemons, /dev/shm segments (file_system strategy) and memfd
                      segments per process (file_descriptor strategy)
  procspawn cleanup [--dry-run] [--json]
                      remove this user's procspawn_* segments in /dev/shm that no
                      live process maps or holds open, that no live cleanup daemon
                      records, and that are older than 2 seconds

exit status: 0 success, 1 a segment could not be removed, 2 bad usage
(procspawn run: see its own help)"""
_MEMFD_PATH = "/memfd:procspawn"  # what /proc shows for os.memfd_create("procspawn")


def _proc_entries() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _daemons() -> list[dict[str, Any]]:
    """Running cleanup daemons: pid, address, clients, recorded names."""
    from .sharing.daemon import _client

    out = []
    for pid in _proc_entries():
        cmdline = _read(f"/proc/{pid}/cmdline")
        if not cmdline or "sharing/daemon/_main.py" not in cmdline:
            continue
        args = cmdline.split("\0")
        address = args[args.index("--address") + 1] if "--address" in args else ""
        sockets = 0
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    sockets += 1
        except OSError:
            pass
        names = _client.query(address) if address else None
        out.append(
            {
                "pid": pid,
                "address": address,
                "clients": max(0, sockets - 1),  # all but the listening socket
                "names": names,
            }
        )
    return out


def _kept_names() -> dict[str, set[int]]:
    """Named segments kept for reuse as recycled segments: name -> pids that map it
    with no access (``---s``)."""
    marker = f" {SHM_DIR}/{PREFIX}"
    kept: dict[str, set[int]] = {}
    for pid in (e for e in os.listdir("/proc") if e.isdigit()):
        maps = _read(f"/proc/{pid}/maps")
        if maps is None or marker not in maps:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[1] == "---s" and fields[5].startswith(marker[1:]):
                kept.setdefault(fields[5][len(SHM_DIR) + 1 :].strip(), set()).add(int(pid))
    return kept


def _segments() -> list[dict[str, Any]]:
    mapped = in_use()
    kept = _kept_names()
    out = []
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        names = []
    for name in names:
        try:
            st = os.stat(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue
        parts = name.split("_")
        owner = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        out.append(
            {
                "name": name,
                "bytes": st.st_size,
                "uid": st.st_uid,
                "age_seconds": round(max(0.0, time.time() - st.st_mtime), 3),
                "owner_pid": owner,
                "owner_alive": owner is not None and os.path.exists(f"/proc/{owner}"),
                "used_by": sorted(mapped.get(name, ())),
                "kept_by": sorted(kept.get(name, ())),
            }
        )
    return out


def _size_of(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _memfds_of(pid: int) -> dict[str, Any] | None:
    """procspawn memfds ``pid`` maps or holds open; None if it cannot be read."""
    maps = _read(f"/proc/{pid}/maps")
    if maps is None:
        return None
    extent: dict[int, int] = {}  # inode -> largest offset + length mapped
    exact: dict[int, int] = {}  # inode -> st_size, where the memfd itself could be stat'ed
    mapped: set[int] = set()
    recycled: set[int] = set()  # recycled segments kept for reuse: mapped with no access
    map_files = True  # readable only with CAP_SYS_ADMIN on many kernels: try once
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith(_MEMFD_PATH):
            continue
        try:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            offset, inode = int(fields[2], 16), int(fields[4])
        except ValueError:
            continue
        mapped.add(inode)
        if fields[1] == "---s":
            recycled.add(inode)
        extent[inode] = max(extent.get(inode, 0), offset + end - start)
        if map_files and inode not in exact:
            size = _size_of(f"/proc/{pid}/map_files/{fields[0]}")
            if size is None:
                map_files = False
            else:
                exact[inode] = size
    held: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith(_MEMFD_PATH):
                continue
            st = os.stat(path)  # follows the link to the memfd itself
        except OSError:
            continue
        held.add(st.st_ino)
        exact[st.st_ino] = st.st_size
    inodes = mapped | held
    sizes = {i: exact.get(i, extent.get(i, 0)) for i in inodes}
    return {
        "pid": pid,
        "command": (_read(f"/proc/{pid}/comm") or "?").strip(),
        "segments": len(inodes),
        "bytes": sum(sizes.values()),
        "mapped": len(mapped),
        "fd_only": len(held - mapped),
        "recycled": len(recycled),
        "recycled_bytes": sum(sizes[i] for i in recycled),
        "inodes": sorted(inodes),
        "sizes": sizes,
    }


def _memfds() -> dict[str, Any]:
    """memfd segments (file_descriptor strategy) held by this user's processes."""
    uid = os.getuid()
    processes = []
    sizes: dict[int, int] = {}  # a segment held by several processes is counted once
    for pid in _proc_entries():
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        found = _memfds_of(pid)
        if not found or not found["segments"]:
            continue
        for inode, size in found.pop("sizes").items():
            sizes[inode] = max(sizes.get(inode, 0), size)
        processes.append(found)
    return {"segments": len(sizes), "bytes": sum(sizes.values()), "processes": processes}


def info() -> dict[str, Any]:
    from . import get_all_sharing_strategies, get_sharing_strategy, get_start_method
    from .sharing.segments import _recycled

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shm: dict[str, Any] = {"path": SHM_DIR}
    try:
        st = os.statvfs(SHM_DIR)
        shm.update(size=st.f_blocks * st.f_frsize, free=st.f_bavail * st.f_frsize)
    except OSError:
        shm.update(size=None, free=None)
    settings = _settings.report()
    start_method, strategy = _or_error(get_start_method), _or_error(get_sharing_strategy)
    chosen = {"PROCSPAWN_START_METHOD": start_method, "PROCSPAWN_SHARING_STRATEGY": strategy}
    for row in settings:  # a name the variable's type accepts, that names nothing
        read = str(chosen.get(row["name"], ""))
        if row["text"] is not None and read.startswith("error: ") and not row["error"]:
            row["error"] = read[len("error: ") :]
    bad = [row for row in settings if row["error"]]
    return {
        "version": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "start_method": start_method,
        "default_strategy": strategy,
        "strategies": sorted(get_all_sharing_strategies()),
        "settings": settings,
        "bad_settings": [row["name"] for row in bad],
        "dev_shm": shm,
        "rlimit_nofile": {"soft": soft, "hard": hard},
        "daemons": _daemons(),
        "segments": _segments(),
        "memfd": _memfds(),
        "recycled": {
            "limit": _or_error(_recycled.limit),
            "set": any(r["name"] == "PROCSPAWN_POOL_BYTES" and r["text"] for r in settings),
            "idle": _or_error(_recycled.idle),
        },
    }


def _or_error(read: Any) -> Any:
    """What ``read()`` gives, or ``"error: ..."`` when a setting it reads is bad (info shows
    every setting, the bad ones flagged, instead of failing on the first)."""
    try:
        return read()
    except ValueError as exc:  # SettingError, or an unknown name
        return f"error: {exc}"


def cleanup(dry_run: bool) -> dict[str, Any]:
    # Files first, daemons second: a segment made after the listing is not considered, and
    # one made before it is either mapped, recorded by its daemon by now, or abandoned.
    segments = _segments()
    tracked: set[str] = set()
    for daemon in _daemons():
        tracked.update(daemon["names"] or ())
    uid = os.getuid()
    freed, kept, failed = [], [], []
    for seg in segments:
        if (
            seg["uid"] != uid  # another user's: not ours to judge
            or seg["age_seconds"] < YOUNG  # being made right now
            or seg["used_by"]
            or seg["name"] in tracked
        ):
            kept.append(seg)
            continue
        if not dry_run:
            try:
                os.unlink(os.path.join(SHM_DIR, seg["name"]))
            except FileNotFoundError:
                continue
            except OSError as exc:
                failed.append({**seg, "error": str(exc)})
                continue
        freed.append(seg)
    return {
        "dry_run": dry_run,
        "freed": freed,
        "freed_bytes": sum(s["bytes"] for s in freed),
        "kept": kept,
        "failed": failed,
    }


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def _print_info(data: dict[str, Any]) -> None:
    print(f"procspawn {data['version']} on Python {data['python']}, {data['platform']}")
    print(f"start method: {data['start_method']}")
    print(
        f"sharing strategy: {data['default_strategy']} (available: {', '.join(data['strategies'])})"
    )
    print("settings (PROCSPAWN_*; unset: the default):")
    for row in data["settings"]:
        shown = "unset" if row["text"] is None else repr(row["text"])
        value = f" = {row['value']}" if row["value"] is not None else ""
        flag = f"   <- BAD: {row['error']}" if row["error"] else ""
        print(f"  {row['name']}: {shown}{value}{flag}")
    shm = data["dev_shm"]
    print(f"{shm['path']}: {_size(shm['free'])} free of {_size(shm['size'])}")
    lim = data["rlimit_nofile"]
    print(f"RLIMIT_NOFILE: soft {lim['soft']}, hard {lim['hard']}")
    print(f"cleanup daemons: {len(data['daemons'])}")
    for d in data["daemons"]:
        names = "?" if d["names"] is None else len(d["names"])
        print(f"  pid {d['pid']} @{d['address']}: {d['clients']} client(s), {names} name(s)")
    print(f"segments: {len(data['segments'])}")
    for s in data["segments"]:
        owner = f"owner {s['owner_pid']} ({'alive' if s['owner_alive'] else 'dead'})"
        mapped = f"mapped or open in {s['used_by']}" if s["used_by"] else "used by no process"
        if s["kept_by"]:
            mapped += f", kept for recycling by {s['kept_by']}"
        print(f"  {s['name']}  {_size(s['bytes'])}  {owner}, {mapped}")
    memfd = data["memfd"]
    print(
        f"memfd segments (file_descriptor strategy): {memfd['segments']} in "
        f"{len(memfd['processes'])} process(es), {_mib(memfd['bytes'])}"
    )
    for p in memfd["processes"]:
        unmapped = f", {p['fd_only']} open without a mapping" if p["fd_only"] else ""
        recycled = (
            f", {p['recycled']} kept for recycling ({_mib(p['recycled_bytes'])})"
            if p["recycled"]
            else ""
        )
        print(
            f"  pid {p['pid']} ({p['command']}): {p['segments']} segment(s), "
            f"{_mib(p['bytes'])}{unmapped}{recycled}"
        )
    cache = data["recycled"]
    if isinstance(cache["limit"], str) or isinstance(cache["idle"], str):
        print(f"recycled segments: {cache['limit']}")
        return
    print(
        f"recycled segments: up to {_mib(cache['limit'])} per process "
        f"(PROCSPAWN_POOL_BYTES{'' if cache['set'] else ', default'}; file_system segments "
        f"at most a quarter of {shm['path']}), each segment for {cache['idle']:g} s unused "
        f"(PROCSPAWN_POOL_IDLE); procspawn.sharing.trim() gives them back"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _print_cleanup(data: dict[str, Any]) -> None:
    verb = "would free" if data["dry_run"] else "freed"
    for s in data["freed"]:
        print(f"{verb} {s['name']} ({_size(s['bytes'])})")
    for s in data["failed"]:
        print(f"could not remove {s['name']}: {s['error']}", file=sys.stderr)
    print(
        f"{verb} {len(data['freed'])} segment(s), {data['freed_bytes']} bytes; "
        f"kept {len(data['kept'])} in use"
    )


def main(argv: list[str] | None = None) -> int:
    """The procspawn command: ``run``, ``info`` or ``cleanup``; returns the exit status."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["run"]:  # its arguments go to the script untouched: not for argparse
        from ._run import run

        return run(argv[1:])
    parser = argparse.ArgumentParser(
        prog="procspawn",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"procspawn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,info,cleanup}")
    sub.add_parser("run", help="run N copies of a Python script or module, like torchrun")
    p_info = sub.add_parser("info", help="versions, limits, daemons and segments")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    p_clean = sub.add_parser("cleanup", help="remove segments nothing uses any more")
    p_clean.add_argument("--dry-run", action="store_true", help="only list what would go")
    p_clean.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.command == "info":
        data = info()
        print(json.dumps(data, indent=2)) if args.json else _print_info(data)
        return 1 if data["bad_settings"] else 0
    data = cleanup(args.dry_run)
    print(json.dumps(data, indent=2)) if args.json else _print_cleanup(data)
    return 1 if data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
