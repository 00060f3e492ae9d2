"""Client of the cleanup daemon (see ``_manager_main`` for the protocol).

Every process that makes or maps a named segment tells the daemon of its process tree:
``register`` before the segment's file exists (so a name is recorded before anyone could
leak it), ``unregister`` once the last reference unlinked it. Both are one 64-byte send on
a connection kept open for the life of the process: no round trip on the hot path.

The daemon's address (an abstract UNIX socket name) is put in ``PROCSPAWN_MANAGER`` when the
daemon starts, so children started later share it; a process with no daemon (or whose
daemon is gone) starts a new one and re-registers every name it holds.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading

from . import _manager_main
from ._strategy import MANAGER_ENV as ENV

RECORD = _manager_main.RECORD

_lock = threading.Lock()
_conn: socket.socket | None = None
_held: set[str] = set()


def _record(op: bytes, name: str) -> bytes:
    return (op + name.encode("ascii")).ljust(RECORD, b"\0")


def _connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + address)
    except OSError:
        sock.close()
        return None
    return sock


def _start_daemon() -> socket.socket:
    """Start a daemon for this process and the children it starts from now on."""
    address = f"procspawn-{os.getuid()}-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + address)
        listener.listen(128)
        conn = _connect(address)  # queued until the daemon accepts: no start-up race
        if conn is None:
            raise OSError(f"cannot connect to the new cleanup daemon at @{address}")
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    _manager_main.__file__,
                    "--fd",
                    str(listener.fileno()),
                    "--grace",
                    str(_manager_main.GRACE),
                    "--address",
                    address,
                ],
                pass_fds=[listener.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
            )
            proc.wait()  # the middle process exits once the daemon has forked off
        except BaseException:
            conn.close()
            raise
    finally:
        listener.close()
    os.environ[ENV] = address
    return conn


def ensure() -> str:
    """Connect to this tree's daemon (starting one if needed); returns its address."""
    with _lock:
        if _conn is None:
            _send(b"")
        return os.environ[ENV]


def _send(record: bytes) -> None:
    """Send one record (with ``_lock`` held); replace a dead daemon and re-register."""
    global _conn
    if _conn is not None:
        try:
            _conn.sendall(record)
            return
        except OSError:
            _conn.close()
            _conn = None
    address = os.environ.get(ENV)
    conn = _connect(address) if address else None
    if conn is None:
        conn = _start_daemon()
    _conn = conn
    for name in _held:
        conn.sendall(_record(b"R", name))
    if record[:1] == b"U":
        conn.sendall(record)
    threading.Thread(
        target=_watch, args=(conn,), name="procspawn-manager-watch", daemon=True
    ).start()


def _watch(conn: socket.socket) -> None:
    """The daemon never writes: EOF means it died. Start a new one at once and hand it
    every name this process holds, so a later crash of ours still gets cleaned up."""
    global _conn
    try:
        conn.recv(1)
    except OSError:
        pass
    with _lock:
        if _conn is not conn:
            return  # closed or replaced by this process itself
        conn.close()
        _conn = None
        try:
            _send(b"")
        except OSError:
            pass  # no daemon can be started now; the next register tries again


def register(name: str) -> None:
    """Record ``name`` with this tree's daemon before its file is created or mapped."""
    with _lock:
        _held.add(name)
        _send(_record(b"R", name))


def released(name: str, unlinked: bool) -> None:
    """This process let go of ``name``; tell the daemon to forget it if it was unlinked
    (while another process holds it, the daemon must keep it, in case that one dies)."""
    with _lock:
        _held.discard(name)
        if not unlinked:
            return
        try:
            _send(_record(b"U", name))
        except OSError:
            pass  # unlinked already; nothing is lost if the daemon never hears of it


def query(address: str, timeout: float = 5.0) -> list[str] | None:
    """The names a live daemon records, or None if nothing answers at ``address``."""
    conn = _connect(address)
    if conn is None:
        return None
    with conn:
        conn.settimeout(timeout)
        try:
            conn.sendall(b"L")
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except OSError:
            return None
    return b"".join(chunks).decode("ascii").split()


def _after_fork_in_child() -> None:
    # The connection and the held names are the parent's; the child reconnects on first use.
    global _conn, _lock
    conn, _conn = _conn, None
    if conn is not None:
        conn.close()
    _held.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
