"""The one pickler every procspawn message goes through.

``dumps(obj)`` gives a :class:`Message`: the pickle bytes, the file descriptors its shared
segments travel with (SCM_RIGHTS, or ``DupFd`` at process start) and the objects that must
stay alive until the message is delivered. ``loads(data, fds)`` rebuilds the object.

Code (lambdas, closures, functions defined in ``__main__``) is pickled by value by
cloudpickle. On top of it sits a reducer registry like ``ForkingPickler``'s: a dispatch
table consulted before ``copyreg``'s, holding procspawn's reducers (``register``) and the
ones ``multiprocessing`` registered for its own objects (connections, sockets), so
Queues and Locks passed at process start pickle as they do for ``Process(args=...)``.
Neither the stdlib's pickler nor ``copyreg`` is changed.

Reducers that attach descriptors or keep segments alive find the message being built
with :func:`sending`; rebuild functions find the received descriptors with
:func:`receiving`. Both are per thread.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import sys
import threading
from collections import ChainMap
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

_reducers: dict[type, Callable[[Any], Any]] = {}
_local = threading.local()


def register(type_: type, reducer: Callable[[Any], Any]) -> None:
    """Make procspawn pickle every exact instance of ``type_`` with ``reducer(obj)``."""
    global _plain_types_overridden, _reducers_version
    _reducers[type_] = reducer
    _PlainPickler.dispatch_table = _dispatch()
    _reducers_version += 1  # a Pickler reads its dispatch table when it is made
    plain_types = (*_PLAIN_LEAVES, *_PLAIN_CONTAINERS, dict)
    _plain_types_overridden = any(t in _reducers for t in plain_types)


class Message:
    """One pickled object ready to send: bytes, descriptors, and what must stay alive.

    The descriptors are borrowed from the objects in ``keepalive`` (segments, connections),
    which the message holds until ``close()``: no descriptor is duplicated to send it.
    """

    __slots__ = ("data", "fds", "keepalive", "inflight", "on_abandon")

    def __init__(
        self,
        data: bytes,
        fds: list[int],
        keepalive: list[Any],
        inflight: bool,
        on_abandon: list[Callable[[], Any]] | None = None,
    ):
        self.data = data
        self.fds = fds
        self.keepalive = keepalive
        self.inflight = inflight
        self.on_abandon = on_abandon or []

    def close(self) -> None:
        """Let go of what the message kept alive (after it was sent or handed over)."""
        self.fds = []
        self.keepalive = []
        self.on_abandon = []

    def abandon(self) -> None:
        """The message will never be received: give back what it holds for its receiver
        (the in-flight references of file_system segments), then close it."""
        callbacks, self.on_abandon = self.on_abandon, []
        for callback in callbacks:
            callback()
        self.close()


class _SendState:
    __slots__ = ("fds", "fd_index", "keepalive", "inflight", "on_abandon", "memo")

    def __init__(self, inflight: bool) -> None:
        self.fds: list[int] = []
        self.fd_index: dict[int, int] = {}
        self.keepalive: list[Any] = []
        self.inflight = inflight
        self.on_abandon: list[Callable[[], Any]] = []  # undo what reducers took
        # for reducers: what they made once per message (a segment's handle)
        self.memo: dict[Any, Any] = {}

    def add_fd(self, fd: int, owner: Any) -> int:
        """Send ``fd`` (once per message) with the message; ``owner`` keeps it open until
        the message is closed. Returns its index for the receiver."""
        index = self.fd_index.get(fd)
        if index is None:
            index = len(self.fds)
            self.fds.append(fd)
            self.fd_index[fd] = index
            self.keepalive.append(owner)
        return index


def sending() -> _SendState:
    """The message being pickled on this thread (only valid inside a reducer)."""
    state = getattr(_local, "send", None)
    if state is None:
        raise RuntimeError("procspawn reducer called outside procspawn.sharing dumps()")
    return state


def attach_fd(fd: int, owner: Any) -> int:
    """For a strategy's ``reduce``: send ``fd`` with the message being pickled, ``owner``
    (the segment) keeping it open meanwhile; returns the index ``received_fd`` takes."""
    return sending().add_fd(fd, owner)


def received_fd(index: int) -> int:
    """For a strategy's ``rebuild``: descriptor ``index`` of the message being unpickled
    (borrowed: it is closed after unpickling, so ``os.dup`` it to keep it)."""
    return receiving()[index]


class _RecvState:
    __slots__ = ("fds", "memo")

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.memo: dict[Any, Any] = {}  # for rebuilders: what they made once per message


def received() -> _RecvState:
    """The message being unpickled on this thread (only valid inside a rebuild function)."""
    state = getattr(_local, "recv", None)
    if state is None:
        raise RuntimeError(
            "a procspawn shared-memory handle can only be unpickled by procspawn's "
            "loads() (it was pickled by procspawn and read back by another unpickler)"
        )
    return state


def take_fd(index: int) -> int:
    """Descriptor ``index`` of the message being unpickled, now owned by the caller
    (``loads`` will not close it)."""
    fds = received().fds
    fd = fds[index]
    if fd < 0:
        raise RuntimeError(f"descriptor {index} of this message was already taken")
    fds[index] = -1
    return fd


def receiving() -> list[int]:
    """The descriptors of the message being unpickled on this thread (borrowed: ``loads``
    closes them all afterwards, so a rebuilder that keeps one must ``os.dup`` it)."""
    return received().fds


def _dispatch() -> dict[type, Callable[[Any], Any]]:
    """copyreg's reducers with procspawn's in front, as one plain dict (fast C lookups)."""
    return {**copyreg.dispatch_table, **_reducers}


class _PlainPickler(pickle.Pickler):
    """The C pickler with procspawn's reducers: for messages of plain data and arrays."""

    dispatch_table = _dispatch()


