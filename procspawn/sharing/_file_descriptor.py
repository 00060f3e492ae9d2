"""The ``file_descriptor`` strategy (Linux): anonymous memfd segments.

Nothing is named, so nothing can leak: the kernel frees a segment when its last
descriptor and last mapping are gone, whoever dies how. The memfd travels with each
message (SCM_RIGHTS on procspawn channels, DupFd at process start). Every live segment
keeps exactly one descriptor in each process that maps it (to send it on); the mapping
itself holds none.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any

from . import _pickler
from ._fdpass import FdLimitError
from ._resources import raise_fd_limit, reserve
from ._segment import Segment, keep_mapped
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


class FileDescriptorStrategy(SharingStrategy):
    """memfd segments whose descriptors are passed with the message."""

    def allocate(self, nbytes: int) -> Segment:
        raise_fd_limit()
        with _fd_limit("a new shared-memory segment could not be created"):
            fd = os.memfd_create("procspawn", os.MFD_CLOEXEC)
        try:
            reserve(fd, max(nbytes, 1), "a memfd segment", None)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return _segment(fd, nbytes, (st.st_dev, st.st_ino))

    def reduce(self, segment: Segment) -> Any:
        # the key travels too: the receiver needs no fstat to know the segment
        return (_pickler.sending().add_fd(segment.fd, segment), segment.size, segment.key)

    def rebuild(self, handle: Any) -> Segment:
        index, size, key = handle
        segment = _segment(_pickler.take_fd(index), size, key)
        segment.received = True
        keep_mapped(segment)
        return segment

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        # the received duplicate is not needed (loads() closes it)
        if segment.received:
            keep_mapped(segment)
