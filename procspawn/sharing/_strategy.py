"""The sharing-strategy interface and the registry of strategies.

A handle on the wire is ``(strategy name, strategy object or None, key, handle)``: the
name says which strategy made it, so any receiver rebuilds any handle; a strategy that is
not built in travels with the handle (pickled by reference when importable, by value
otherwise), so a child that never registered it can still rebuild it.
"""

from __future__ import annotations

import importlib
import os
import secrets
import sys
import threading
from typing import Any

from . import _pickler
from ._segment import Segment, cache_lock, cached, remember

_ENV = "PROCSPAWN_SHARING_STRATEGY"


class SharingStrategy:
    """How shared segments are made and moved between processes.

    Subclass it and register an instance with ``procspawn.sharing.register_strategy``.
    A strategy implements three operations:

    * ``allocate(nbytes)`` makes a new Segment of ``nbytes`` usable bytes in this process
      (``Segment.map(fd, nbytes, strategy=self.name, key=...)`` maps a descriptor);
    * ``reduce(segment)`` turns a Segment into a picklable handle while a message is being
      pickled (``sharing.attach_fd(fd)`` sends a descriptor along with the message);
    * ``rebuild(handle)`` maps the segment a handle names, in the receiving process, and
      returns a new Segment (``sharing.received_fd(index)`` gives a sent descriptor).

    ``key`` identifies a segment across processes: a receiver maps each key once.

    ``adopt_cached(handle, segment)`` is called instead of ``rebuild`` when this process
    already maps the segment; it releases whatever the handle carried.
    """

    #: set by register_strategy
    name: str = ""

    def allocate(self, nbytes: int) -> Segment:
        raise NotImplementedError

    def reduce(self, segment: Segment) -> Any:
        raise NotImplementedError

    def rebuild(self, handle: Any) -> Segment:
        raise NotImplementedError

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        """A handle arrived for a segment this process already maps; default: nothing."""


_strategies: dict[str, SharingStrategy] = {}
_lock = threading.Lock()
_current: str | None = None

MANAGER_ENV = "PROCSPAWN_MANAGER"  # the cleanup daemon's address, for a tree's processes

# Built-in strategies are imported when first used, so a process that never shares an array
# (a rank returning a number) pays nothing for them.
_BUILTIN: dict[str, tuple[str, str]] = {"file_system": ("._file_system", "FileSystemStrategy")}
if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
    _BUILTIN["file_descriptor"] = ("._file_descriptor", "FileDescriptorStrategy")


def register_strategy(name: str, strategy: SharingStrategy) -> None:
    """Make ``strategy`` available under ``name`` (for ``set_sharing_strategy``).

    Raises:
        TypeError: ``strategy`` is not a SharingStrategy.
        ValueError: ``name`` is empty, not a string, or the name of a built-in strategy.
    """
    if not isinstance(strategy, SharingStrategy):
        raise TypeError(
            f"a sharing strategy must be a procspawn.sharing.SharingStrategy instance, "
            f"got {type(strategy).__name__}"
        )
    if not isinstance(name, str) or not name:
        raise ValueError(f"a sharing strategy needs a non-empty string name, got {name!r}")
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in sharing strategy; pick another name")
    strategy.name = name
    with _lock:
        _strategies[name] = strategy


def strategy_named(name: str) -> SharingStrategy | None:
    """The strategy object registered as ``name`` (built-ins are made on first use)."""
    strategy = _strategies.get(name)
    if strategy is None and name in _BUILTIN:
        module_name, class_name = _BUILTIN[name]
        cls = getattr(importlib.import_module(module_name, __package__), class_name)
        with _lock:
            strategy = _strategies.get(name)
            if strategy is None:
                strategy = cls()
                strategy.name = name
                _strategies[name] = strategy
    return strategy


def get_all_sharing_strategies() -> set[str]:
    """The names of every strategy this process can use."""
    return set(_strategies) | set(_BUILTIN)


def _default() -> str:
    name = os.environ.get(_ENV)
    if name:
        if name not in get_all_sharing_strategies():
            raise ValueError(
                f"{_ENV}={name!r} is not a sharing strategy; valid: "
                f"{', '.join(sorted(get_all_sharing_strategies()))}"
            )
        return name
    return "file_descriptor" if "file_descriptor" in _BUILTIN else "file_system"


