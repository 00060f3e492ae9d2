"""A message handed to a new process at start-up, pickled once however many processes.

``multiprocessing`` pickles a Process (spawn, forkserver) while it starts the process,
with its "spawning popen" set: only then do Queues, Locks and Connections pickle, and only
then can ``DupFd`` hand a descriptor to the new process. StartupMessage carries a message
procspawn pickled earlier (once) and, in ``__reduce__``, hands over its descriptors with
``DupFd`` and its deferred objects (see ``dumps(deferred=...)``) to multiprocessing's own
reducers. Under fork nothing is pickled: the child inherits the object and the
descriptors under the same numbers.

It also carries the address of the process tree's cleanup daemon: the new process joins
its starter's tree before it maps any segment (a tree is what procspawn starts; nothing
travels in the environment, so a program started with ``subprocess`` is a tree of its own).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .. import _message
from ..daemon import _tree
from ..wire import _pickler

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any


class StartupMessage:
    """A pickled message plus the objects that only pickle at process start."""

    _NONE = object()

    def __init__(self, message: _message.Message, deferred: list[Any], value: Any = _NONE) -> None:
        self.message = message
        self.deferred = deferred
        self.tree = _tree.tree_address()
        # plain data the message was made from: a forked child that inherits this object
        # takes it as it is, without unpickling the message
        self.value = value

    def __reduce__(self) -> tuple[Callable[..., _Received], tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        fds = [DupFd(fd) for fd in self.message.fds]
        return (_rebuild, (self.message.data, fds, self.deferred, self.tree))

    def load(self) -> Any:
        """Unpickle in the child (fork: the inherited object; loads gets duplicates)."""
        _tree.adopt_tree(self.tree)
        if self.value is not StartupMessage._NONE:
            return self.value
        return _pickler.loads(
            self.message.data, [os.dup(fd) for fd in self.message.fds], self.deferred
        )

    def close(self) -> None:
        self.message.close()


class _Received:
    def __init__(self, data: bytes, fds: list[int], deferred: list[Any], tree: str) -> None:
        self.data = data
        self.fds = fds
        self.deferred = deferred
        self.tree = tree

    def load(self) -> Any:
        _tree.adopt_tree(self.tree)
        fds, self.fds = self.fds, []
        return _pickler.loads(self.data, fds, self.deferred)


def _rebuild(data: bytes, fds: list[Any], deferred: list[Any], tree: str) -> _Received:
    # Only the descriptors are taken here; the pickle is loaded by the child's own code,
    # where an error in it can be reported.
    return _Received(data, [fd.detach() for fd in fds], deferred, tree)
