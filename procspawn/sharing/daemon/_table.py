"""The holder table of a named segment, and the sweep of what nobody holds any more.

Standard library only, and nothing of procspawn: the cleanup daemon (``_main``, run by
path) loads it by its path, while the ``file_system`` strategy and the command line import
it as ``procspawn.sharing.daemon._table``. What a name looks like, who holds it, and when
it may go are decided here and only here; the daemon decides *when* to ask.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Set
from typing import TypeVar


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if it is gone or a zombie: a
    pid and its start time name one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


SHM_DIR = "/dev/shm"
PREFIX = "procspawn_"
NAME_RE = re.compile(r"procspawn_([0-9]{1,10})_[0-9a-f]{16}")
YOUNG = 2.0  # seconds: a segment this young may be between creation and mapping
_T = TypeVar("_T")
DEBUG = False  # the daemon's --debug (its client passes PROCSPAWN_DEBUG)


def log(text: str) -> None:
    """A line on stderr, with ``--debug`` only (the daemon has no logging set up)."""
    if DEBUG:
        print(f"procspawn daemon {os.getpid()}: {text}", file=sys.stderr, flush=True)


# -- named segments ----------------------------------------------------------------------
#
# The first page of a named segment is its table of holders, changed only under
# flock(LOCK_EX) on a descriptor of the segment (the lock belongs to that open file, so
# threads of one process exclude each other too, and the kernel drops it if its holder dies
# mid-update). Four int32 words, then holder slots:
#
#   transfers  messages in flight that carry a descriptor of the segment
#   by_name    messages in flight that carry only its name (beyond FDS_PER_MESSAGE)
#   more       pages of further holder slots, at page ``more_at`` (past the data), 0: none
#   more_at
#   slots      the pid of each process that maps the segment (0: free)
#
# A pid, not a count, for holders: whoever cleans up after a dead process removes exactly
# the slots that process took, however it died (between registering and taking its slot,
# or between giving the slot back and telling the daemon). A count for messages: any
# receiver turns one into its own pid (``adopt``), and a daemon leaves them alone when the
# sender dies (the message may be received after that). Neither has a fixed limit: a
# backlog of any length is a count, and when the slots fill (a thousand processes mapping
# one slab) the table grows by whole pages at the end of the file, which no mapping
# covers. The data starts on the second page.

HEADER = 4096  # bytes before a named segment's data: the table of holders
_PAGE = 4096
_COUNTS = struct.Struct("<4i")
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


class Table:
    """A segment's table of holders, as read under its lock; changes are written through."""

    __slots__ = ("fd", "transfers", "by_name", "more", "more_at", "slots")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        # short when its creator died before giving it its size: nothing is taken then
        head = os.pread(fd, HEADER, 0).ljust(HEADER, b"\0")
        self.transfers, self.by_name, self.more, self.more_at = _COUNTS.unpack_from(head)
        self.slots = bytearray(head[_COUNTS.size :])
        if self.more:
            size = self.more * _PAGE
            self.slots += os.pread(fd, size, self.more_at * _PAGE).ljust(size, b"\0")

    def _offset(self, i: int) -> int:
        """The file offset of byte ``i`` of the slots."""
        first = HEADER - _COUNTS.size
        return _COUNTS.size + i if i < first else self.more_at * _PAGE + i - first

    def find(self, pid: int) -> int:
        """The byte index of the first slot holding ``pid`` (0: a free one), or -1."""
        word = _slot_word(pid)
        i = self.slots.find(word)
        while i >= 0 and i % 4:
            i = self.slots.find(word, i + 1)
        return i

    def put(self, i: int, pid: int) -> None:
        word = _slot_word(pid)
        self.slots[i : i + 4] = word
        os.pwrite(self.fd, word, self._offset(i))

    def add(self, pid: int) -> None:
        """Take a free slot for ``pid``, growing the table when none is left."""
        i = self.find(0)
        if i < 0:
            i = len(self.slots)
            self._grow()
        self.put(i, pid)

    def _grow(self) -> None:
        pages = max(1, self.more)  # doubling: a table of n slots is read in O(log n) steps
        at = self.more_at or -(-os.fstat(self.fd).st_size // _PAGE)
        start = (at + self.more) * _PAGE
        try:
            os.posix_fallocate(self.fd, start, pages * _PAGE)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"no room in {SHM_DIR} to track one more process mapping a shared segment "
                f"({exc.strerror}): free some shared memory, or make {SHM_DIR} larger",
            ) from None
        self.more, self.more_at = self.more + pages, at
        self.slots += bytes(pages * _PAGE)
        self._write_counts()

    def _write_counts(self) -> None:
        counts = _COUNTS.pack(self.transfers, self.by_name, self.more, self.more_at)
        os.pwrite(self.fd, counts, 0)

    def count(self, kind: str, change: int) -> bool:
        """Change the count of messages of ``kind`` ("transfer" or "inflight") by
        ``change``; False, changing nothing, when that would take it below zero."""
        attr = "transfers" if kind == "transfer" else "by_name"
        value = getattr(self, attr) + change
        if value < 0:
            return False
        setattr(self, attr, value)
        self._write_counts()
        return True

    def pids(self) -> list[int]:
        return [pid for pid in struct.unpack(f"<{len(self.slots) // 4}i", self.slots) if pid]

    def empty(self) -> bool:
        """Nothing holds the segment: no process, no message."""
        return not (self.transfers or self.by_name) and self.slots.count(0) == len(self.slots)


