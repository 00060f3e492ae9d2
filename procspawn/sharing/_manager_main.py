"""Level 0: the file_system cleanup daemon, and what it shares with the strategy and the CLI.

Standard library only; imports nothing of procspawn and never unpickles. It is run by
path (``python -I -S _manager_main.py --fd N``) by the first process of a tree that
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

import fcntl
import os
import re
import selectors
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable

RECORD = 64
SHM_DIR = "/dev/shm"
PREFIX = "procspawn_"
NAME_RE = re.compile(r"procspawn_([0-9]{1,10})_[0-9a-f]{16}")
GRACE = float(os.environ.get("PROCSPAWN_MANAGER_GRACE", "2.0"))
YOUNG = 2.0  # seconds: a segment this young may be between creation and mapping
DEBUG = os.environ.get("PROCSPAWN_DEBUG", "") not in ("", "0")


def _log(text: str) -> None:
    if DEBUG:
        print(f"procspawn daemon {os.getpid()}: {text}", file=sys.stderr, flush=True)


# -- named segments ----------------------------------------------------------------------
#
# The first page of a named segment is its table of holders: 1024 int32 slots, each the pid
# of a process that maps it (0: free), changed only under flock(LOCK_EX) on a descriptor of
# the segment (the lock belongs to that open file, so threads of one process exclude each
# other too, and the kernel drops it if its holder dies mid-update). A pid, not a count:
# whoever cleans up after a dead process removes exactly the slots that process took,
# however it died (between registering and taking its slot, or between giving the slot
# back and telling the daemon). A message holds a slot of its own, which its receiver
# turns into its pid and a daemon leaves alone when the sender dies (the message may be
# received after that): see TRANSFER below. The data starts on the next page.

HEADER = 4096  # bytes before a named segment's data: the table of holders
_SLOTS = HEADER // 4
_FREE = b"\0\0\0\0"


def segment_path(name: str) -> str:
    return SHM_DIR + "/" + name


def open_segment(name: str) -> int:
    """Open an existing segment read-write, refusing anything procspawn did not make."""
    fd = os.open(segment_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o777 != 0o600:
        os.close(fd)
        raise PermissionError(
            f"{segment_path(name)} is not a procspawn segment of this user (a regular file "
            f"of uid {os.getuid()} with mode 0600); refusing to map it"
        )
    return fd


def _find(table: bytes | bytearray, word: bytes) -> int:
    """The first slot holding ``word`` (4 bytes), or -1."""
    i = table.find(word)
    while i >= 0 and i % 4:
        i = table.find(word, i + 1)
    return i


_here = threading.local()  # .depth: table locks this thread holds; .later: deferred work


class _Locked:
    """flock(LOCK_EX) on a segment for the time of one change of its table."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> bytes:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            # short when its creator died before giving it its size: no slot is taken then
            table = os.pread(self.fd, HEADER, 0).ljust(HEADER, b"\0")
        except BaseException:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            raise
        _here.depth = getattr(_here, "depth", 0) + 1
        return table

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        _here.depth -= 1
        if not _here.depth:
            later, _here.later = getattr(_here, "later", []), []
            for work in later:
                work()


def when_unlocked(work: Callable[[], object]) -> None:
    """Run ``work`` now, or, if this thread is inside a table lock, once it leaves it.

    For releases run by the garbage collector (weak-reference callbacks), which can fire
    on any allocation, inside a table lock too: taking a second lock on a segment there
    (another open of the same file) would wait for this very thread forever."""
    if getattr(_here, "depth", 0):
        if not hasattr(_here, "later"):
            _here.later = []
        _here.later.append(work)
    else:
        work()


def first_holder(fd: int) -> None:
    """Make this process the only holder of a segment it just created (and still owns)."""
    os.pwrite(fd, struct.pack("<i", os.getpid()), 0)


# A slot is a holder's pid, or a message's: ``pid | TRANSFER`` (the sender's pid) when the
# message carries a descriptor of the segment, which is every message but the by-name
# part of a batch of more than 32 segments: those hold ``-pid``. A TRANSFER slot goes when
# its message is received, or closed unread (``expire_transfers``); a ``-pid`` slot when
# it is received, or when the daemon of the tree exits.
TRANSFER = 0x40000000
_TOP_INFLIGHT = 0xFF  # top byte of -pid (pids are < 2**22)
_TOP_TRANSFER = 0x40


def _slot_word(pid: int) -> bytes:
    return struct.pack("<i", pid)


def _find_top(table: bytes | bytearray, top: int) -> int:
    """The first slot whose top byte is ``top`` (a message's slot of that kind), or -1."""
    i = table.find(bytes([top]), 3)
    while i >= 0 and i % 4 != 3:
        i = table.find(bytes([top]), i + 1)
    return i - 3 if i >= 0 else -1


