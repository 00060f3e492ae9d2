"""The errors of sharing, each saying what ran out and what to do (each pickles
as itself), and reserving space and descriptors up front."""

from __future__ import annotations

import errno
import os
import resource
import threading

from .._late import renew_lock_in_child

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any


class CudaError(RuntimeError):
    """A GPU array could not be shared: a CUDA driver call failed, or the GPU cannot share
    memory. The message names the call, the driver's error and what to do; ``.code`` is
    the driver's status (0 where no call failed)."""

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.code))


_raised = False
_lock = threading.Lock()

renew_lock_in_child(globals())


def raise_fd_limit() -> None:
    """Once per process: lift the soft RLIMIT_NOFILE to the hard limit."""
    global _raised
    if _raised:
        return
    with _lock:
        if _raised:
            return
        _raised = True
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            except (ValueError, OSError):
                pass


def descriptors_used_past(fraction: float) -> bool:
    """Whether this process uses more than ``fraction`` of its soft RLIMIT_NOFILE,
    counted in ``/proc/self/fd``. (Not the lowest free number: descriptors closed below
    the ones in use leave holes, and a process with most of its limit in use looked
    nearly empty.)"""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return False
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # (the listing's own descriptor)
    except OSError:  # no /proc: every one below the lowest free number is in use
        used = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        os.close(used)
    return used >= soft * fraction


class FdLimitError(OSError):
    """This process ran out of file descriptors while receiving shared arrays.

    Under the ``file_descriptor`` strategy every live shared segment holds one descriptor.
    Raise the limit (``ulimit -n``) or switch to the ``file_system`` strategy, where a live
    array holds none: ``procspawn.set_sharing_strategy("file_system")``.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __init__(self, what: str, where: tuple[int, int, int] | None = None) -> None:
        """``where``: (pid, soft limit, hard limit) of the process that ran out, when it
        is not this one (an error sent back by a pool worker)."""
        self.what = what
        if where is None:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            where = (os.getpid(), soft, hard)
        self.where = where
        pid, soft, hard = where
        who = "this process" if pid == os.getpid() else f"process {pid}"
        super().__init__(
            errno.EMFILE,
            f"too many open files: {what}, because {who} is at its limit "
            f"(RLIMIT_NOFILE soft={soft}, hard={hard}). Each live array shared under the "
            f"'file_descriptor' strategy holds one descriptor. Fix: raise the limit "
            f"(`ulimit -n {max(hard, soft * 4)}`) or call "
            f"procspawn.set_sharing_strategy('file_system'), which holds no descriptor "
            f"per array.",
        )

    def __reduce__(self) -> tuple[type[FdLimitError], tuple[str, tuple[int, int, int]]]:
        return (FdLimitError, (self.what, self.where))


class SharedMemoryFullError(OSError):
    """There is not enough shared memory for a new segment.

    Raised when a segment is made (its space is reserved at once), never later as a bus
    error: by ``sharing.zeros`` / ``empty`` / ``share_memory_``, and by a send that
    copies an array into shared memory, under the ``file_system`` strategy (/dev/shm).
    Free space (``procspawn cleanup`` removes what dead programs left), give the
    container more (``docker run --shm-size=...``), send smaller batches, or switch to
    the ``file_descriptor`` strategy. An ``OSError`` (``errno.ENOSPC``).
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __reduce__(self) -> tuple[type[SharedMemoryFullError], tuple[Any, ...]]:
        return (SharedMemoryFullError, self.args)


class ChannelClosed(EOFError):
    """The other end of a channel closed before a whole message arrived.

    Raised by a receive on a procspawn channel (``Connection.recv``, the end of a
    ``Pipe``) whose other end was closed, or whose process exited, with no message left
    to read, or in the middle of one. An ``EOFError``, as multiprocessing raises there:
    treat it as the end of the stream, or find out why the sender went away.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles


def reserve(fd: int, nbytes: int, where: str, free_path: str | None, overhead: int = 0) -> None:
    """posix_fallocate ``overhead + nbytes`` of ``fd``; ENOSPC becomes a SharedMemoryFullError."""
    try:
        os.posix_fallocate(fd, 0, overhead + nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = ""
        if free_path is not None:
            st = os.statvfs(free_path)
            free = f", {st.f_bavail * st.f_frsize:,} bytes free of {st.f_blocks * st.f_frsize:,}"
        raise SharedMemoryFullError(
            errno.ENOSPC,
            f"not enough shared memory: asked for {nbytes:,} bytes in {where}{free}. "
            f"Free some (`procspawn cleanup`), give the container more "
            f"(`docker run --shm-size=...`), send smaller arrays or batches, or switch "
            f"strategy (procspawn.set_sharing_strategy)",
        ) from None


__all__ = [
    "ChannelClosed",
    "FdLimitError",
    "SharedMemoryFullError",
    "raise_fd_limit",
    "reserve",
]
