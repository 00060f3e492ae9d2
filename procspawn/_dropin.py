"""Drop-in multiprocessing contexts whose Process, Queue, Pipe and Pool share arrays.

The top floor of the package: it puts together ``context``'s processes, ``sharing``'s
channels and ``pool``'s Pool under multiprocessing's names.

``procspawn.get_context(method)`` returns a context like ``multiprocessing.get_context``'s
(it subclasses the stdlib's), except that:

* ``Process(target=..., args=..., kwargs=...)`` pickles target and arguments with procspawn's
  pickler (cloudpickle for code, shared memory for arrays) as the process starts;
* ``Queue``, ``JoinableQueue``, ``SimpleQueue`` and ``Pipe`` are procspawn's;
* ``Pool`` is ``procspawn.Pool`` (the stdlib's interface; a worker's death fails its task
  instead of hanging the call) with the context's start method.

Nothing of the stdlib is patched: ``multiprocessing.Queue`` stays as it is.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context as mpc
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias, overload

from . import _settings
from .context.launch._cuda_guard import refuse_fork
from .context.launch._start_method import (
    force_start_method,
    get_start_method,
    refuse_while_starting,
    set_start_method,
)
from .sharing.channels._connection import Pipe as _Pipe
from .sharing.channels._queues import JoinableQueue as _JoinableQueue
from .sharing.channels._queues import Queue as _Queue
from .sharing.channels._queues import SimpleQueue as _SimpleQueue
from .sharing.channels._startup import StartupMessage
from .sharing.segments import _strategy
from .sharing.wire import _pickler

TYPE_CHECKING = False  # as typing's (this package's one convention)
if TYPE_CHECKING:  # pragma: no cover
    from .pool import _pool
    from .sharing.channels import _connection, _queues


class _Call:
    """target(*args, **kwargs) of a Process, pickled by procspawn when the process starts."""

    def __init__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.target: Any = target
        self.args: Any = args
        self.kwargs: Any = kwargs
        self.sent: list[StartupMessage] = []

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        deferred: list[Any] = []
        message = _pickler.dumps(
            (_strategy.snapshot(), self.target, self.args, self.kwargs), deferred=deferred
        )
        startup = StartupMessage(message, deferred)
        self.sent.append(startup)  # its descriptors must stay open until start() returns
        return startup.__reduce__()

    def close(self, started: bool = True) -> None:
        for startup in self.sent:
            startup.close() if started else startup.message.abandon()
        self.sent = []


def _load(received: Any) -> tuple[Any, Any, Any]:
    """The target, args and kwargs a started child received (see ``_Call``)."""
    strategy, target, args, kwargs = received.load()
    _strategy.restore(strategy)
    return target, args, kwargs


def _run(received: Any) -> Any:
    """The target a Process is pickled with; ``__setstate__`` puts the real one back, so
    this only runs for a subclass that unpickles itself with its own ``__setstate__``."""
    target, args, kwargs = _load(received)
    return target(*args, **kwargs)


class _ProcessMixin:
    """Routes target and arguments through procspawn's pickler.

    The Process keeps multiprocessing's ``_target``, ``_args`` and ``_kwargs`` as they
    are; only the pickle made while it starts (spawn, forkserver) carries them as a
    procspawn message, and the child puts them back as it unpickles the Process, as the
    stdlib's child does. Under fork nothing is pickled: the child inherits them.
    """

    _target: Any
    _args: Any
    _kwargs: Any
    _procspawn_calls: list[_Call]
    _procspawn_method: str

    def start(self) -> None:
        """Start the process, as ``multiprocessing.Process.start`` does.

        Raises:
            pickle.PicklingError: (under "spawn" and "forkserver") ``target`` or an
                argument cannot be sent to another process.
            TypeError: (likewise) an argument's type cannot be pickled at all.
            AssertionError: the process was started already, as the stdlib's.
            SettingError: a ``PROCSPAWN_*`` variable has a value procspawn cannot use.
        """
        _settings.check_all()  # a bad PROCSPAWN_* variable: its SettingError, first
        refuse_while_starting("Process.start()")  # (a child importing the main module)
        # what the child reports as its start method (see _bootstrap)
        # (the stdlib's class attribute: None for the default context's Process)
        self._procspawn_method = getattr(self, "_start_method", None) or get_start_method()
        calls: list[_Call] = []
        self._procspawn_calls = calls  # filled by __getstate__ if the process is pickled
        try:
            # a mixin: the multiprocessing Process class it is mixed into has start()
            super().start()  # type: ignore[misc]
        except BaseException:
            for call in calls:
                call.close(started=False)
            raise
        else:
            for call in calls:
                call.close()
        finally:
            del self._procspawn_calls
            for call in calls:
                # as the stdlib's start() does: the target and its arguments can be collected
                call.target = call.args = call.kwargs = None

    def _bootstrap(self, *args: Any, **kwargs: Any) -> int:
        # in the child: procspawn.get_start_method() names the method that started it,
        # as multiprocessing.get_start_method() does in the stdlib's children
        method = self.__dict__.get("_procspawn_method")
        if method is not None:
            force_start_method(method)
        return super()._bootstrap(*args, **kwargs)  # type: ignore[misc,no-any-return]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        calls = state.pop("_procspawn_calls", None)
        # a falsy target is not run (BaseProcess.run), so it is not wrapped either
        if calls is not None and state.get("_target"):
            call = _Call(state["_target"], state["_args"], state["_kwargs"])
            calls.append(call)
            state["_target"], state["_args"], state["_kwargs"] = _run, (call,), {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if state.get("_target") is _run:
            self._target, self._args, self._kwargs = _load(state["_args"][0])


class Process(_ProcessMixin, mpc.Process):
    """``multiprocessing.Process`` whose arguments share arrays, started with procspawn's
    default start method (``procspawn.get_start_method()``).

    The same constructor and methods as ``multiprocessing.Process`` (``start``, ``join``,
    ``terminate``, ``kill``, ``exitcode``, ...). What differs: ``target`` and its
    arguments are pickled by procspawn as the process starts (cloudpickle for code, so a
    lambda or a function of ``__main__`` works; shared memory for NumPy arrays, so an
    array made with ``procspawn.sharing.zeros`` is the same memory in both processes),
    and the start method is procspawn's default ("forkserver") instead of
    multiprocessing's. ``procspawn.get_context(method).Process`` uses another one.

    Args:
        group: always None (as for ``threading.Thread``).
        target: the callable the process runs, as ``target(*args, **kwargs)``.
        name: the process name.
        args: positional arguments for ``target``.
        kwargs: keyword arguments for ``target``.
        daemon: whether the process is daemonic (None: inherited from this process).

    Raises:
        pickle.PicklingError: (from ``start()``, under "spawn" and "forkserver")
            ``target`` or an argument cannot be sent to another process.
        TypeError: (likewise) an argument's type cannot be pickled at all (a lock of
            the ``threading`` module, say), as ``pickle`` says.

    Example::

        import procspawn
        from procspawn import sharing

        def fill(array, value):
            array[:] = value

        if __name__ == "__main__":
            array = sharing.zeros(3)
            p = procspawn.Process(target=fill, args=(array, 7.0))
            p.start()
            p.join()
            assert p.exitcode == 0 and array.tolist() == [7.0, 7.0, 7.0]
    """

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return get_context(None).Process._Popen(process_obj)


class SpawnProcess(_ProcessMixin, mpc.SpawnProcess):
    pass


class ForkProcess(_ProcessMixin, mpc.ForkProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        refuse_fork("Process.start()")
        return mpc.ForkProcess._Popen(process_obj)


class ForkServerProcess(_ProcessMixin, mpc.ForkServerProcess):
    pass


class _ContextMixin:
    def get_context(self, method: str | None = None) -> ProcspawnContext:
        if method is None:
            return self  # type: ignore[return-value]  # every user is a ProcspawnContext
        return get_context(method)

    def Pipe(self, duplex: bool = True) -> tuple[_connection.Connection, _connection.Connection]:
        """A pair of procspawn Connections (arrays travel as shared-memory handles).

        ``multiprocessing.Pipe``'s interface: ``send``/``recv``, ``send_bytes``/
        ``recv_bytes``, ``poll``, ``close``.

        Args:
            duplex: both ends send and receive (True), or the first end only receives and
                the second only sends (False).

        Returns:
            The two ends, ``(receive end, send end)`` when ``duplex`` is False.
        """
        return _Pipe(duplex)

    def Queue(self, maxsize: int = 0) -> _queues.Queue:
        """A procspawn Queue (arrays travel as shared-memory handles).

        ``multiprocessing.Queue``'s interface: ``put``/``get`` (with ``block`` and
        ``timeout``), ``qsize``, ``empty``, ``full``, ``close``, ``join_thread``.

        Args:
            maxsize: at most this many items in the queue (``put`` blocks when it is
                full); 0 or less: no limit.

        Returns:
            The queue, to pass to processes as an argument (at their start).
        """
        return _Queue(maxsize, ctx=self.get_context())

    def JoinableQueue(self, maxsize: int = 0) -> _queues.JoinableQueue:
        """A procspawn JoinableQueue: a Queue with ``task_done()`` and ``join()``.

        Args:
            maxsize: as for ``Queue``.

        Returns:
            The queue.
        """
        return _JoinableQueue(maxsize, ctx=self.get_context())

    def SimpleQueue(self) -> _queues.SimpleQueue:
        """A procspawn SimpleQueue: ``put`` sends at once, ``get``, ``empty``, ``close``.

        Returns:
            The queue.
        """
        return _SimpleQueue(ctx=self.get_context())

    def Pool(
        self,
        processes: int | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[object] = (),
        maxtasksperchild: int | None = None,
    ) -> _pool.Pool:
        """A ``procspawn.Pool`` whose workers start with this context's method.

        Args:
            processes: as for ``procspawn.Pool``.
            initializer: as for ``procspawn.Pool``.
            initargs: as for ``procspawn.Pool``.
            maxtasksperchild: as for ``procspawn.Pool``.

        Returns:
            The pool.
        """
        from .pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, context=self.get_context())


# The contexts are drop-ins whose Queue, Pipe and Pool are procspawn's, not the types
# typeshed gives the stdlib's contexts: hence the ignores of the incompatible definitions.
class SpawnContext(_ContextMixin, mpc.SpawnContext):  # type: ignore[misc]
    Process = SpawnProcess


class ForkContext(_ContextMixin, mpc.ForkContext):  # type: ignore[misc]
    Process = ForkProcess


class ForkServerContext(_ContextMixin, mpc.ForkServerContext):  # type: ignore[misc]
    Process = ForkServerProcess


class DefaultContext(_ContextMixin, mpc.BaseContext):  # type: ignore[misc]
    """Follows procspawn's default start method (``procspawn.set_start_method``)."""

    Process = Process

    # one of procspawn's contexts, never the stdlib's (typeshed's overloads say those)
    def get_context(self, method: str | None = None) -> ProcspawnContext:  # type: ignore[override]
        if method is None:
            method = get_start_method()
        return get_context(method)

    def get_start_method(self, allow_none: bool = False) -> str:
        return get_start_method(allow_none)

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        set_start_method(method, force)


