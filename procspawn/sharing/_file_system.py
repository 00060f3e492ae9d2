"""The ``file_system`` strategy: named segments in /dev/shm with a cross-process refcount.

Layout of ``/dev/shm/procspawn_<pid>_<random>`` (created O_EXCL, mode 0600)::

    [0:8)    reference count, int64 little endian, changed only under flock(LOCK_EX) on
             a descriptor opened for that one update: the lock belongs to that open file,
             so threads of one process exclude each other too, and the kernel drops it if
             its holder dies mid-update
    [8:64)   unused
    [64:)    the data, 64-byte aligned

Who holds a reference: the creating process; every other process that maps the segment;
every message in flight (the sender takes it while pickling, the receiver adopts it, or
drops it when it already maps the segment). The last release unlinks the name. No
descriptor is kept once the segment is mapped: a live array costs none, which makes this
the strategy for low fd limits and very many arrays.

Segments are opened by name with O_NOFOLLOW and used only if they are regular files of
this user with mode 0600: a name planted by someone else in the shared /dev/shm is refused.

Names that a process that dies leaves behind are for the cleanup daemon (``_manager``): a
process registers every name before it creates or maps it, and tells the daemon when the
last reference unlinked it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import struct
from typing import Any

from . import _manager, _pickler
from ._resources import reserve
from ._segment import Segment, keep_mapped
from ._strategy import SharingStrategy

SHM_DIR = "/dev/shm"
PREFIX = "procspawn_"
_HEADER = 64
_COUNT = struct.Struct("<q")


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _open(name: str) -> int:
    """Open an existing segment read-write, refusing anything procspawn did not make."""
    fd = os.open(_path(name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o777 != 0o600:
        os.close(fd)
        raise PermissionError(
            f"{_path(name)} is not a procspawn segment of this user (a regular file of uid "
            f"{os.getuid()} with mode 0600); refusing to map it"
        )
    return fd


def adjust_refcount(name: str, delta: int, fd: int | None = None) -> int:
    """Add ``delta`` to a segment's reference count; unlink it when it reaches 0.

    Returns the new count (0 if the segment is gone already).
    """
    own = fd is None
    if own:
        try:
            fd = _open(name)
        except FileNotFoundError:
            return 0
    assert fd is not None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            (count,) = _COUNT.unpack(os.pread(fd, _COUNT.size, 0))
            count += delta
            os.pwrite(fd, _COUNT.pack(count), 0)
            if count <= 0:
                os.unlink(_path(name))
            return count
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        if own:
            os.close(fd)


def _release(name: str) -> None:
    count = adjust_refcount(name, -1)
    _manager.released(name, unlinked=count <= 0)


def _drop_inflight(name: str) -> None:
    # the reference a message took for a receiver that will never come
    if adjust_refcount(name, -1) <= 0:
        _manager.released(name, unlinked=True)


def _map(fd: int, name: str, size: int) -> Segment:
    segment = Segment.map(
        fd,
        size,
        strategy="file_system",
        key=name,
        header=_HEADER,
        on_release=lambda: _release(name),
    )
    segment.name = name
    return segment


class FileSystemStrategy(SharingStrategy):
    """Named /dev/shm segments with a reference count kept in the segment."""

    def allocate(self, nbytes: int) -> Segment:
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        _manager.register(name)
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.fchmod(fd, 0o600)  # whatever the umask: receivers check for exactly 0600
                reserve(fd, nbytes, SHM_DIR, SHM_DIR, overhead=_HEADER)
                os.pwrite(fd, _COUNT.pack(1), 0)
                return _map(fd, name, nbytes)
            except BaseException:
                os.unlink(_path(name))
                _manager.released(name, unlinked=True)
                raise
        finally:
            os.close(fd)

    def reduce(self, segment: Segment) -> Any:
        state = _pickler.sending()
        if state.inflight:
            name: str = segment.name  # type: ignore[assignment]
            adjust_refcount(name, +1)
            state.on_abandon.append(lambda: _drop_inflight(name))
        else:
            state.keepalive.append(segment)
        return (segment.name, segment.size, state.inflight)

    def rebuild(self, handle: Any) -> Segment:
        name, size, inflight = handle
        _manager.register(name)
        try:
            fd = _open(name)
        except BaseException as exc:
            _manager.released(name, unlinked=False)
            if isinstance(exc, FileNotFoundError):
                raise FileNotFoundError(
                    f"shared segment {name} no longer exists: every process holding it let "
                    f"go before this message was received"
                ) from None
            raise
        try:
            if not inflight:
                # the sender keeps it alive until we hold our own reference
                adjust_refcount(name, +1, fd)
            try:
                segment = _map(fd, name, size)
            except BaseException:
                _release(name)  # ours, or the message's we were adopting
                raise
        finally:
            os.close(fd)
        segment.received = True
        keep_mapped(segment)  # as file_descriptor: the next message for it maps nothing
        return segment

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        name, _, inflight = handle
        if inflight:
            # we hold a reference already (so this never unlinks): drop the message's
            adjust_refcount(name, -1)
        if segment.received:
            keep_mapped(segment)