_reducers_version = 0


def _plain_dumps(obj: Any) -> bytes:
    """``obj`` pickled by this thread's _PlainPickler, made once and reused (making one
    costs more than pickling a handle)."""
    cached = getattr(_local, "plain", None)
    if cached is None or cached[2] != _reducers_version:
        buf = io.BytesIO()
        cached = (_PlainPickler(buf, pickle.HIGHEST_PROTOCOL), buf, _reducers_version)
    pickler, buf, _ = cached
    _local.plain = None  # in use: a dumps nested in a reducer makes its own
    pickler.dump(obj)
    data = buf.getvalue()
    pickler.clear_memo()
    buf.seek(0)
    buf.truncate()
    _local.plain = cached  # not reused after an error: back only when all went well
    return data


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray)
_PLAIN_CONTAINERS = (tuple, list, set, frozenset)
_PLAIN_LIMIT = 10_000
_plain_types_overridden = False


_NOT_PLAIN, _PLAIN, _PLAIN_WITH_ARRAYS = 0, 1, 2


def _is_plain(obj: Any) -> int:
    """Plain data (numbers, strings, bytes, NumPy arrays of those, in tuples, lists, sets
    and dicts) is what the C pickler moves as well as cloudpickle, only faster, and
    without importing cloudpickle in a process that sends nothing else. Returns
    ``_NOT_PLAIN``, ``_PLAIN`` (no array: stdlib pickle as it is) or
    ``_PLAIN_WITH_ARRAYS`` (needs procspawn's reducers)."""
    np = sys.modules.get("numpy")
    stack = [obj]
    seen = 0
    kind = _PLAIN
    while stack:
        item = stack.pop()
        seen += 1
        if seen > _PLAIN_LIMIT:
            return _NOT_PLAIN
        t = type(item)
        if t in _PLAIN_LEAVES:
            continue
        if t in _PLAIN_CONTAINERS:
            stack.extend(item)
        elif t is dict:
            stack.extend(item.keys())
            stack.extend(item.values())
        elif np is not None and t is np.ndarray:
            if item.dtype.hasobject:
                return _NOT_PLAIN
            kind = _PLAIN_WITH_ARRAYS
        elif np is not None and isinstance(item, np.generic):
            if item.dtype.hasobject:
                return _NOT_PLAIN
        else:
            return _NOT_PLAIN
    if _plain_types_overridden:
        return _PLAIN_WITH_ARRAYS  # a reducer registered for a plain type must run
    return kind


_cloud: tuple[type, type] | None = None