def get_sharing_strategy() -> str:
    """The name of the strategy new shared segments are made with.

    The default is ``file_descriptor`` on Linux and ``file_system`` elsewhere; the
    environment variable ``PROCSPAWN_SHARING_STRATEGY`` overrides it.
    """
    global _current
    if _current is None:
        _current = _default()
    return _current


def set_sharing_strategy(name: str) -> None:
    """Make new shared segments with strategy ``name``; ranks started later inherit it.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names);
            nothing is changed.
    """
    global _current
    valid = get_all_sharing_strategies()
    if name not in valid:
        raise ValueError(f"unknown sharing strategy {name!r}; valid: {', '.join(sorted(valid))}")
    _current = name


def tree_address() -> str:
    """The address of this process tree's cleanup daemon: inherited from the parent, or
    chosen here for this process and its children (no daemon starts until one is needed)."""
    address = os.environ.get(MANAGER_ENV)
    if not address:
        address = f"procspawn-{os.getuid()}-{secrets.token_hex(8)}"
        os.environ[MANAGER_ENV] = address
    return address


def snapshot() -> dict[str, Any]:
    """What a child needs of this process' sharing settings, whatever the start method:
    the strategy (a custom one travels along) and the tree's cleanup-daemon address (a
    forkserver child would not inherit it through the environment)."""
    name = get_sharing_strategy()
    if name == "file_system":
        # A parent that shares this way stays a client of the tree's daemon while its
        # children run, so what they leave in flight outlives them.
        from . import _manager

        _manager.ensure()
    return {
        "strategy": name,
        "custom": None if name in _BUILTIN else _strategies[name],
        "manager": tree_address(),
    }


def restore(settings: dict[str, Any]) -> None:
    """Adopt a parent's ``snapshot()`` in a child."""
    if settings["manager"]:
        os.environ[MANAGER_ENV] = settings["manager"]
    name, strategy = settings["strategy"], settings["custom"]
    if strategy is not None and name not in _strategies:
        register_strategy(name, strategy)
    set_sharing_strategy(name)


def current() -> SharingStrategy:
    """The strategy object new segments are made with."""
    strategy = strategy_named(get_sharing_strategy())
    assert strategy is not None
    return strategy


def allocate(nbytes: int) -> Segment:
    """A new Segment of ``nbytes`` from the current strategy, known to this process' cache."""
    segment = current().allocate(nbytes)
    with cache_lock():
        remember(segment)
    return segment


# -- segments on the wire ------------------------------------------------------------------


def segment_handle(segment: Segment) -> tuple[str, Any, Any, Any]:
    """The wire handle of ``segment`` in the message being pickled:
    ``(strategy name, strategy object if not built in, key, the strategy's handle)``.
    The strategy reduces a segment once per message, however many arrays lie in it."""
    memo = _pickler.sending().memo
    handle = memo.get((segment.strategy, segment.key))
    if handle is None:
        strategy = _strategies[segment.strategy]
        travelling = None if segment.strategy in _BUILTIN else strategy
        handle = (segment.strategy, travelling, segment.key, strategy.reduce(segment))
        memo[(segment.strategy, segment.key)] = handle
    return handle


def segment_from_handle(handle: tuple[str, Any, Any, Any]) -> Segment:
    """The Segment of this process for a received handle (rebuilt once per message)."""
    memo = _pickler.received().memo
    segment = memo.get((handle[0], handle[2]))
    if segment is None:
        segment = _rebuild_segment(*handle)
        memo[(handle[0], handle[2])] = segment
    return segment


def _reduce_segment(segment: Segment) -> Any:
    return (segment_from_handle, (segment_handle(segment),))


def _rebuild_segment(name: str, travelling: Any, key: Any, handle: Any) -> Segment:
    strategy = strategy_named(name)
    if strategy is None:
        if travelling is None:
            raise ValueError(f"received a handle of unknown sharing strategy {name!r}")
        register_strategy(name, travelling)
        strategy = travelling
    with cache_lock():
        segment = cached(name, key)
        if segment is not None:
            strategy.adopt_cached(handle, segment)
            return segment
        segment = strategy.rebuild(handle)
        remember(segment)
        return segment


_pickler.register(Segment, _reduce_segment)