def _slot_word(pid: int) -> bytes:
    return struct.pack("<i", pid)


_here = threading.local()  # .depth: table locks this thread holds; .later: deferred work


class _Locked:
    """flock(LOCK_EX) on a segment for the time of one change of its table."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> Table:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            table = Table(self.fd)
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
    os.pwrite(fd, _slot_word(os.getpid()), _COUNTS.size)


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
    """Forget the messages that no longer exist (their channel was closed unread) when no
    living process holds ``name``; unlink it if nobody is left. Returns whether it was
    unlinked."""
    try:
        fd = open_segment(name)
    except OSError:
        return False
    try:
        with _Locked(fd) as table:
            if not table.transfers or _messages_alive(fd):
                return False
            if any(_alive(pid) for pid in table.pids()):
                return False  # its holders will let go themselves
            table.count("transfer", -table.transfers)
            if table.empty():
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
    """Add this process to the holders of the segment open as ``fd``, or (``kind``
    "inflight": by name only; "transfer": with a descriptor) count one more message in
    flight, which its receiver takes over (``adopt``); a daemon leaves those alone.

    Returns False, changing nothing, when the segment is no longer named (its last
    holder, a daemon or a sweep unlinked it): then it is just memory, as a memfd is.
    """
    own = _reopen(fd)
    try:
        with _Locked(own) as table:
            if table.empty() or os.fstat(own).st_nlink == 0:
                return False
            if kind == "holder":
                table.add(os.getpid())
            else:
                table.count(kind, 1)
            return True
    finally:
        os.close(own)


def adopt(name: str, fd: int, kind: str) -> bool:
    """Turn one message of ``kind`` ("inflight" or "transfer") into this process' own
    slot. False when there is none (another receiver took it, or it was freed)."""
    own = _reopen(fd)
    try:
        with _Locked(own) as table:
            if os.fstat(own).st_nlink == 0:
                return False
            table.add(os.getpid())  # first: if the table cannot grow, the message stays
            if not table.count(kind, -1):
                table.put(table.find(os.getpid()), 0)
                return False
            return True
    finally:
        os.close(own)


def drop_inflight(name: str, kind: str = "inflight") -> int:
    """A message is not needed (its receiver maps the segment already, or it was never
    sent): forget it; unlink if nobody is left. Returns 0 once unlinked."""
    try:
        fd = open_segment(name)
    except FileNotFoundError:
        return 0
    try:
        with _Locked(fd) as table:
            if os.fstat(fd).st_nlink == 0:
                return 0
            table.count(kind, -1)
            if table.empty():
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
    log(f"unlinked {name}")


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
    pid = os.getpid() if pid is None else pid
    try:
        with _Locked(fd) as table:
            changed = False
            while (slot := table.find(pid)) >= 0:
                table.put(slot, 0)
                changed = True
                if not every:
                    break
            if not table.empty():
                return True
            if not changed and every:
                # every name in the table matched NAME_RE when it was added
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
        with _Locked(fd) as table:
            if os.fstat(fd).st_nlink == 0:
                return False
            pids = table.pids()
            return pids == [os.getpid()] and not (table.transfers or table.by_name)
    finally:
        os.close(fd)


def holders(name: str) -> list[int]:
    """The pids that hold a segment (empty when the name is gone)."""
    return _read(name, Table.pids) or []


def messages(name: str) -> tuple[int, int]:
    """How many messages that carry a segment are in flight: (with a descriptor, by name)."""
    return _read(name, lambda t: (t.transfers, t.by_name)) or (0, 0)


def _read(name: str, what: Callable[[Table], _T]) -> _T | None:
    try:
        fd = open_segment(name)
    except FileNotFoundError:
        return None
    try:
        with _Locked(fd) as table:
            return what(table)
    finally:
        os.close(fd)


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
        return bool(Table(fd).by_name) or _messages_alive(fd)
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
    keep: Set[str] = frozenset(),
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
            log(f"swept {name}")
        freed.append((name, size))
    return freed
