"""The ``file_system`` strategy: named segments in /dev/shm that know their holders.

``/dev/shm/procspawn_<pid>_<random>`` (created O_EXCL, mode 0600; layout in
``daemon._table``) lists the pids of the processes that map it. A process adds itself
when it maps the segment and removes itself when the last array over it is gone; the
last one unlinks the name. A live array holds no descriptor: this is the strategy for low fd
limits and very many arrays. Space is reserved when a segment is made
(``posix_fallocate``): /dev/shm is a sized tmpfs (64 MiB in a default Docker container),
and a full one must fail at allocation, not as a bus error later.

A message carries a descriptor of each segment, opened for that message (SCM_RIGHTS on
procspawn channels, DupFd on the stdlib's), and is counted in the segment's table,
a count its receiver turns into a slot of its own: the array arrives named, holding no
descriptor, even if the sender dropped it or died before it was received. The descriptor
keeps the memory safe whatever happens to the name: if the count was swept meanwhile and
the name is gone, the receiver maps the memory all the same and keeps the descriptor, as
a memfd segment does. A message carries at most ``FDS_PER_MESSAGE`` descriptors: further
segments (a batch of hundreds) travel by name only, counted apart, and sweeps leave
those alone. Counts have no limit: a backlog of any length can wait for a slow consumer.
The by-name part of a message that is never read stays until ``procspawn cleanup``:
nothing tells the daemon that such a message is gone. One that was read but could not be
unpickled (its descriptors dropped at the receiver's limit, or a rebuild failed) is given
back by its receiver (``discard``, ``owe``: see ``wire._handles.give_back``).

The cleanup daemon (``_client``) knows which process holds which name: a process
registers a name before it creates or maps it, and the daemon removes a dead process from
the holders of every name it registered (message slots stay). Segments are opened by name
with O_NOFOLLOW and used only if they are regular files of this user with mode 0600.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import resource
import threading
from collections.abc import Callable
from multiprocessing import util
from typing import Any, TypeVar

from ... import _log
from .. import _message
from .._errors import FdLimitError, reserve
from ..daemon import _client
from ..daemon._table import (
    HEADER,
    PREFIX,
    SHM_DIR,
    adopt,
    drop_inflight,
    first_holder,
    hold,
    let_go,
    mark_message,
    only_holder,
    open_segment,
    segment_path,
    when_unlocked,
)
from . import _recycled
from ._segment import Segment, map_fd
from ._strategy import SharingStrategy

_T = TypeVar("_T")


def _release(name: str) -> None:
    when_unlocked(lambda: _let_go(name))


def _let_go(name: str) -> None:
    _forget_marked(name)
    _client.released(name, gone=not let_go(name))
    _log.debug("released %s", name)


def _map_named(fd: int, name: str, size: int) -> Segment:
    segment = Segment.map(
        fd,
        size,
        strategy="file_system",
        key=name,
        header=HEADER,
        on_release=lambda: _release(name),
    )
    segment.name = name
    return segment


# Descriptors one message carries at most: a batch of many segments travels by name
# beyond that, so neither end of a message needs more than a few descriptors at once
# (this is the strategy for low fd limits).
FDS_PER_MESSAGE = 32


def _short_of_descriptors(lowest_free: int) -> bool:
    """Whether this process has used half its descriptors: ``lowest_free`` was just
    opened, and a new descriptor takes the lowest number free, so every one below it is
    in use. A message then names its segments instead of carrying a descriptor for each
    while it waits to be sent: a producer far ahead of its consumer (a Queue's backlog)
    holds none for its backlog, and never runs out of them for it."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft != resource.RLIM_INFINITY and lowest_free >= soft // 2


def _open_for_message(name: str, share: bool) -> int:
    """A descriptor of ``name`` for the message being pickled, marked: with ``share``, of
    the one open file description that every message of ``name`` from this process shares
    while it is sent often (see ``_marked``); else of its own (a recycled segment, which
    carries one message at a time and is kept long after)."""
    if not share:
        own = _open(name)
        try:
            mark_message(own)
        except BaseException:
            os.close(own)
            raise
        return own
    with _marked_lock:
        fd = _marked.get(name, -1)
        if fd < 0:
            fd = _open_for_message(name, share=False)
            _marked[name] = fd
            if len(_marked) > _MARKED:
                os.close(_marked.popitem(last=False)[1])
        else:
            _marked.move_to_end(name)
        try:
            mine = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise FdLimitError(f"shared segment {name} could not be sent") from None
            raise
    _forget_later()
    return mine


# Whether a message is alive is the lock its description carries (``mark_message``), and
# the kernel keeps a file's locks in one list that every lock and every close walks: one
# description per message made a backlog of n messages cost O(n) per send. So the
# messages of a segment share one description, marked once, which this process keeps
# open for its last four segments sent (four descriptors, however many arrays) and
# closes when it lets go of the segment: from then on only its messages keep it alive.
_MARKED = 4
_marked: collections.OrderedDict[str, int] = collections.OrderedDict()
_marked_lock = threading.Lock()
_to_forget: collections.deque[str] = collections.deque()


def _forget_marked(name: str) -> None:
    """This process let go of ``name``: close its marked description. A release may run
    from the garbage collector inside ``_open_for_message`` on this very thread, so it
    never waits for the lock: it leaves the name for the holder of the lock."""
    _to_forget.append(name)
    _forget_later()


def _forget_later() -> None:
    while _to_forget and _marked_lock.acquire(blocking=False):
        try:
            while _to_forget:
                fd = _marked.pop(_to_forget.popleft(), None)
                if fd is not None:
                    os.close(fd)
        finally:
            _marked_lock.release()


def _open(name: str) -> int:
    try:
        return open_segment(name)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"shared segment {name} cannot be sent: its name was removed while this "
            f"process still maps it. Copy the array (np.array(a)) to send it.",
        ) from None
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise FdLimitError(f"shared segment {name} could not be opened to send it") from None
        raise


