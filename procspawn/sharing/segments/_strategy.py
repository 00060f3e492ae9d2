"""The sharing-strategy interface, the registry of strategies, the current one.

Built-in strategies are data (``BUILTIN``: name -> module, class), imported when first
used, so a process that never shares an array pays nothing for them.
"""

from __future__ import annotations

import errno
import os
import resource
import sys
import threading
import warnings

from ... import _log, _settings
from ..._late import late_import, renew_lock_in_child
from .. import _registry
from .._errors import FdLimitError, SharedMemoryFullError
from . import _mapcache, _recycled
from ._segment import Segment

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

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
    already maps the segment; it releases whatever the handle carried beyond the
    message's descriptors (those are closed for it).

    Whatever a strategy does, it keeps the lifetime rule of ``procspawn.sharing``: a
    segment lives while an array over it or a message carrying it does, no longer.

    A handle is whatever the strategy picks (it must pickle), so ``rebuild`` and
    ``adopt_cached`` take it as ``Any``: a subclass names its own handle type there.

    Example::

        import os

        from procspawn import sharing

        class Memfd(sharing.SharingStrategy):
            def allocate(self, nbytes):
                fd = os.memfd_create("mine", os.MFD_CLOEXEC)
                os.ftruncate(fd, max(nbytes, 1))
                st = os.fstat(fd)
                return sharing.Segment.map(
                    fd, nbytes, strategy=self.name, key=(st.st_dev, st.st_ino), keep_fd=True
                )

            def reduce(self, segment):
                return (sharing.attach_fd(segment.fd, segment), segment.size)

            def rebuild(self, handle):
                index, size = handle
                fd = os.dup(sharing.received_fd(index))
                st = os.fstat(fd)
                return sharing.Segment.map(
                    fd, size, strategy=self.name, key=(st.st_dev, st.st_ino), keep_fd=True
                )

        sharing.register_strategy("memfd", Memfd())
        sharing.set_sharing_strategy("memfd")
        assert sharing.is_shared(sharing.zeros(1 << 20))
    """

    #: set by register_strategy
    name: str = ""

    def allocate(self, nbytes: int) -> Segment:
        """Make a new segment in this process (its bytes zero).

        Args:
            nbytes: how many usable bytes it needs.

        Returns:
            The new Segment (``Segment.map`` makes one from a descriptor).
        """
        raise NotImplementedError

    def allocate_for_copy(self, nbytes: int) -> Segment:
        """A segment that a send fills at once with a copy (its old bytes need not be
        zero, so the strategy may reuse one); by default ``allocate``.

        Args:
            nbytes: how many usable bytes it needs.

        Returns:
            The Segment.
        """
        return self.allocate(nbytes)

    def open_file(self, segment: Segment) -> int:
        """A new descriptor of ``segment``'s memory, open for writing, for a copy into a
        new segment that writes the file (``pwrite``) instead of going through the
        mapping; -1 (the default) when there is none. Not asked of a segment that keeps a
        descriptor (``segment.fd``): that one is written.

        Args:
            segment: a segment this strategy made in this process.

        Returns:
            A descriptor the caller closes, or -1.
        """
        return -1

    def reduce(self, segment: Segment) -> object:
        """Turn a Segment into a picklable handle, while a message is being pickled.

        Args:
            segment: a segment this strategy made (or rebuilt) in this process.

        Returns:
            The handle ``rebuild`` takes in the receiver (``sharing.attach_fd`` sends a
            descriptor along with the message; put its index in the handle).
        """
        raise NotImplementedError

    def rebuild(self, handle: Any) -> Segment:
        """Map the segment a handle names, in the process that received it.

        Args:
            handle: what ``reduce`` returned in the sender (``sharing.received_fd``
                gives a descriptor sent with it).

        Returns:
            A new Segment over the same memory.
        """
        raise NotImplementedError

    def adopt_cached(self, handle: Any, segment: Segment) -> None:
        """A handle arrived for a segment this process already maps; default: nothing.

        Args:
            handle: what ``reduce`` returned in the sender.
            segment: the Segment this process maps already (it is used instead of a
                new one); release here what the handle carried beyond the message's
                descriptors (those are closed for it).
        """

    def discard(self, handle: Any) -> None:
        """A message carrying this handle will never be unpickled (its receiver could not
        take its descriptors, or unpickling it failed first); default: nothing.

        Args:
            handle: what ``reduce`` returned in the sender; give back here what it
                carried for its receiver beyond the message's descriptors (those are
                closed for it), or no one would.
        """


_strategies: dict[str, SharingStrategy] = {}
_lock = threading.Lock()

renew_lock_in_child(globals())
_current: str | None = None
_explicit = False  # chosen by the user (set_sharing_strategy or the environment)
_fell_back = False  # warned once
_short = False  # the last memfd came near the descriptor limit

BUILTIN: dict[str, tuple[str, str]] = {"file_system": ("._file_system", "FileSystemStrategy")}
if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
    BUILTIN["file_descriptor"] = ("._file_descriptor", "FileDescriptorStrategy")
# Strategies for device memory: the arrays' own plug-in picks them (never the default, nor
# set_sharing_strategy's choice: a NumPy array has no device memory to put there)
DEVICE: dict[str, tuple[str, str]] = {
    "cuda_fd": ("..cuda._fd", "CudaFdStrategy"),
    "cuda_ipc": ("..cuda._ipc", "CudaIpcStrategy"),
}


def built_in(name: str) -> bool:
    """Whether strategy ``name`` is procspawn's own (it need not travel with handles)."""
    return name in BUILTIN or name in DEVICE


