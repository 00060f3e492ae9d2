"""The cleanup daemon of the file_system strategy (standard library only, never unpickles).

Run as ``python -m procspawn.sharing._manager_main --fd N`` (or by path) by the first
process of a tree that makes a named segment; that process made the listening socket and
hands it over as descriptor N, so clients can connect before the daemon runs.

::

    client ──connect (abstract UNIX socket, same uid only: SO_PEERCRED)──▶ daemon
    client ──"R" + name  (64-byte record, fire-and-forget)──────────────▶ names.add
    client ──"U" + name ────────────────────────────────────────────────▶ names.discard
    client exits / is SIGKILLed ──EOF──▶ when no client is left, wait GRACE seconds for a
                                         new one, then unlink every name still recorded
                                         (and still present) and exit.

A record is a byte ``R`` or ``U`` and the name, NUL-padded to 64 bytes. One more record,
``L``, asks for the recorded names (``procspawn info`` / ``cleanup``): the daemon answers
with them, one per line, then a line ``.``, and closes that connection. Names that are not
``procspawn_<pid>_<16 hex digits>`` are ignored, so the daemon can only ever delete the
kind of name procspawn creates, and only in /dev/shm.
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import socket
import struct
import sys
import time

RECORD = 64
SHM_DIR = "/dev/shm"
NAME_RE = re.compile(rb"procspawn_[0-9]{1,10}_[0-9a-f]{16}")
GRACE = float(os.environ.get("PROCSPAWN_MANAGER_GRACE", "2.0"))


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _unlink_all(names: set[bytes]) -> list[str]:
    freed = []
    for raw in sorted(names):
        name = raw.decode("ascii")
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            freed.append(name)
        except FileNotFoundError:
            pass
    return freed


def _answer(sock: socket.socket, names: set[bytes]) -> None:
    try:
        sock.setblocking(True)
        sock.settimeout(5.0)
        sock.sendall(b"".join(name + b"\n" for name in sorted(names)) + b".\n")
    except OSError:
        pass


def serve(listener: socket.socket, grace: float = GRACE) -> list[str]:
    """Run until every client has gone for ``grace`` seconds; returns the names it freed."""
    names: set[bytes] = set()
    buffers: dict[socket.socket, bytearray] = {}
    sel = selectors.DefaultSelector()
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ)
    uid = os.getuid()
    idle_since: float | None = time.monotonic()
    while True:
        timeout = None
        if not buffers:
            assert idle_since is not None
            timeout = idle_since + grace - time.monotonic()
            if timeout <= 0:
                break
        for key, _ in sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is listener:
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                if _peer_uid(conn) != uid:
                    conn.close()
                    continue
                conn.setblocking(False)
                buffers[conn] = bytearray()
                sel.register(conn, selectors.EVENT_READ)
                idle_since = None
                continue
            try:
                data = sock.recv(RECORD * 256)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(sock)
                sock.close()
                del buffers[sock]
                if not buffers:
                    idle_since = time.monotonic()
                continue
            buf = buffers[sock]
            buf += data
            whole = len(buf) - len(buf) % RECORD
            for i in range(0, whole, RECORD):
                op, name = buf[i : i + 1], bytes(buf[i + 1 : i + RECORD]).rstrip(b"\0")
                if not NAME_RE.fullmatch(name):
                    continue
                if op == b"R":
                    names.add(name)
                elif op == b"U":
                    names.discard(name)
            del buf[:whole]
            if buf[:1] == b"L":
                _answer(sock, names)
                sel.unregister(sock)
                sock.close()
                del buffers[sock]
                if not buffers:
                    idle_since = time.monotonic()
    sel.unregister(listener)
    listener.close()  # new clients now fail to connect and start a daemon of their own
    sel.close()
    return _unlink_all(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--grace", type=float, default=GRACE)
    parser.add_argument("--address", default="", help="shown by `procspawn info` only")
    args = parser.parse_args(argv)
    listener = socket.socket(fileno=args.fd)
    # Detach: a grandchild in its own session, so neither the starter's Ctrl-C nor its
    # death reaches us, and the starter reaps the short-lived middle process at once.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    serve(listener, args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