def _cloud_picklers() -> tuple[type, type]:
    """(Pickler, DeferringPickler) on top of cloudpickle, made on first use."""
    global _cloud
    if _cloud is None:
        import cloudpickle

        class Pickler(cloudpickle.Pickler):
            """cloudpickle with procspawn's and multiprocessing's reducers in front of
            copyreg's."""

            dispatch_table = ChainMap(
                _reducers,
                ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
                getattr(cloudpickle.Pickler, "dispatch_table", copyreg.dispatch_table),
            )

            def __init__(self, file: io.BytesIO) -> None:
                super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

        class DeferringPickler(Pickler):
            """Leaves objects that only pickle while a process starts (multiprocessing's
            "should only be shared between processes through inheritance") out of the
            pickle, as persistent ids into a side list the start-up machinery hands over."""

            def __init__(self, file: io.BytesIO, deferred: list[Any]) -> None:
                super().__init__(file)
                self._deferred = deferred
                self._deferred_types = _deferred_types()

            def persistent_id(self, obj: Any) -> int | None:  # type: ignore[override]
                if isinstance(obj, self._deferred_types) or (
                    type(obj) in ForkingPickler._extra_reducers  # type: ignore[attr-defined]
                    and type(obj).__module__ == "multiprocessing.sharedctypes"
                ):
                    self._deferred.append(obj)
                    return len(self._deferred) - 1
                return None

        _cloud = (Pickler, DeferringPickler)
    return _cloud


def _deferred_types() -> tuple[type, ...]:
    import multiprocessing.connection as connection
    import multiprocessing.heap as heap
    import multiprocessing.queues as queues
    import multiprocessing.sharedctypes as sharedctypes
    import multiprocessing.synchronize as synchronize
    import socket

    return (
        socket.socket,
        connection.Connection,
        synchronize.SemLock,
        synchronize.Condition,
        synchronize.Event,
        queues.Queue,
        queues.SimpleQueue,
        sharedctypes.SynchronizedBase,
        heap.BufferWrapper,
        *_extra_deferred,
    )


# Types whose instances are handed over at process start, not in the pickle; the sharing
# package adds its own channel types here.
_extra_deferred: list[type] = []


class _DeferredUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, deferred: list[Any]) -> None:
        super().__init__(file)
        self._deferred = deferred

    def persistent_load(self, pid: Any) -> Any:
        return self._deferred[pid]


_numpy_ready = False


def _register_numpy() -> None:
    # Arrays exist only once NumPy is imported: register their reducer then, so a process
    # that never uses NumPy never imports it.
    global _numpy_ready
    from . import _reductions  # noqa: F401  (registers the ndarray reducer)

    _numpy_ready = True


def dumps(obj: Any, inflight: bool = True, deferred: list[Any] | None = None) -> Message:
    """Pickle ``obj`` for another process.

    Args:
        obj: anything cloudpickle can pickle; arrays go through shared memory.
        inflight: True when the message, not its sender, keeps the shared segments alive
            until one receiver adopts them (queues, pipes). False when the sender keeps
            ``Message.keepalive`` alive until every receiver has mapped them (spawn args).
        deferred: when a list, objects that only pickle at process start (Queue, Lock,
            Connection, socket, ...) are appended to it instead of being pickled.

    Returns:
        A Message; call ``close()`` once it was sent.
    """
    if not _numpy_ready and "numpy" in sys.modules:
        _register_numpy()
    kind = _is_plain(obj) if deferred is None else _NOT_PLAIN
    if kind == _PLAIN:  # nothing to share, nothing to reduce: the stdlib pickle as it is
        return Message(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), [], [], inflight)
    state = _SendState(inflight)
    previous = getattr(_local, "send", None)
    _local.send = state
    try:
        if kind == _PLAIN_WITH_ARRAYS:
            data = _plain_dumps(obj)
        else:
            buf = io.BytesIO()
            if deferred is None:
                _cloud_picklers()[0](buf).dump(obj)
            else:
                _cloud_picklers()[1](buf, deferred).dump(obj)
            data = buf.getvalue()
    except BaseException:
        for callback in state.on_abandon:
            callback()
        raise
    finally:
        _local.send = previous
    return Message(data, state.fds, state.keepalive, inflight, state.on_abandon)


def loads(
    data: bytes | bytearray | memoryview,
    fds: list[int] = (),  # type: ignore[assignment]
    deferred: list[Any] | None = None,
) -> Any:
    """Unpickle a message; closes every descriptor in ``fds`` before returning."""
    previous = getattr(_local, "recv", None)
    _local.recv = _RecvState(fds)
    try:
        if deferred is None:
            return pickle.loads(data)
        return _DeferredUnpickler(io.BytesIO(data), deferred).load()
    finally:
        _local.recv = previous
        for fd in fds:
            if fd >= 0:  # not taken by a rebuild function
                os.close(fd)
