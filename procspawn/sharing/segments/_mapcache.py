"""The per-process cache of mapped segments, one Segment per (strategy, key).

A receiver maps each segment once, so two handles to one segment give arrays that share
memory, as in the sender. The cache holds its Segments weakly: it never keeps a segment
alive, and once the last array over one is gone the next message for it maps it anew.
Dead entries are plain weak references without callbacks (cheaper than a
WeakValueDictionary, whose every entry carries one), replaced by the next ``remember`` of
their key and swept when the cache grows past twice its live size.
"""

from __future__ import annotations

import os
import threading
import weakref

from ._segment import Segment

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

_cache: dict[tuple[str, Any], weakref.ref[Segment]] = {}
_lock = threading.RLock()  # (a rebuild may rebuild a segment its handle names)
_SWEEP = 4096
_sweep_at = _SWEEP


def lock() -> threading.RLock:
    """Hold it around a ``cached`` / rebuild / ``remember`` sequence."""
    return _lock


def cached(strategy: str, key: Any) -> Segment | None:
    """The live Segment of this process for ``key`` (call with ``lock()`` held)."""
    ref = _cache.get((strategy, key))
    return ref() if ref is not None else None


def remember(segment: Segment) -> None:
    """Make ``segment`` the one this process uses for its key (with ``lock()`` held)."""
    global _sweep_at
    _cache[(segment.strategy, segment.key)] = weakref.ref(segment)
    if len(_cache) >= _sweep_at:
        for key in [key for key, ref in _cache.items() if ref() is None]:
            del _cache[key]
        _sweep_at = max(_SWEEP, 2 * len(_cache))


def _reset_after_fork() -> None:
    # The child took no references of its own to the parent's segments; it maps anew.
    global _cache, _lock, _sweep_at
    _cache = {}
    _lock = threading.RLock()
    _sweep_at = _SWEEP


os.register_at_fork(after_in_child=_reset_after_fork)
