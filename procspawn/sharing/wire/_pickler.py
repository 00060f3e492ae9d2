"""The one pickler every procspawn message goes through: ``dumps`` and ``loads``.

``dumps(obj)`` gives a :class:`~._message.Message`: the pickle bytes and the descriptors
its shared segments travel with. ``loads(data, fds)`` rebuilds the object and closes
every descriptor no rebuild function took.

Plain data (numbers, strings, bytes, NumPy arrays of those, in tuples, lists, sets and
dicts) goes through the C pickler with procspawn's reducer table; everything else
(lambdas, closures, functions defined in ``__main__``) through cloudpickle, imported on
first need, with procspawn's reducers and the ones ``multiprocessing`` registered for its
own objects in front of copyreg's, so Queues and Locks passed at process start pickle as
they do for ``Process(args=...)``. Neither the stdlib's pickler nor ``copyreg`` is changed.
"""

from __future__ import annotations

import atexit
import collections
import copyreg
import errno
import io
import os
import pickle
import sys
import threading
import types
from collections import ChainMap
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.reduction import ForkingPickler

from ... import _settings
from ..._late import late_import
from .. import _registry
from .._message import Message, RecvState, SendState, begin_receive, begin_send
from . import _main_names

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

_local = threading.local()


class _NotPlain(Exception):
    """Raised while the C pickler runs: the message needs cloudpickle."""


class _PlainPickler(pickle.Pickler):
    """The C pickler with procspawn's reducers: for messages of plain data and arrays.

    It refuses (``_NotPlain``) what only cloudpickle pickles right, so trying it costs
    nothing for plain data: the C pickler asks ``reducer_override`` only about objects
    that are not None, bools, ints, floats, strs, bytes, lists, tuples, dicts or sets.
    """

    dispatch_table: dict[type, Any]

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t in _PLAIN_LEAVES:
            return NotImplemented
        np = sys.modules.get("numpy")
        if np is not None and (t is np.ndarray or isinstance(obj, np.generic)):
            if obj.dtype.hasobject:
                raise _NotPlain
            if _registry.load_plugins():  # the first array: its reducers join the table
                self.dispatch_table.update(_registry.reducers)
            return NotImplemented  # procspawn's reducer (the dispatch table) or numpy's
        if t in _NAMED_TYPES and _by_reference(obj):
            return NotImplemented  # by name, as cloudpickle would
        raise _NotPlain


def _plain_dumps(obj: Any) -> bytes:
    """``obj`` pickled by this thread's _PlainPickler, made once and reused (making one
    costs more than pickling a handle)."""
    cached = getattr(_local, "plain", None)
    if cached is None or cached[2] != _registry.version:
        buf = io.BytesIO()
        pickler = _PlainPickler(buf, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = _registry.dispatch_table()
        cached = (pickler, buf, _registry.version)
    pickler, buf, _ = cached
    _local.plain = None  # in use: a dumps nested in a reducer makes its own
    pickler.dump(obj)
    data = buf.getvalue()
    pickler.clear_memo()
    buf.seek(0)
    buf.truncate()
    _local.plain = cached  # not reused after an error: back only when all went well
    return data


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, range)
_PLAIN_CONTAINERS = (tuple, list, set, frozenset)
_PLAIN_LIMIT = 10_000
_PLAIN_TYPES = (*_PLAIN_LEAVES, *_PLAIN_CONTAINERS, dict)
_overridden = (-1, False)  # (registry version, whether a plain type has a reducer)


def _plain_types_overridden() -> bool:
    """Whether a reducer is registered for a plain type (then it must run)."""
    global _overridden
    if _overridden[0] != _registry.version:
        _overridden = (_registry.version, any(t in _registry.reducers for t in _PLAIN_TYPES))
    return _overridden[1]


_NOT_PLAIN, _PLAIN, _PLAIN_WITH_ARRAYS = 0, 1, 2
_LEAF_SET = frozenset(_PLAIN_LEAVES)
_NAMED_TYPES = (types.FunctionType, types.BuiltinFunctionType, type)


