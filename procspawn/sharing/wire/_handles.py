"""A Segment on the wire, reduced once per message and rebuilt once per message.

A handle is ``(strategy name, strategy object or None, key, the strategy's handle)``: the
name says which strategy made it, so any receiver rebuilds any handle; a strategy that is
not built in travels with the handle (pickled by reference when importable, by value
otherwise), so a child that never registered it can still rebuild it. The receiver looks
the key up in its map cache first: a segment it maps already is not mapped twice.
"""

from __future__ import annotations

import errno
import io
import pickle
from typing import Any

from .. import _message, _registry
from ..segments import _mapcache, _strategy
from ..segments._segment import Segment

Handle = tuple[str, Any, Any, Any]


def segment_handle(segment: Segment) -> Handle:
    """The wire handle of ``segment`` in the message being pickled; the strategy reduces
    a segment once per message, however many arrays lie in it."""
    memo = _message.sending().memo
    handle = memo.get((segment.strategy, segment.key))
    if handle is None:
        handle = reduce_segment(segment)
        memo[(segment.strategy, segment.key)] = handle
    return handle


def reduce_segment(segment: Segment) -> Handle:
    """The strategy's handle of ``segment`` (attaching to the message being pickled)."""
    strategy = _strategy.strategy_named(segment.strategy)
    assert strategy is not None
    travelling = None if _strategy.built_in(segment.strategy) else strategy
    return (segment.strategy, travelling, segment.key, strategy.reduce(segment))


def segment_from_handle(handle: Handle) -> Segment:
    """The Segment of this process for a received handle (rebuilt once per message)."""
    state = _message.received()
    key = (handle[0], handle[2])
    segment = state.memo.get(key)
    if segment is None:
        state.taken.add(key)
        segment = rebuild_segment(handle)
        state.memo[key] = segment
    return segment


def rebuild_segment(handle: Handle) -> Segment:
    """Map the segment a handle names, or take the one this process maps already."""
    name, travelling, key, strategy_handle = handle
    strategy = _strategy.strategy_named(name)
    if strategy is None:
        if travelling is None:
            raise ValueError(f"received a handle of unknown sharing strategy {name!r}")
        _strategy.register_strategy(name, travelling)
        strategy = travelling
    with _mapcache.lock():
        segment = _mapcache.cached(name, key)
        if segment is not None:
            strategy.adopt_cached(strategy_handle, segment)
            return segment
        segment = strategy.rebuild(strategy_handle)
        _mapcache.remember(segment)
        return segment


def discard_handle(handle: Handle) -> None:
    """A message carrying ``handle`` will never be unpickled: its strategy gives back what
    the handle held for the receiver (one registered here, or built in; a strategy no
    one registered here was never used here)."""
    name, _travelling, _key, strategy_handle = handle
    strategy = _strategy.strategy_named(name) if isinstance(name, str) else None
    if strategy is not None:
        strategy.discard(strategy_handle)


# -- a message that will never be unpickled -------------------------------------------------
#
# A file_system segment counts every message that carries it, for the receiver to take
# over. A message whose descriptors the kernel dropped (its receiver at its RLIMIT_NOFILE),
# or whose unpickling failed halfway, is never received: ``give_back`` reads its pickle
# with an unpickler that runs none of it (every global it names is an inert stand-in)
# but for the two rebuild functions that take a segment handle, whose strategies give
# back what the handles held.

# the functions a message calls with a segment handle as their first argument
_TAKES_A_HANDLE = {
    ("procspawn.sharing.wire._handles", "segment_from_handle"),
    ("procspawn.sharing.wire._reductions", "_rebuild_ndarray"),
}


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


class _InertType(type):
    """The stand-ins are types (an instance is rebuilt from a class the pickle made, say
    by cloudpickle), and calling one, or anything it made, gives the stand-in again."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls

    def __setitem__(cls, key: Any, value: Any) -> None:
        pass


class _Inert(metaclass=_InertType):
    """Every global of the pickle, what every call in it returns, and what its NEWOBJs
    make: takes any arguments, state and items, and does nothing with them."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    __setstate__ = staticmethod(_ignore)
    __setitem__ = staticmethod(_ignore)
    append = staticmethod(_ignore)
    extend = staticmethod(_ignore)
    add = staticmethod(_ignore)


class _Discarding(pickle.Unpickler):
    def __init__(self, data: bytes, done: set[Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._done = done

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TAKES_A_HANDLE:
            return self._discard
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return _Inert

    def _discard(self, handle: Any, *rest: Any) -> Any:
        if isinstance(handle, tuple) and len(handle) == 4:
            key = (handle[0], handle[2])
            if key not in self._done:
                discard_handle(handle)
                self._done.add(key)  # (after: one that raised is tried again)
        return _Inert


def give_back(data: bytes, done: set[Any]) -> None:
    """Give back what the segments in the pickle ``data`` counted for this receiver.

    Args:
        data: a message's pickle bytes, made by ``dumps``.
        done: the ``(strategy, key)`` of its segments already taken over (their rebuild
            started) or given back; those given back now are added.

    Raises:
        OSError: EMFILE or ENFILE, out of descriptors (to import a strategy's module):
            call again later with the same ``done``.
    """
    if not any(name.encode() in data for _, name in _TAKES_A_HANDLE):
        return  # no segment in it (global names are in a pickle's bytes as they are)
    try:
        _Discarding(data, done).load()
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
    except Exception:  # noqa: BLE001,S110 -- what the stand-ins cannot walk keeps its counts
        pass


def _reduce(segment: Segment) -> Any:
    return (segment_from_handle, (segment_handle(segment),))


_registry.register(Segment, _reduce)
