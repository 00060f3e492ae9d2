"""Pointing a child's stdout and stderr at the parent's pipes (``RedirectFds``), and
doing it the moment the child unpickles it (``EarlyRedirect``): see ``_popen`` for when
each is used. Apart from ``_popen`` so that a fork-method child, which needs only this,
does not import the spawn and fork-server machinery (~5 ms of a pool's start-up).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from multiprocessing import reduction

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any


class RedirectFds:
    """Write ends of the rank's output pipes, by target descriptor (1 stdout, 2 stderr).

    Pickled (forkserver) it travels as ``DupFd``s; under fork the child inherits it.
    """

    def __init__(self, fds: dict[int, int]) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Callable[..., object], tuple[dict[int, Any]]]:
        return (_rebuild, ({target: reduction.DupFd(fd) for target, fd in self.fds.items()},))

    def apply(self) -> None:
        """In the child: point the target descriptors at the pipes."""
        for target, fd in self.fds.items():
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        self.fds = {}


def _rebuild(dup_fds: dict[int, Any]) -> RedirectFds:
    return RedirectFds({target: dup.detach() for target, dup in dup_fds.items()})


class EarlyRedirect(RedirectFds):
    """A RedirectFds applied the moment it is unpickled: put in a forkserver child's
    preparation data, it points the child's output at the pipes before the child imports
    the main module again, so what fails there reaches the parent's error message."""

    def __reduce__(self) -> tuple[Callable[..., object], tuple[dict[int, Any]]]:
        return (_apply, ({target: reduction.DupFd(fd) for target, fd in self.fds.items()},))


def _apply(dup_fds: dict[int, Any]) -> None:
    _rebuild(dup_fds).apply()