def _by_reference(obj: Any) -> bool:
    """Whether ``obj`` (a function or class) is found under its name in a module other
    than ``__main__`` that cloudpickle was not told to pickle by value: then the C pickler
    pickles it by name, exactly as cloudpickle would, without importing cloudpickle. One
    of ``__main__`` goes by name when the receiver has it (see ``_main_names``)."""
    module_name = getattr(obj, "__module__", None)
    if not module_name:
        return False
    if module_name == "__main__":
        return _main_names.by_name(obj)
    cloudpickle = sys.modules.get("cloudpickle.cloudpickle")
    if cloudpickle is not None and getattr(cloudpickle, "_PICKLE_BY_VALUE_MODULES", None):
        return False
    found: Any = sys.modules.get(module_name)
    for part in getattr(obj, "__qualname__", "<>").split("."):
        found = getattr(found, part, None)
    return found is obj


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
            if len(item) > 8 and set(map(type, item)) <= _LEAF_SET:
                continue  # a long run of numbers or strings: checked at C speed
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
        elif t in _NAMED_TYPES and _by_reference(item):
            continue  # a module-level function or class: pickled by name, as cloudpickle would
        else:
            return _NOT_PLAIN
    if _plain_types_overridden():
        return _PLAIN_WITH_ARRAYS  # a reducer registered for a plain type must run
    return kind


_cloud: tuple[type, type] | None = None


def _cloud_picklers() -> tuple[type, type]:
    """(Pickler, DeferringPickler) on top of cloudpickle, made on first use."""
    global _cloud
    if _cloud is None:
        import cloudpickle

        class Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no types
            """cloudpickle with procspawn's and multiprocessing's reducers in front of
            copyreg's."""

            dispatch_table = ChainMap(
                _registry.reducers,
                {io.TextIOWrapper: _reduce_text_file, types.CodeType: _reduce_code},
                ForkingPickler._extra_reducers,  # type: ignore[attr-defined]  # not in typeshed
                getattr(cloudpickle.Pickler, "dispatch_table", copyreg.dispatch_table),
            )

            def __init__(self, file: io.BytesIO) -> None:
                super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

            def reducer_override(self, obj: Any) -> Any:
                if (
                    (type(obj) is types.FunctionType or isinstance(obj, type))
                    and obj.__module__ == "__main__"
                    and _main_names.by_name(obj)
                ):
                    return NotImplemented  # by name: the receiver has this very definition
                if isinstance(obj, type) and obj.__module__ not in sys.modules:
                    _import_quietly(obj.__module__)
                for base, reducer in _registry.subclass_reducers.items():
                    if isinstance(obj, base) and type(obj) is not base:
                        reduced = reducer(obj)
                        if reduced is not NotImplemented:
                            return reduced
                return super().reducer_override(obj)

        class DeferringPickler(Pickler):
            """Leaves objects that only pickle while a process starts (multiprocessing's
            "should only be shared between processes through inheritance") out of the
            pickle, as persistent ids into a side list the start-up machinery hands over."""

            def __init__(self, file: io.BytesIO, deferred: list[Any]) -> None:
                super().__init__(file)
                self._deferred = deferred
                self._deferred_types = _deferred_types()

            def persistent_id(self, obj: Any) -> int | None:
                if isinstance(obj, self._deferred_types) or (
                    # typeshed has no _extra_reducers
                    type(obj) in ForkingPickler._extra_reducers  # type: ignore[attr-defined]
                    and type(obj).__module__ == "multiprocessing.sharedctypes"
                ):
                    self._deferred.append(obj)
                    return len(self._deferred) - 1
                return None

        _cloud = (Pickler, DeferringPickler)
    return _cloud


_unimportable: set[str] = set()  # modules _import_quietly tried (a failed import is slow)


def _import_quietly(module: str) -> None:
    """Import the module a class says it is from, as pickle does to send a class by
    name: cloudpickle sends a class whose module is not imported by value, a copy that is
    not the class (``np.recarray`` says ``numpy.rec``, a module only imported on use)."""
    if module in _unimportable:
        return
    try:
        late_import(module)  # (from any thread: see _late)
    except Exception:  # noqa: BLE001 -- then by value, as cloudpickle would
        _unimportable.add(module)


def _reduce_code(code: types.CodeType) -> Any:
    """cloudpickle's reduction of a function's code, keeping its file name (cloudpickle
    writes "<dynamic-code>"): a traceback in the receiver then shows the user's file and
    line, and the line itself when the file is there, as it would without procspawn."""
    import cloudpickle

    table = getattr(cloudpickle.Pickler, "dispatch_table", {})
    rebuild, args = table[types.CodeType](code)
    dynamic = "<dynamic-code>"
    args = tuple(code.co_filename if isinstance(a, str) and a == dynamic else a for a in args)
    return rebuild, args


