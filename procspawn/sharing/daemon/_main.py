"""The cleanup daemon of a process tree: whom it serves, when it lets go, when it exits.

Standard library only; imports nothing of procspawn and never unpickles. It is run by
path (``python -I -S daemon/_main.py --fd N``) by the first process of a tree that
makes or maps a named segment; that process made the listening socket and hands it over
as descriptor N, so clients can connect before the daemon runs.

A named segment ``/dev/shm/procspawn_<creator pid>_<16 hex digits>`` (O_EXCL, mode 0600)
starts with a page that lists the pids of the processes that map it, changed only under
``flock``; whoever removes the last one unlinks the name. Messages never hold a place
there: they carry the segment's descriptor, and the kernel keeps the memory for as long
as a message (in a socket buffer, or waiting for ``DupFd``) does.

::

    client ──connect (abstract UNIX socket, same uid only: SO_PEERCRED)──▶ daemon
    client ──"R" + name  (64-byte record, fire-and-forget)──────▶ names[client].add(name)
    client ──"U" + name  (the name is gone, or not mapped) ─────▶ names[client].discard
    client exits / is SIGKILLed ──EOF──▶ for each name it registered: remove the client's
                                         pid from the holders, unlink when none is left
    no client left for GRACE seconds ──▶ unlink what it saw that nobody maps or holds
                                         open any more, and exit

A client sends ``R`` before it first creates or maps a name and ``U`` once it no longer
maps it (when the name is gone, or to forget old names), so the daemon knows of every
name a dead client may hold, and the table says exactly whether it did. One more record,
``L``, asks for the names held (``procspawn info`` / ``cleanup``): the daemon answers with
them, one per line, then a line ``.``, and closes that connection. Names that are not
``procspawn_<pid>_<16 hex digits>`` are ignored, so the daemon can only ever touch the
kind of name procspawn creates, and only in /dev/shm.

When a whole tree is SIGKILLed at once, daemon included, nobody is left to clean: the
next daemon of this user sweeps at start-up (``sweep``), and so does ``procspawn cleanup``.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import struct
import sys
import time

if __package__:
    from . import _table as table
else:  # run by path, with -I -S: the table is loaded from this folder by its path
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "procspawn_daemon_table",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "_table.py"),
    )
    assert _spec is not None and _spec.loader is not None
    table = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = table
    _spec.loader.exec_module(table)

RECORD = 64
GRACE = 2.0  # seconds; the client passes PROCSPAWN_DAEMON_GRACE as --grace

# -- the daemon ----------------------------------------------------------------------------
#
# What can go wrong around it, and what it does:
# - its clients outnumber its descriptors: it lifts its soft RLIMIT_NOFILE to the hard
#   limit at start; at EMFILE it stops accepting for a moment (new clients wait in the
#   listen backlog, then in connect()) and logs it once;
# - a connection closes while its process lives (it closed the socket, or exec'ed): a
#   process is gone when its pid says so, not at EOF: the daemon watches the pid (a pidfd,
#   or a look every second without one) and lets go of its names only once it exited;
# - a client sends garbage or half a record: names not of procspawn's form are ignored,
#   and a partial record waits for the rest;
# - a client stops (SIGSTOP) in the middle of a query: the answer is written as the socket
#   takes it, never blocking the loop;
# - a let-go fails for lack of descriptors: it is tried again every second.


def _peer(conn: socket.socket) -> tuple[int, int]:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _raise_fd_limit() -> None:
    import resource  # the daemon only

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


class _Client:
    __slots__ = ("pid", "started", "buf", "holds", "out")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.started = table.start_time(pid)
        self.buf = bytearray()
        self.holds: set[str] = set()
        self.out = b""  # the rest of an answer to "L"

    def alive(self) -> bool:
        return self.started is not None and table.start_time(self.pid) == self.started


_CHECK = 1.0  # seconds between looks: messages that no longer exist, exits without pidfd
_PAUSE = 0.1  # seconds without accepting after EMFILE


class _Daemon:
    def __init__(self, listener: socket.socket, grace: float) -> None:
        self.listener = listener
        self.grace = grace
        self.sel = selectors.DefaultSelector()
        self.clients: dict[socket.socket, _Client] = {}
        self.exiting: dict[int, _Client] = {}  # pidfd -> a client whose connection closed
        self.polled: list[_Client] = []  # the same, where no pidfd could be had
        self.unfinished: list[tuple[str, int]] = []  # (name, pid): let go when possible
        self.seen: set[str] = set()
        self.uid = os.getuid()
        self.idle_since: float | None = time.monotonic()
        self.accept_at: float | None = None  # listening paused until then (EMFILE)
        self.warned = False
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ)

    def busy(self) -> bool:
        return bool(self.clients or self.exiting or self.polled or self.unfinished)

    def run(self, resweep: bool = False) -> list[str]:
        next_check = time.monotonic() + _CHECK
        # (resweep) once more when what was too young for the start-up sweep is not: a
        # client killed with its daemon (nobody else knew its names) an instant before
        resweep_at = time.monotonic() + table.YOUNG + 0.5 if resweep else None
        while True:
            now = time.monotonic()
            if resweep_at is not None and now >= resweep_at:
                resweep_at = None
                table.sweep()
            if not self.busy():
                if self.idle_since is None:
                    self.idle_since = now
                if now >= self.idle_since + self.grace:
                    break
            else:
                self.idle_since = None
            if now >= next_check:
                self.check()
                next_check = now + _CHECK
            if self.accept_at is not None and now >= self.accept_at:
                self.accept_at = None
                self.sel.register(self.listener, selectors.EVENT_READ)
            wake = [next_check]
            if resweep_at is not None:
                wake.append(resweep_at)
            if self.idle_since is not None:
                wake.append(self.idle_since + self.grace)
            if self.accept_at is not None:
                wake.append(self.accept_at)
            for key, events in self.sel.select(max(0.0, min(wake) - now)):
                if key.fileobj is self.listener:
                    self.accept()
                elif isinstance(key.fileobj, int):
                    self.exited(key.fileobj)
                # what is left is a client socket (registered only as one)
                elif events & selectors.EVENT_WRITE:
                    self.write(key.fileobj)  # type: ignore[arg-type]
                else:
                    self.read(key.fileobj)  # type: ignore[arg-type]
        if self.accept_at is None:
            self.sel.unregister(self.listener)
        self.listener.close()  # new clients now fail to connect and start a daemon of their own
        self.sel.close()
        # Whatever is left of what this tree used (a slot a client died too early to take
        # back) goes if nobody maps or holds it open any more.
        return [name for name, _ in table.sweep(self.seen, young=0.0, creator_dead=False)]

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: clients wait in the backlog
            self.sel.unregister(self.listener)
            self.accept_at = time.monotonic() + _PAUSE
            if not self.warned:
                self.warned = True
                table.log(f"cannot accept clients ({exc}); pausing {_PAUSE} s each time")
            return
        pid, peer_uid = _peer(conn)
        if peer_uid != self.uid:
            conn.close()
            return
        conn.setblocking(False)
        self.clients[conn] = _Client(pid)
        self.sel.register(conn, selectors.EVENT_READ)

    def read(self, sock: socket.socket) -> None:
        client = self.clients[sock]
        try:
            data = sock.recv(RECORD * 256)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.closed(sock)
            return
        buf = client.buf
        buf += data
        whole = len(buf) - len(buf) % RECORD
        for i in range(0, whole, RECORD):
            op = buf[i : i + 1]
            name = bytes(buf[i + 1 : i + RECORD]).rstrip(b"\0").decode("ascii", "replace")
            if not table.NAME_RE.fullmatch(name):
                continue
            if op == b"R":
                client.holds.add(name)
                self.seen.add(name)
            elif op == b"U":
                client.holds.discard(name)
        del buf[:whole]
        if buf[:1] == b"L":  # a query: answer, then close this connection
            del buf[:]
            held = {n for c in self.clients.values() for n in c.holds}
            names = sorted(n for n in held if os.path.exists(table.segment_path(n)))
            client.out = "".join(n + "\n" for n in names).encode() + b".\n"
            self.sel.modify(sock, selectors.EVENT_WRITE)
            self.write(sock)

    def write(self, sock: socket.socket) -> None:
        client = self.clients[sock]
        try:
            sent = sock.send(client.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(client.out)
        client.out = client.out[sent:]
        if not client.out:
            self.closed(sock)

    def closed(self, sock: socket.socket) -> None:
        """A connection ended: its client lets go now if its process is gone, else once
        it is (a process that closed the socket may still map what it registered)."""
        self.sel.unregister(sock)
        sock.close()
        client = self.clients.pop(sock)
        if not client.holds:
            return
        if not client.alive():
            self.let_go(client)
            return
        for other in (*self.exiting.values(), *self.polled):  # one watch per process
            if other.pid == client.pid and other.started == client.started:
                other.holds |= client.holds
                return
        try:
            pidfd = os.pidfd_open(client.pid)
        except (AttributeError, OSError):
            self.polled.append(client)
            return
        if not client.alive():  # the pid was not reused between the look and the open
            os.close(pidfd)
            self.let_go(client)
            return
        self.exiting[pidfd] = client
        self.sel.register(pidfd, selectors.EVENT_READ)

    def exited(self, pidfd: int) -> None:
        self.sel.unregister(pidfd)
        os.close(pidfd)
        self.let_go(self.exiting.pop(pidfd))

    def let_go(self, client: _Client) -> None:
        """A client is gone: remove it from the holders of every name it registered."""
        for name in client.holds:
            self.let_go_of(name, client.pid)
        client.holds.clear()

    def let_go_of(self, name: str, pid: int) -> None:
        try:
            held = table.let_go(name, pid, every=True)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                self.unfinished.append((name, pid))
            return
        table.log(f"client {pid} gone: {name} {'still held' if held else 'freed'}")

    def check(self) -> None:
        """Every second: messages closed unread, exits seen without a pidfd, let-gos
        that failed for lack of descriptors."""
        for name in list(self.seen):
            if not os.path.exists(table.segment_path(name)):
                self.seen.discard(name)
                continue
            try:
                if table.expire_transfers(name):
                    table.log(f"{name}: its messages were closed unread; freed")
            except OSError:
                continue
        for client in [c for c in self.polled if not c.alive()]:
            self.polled.remove(client)
            self.let_go(client)
        unfinished, self.unfinished = self.unfinished, []
        for name, pid in unfinished:
            self.let_go_of(name, pid)


def serve(listener: socket.socket, grace: float = GRACE, resweep: bool = False) -> list[str]:
    """Run until no client is left for ``grace`` seconds; returns the names swept then.
    ``resweep``: sweep this user's names once more when the start-up sweep's too young
    ones are old enough."""
    return _Daemon(listener, grace).run(resweep)


def main(argv: list[str] | None = None) -> int:
    import argparse  # the daemon's command line only: clients import this module too

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--grace", type=float, default=GRACE)
    parser.add_argument("--address", default="", help="shown by `procspawn info` only")
    parser.add_argument("--debug", action="store_true", help="log to stderr")
    args = parser.parse_args(argv)
    table.DEBUG = args.debug
    listener = socket.socket(fileno=args.fd)
    # Detach: a grandchild in its own session, so neither the starter's Ctrl-C nor its
    # death reaches us, and the starter reaps the short-lived middle process at once.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    _raise_fd_limit()
    table.log(f"serving @{args.address}")
    # What a tree killed whole (daemon included) left behind: nobody else will free it.
    table.sweep()
    serve(listener, args.grace, resweep=True)
    table.log("exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
