"""The exceptions the pools raise besides the tasks' own, but for a broken pool's
(``_broken``)."""

from __future__ import annotations


class TaskTimeoutError(TimeoutError):
    """A pool task ran longer than the pool's ``task_timeout``: its worker was killed
    (SIGKILL) and a new one took its place; the other tasks went on.

    ``timeout`` is the limit in seconds, ``pid`` the killed worker's; the message names
    the call and its arguments (short reprs). A ``TimeoutError`` (the builtin, which is
    also ``concurrent.futures.TimeoutError``), not ``multiprocessing.TimeoutError``,
    which ``AsyncResult.get(timeout)`` raises when the caller stops waiting. Raise the
    pool's ``task_timeout``, use smaller chunks (``chunksize``), or find out why the call
    hangs.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles

    def __init__(self, msg: str, timeout: float, pid: int) -> None:
        super().__init__(msg)
        self.timeout = timeout
        self.pid = pid

    def __reduce__(self) -> tuple[type[TaskTimeoutError], tuple[str, float, int]]:
        return (type(self), (self.args[0], self.timeout, self.pid))


__all__ = ["TaskTimeoutError"]