def _reduce_text_file(obj: io.TextIOWrapper) -> Any:
    """The standard streams go by reference (cloudpickle's way); any other open file is
    refused, as the stdlib refuses it, rather than sent as a snapshot of its contents."""
    if any(obj is stream for stream in (sys.stdin, sys.stdout, sys.stderr)):
        import cloudpickle

        table = getattr(cloudpickle.Pickler, "dispatch_table", {})
        return table[io.TextIOWrapper](obj)
    name = getattr(obj, "name", "?")
    mode = getattr(obj, "mode", "?")
    raise pickle.PicklingError(
        f"cannot send the open file {name!r} (mode {mode!r}) to another process: a file "
        f"object does not cross processes (it would arrive as a snapshot of its contents, "
        f"and reads, writes and seeks would not reach the file). Send its path and open it "
        f"in the receiving process."
    )


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


# Types whose instances are handed over at process start, not in the pickle.
_extra_deferred: list[type] = []


def defer_at_start(*types: type) -> None:
    """Hand instances of ``types`` over at process start, not in the pickle (channels)."""
    _extra_deferred.extend(types)


class _DeferredUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, deferred: Sequence[object]) -> None:
        super().__init__(file)
        self._deferred = deferred

    def persistent_load(self, pid: Any) -> Any:
        return self._deferred[pid]


def dumps(obj: object, deferred: list[object] | None = None) -> Message:
    """Pickle ``obj`` for another process.

    Plain data goes through the C pickler, anything else through cloudpickle (lambdas,
    closures, functions of ``__main__``). A shared array goes as a handle to its
    segment; any other array of 64 KiB or more (``PROCSPAWN_INLINE_BYTES``) is copied
    once into a new segment, and smaller ones are pickled as NumPy pickles them.

    Args:
        obj: anything cloudpickle can pickle; arrays go through shared memory.
        deferred: when a list, objects that only pickle at process start (Queue, Lock,
            Connection, socket, ...) are appended to it instead of being pickled.

    Returns:
        A Message: ``data`` (the pickle bytes) and ``fds`` (the descriptors to send with
        them). It keeps the segments it carries alive until ``close()``, which the
        caller calls once it was sent (or ``abandon()`` if it will never be).

    Raises:
        pickle.PicklingError: ``obj`` cannot be pickled (an open file, say).
        TypeError: ``obj`` holds something no pickler takes (a lock, say).
        SharedMemoryFullError: as for ``zeros``, when an array is copied.
        FdLimitError: as for ``zeros``, when an array is copied.

    Example::

        import numpy as np
        from procspawn import sharing

        message = sharing.dumps({"weights": np.ones(100_000)})
        # ... send message.data and message.fds (SCM_RIGHTS), then:
        message.close()
    """
    _settings.check_all()  # (once: a bad PROCSPAWN_* variable fails any send, as itself)
    # The plug-ins' reducers (NumPy's) are loaded when the C pickler meets their first
    # object (a message without arrays imports nothing); cloudpickle gets them up front.
    if deferred is None and not _plain_types_overridden():
        # Plain data, arrays and functions by name: the C pickler, tried first (it
        # refuses the rest before doing much).
        state = SendState()
        previous = begin_send(state)
        try:
            data = _plain_dumps(obj)
        except (_NotPlain, pickle.PicklingError, AttributeError, TypeError):
            # _NotPlain: cloudpickle's business. The others: a class the C pickler can
            # only name (one defined in a function, or received by value in a child)
            # goes through cloudpickle, by value, with a fresh message.
            state.discard()
            data = None
        except BaseException:
            state.discard()
            raise
        finally:
            begin_send(previous)
        if data is not None:
            return state.message(data)
        kind = _NOT_PLAIN
    else:
        kind = _is_plain(obj) if deferred is None else _NOT_PLAIN
    _registry.load_plugins()
    if kind == _PLAIN:  # nothing to share, nothing to reduce: the stdlib pickle as it is
        return Message(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))
    state = SendState()
    previous = begin_send(state)
    try:
        data = None
        if kind == _PLAIN_WITH_ARRAYS:
            try:
                data = _plain_dumps(obj)
            except (pickle.PicklingError, AttributeError, TypeError):
                # A custom strategy travels with its handles, and the C pickler can only
                # name a class: one defined in a function, or received by value in a
                # child, goes through cloudpickle, by value, with a fresh message.
                state.discard()
                state = SendState()
                begin_send(state)
        if data is None:
            buf = io.BytesIO()
            if deferred is None:
                _cloud_picklers()[0](buf).dump(obj)
            else:
                _cloud_picklers()[1](buf, deferred).dump(obj)
            data = buf.getvalue()
    except BaseException:
        state.discard()
        raise
    finally:
        begin_send(previous)
    return state.message(data)