def has_inflight(table: bytes | bytearray) -> bool:
    """A message carrying the segment by name only holds a slot (a sweep must keep it)."""
    return _find_top(table, _TOP_INFLIGHT) >= 0


# Whether a message that carries a descriptor still exists anywhere (in a socket buffer,
# with DupFd, in its receiver's hands): its sender takes an open-file-description read
# lock on byte 0 of the descriptor it sends (F_OFD_SETLKW; not flock, which guards the
# table). That lock lives exactly as long as the description, which every copy of the
# descriptor shares, so when a channel is closed with the message unread, the lock goes.
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)


def _ofd_lock(fd: int, cmd: int, kind: int) -> None:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padding
    fcntl.fcntl(fd, cmd, struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 1, 0))


def mark_message(fd: int) -> None:
    """Mark the descriptor a message carries as alive for as long as the message is."""
    _ofd_lock(fd, _OFD_SETLKW, fcntl.F_RDLCK)


def _messages_alive(fd: int) -> bool:
    """Whether a message marked with ``mark_message`` still exists (``fd``: our own open)."""
    try:
        _ofd_lock(fd, _OFD_SETLK, fcntl.F_WRLCK)
    except OSError:
        return True  # EAGAIN/EACCES: somebody's read lock
    _ofd_lock(fd, _OFD_SETLK, fcntl.F_UNLCK)
    return False


def expire_transfers(name: str) -> bool:
    """Give back the slots of messages that no longer exist (their channel was closed
    unread) when no living process holds ``name``; unlink it if nobody is left. Returns
    whether it was unlinked."""
    try:
        fd = open_segment(name)
    except OSError:
        return False
    try:
        with _Locked(fd) as current:
            table = bytearray(current)
            if _find_top(table, _TOP_TRANSFER) < 0 or _messages_alive(fd):
                return False
            for pid in struct.unpack(f"<{_SLOTS}i", table):
                if 0 < pid < TRANSFER and _alive(pid):
                    return False  # its holder will let go itself
            while (slot := _find_top(table, _TOP_TRANSFER)) >= 0:
                table[slot : slot + 4] = _FREE
                os.pwrite(fd, _FREE, slot)
            if _empty(table):
                _unlink(name)
                return True
            return False
    finally:
        os.close(fd)


def _reopen(fd: int) -> int:
    # flock belongs to the open file description, which a descriptor received through
    # SCM_RIGHTS, DupFd or fork shares with every other copy: lock through one of our own
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def hold(name: str, fd: int, kind: str = "holder") -> bool:
    """Add a slot to the holders of the segment open as ``fd``: this process' own, or a
    message's (``kind`` "inflight": by name only; "transfer": with a descriptor), which
    its receiver takes over (``adopt``); a daemon leaves message slots alone.

    Returns False, changing nothing, when the segment is no longer named (its last
    holder, a daemon or a sweep unlinked it): then it is just memory, as a memfd is.
    """
    pid = os.getpid()
    word = {"holder": pid, "inflight": -pid, "transfer": pid | TRANSFER}[kind]
    own = _reopen(fd)
    try:
        with _Locked(own) as table:
            if _empty(table) or os.fstat(own).st_nlink == 0:
                return False
            slot = _find(table, _FREE)
            if slot < 0:
                words = struct.unpack(f"<{_SLOTS}i", table)
                sent = sum(1 for w in words if w < 0 or w & TRANSFER)
                raise OSError(
                    f"shared segment {name} is held {_SLOTS} times already, the most a "
                    f"file_system segment keeps track of: {_SLOTS - sent} by processes that "
                    f"map it, {sent} by messages sent but not received yet. Let receivers "
                    f"keep up (a Queue with maxsize), send fewer handles to one array, or "
                    f"use the file_descriptor strategy, which has no such limit"
                )
            os.pwrite(own, _slot_word(word), slot)
            return True
    finally:
        os.close(own)


def adopt(name: str, fd: int, kind: str) -> bool:
    """Take over a message's slot of ``kind`` ("inflight" or "transfer") as this
    process' own. False when there is none (another receiver took it, or it was freed)."""
    top = _TOP_INFLIGHT if kind == "inflight" else _TOP_TRANSFER
    own = _reopen(fd)
    try:
        with _Locked(own) as table:
            if os.fstat(own).st_nlink == 0:
                return False
            slot = _find_top(table, top)
            if slot < 0:
                return False
            os.pwrite(own, _slot_word(os.getpid()), slot)
            return True
    finally:
        os.close(own)