# Counts of messages never received, still to give back: dropping one opens the segment,
# and the receiver of a message whose descriptors the kernel dropped is at its descriptor
# limit. Tried again at the next segment this process rebuilds or discards, at the next
# message it receives (wire's loads_received), and at exit.
undropped: collections.deque[tuple[str, str]] = collections.deque()
_undropped_at_exit = False


def owe(name: str, kind: str) -> None:
    """The count ``kind`` of ``name`` that a message held for this process is to go back
    (a rebuild failed before taking it over, or the message will never be unpickled)."""
    undropped.append((name, kind))
    drop_undropped()


def drop_undropped() -> None:
    """Give back the counts of messages never received that are still owed (each taken
    by one thread: a count is never given back twice)."""
    global _undropped_at_exit
    while undropped:
        try:
            name, kind = undropped.popleft()
        except IndexError:  # another thread took the last
            return
        try:
            drop_inflight(name, kind)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                continue  # nothing this process can do about it: the count stays
            undropped.appendleft((name, kind))
            if not _undropped_at_exit:
                # at exit too: multiprocessing runs these in its children, which skip atexit
                _undropped_at_exit = True
                util.Finalize(None, drop_undropped, exitpriority=-90)
            return


def _after_fork_in_child() -> None:
    global _marked_lock
    for fd in _marked.values():
        os.close(fd)  # the parent's messages' mark: a child's copy would keep them alive
    _marked.clear()
    _to_forget.clear()
    undropped.clear()  # the parent's to give back, once
    _marked_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _message_slot(name: str, fd: int, kind: str, state: _message.SendState) -> None:
    """Count the message in the segment's table, for its receiver to turn into a slot
    of its own; a message that is never sent takes its count back."""
    if not hold(name, fd, kind):
        raise FileNotFoundError(errno.ENOENT, f"shared segment {name} was freed meanwhile")
    state.on_abandon.append(lambda: drop_inflight(name, kind))


def _create(nbytes: int, mapper: Callable[[int, str], _T]) -> _T:
    """Make a new named segment with room for ``nbytes``, this process its only holder,
    and map it with ``mapper(fd, name)`` (the descriptor is closed after)."""
    name = f"{PREFIX}{os.getpid()}_{os.urandom(8).hex()}"
    _client.register(name)
    try:
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except BaseException:
        _client.released(name, gone=True)
        raise
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: receivers check for exactly 0600
            reserve(fd, nbytes, SHM_DIR, SHM_DIR, overhead=HEADER)
            first_holder(fd)
            return mapper(fd, name)
        except BaseException:
            os.unlink(segment_path(name))
            _client.released(name, gone=True)
            raise
    finally:
        os.close(fd)


class _KeptNames(_recycled.Kind):
    """Recycled named segments: the maker stays their holder while it keeps them for
    reuse (see ``_recycled``)."""

    name = "file_system"
    _limit: int | None = None

    def limit(self) -> int:
        if self._limit is None:  # a quarter of /dev/shm at most: 16 MiB in a container
            try:
                st = os.statvfs(SHM_DIR)
                quarter = st.f_blocks * st.f_frsize // 4
            except OSError:
                quarter = 0
            self._limit = min(_recycled.limit(), quarter)
        return self._limit

    def make(self, capacity: int) -> _recycled.Kept:
        def mapper(fd: int, name: str) -> _recycled.Kept:
            address = map_fd(fd, HEADER + capacity)
            return _recycled.Kept(self, address, HEADER + capacity, HEADER, name, name=name)

        return _create(capacity, mapper)

    # a file_system Kept always has its segment's name (Kept.name is str | None)
    def nobody_else(self, kept: _recycled.Kept) -> bool:
        return only_holder(kept.name)  # type: ignore[arg-type]

    def give_back(self, kept: _recycled.Kept) -> None:
        _recycled.unmap(kept.address, kept.length)
        _release(kept.name)  # type: ignore[arg-type]

    def at_exit(self, kept: _recycled.Kept) -> None:
        _let_go(kept.name)  # type: ignore[arg-type]

    def on_release(self, kept: _recycled.Kept) -> Callable[[], Any]:
        name: str = kept.name  # type: ignore[assignment]
        return lambda: _release(name)