def loads(
    data: bytes | bytearray | memoryview,
    fds: Sequence[int] = (),
    deferred: Sequence[object] | None = None,
) -> Any:
    """Unpickle a message made by :func:`dumps` in another process.

    Args:
        data: the message's pickle bytes.
        fds: the descriptors received with it, in order; every one no rebuild function
            took is closed, whatever happens.
        deferred: the objects ``dumps(deferred=...)`` left out of the pickle, in order.

    Returns:
        The object; its arrays lie over the shared segments the descriptors name.

    Raises:
        pickle.UnpicklingError: ``data`` is not a pickle, or is cut short.
        EOFError: ``data`` is empty.
        IndexError: a shared-memory handle in ``data`` names a descriptor missing from
            ``fds``.
    """
    state = RecvState(list(fds))
    previous = begin_receive(state)
    try:
        if deferred is None:
            return pickle.loads(data)
        return _DeferredUnpickler(io.BytesIO(data), deferred).load()
    finally:
        begin_receive(previous)
        state.close_rest()


def loads_received(data: bytes | bytearray | memoryview, fds: Sequence[int] = ()) -> Any:
    """``loads`` for a message a channel delivered, which no one else will unpickle: if
    unpickling fails, what the segments it did not reach counted for this receiver is
    given back (``give_back``), or their names would outlive every process.
    """
    _settle_debts()
    state = RecvState(list(fds))
    previous = begin_receive(state)
    try:
        return pickle.loads(data)
    except BaseException:
        give_back(data, state.taken)
        raise
    finally:
        begin_receive(previous)
        state.close_rest()


def give_back(data: bytes | bytearray | memoryview, taken: Iterable[Any] = ()) -> None:
    """The message ``data`` will never be unpickled (its descriptors were dropped at this
    process' descriptor limit, or unpickling it failed): give back what its shared
    segments counted for this receiver, but for those in ``taken`` (see ``_handles``).
    Never raises: what cannot be given back now (no descriptor left to import or open
    with) is tried again at the next message received, and at exit.
    """
    if data:
        _owed.append((bytes(data), set(taken)))
        _give_back_owed()


# Messages whose counts are still to give back: (pickle, the segments done with)
_owed: collections.deque[tuple[bytes, set[Any]]] = collections.deque()
_owed_at_exit = False


def _forget_owed_in_child() -> None:
    global _owed_at_exit
    _owed.clear()  # the parent's to give back, once
    _owed_at_exit = False


os.register_at_fork(after_in_child=_forget_owed_in_child)


def _give_back_owed() -> None:
    global _owed_at_exit
    while _owed:
        try:
            owed = _owed.popleft()  # each taken by one thread: given back once
        except IndexError:
            return
        try:
            late_import("procspawn.sharing.wire._handles").give_back(*owed)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                continue
            _owed.appendleft(owed)  # at the descriptor limit: later (``done`` is kept)
            if not _owed_at_exit:
                _owed_at_exit = True
                _at_exit(_give_back_owed)
            return
        except Exception:  # noqa: BLE001,S112 -- never in the receiver's way: the counts stay
            continue


def _at_exit(function: Callable[[], None]) -> None:
    """Run ``function`` at this process' exit, also in a child multiprocessing started
    (which leaves with os._exit, after running its util finalizers)."""
    atexit.register(function)
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util.Finalize(None, function, exitpriority=-90)


def _settle_debts() -> None:
    """What this process still owes for messages it never unpickled, tried again."""
    if _owed:
        _give_back_owed()
    file_system = sys.modules.get("procspawn.sharing.segments._file_system")
    if file_system is not None and file_system.undropped:
        file_system.drop_undropped()


def give_back_unreceived(error: BaseException) -> None:
    """``give_back`` for the message a channel's reader dropped with ``error`` (an
    FdLimitError: the kernel dropped its descriptors), if the error carries one."""
    data = getattr(error, "_unreceived", None)
    if data:
        error._unreceived = None  # type: ignore[attr-defined]  # (given back once)
        give_back(data)