def drop_inflight(name: str, kind: str = "inflight") -> int:
    """A message's slot is not needed (its receiver maps the segment already, or it was
    never sent): give it back; unlink if nobody is left. Returns 0 once unlinked."""
    top = _TOP_INFLIGHT if kind == "inflight" else _TOP_TRANSFER
    try:
        fd = open_segment(name)
    except FileNotFoundError:
        return 0
    try:
        with _Locked(fd) as current:
            if os.fstat(fd).st_nlink == 0:
                return 0
            table = bytearray(current)
            slot = _find_top(table, top)
            if slot >= 0:
                table[slot : slot + 4] = _FREE
                os.pwrite(fd, _FREE, slot)
            if _empty(table):
                _unlink(name)
                return 0
            return 1
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass
    _log(f"unlinked {name}")


def _empty(table: bytes | bytearray) -> bool:
    """No slot is taken (every byte zero)."""
    return table.count(0) == len(table)


def let_go(name: str, pid: int | None = None, every: bool = False) -> bool:
    """Remove ``pid`` (default: this process) from a segment's holders, once or ``every``
    time it is there; unlink the segment when nobody is left. Returns whether anyone
    still holds it (False when the name is gone).

    With ``every`` (``pid`` is dead), an empty table is unlinked too when ``pid`` or a
    dead process created the segment: it died between creating the name and taking
    its slot."""
    try:
        fd = open_segment(name)
    except FileNotFoundError:
        return False
    word = _slot_word(os.getpid() if pid is None else pid)
    try:
        with _Locked(fd) as current:
            table = bytearray(current)
            changed = False
            while (slot := _find(table, word)) >= 0:
                table[slot : slot + 4] = _FREE
                os.pwrite(fd, _FREE, slot)
                changed = True
                if not every:
                    break
            if not _empty(table):
                return True
            if not changed and every:
                creator = int(NAME_RE.fullmatch(name).group(1))  # type: ignore[union-attr]
                changed = creator == pid or not _alive(creator)
            if changed:
                _unlink(name)
                return False
            return True  # being made right now by its living creator
    finally:
        os.close(fd)


def only_holder(name: str) -> bool:
    """Whether this process holds ``name`` exactly once and nothing else does: no other
    process, no message (the recycled-segment cache's test that a name it keeps is free)."""
    try:
        fd = open_segment(name)
    except OSError:
        return False
    try:
        with _Locked(fd) as current:
            if os.fstat(fd).st_nlink == 0:
                return False
            table = bytearray(current)
            slot = _find(table, _slot_word(os.getpid()))
            if slot < 0:
                return False
            table[slot : slot + 4] = _FREE
            return _empty(table)
    finally:
        os.close(fd)


def holders(name: str) -> list[int]:
    """The pids that hold a segment (empty when the name is gone)."""
    try:
        fd = open_segment(name)
    except FileNotFoundError:
        return []
    try:
        with _Locked(fd) as table:
            pids = struct.unpack(f"<{_SLOTS}i", table)
    finally:
        os.close(fd)
    return [pid for pid in pids if pid]


# -- what nobody holds any more ----------------------------------------------------------


