"""A Segment on the wire, reduced once per message and rebuilt once per message.

A handle is ``(strategy name, strategy object or None, key, the strategy's handle)``: the
name says which strategy made it, so any receiver rebuilds any handle; a strategy that is
not built in travels with the handle (pickled by reference when importable, by value
otherwise), so a child that never registered it can still rebuild it. The receiver looks
the key up in its map cache first: a segment it maps already is not mapped twice.
"""

from __future__ import annotations

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
    travelling = None if segment.strategy in _strategy.BUILTIN else strategy
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
    the handle held for the receiver (a strategy that is not built in travels by value:
    its stand-in cannot say, and nothing of procspawn's is held for it)."""
    name, _travelling, _key, strategy_handle = handle
    strategy = _strategy.strategy_named(name) if name in _strategy.BUILTIN else None
    if strategy is not None:
        strategy.discard(strategy_handle)


def _reduce(segment: Segment) -> Any:
    return (segment_from_handle, (segment_handle(segment),))


_registry.register(Segment, _reduce)
