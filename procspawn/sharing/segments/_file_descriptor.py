"""The ``file_descriptor`` strategy (Linux): anonymous memfd segments.

Nothing is named, so nothing can leak: the kernel frees a segment when its last
descriptor and last mapping are gone, whoever dies how. The memfd travels with each
message (SCM_RIGHTS on procspawn channels, DupFd at process start), so a message keeps
its segments alive by itself, after its sender exited too. Every live segment keeps
exactly one descriptor in each process that maps it (to send it on); the mapping itself
holds none.

No space is reserved up front (``ftruncate``, not ``posix_fallocate``): a memfd lives in
the kernel's internal shared-memory mount, which has no size of its own to run out of,
so its pages are allocated as they are first touched, like any other memory (a fresh
64 MiB array that is written sparsely costs a few pages, not 64 MiB of zeroing).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

from .. import _message
from .._errors import FdLimitError, raise_fd_limit
from . import _recycled
from ._segment import Segment
from ._strategy import SharingStrategy


@contextlib.contextmanager
def _fd_limit(what: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise FdLimitError(what) from None
        raise


def _segment(fd: int, size: int, key: Any) -> Segment:
    try:
        return Segment.map(fd, size, strategy="file_descriptor", key=key, keep_fd=True)
    except BaseException:
        os.close(fd)
        raise


_BIG = 1 << 30  # segments from this size up are checked against the machine's memory


def _check_fits(nbytes: int) -> None:
    """A memfd is sized without being filled, so one larger than all memory and swap is
    made at once, then filled page by page until the out-of-memory killer stops the
    program (any program). Refuse it up front, as malloc does (MemoryError)."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return
    if total and nbytes > total:
        raise MemoryError(
            f"a shared-memory segment of {nbytes:,} bytes cannot be made: this machine has "
            f"{total:,} bytes of memory and swap in all. An array sent is copied whole: a "
            "broadcast or zero-stride view (np.broadcast_to, as_strided) is as large as "
            "its shape says. Send its base array, or a smaller one."
        )


class FileDescriptorStrategy(SharingStrategy):
    """memfd segments whose descriptors are passed with the message."""

    def allocate(self, nbytes: int) -> Segment:
        if nbytes > _BIG:
            _check_fits(nbytes)
        raise_fd_limit()
        with _fd_limit("a new shared-memory segment could not be created"):
            fd = os.memfd_create("procspawn", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return _segment(fd, nbytes, (st.st_dev, st.st_ino))

    def allocate_for_copy(self, nbytes: int) -> Segment:
        raise_fd_limit()
        with _fd_limit("a new shared-memory segment could not be created"):
            recycled = _recycled.take(nbytes, _recycled.MEMFDS)
        return recycled if recycled is not None else self.allocate(nbytes)

    def reduce(self, segment: Segment) -> Any:
        # the key travels too: the receiver needs no fstat to know the segment
        state = _message.sending()
        if _recycled.is_recycled(segment):  # a file of its own for this message (see _recycled)
            with _fd_limit("a shared-memory segment could not be sent"):
                index = state.give_fd(_recycled.file_to_send(segment))
        else:
            index = state.add_fd(segment.fd, segment)
        return (index, segment.size, segment.key)

    def rebuild(self, handle: Any) -> Segment:
        index, size, key = handle
        return _segment(_message.take_fd(index), size, key)