def _pids() -> list[str]:
    try:
        return [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def in_use() -> dict[str, set[int]]:
    """Segment name -> pids of live processes that map it or hold it open (from /proc;
    a process that exits meanwhile is simply not counted)."""
    marker = f"{SHM_DIR}/{PREFIX}"
    found: dict[str, set[int]] = {}

    def note(path: str, pid: str) -> None:
        i = path.find(marker)
        if i >= 0:
            name = path[i + len(SHM_DIR) + 1 :].split()[0]
            found.setdefault(name, set()).add(int(pid))

    for pid in _pids():
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read().decode("utf-8", "replace")
        except OSError:
            maps = ""
        if marker in maps:
            for line in maps.splitlines():
                note(line, pid)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                note(os.readlink(f"/proc/{pid}/fd/{fd}"), pid)
            except OSError:
                continue
    return found


def _carried_by_name(name: str) -> bool:
    """A message that carries ``name`` may still be read: nothing shows it in /proc, so
    its slot (by name only) or its descriptor's lock is the only sign of it."""
    try:
        fd = open_segment(name)
    except OSError:
        return False
    try:
        return has_inflight(os.pread(fd, HEADER, 0)) or _messages_alive(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def sweep(
    names: set[str] | None = None,
    *,
    young: float = YOUNG,
    creator_dead: bool = True,
    keep: set[str] = frozenset(),  # type: ignore[assignment]
    dry_run: bool = False,
) -> list[tuple[str, int]]:
    """Unlink this user's segments that no live process maps or holds open.

    Args:
        names: the names to consider (default: every ``procspawn_*`` in /dev/shm).
        young: skip segments changed less than this many seconds ago.
        creator_dead: skip segments whose creating process (the pid in the name) lives.
        keep: names to leave alone whatever they look like (a live daemon holds them).
        dry_run: only say what would go.

    Returns:
        (name, bytes) of each segment unlinked (or that would be).
    """
    if names is None:
        try:
            names = {n for n in os.listdir(SHM_DIR) if NAME_RE.fullmatch(n)}
        except OSError:
            return []
    candidates = []
    now = time.time()
    for name in sorted(names):
        match = NAME_RE.fullmatch(name)
        if match is None or name in keep:
            continue
        try:
            st = os.lstat(segment_path(name))
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            continue
        if now - st.st_mtime < young:
            continue
        if creator_dead and _alive(int(match.group(1))):
            continue
        candidates.append((name, st.st_size))
    if not candidates:
        return []
    used = in_use()
    freed = []
    for name, size in candidates:
        if name in used or _carried_by_name(name):
            continue
        if not dry_run:
            try:
                os.unlink(segment_path(name))
            except OSError:
                continue
            _log(f"swept {name}")
        freed.append((name, size))
    return freed


# -- the daemon ----------------------------------------------------------------------------


def _peer(conn: socket.socket) -> tuple[int, int]:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _answer(sock: socket.socket, names: list[str]) -> None:
    try:
        sock.setblocking(True)
        sock.settimeout(5.0)
        sock.sendall("".join(name + "\n" for name in sorted(names)).encode() + b".\n")
    except OSError:
        pass


class _Client:
    __slots__ = ("pid", "buf", "holds")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.buf = bytearray()
        self.holds: set[str] = set()


def _let_go(client: _Client) -> None:
    """A client is gone: remove it from the holders of every name it registered."""
    for name in client.holds:
        try:
            held = let_go(name, client.pid, every=True)
        except OSError:
            continue
        _log(f"client {client.pid} gone: {name} {'still held' if held else 'freed'}")
    client.holds.clear()


_CHECK = 1.0  # seconds between looks for the slots of messages that no longer exist


def _expire(seen: set[str]) -> None:
    """Give back the slots of messages closed unread; forget names that are gone."""
    for name in list(seen):
        if not os.path.exists(segment_path(name)):
            seen.discard(name)
            continue
        try:
            if expire_transfers(name):
                _log(f"{name}: its messages were closed unread; freed")
        except OSError:
            continue


def serve(listener: socket.socket, grace: float = GRACE) -> list[str]:
    """Run until no client is left for ``grace`` seconds; returns the names swept then."""
    clients: dict[socket.socket, _Client] = {}
    seen: set[str] = set()
    sel = selectors.DefaultSelector()
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ)
    uid = os.getuid()
    idle_since: float | None = time.monotonic()

    def drop(sock: socket.socket) -> None:
        nonlocal idle_since
        sel.unregister(sock)
        sock.close()
        _let_go(clients.pop(sock))
        if not clients:
            idle_since = time.monotonic()

    next_check = time.monotonic() + _CHECK
    while True:
        timeout = None
        if not clients:
            assert idle_since is not None
            timeout = idle_since + grace - time.monotonic()
            if timeout <= 0:
                break
        if seen:
            now = time.monotonic()
            if now >= next_check:
                _expire(seen)
                next_check = now + _CHECK
            timeout = min(timeout, next_check - now) if timeout is not None else next_check - now
        for key, _ in sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is listener:
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                pid, peer_uid = _peer(conn)
                if peer_uid != uid:
                    conn.close()
                    continue
                conn.setblocking(False)
                clients[conn] = _Client(pid)
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
                drop(sock)
                continue
            client = clients[sock]
            buf = client.buf
            buf += data
            whole = len(buf) - len(buf) % RECORD
            for i in range(0, whole, RECORD):
                op = buf[i : i + 1]
                name = bytes(buf[i + 1 : i + RECORD]).rstrip(b"\0").decode("ascii", "replace")
                if not NAME_RE.fullmatch(name):
                    continue
                if op == b"R":
                    client.holds.add(name)
                    seen.add(name)
                elif op == b"U":
                    client.holds.discard(name)
            del buf[:whole]
            if buf[:1] == b"L":
                held = {n for c in clients.values() for n in c.holds}
                _answer(sock, [n for n in held if os.path.exists(segment_path(n))])
                drop(sock)
    sel.unregister(listener)
    listener.close()  # new clients now fail to connect and start a daemon of their own
    sel.close()
    # Whatever is left of what this tree used (a count a client died too early to take
    # back) goes if nobody maps or holds it open any more.
    return [name for name, _ in sweep(seen, young=0.0, creator_dead=False)]


def main(argv: list[str] | None = None) -> int:
    import argparse  # the daemon's command line only: clients import this module too

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
    _log(f"serving @{args.address}")
    # What a tree killed whole (daemon included) left behind: nobody else will free it.
    sweep()
    serve(listener, args.grace)
    _log("exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