def register_strategy(name: str, strategy: SharingStrategy) -> None:
    """Make ``strategy`` available under ``name`` (for ``set_sharing_strategy``).

    A strategy registered again under its name replaces the earlier one. Children get
    it with the segments it made (it travels with their handles).

    Args:
        name: the name ``set_sharing_strategy`` takes.
        strategy: an instance of a ``SharingStrategy`` subclass; its ``name`` is set.

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
    if built_in(name):
        raise ValueError(f"{name!r} is a built-in sharing strategy; pick another name")
    strategy.name = name
    with _lock:
        _strategies[name] = strategy


def strategy_named(name: str) -> SharingStrategy | None:
    """The strategy object registered as ``name`` (built-ins are made on first use)."""
    strategy = _strategies.get(name)
    if strategy is None and built_in(name):
        module_name, class_name = BUILTIN.get(name) or DEVICE[name]
        cls = getattr(late_import(module_name, __package__), class_name)  # (see _late)
        with _lock:
            strategy = _strategies.get(name)
            if strategy is None:
                strategy = cls()
                strategy.name = name
                _strategies[name] = strategy
    return strategy


def get_all_sharing_strategies() -> set[str]:
    """The names of every strategy this process can use.

    Returns:
        The built-in ones (``file_descriptor`` on Linux, ``file_system``) and those
        registered with ``procspawn.sharing.register_strategy``.
    """
    return set(_strategies) | set(BUILTIN)


def _default() -> str:
    name: str | None = _settings.get(_ENV)
    if name:
        if name not in get_all_sharing_strategies():
            raise _settings.SettingError(
                f"{_ENV}={name!r} is not a sharing strategy; valid: "
                f"{', '.join(sorted(get_all_sharing_strategies()))}"
            )
        return name
    return "file_descriptor" if "file_descriptor" in BUILTIN else "file_system"


def get_sharing_strategy() -> str:
    """The name of the strategy new shared segments are made with.

    The default is ``file_descriptor`` on Linux and ``file_system`` elsewhere; the
    environment variable ``PROCSPAWN_SHARING_STRATEGY`` overrides it, and
    ``set_sharing_strategy`` overrides both.

    Returns:
        The strategy's name.

    Raises:
        ValueError: ``PROCSPAWN_SHARING_STRATEGY`` names no strategy (read the first time
            it is needed).
    """
    global _current
    if _current is None:
        _current = _default()
    return _current


def set_sharing_strategy(name: str) -> None:
    """Make new shared segments with strategy ``name``; ranks started later inherit it.

    ``file_descriptor`` (the default on Linux): anonymous memory, one file descriptor per
    live segment in each process that holds it; nothing can leak. ``file_system``: named
    segments in /dev/shm, no descriptor per array (for programs that hold very many
    arrays), cleaned up by a daemon if a process dies. Arrays made earlier keep theirs;
    the choice also ends the default strategy's fallback to ``file_system`` when a process
    runs short of descriptors (running out is then an ``FdLimitError``).

    Args:
        name: one of ``get_all_sharing_strategies()``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names);
            nothing is changed.

    Example::

        import procspawn

        procspawn.set_sharing_strategy("file_system")
        assert procspawn.get_sharing_strategy() == "file_system"
    """
    global _current, _explicit
    valid = get_all_sharing_strategies()
    if name not in valid:
        raise ValueError(f"unknown sharing strategy {name!r}; valid: {', '.join(sorted(valid))}")
    _current = name
    _explicit = True


def snapshot() -> dict[str, Any]:
    """What a child needs of this process' sharing settings, whatever the start method:
    the strategy's name, and the strategy itself when it is not built in."""
    name = get_sharing_strategy()
    return {
        "strategy": name,
        "custom": None if name in BUILTIN else _strategies[name],
        "explicit": _explicit or _settings.get(_ENV) is not None,
    }


