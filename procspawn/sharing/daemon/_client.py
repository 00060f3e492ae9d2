"""Client of the cleanup daemon (see ``_main`` for the protocol).

Every process that makes or maps a named segment tells the daemon of its process tree:
``register`` before it creates or maps the name for the first time (so the daemon knows
of it before anyone could leak it), and, once the name is gone, that it can forget it.
Each is one 64-byte send on a connection kept open for the life of the process: no round
trip on the hot path, and none at all for a segment mapped again and again (a buffer the
producer re-sends). When the process dies, however it dies, the daemon removes it from
the holders of every name it registered; the holder tables say exactly which it held, so
a name registered but no longer mapped costs nothing but a line in the daemon.

One daemon per tree. A tree is what procspawn starts: its first process chooses the
address (an abstract UNIX socket name); ranks and procspawn Process/Pool workers get it
in their start-up message (``adopt_tree``), never through the environment, so a program
started with ``subprocess`` is a tree of its own. Whoever needs the daemon first binds
that address and starts it; binding is atomic, so a process that loses the race just
connects. If the daemon dies, every client notices at once (its connection reads EOF),
the first to bind the same address starts a new one, and each registers again the names
it holds.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time

from ... import _log, _settings
from . import _main, _tree
from ._tree import tree_address

RECORD = _main.RECORD
_SEND_TIMEOUT = 10.0

# Reentrant: released() runs from segment finalizers, which the garbage collector may call
# on a thread that is inside _send already.
_lock = threading.RLock()
_conn: socket.socket | None = None
_registered: dict[str, int] = {}  # name -> how many Segments of this process hold it
_PRUNE = 1024  # forget unmapped registered names when there are more than this
_prune_at = _PRUNE


def _record(op: bytes, name: str) -> bytes:
    return (op + name.encode("ascii")).ljust(RECORD, b"\0")


def _connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_SEND_TIMEOUT)  # a daemon short of descriptors accepts a little later
    try:
        sock.connect("\0" + address)
    except OSError:
        sock.close()
        return None
    return sock


def _start_daemon(address: str) -> socket.socket | None:
    """Bind ``address`` and start the daemon on it; None if another process bound it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            listener.bind("\0" + address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return None
            raise
        listener.listen(128)
        conn = _connect(address)  # queued until the daemon accepts: no start-up race
        if conn is None:
            raise OSError(f"cannot connect to the new cleanup daemon at @{address}")
        try:
            import subprocess  # here: a rank that never starts a daemon does not pay for it

            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    _main.__file__,
                    "--fd",
                    str(listener.fileno()),
                    "--grace",
                    str(_settings.get("PROCSPAWN_DAEMON_GRACE")),
                    "--address",
                    address,
                    *(["--debug"] if _log.enabled() else []),
                ],
                pass_fds=[listener.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=None if _log.enabled() else subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,  # a Ctrl-C to our group cannot stop it starting
            )
            proc.wait()  # the middle process exits once the daemon has forked off
        except BaseException:
            conn.close()
            raise
        return conn
    finally:
        listener.close()


def _connect_or_start(address: str) -> socket.socket:
    for _ in range(200):
        conn = _connect(address) or _start_daemon(address)
        if conn is not None:
            return conn
        time.sleep(0.01)  # another process bound the address and is starting the daemon
    raise OSError(f"no cleanup daemon answers at @{address} and none could be started")


def ensure() -> str:
    """Connect to this tree's daemon (starting it if needed); returns its address."""
    with _lock:
        if _conn is None:
            _send(b"")
        return tree_address()


def _send(record: bytes) -> None:
    """Send one record (with ``_lock`` held); replace a dead daemon and re-register."""
    global _conn
    if _conn is not None:
        try:
            if record:
                _conn.sendall(record)
            return
        except OSError:
            _conn.close()
            _conn = None
    for _ in range(100):
        conn = _connect_or_start(tree_address())
        try:
            # the record itself is among these if it is an "R"; a "U" need not be sent
            for name in list(_registered):  # a release (GC callback) may change it
                conn.sendall(_record(b"R", name))
        except OSError:
            # connected to a daemon killed at that very moment (its listener was still
            # open): the kernel resets the connection; connect again, or start a new one
            conn.close()
            time.sleep(0.01)
            continue
        _conn = conn
        _tree.joined = True
        _log.debug("connected to the cleanup daemon @%s", tree_address())
        threading.Thread(
            target=_watch, args=(conn,), name="procspawn-daemon-watch", daemon=True
        ).start()
        return
    raise OSError(f"the cleanup daemon at @{tree_address()} keeps closing on this process")


def _watch(conn: socket.socket) -> None:
    """The daemon never writes: EOF means it died. Reconnect at once (starting a new one)
    and hand it every name this process holds, so a later crash of ours is still cleaned."""
    global _conn
    while True:
        try:
            conn.recv(1)
            break
        except TimeoutError:
            continue  # the socket has a send timeout; waiting here has none
        except OSError:
            break
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
    """Tell this tree's daemon of ``name`` (once) before it is created or mapped here."""
    with _lock:
        held = _registered.get(name)
        if held is None:
            _registered[name] = 1
            _tree.joined = True
            _send(_record(b"R", name))
        else:
            _registered[name] = held + 1


def released(name: str, gone: bool) -> None:
    """This process left the holders of ``name``; ``gone``: and the name was unlinked (or
    never made), so the daemon can forget it."""
    global _prune_at
    with _lock:
        held = _registered.get(name, 0) - 1
        if gone and held <= 0:
            _registered.pop(name, None)
            _forget([name])
            return
        _registered[name] = max(held, 0)
        if len(_registered) > _prune_at:
            unmapped = [n for n, k in _registered.items() if k == 0]
            for n in unmapped:
                del _registered[n]
            _forget(unmapped)
            _prune_at = max(_PRUNE, 2 * len(_registered))


def _forget(names: list[str]) -> None:
    try:
        for name in names:
            _send(_record(b"U", name))
    except OSError:
        pass  # a new daemon hears only of what is registered


def query(address: str, timeout: float = 5.0) -> list[str] | None:
    """The names a live daemon records; None if nothing answers at ``address`` or the
    daemon refuses us (another user's)."""
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
    words = b"".join(chunks).decode("ascii").split()
    if not words or words[-1] != ".":
        return None  # a daemon always ends its answer with "."; silence is a refusal
    return words[:-1]


def _after_fork_in_child() -> None:
    # The connection and the held names are the parent's; the child reconnects on first use.
    global _conn, _lock
    conn, _conn = _conn, None
    if conn is not None:
        conn.close()
    _registered.clear()
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