if TYPE_CHECKING:  # pragma: no cover
    # what get_context() returns: one of these, by start method
    ProcspawnContext: TypeAlias = SpawnContext | ForkContext | ForkServerContext

_contexts: dict[str, Any] = {
    name: cls()
    for name, cls in [
        ("spawn", SpawnContext),
        ("fork", ForkContext),
        ("forkserver", ForkServerContext),
    ]
    if name in multiprocessing.get_all_start_methods()
}
default_context: DefaultContext = DefaultContext()


@overload
def get_context(method: Literal["spawn"]) -> SpawnContext: ...
@overload
def get_context(method: Literal["fork"]) -> ForkContext: ...
@overload
def get_context(method: Literal["forkserver"]) -> ForkServerContext: ...
@overload
def get_context(method: str | None = None) -> ProcspawnContext: ...


def get_context(method: str | None = None) -> ProcspawnContext:
    """A multiprocessing context whose Process, queues, Pipe and Pool share arrays.

    As ``multiprocessing.get_context(method)`` (it subclasses the stdlib's context), but
    its ``Process`` pickles target and arguments with procspawn (cloudpickle for code,
    shared memory for arrays), its ``Queue``, ``JoinableQueue``, ``SimpleQueue`` and
    ``Pipe`` are procspawn's, and its ``Pool`` is ``procspawn.Pool`` with that start
    method. The stdlib's own objects are not changed.

    Args:
        method: "spawn", "forkserver" or "fork"; None: procspawn's default start method
            (``procspawn.get_start_method()``).

    Returns:
        The context of that start method (one per method and program).

    Raises:
        ValueError: ``method`` is not a start method of this platform, or
            ``PROCSPAWN_START_METHOD`` names none when ``method`` is None.

    Example::

        import procspawn

        def double(x):
            return 2 * x

        if __name__ == "__main__":
            ctx = procspawn.get_context("spawn")
            queue = ctx.Queue()
            with ctx.Pool(2) as pool:
                assert pool.map(double, [1, 2, 3]) == [2, 4, 6]
            queue.put([1, 2])
            assert queue.get() == [1, 2]
    """
    if method is None:
        method = get_start_method()
    if method not in _contexts:
        raise ValueError(
            f"unknown start method {method!r}; this platform has: {', '.join(_contexts)}"
        )
    context: ProcspawnContext = _contexts[method]
    return context
