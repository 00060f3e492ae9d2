"""The ``file_system`` strategy: named segments in /dev/shm with a cross-process refcount.

Layout of ``/dev/shm/procspawn_<pid>_<random>`` (created O_EXCL, mode 0600)::

    [0:8)    reference count, int64 little endian, changed only under an fcntl lock on
             those 8 bytes (the kernel drops the lock if its holder dies mid-update)
    [8:64)   unused
    [64:)    the data, 64-byte aligned

Who holds a reference: the creating process; every other process that maps the segment;
every message in flight (the sender takes it while pickling, the receiver adopts it, or
drops it when it already maps the segment). The last release unlinks the name. No
descriptor is kept once the segment is mapped: a live array costs none, which makes this
the strategy for low fd limits and very many arrays.

Names that a process that dies leaves behind are for the cleanup daemon (``_manager``): a
process registers every name before it creates or maps it, and tells the daemon when the
last reference unlinked it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import struct
from typing import Any

from . import _manager, _pickler
from ._resources import reserve
from ._segment import Segment
from ._strategy import SharingStrategy

SHM_DIR = "/dev/shm"
PREFIX = "procspawn_"
_HEADER = 64
_COUNT = struct.Struct("<q")


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def adjust_refcount(name: str, delta: int) -> int:
    """Add ``delta`` to a segment's reference count; unlink it when it reaches 0."""
    try:
        fd = os.open(_path(name), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX, _COUNT.size, 0)
        (count,) = _COUNT.unpack(os.pread(fd, _COUNT.size, 0))
        count += delta
        os.pwrite(fd, _COUNT.pack(count), 0)
        if count <= 0:
            os.unlink(_path(name))
        return count
    finally:
        os.close(fd)  # closing drops the lock


def _release(name: str) -> None:
    count = adjust_refcount(name, -1)
    _manager.released(name, unlinked=count <= 0)


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
            adjust_refcount(segment.name, +1)  # type: ignore[arg-type]
        else:
            state.keepalive.append(segment)
        return (segment.name, segment.size, state.inflight)

    def rebuild(self, handle: Any) -> Segment:
        name, size, inflight = handle
        _manager.register(name)
        if not inflight:
            adjust_refcount(name, +1)  # the sender keeps it alive until we hold our own
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            _manager.released(name, unlinked=False)
            raise FileNotFoundError(
                f"shared segment {name} no longer exists: every process holding it let go "
                f"before this message was received"
            ) from None
        try:
            return _map(fd, name, size)
        except BaseException:
            _release(name)
            raise
        finally:
            os.close(fd)

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        name, _, inflight = handle
        if inflight:
            _release(name)  # we already hold a reference; drop the message's
