"""A message handed to a new process at start-up, pickled once however many processes.

``multiprocessing`` pickles a Process (spawn, forkserver) while it starts the process,
with its "spawning popen" set: only then do Queues, Locks and Connections pickle, and only
then can ``DupFd`` hand a descriptor to the new process. StartupMessage carries a message
procspawn pickled earlier (once) and, in ``__reduce__``, hands over its descriptors with
``DupFd`` and its deferred objects (see ``dumps(deferred=...)``) to multiprocessing's own
reducers. Under fork nothing is pickled: the child inherits the object and the
descriptors under the same numbers.
"""

from __future__ import annotations

import os
from typing import Any

from . import _pickler


class StartupMessage:
    """A pickled message plus the objects that only pickle at process start."""

    def __init__(self, message: _pickler.Message, deferred: list[Any]) -> None:
        self.message = message
        self.deferred = deferred

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        fds = [DupFd(fd) for fd in self.message.fds]
        return (_rebuild, (self.message.data, fds, self.deferred))

    def load(self) -> Any:
        """Unpickle in the child (fork: the inherited object; loads gets duplicates)."""
        return _pickler.loads(
            self.message.data, [os.dup(fd) for fd in self.message.fds], self.deferred
        )

    def close(self) -> None:
        self.message.close()


class _Received:
    def __init__(self, data: bytes, fds: list[int], deferred: list[Any]) -> None:
        self.data = data
        self.fds = fds
        self.deferred = deferred

    def load(self) -> Any:
        fds, self.fds = self.fds, []
        return _pickler.loads(self.data, fds, self.deferred)


def _rebuild(data: bytes, fds: list[Any], deferred: list[Any]) -> _Received:
    # Only the descriptors are taken here; the pickle is loaded by the child's own code,
    # where an error in it can be reported.
    return _Received(data, [fd.detach() for fd in fds], deferred)