KEPT_NAMES = _KeptNames()


class FileSystemStrategy(SharingStrategy):
    """Named /dev/shm segments that list their holders; messages carry a descriptor."""

    def allocate(self, nbytes: int) -> Segment:
        return _create(nbytes, lambda fd, name: _map_named(fd, name, nbytes))

    def allocate_for_copy(self, nbytes: int) -> Segment:
        recycled = _recycled.take(nbytes, KEPT_NAMES)
        return recycled if recycled is not None else self.allocate(nbytes)

    def open_file(self, segment: Segment) -> int:
        if segment.name is None:
            return -1
        try:
            return open_segment(segment.name)
        except OSError:
            return -1

    def reduce(self, segment: Segment) -> Any:
        state = _message.sending()
        if segment.name is None:  # its name was gone when it was received: keeps its fd
            return (state.add_fd(segment.fd, segment), segment.key, segment.size, "anon")
        name = segment.name
        # The message keeps the sender's own slot until it is closed (a start-up message
        # serves every rank), and is counted in the table, a count that outlives the
        # sender for the receiver to turn into a slot: the array arrives named (no
        # descriptor to keep) even if the sender dropped it, or died, before it was received.
        state.keepalive.append(segment)
        fd = _open_for_message(name, share=not segment.recycled)
        try:
            if len(state.owned) < FDS_PER_MESSAGE and not _short_of_descriptors(fd):
                index = state.give_fd(fd)
                _message_slot(name, fd, "transfer", state)
                return (index, name, segment.size, "transfer")
            try:
                _message_slot(name, fd, "inflight", state)
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise FdLimitError(f"shared segment {name} could not be sent") from None
            raise
        return (None, name, segment.size, "inflight")

    def rebuild(self, handle: Any) -> Segment:
        if undropped:
            drop_undropped()
        index, name, size, mode = handle
        if index is None:
            return self._rebuild_by_name(name, size)
        fd = _message.take_fd(index)
        kept = False
        try:
            if mode != "anon":
                try:
                    _client.register(name)
                except BaseException:
                    if mode == "transfer":
                        owe(name, "transfer")  # not taken over: it goes back
                    raise
                if (mode == "transfer" and adopt(name, fd, "transfer")) or hold(name, fd):
                    try:
                        return _map_named(fd, name, size)
                    except BaseException:
                        _release(name)
                        raise
                _client.released(name, gone=True)  # every holder let go meanwhile
            # No longer named: the memory lives as long as a descriptor or a mapping does.
            segment = Segment.map(
                fd, size, strategy="file_system", key=name, header=HEADER, keep_fd=True
            )
            kept = True
            return segment
        finally:
            if not kept:
                os.close(fd)

    def _rebuild_by_name(self, name: str, size: int) -> Segment:
        try:
            _client.register(name)
        except BaseException:
            owe(name, "inflight")  # not taken over: it goes back
            raise
        try:
            fd = open_segment(name)
        except BaseException as exc:
            _client.released(name, gone=True)
            if isinstance(exc, FileNotFoundError):
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"shared segment {name} no longer exists: it was freed before this "
                    f"message was received",
                ) from None
            owe(name, "inflight")  # (out of descriptors, say): it goes back
            raise
        try:
            if not adopt(name, fd, "inflight") and not hold(name, fd):
                _client.released(name, gone=True)
                raise FileNotFoundError(errno.ENOENT, f"shared segment {name} was freed")
            try:
                return _map_named(fd, name, size)
            except BaseException:
                _release(name)
                raise
        finally:
            os.close(fd)

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        # this process holds it already: the message's own count goes back
        self.discard(handle)

    def discard(self, handle: Any) -> None:
        # the message's count goes back: nobody else would take a by-name one back (the
        # daemon's sweeps leave those alone), and its name would outlive every process
        _, name, _, mode = handle  # (None, ..., "inflight") by name, (i, ..., "transfer")
        if mode in ("inflight", "transfer"):
            owe(name, mode)
