"""In procspawn's fork server only: the modules few children need at once are imported
while the server is idle, after it has forked its first children, not before.

The server imports its preload list before it serves anyone, so every module on it delays
a program's first children: cloudpickle alone is ~15 ms there, a third of the server's
start. A pool's worker needs cloudpickle only for something that goes by value (a
lambda, a function made under the ``__main__`` guard): the main script's functions go by
name. So a server started for a pool preloads a worker's modules only, and imports
:data:`DEFERRED` once it has served a first request and then heard nothing for
:data:`IDLE` seconds: the first workers are forked without them (one that needs a module
imports it itself), and every child forked later, worker or rank, has them.

How: this module is first on the server's preload list, and gives the stdlib's server
loop (``multiprocessing.forkserver.main``, which it runs unchanged) a selector that
imports the next deferred module whenever a wait for the next request times out. The
imports happen between two requests, in the server's only thread, so a fork never
catches one half done. Imported anywhere else, the module only sets that selector where
no server loop will ever use it.
"""

from __future__ import annotations

import importlib
import selectors
from multiprocessing import forkserver

from . import _forkserver

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

# everything either kind of child imports (_forkserver's two lists), and more
DEFERRED = list(
    dict.fromkeys(
        m
        for m in [
            *_forkserver.PRELOAD,
            *_forkserver.POOL_PRELOAD,
            "procspawn.sharing.segments._file_system",  # the fallback strategy
            "ctypes",  # a worker's parent-death signal, a recycled segment's mprotect
        ]
        if m != __name__
    )
)
IDLE = 0.03  # seconds without a request: a pool's workers are asked for back to back

_pending = list(DEFERRED)


def _import_next() -> None:
    module = _pending.pop(0)
    try:
        importlib.import_module(module)
    except Exception:  # as the server's own preload: a child imports it itself
        pass


class _IdleImportSelector(selectors.DefaultSelector):
    """The platform's selector; an endless wait first imports the deferred modules, one
    per idle spell, once a first request has been served."""

    _served = False

    def select(self, timeout: float | None = None) -> Any:
        while timeout is None and self._served and _pending:
            events = super().select(IDLE)
            if events:
                return events
            _import_next()
        events = super().select(timeout)
        if events:
            self._served = True
        return events


class _Selectors:
    """``selectors`` as the server loop sees it: the same, but for ``DefaultSelector``."""

    DefaultSelector = _IdleImportSelector

    def __getattr__(self, name: str) -> Any:
        return getattr(selectors, name)


vars(forkserver)["selectors"] = _Selectors()  # the name main() looks up when it runs