def restore(settings: dict[str, Any]) -> None:
    """Adopt a parent's ``snapshot()`` in a child."""
    global _explicit
    name, strategy = settings["strategy"], settings["custom"]
    if strategy is not None and name not in _strategies:
        register_strategy(name, strategy)
    set_sharing_strategy(name)
    _explicit = settings.get("explicit", True)


def current() -> SharingStrategy:
    """The strategy object new segments are made with."""
    strategy = strategy_named(get_sharing_strategy())
    assert strategy is not None
    return strategy


def open_file(segment: Segment) -> int:
    """A new descriptor to write ``segment``'s memory through, from the strategy that made
    it, or -1."""
    strategy = strategy_named(segment.strategy)
    return strategy.open_file(segment) if strategy is not None else -1


def allocate(nbytes: int, for_copy: bool = False) -> Segment:
    """A new Segment of ``nbytes`` from the current strategy, known to this process' cache.

    ``for_copy``: a send is about to fill all of it (the strategy may reuse a segment).
    Short of shared memory or of descriptors, the recycled segments are given back and it
    is tried again; then, under the default strategy, a process short of descriptors
    makes its segments under ``file_system`` (see ``_fall_back``).
    """
    _registry.load_plugins()  # its arrays may go through any channel, the stdlib's too
    global _short
    strategy = current()
    may_fall_back = strategy.name == "file_descriptor" and not (
        _explicit or _settings.get(_ENV) is not None
    )
    fell_back = may_fall_back and _short and _fds_short()
    if fell_back:
        segment = _fall_back(nbytes, for_copy)
    else:
        try:
            segment = _make(strategy, nbytes, for_copy)
        except FdLimitError:
            if not may_fall_back:
                raise
            segment, fell_back = _fall_back(nbytes, for_copy), True
    _short = may_fall_back and (fell_back or segment.fd >= _reserve_mark())
    _log.debug("allocated %r", segment)
    with _mapcache.lock():
        _mapcache.remember(segment)
    return segment


def _make(strategy: SharingStrategy, nbytes: int, for_copy: bool) -> Segment:
    """``strategy``'s new segment; out of memory or descriptors, once more after the
    recycled-segment cache gave back what it keeps (memory, and a descriptor per memfd)."""
    make = strategy.allocate_for_copy if for_copy else strategy.allocate
    try:
        return make(nbytes)
    except OSError as exc:
        short = isinstance(exc, (SharedMemoryFullError, FdLimitError)) or exc.errno in (
            errno.ENOMEM,
            errno.EMFILE,
            errno.ENFILE,
        )
        if not short or not _recycled.trim():
            raise
    return make(nbytes)


def _reserve_mark() -> int:
    """The descriptor number from which the default strategy counts as short of them: a
    sixteenth of the soft limit (at least 32) stays free for everything else, the
    fallback's own needs included (the daemon's socket, opening a segment)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 62
    return soft - max(32, soft // 16)


def _fds_short() -> bool:
    """Still short? Descriptors are numbered lowest free first: a new one tells."""
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return fd >= _reserve_mark()


def _fall_back(nbytes: int, for_copy: bool) -> Segment:
    """This process is out of descriptors under the default strategy: make the segment
    under ``file_system`` instead (its arrays hold none), and say so once."""
    global _fell_back
    if not _fell_back:
        _fell_back = True
        warnings.warn(
            "procspawn: this process is running out of file descriptors for new shared "
            "segments (each large array under the default 'file_descriptor' strategy holds "
            "one), so while it is short of them "
            "new segments are made under 'file_system', whose arrays hold none. To choose "
            "yourself: raise `ulimit -n`, or call procspawn.set_sharing_strategy(...) "
            "(then running out is an error, FdLimitError).",
            RuntimeWarning,
            stacklevel=4,
        )
    fallback = strategy_named("file_system")
    assert fallback is not None
    return _make(fallback, nbytes, for_copy)
