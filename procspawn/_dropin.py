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
from typing import Any

from .context._start_method import get_start_method, set_start_method
from .sharing.channels._connection import Pipe as _Pipe
from .sharing.channels._queues import JoinableQueue as _JoinableQueue
from .sharing.channels._queues import Queue as _Queue
from .sharing.channels._queues import SimpleQueue as _SimpleQueue
from .sharing.channels._startup import StartupMessage
from .sharing.segments import _strategy
from .sharing.wire import _pickler


class _Call:
    """target(*args, **kwargs) of a Process, pickled by procspawn when the process starts."""

    def __init__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.target: Any = target
        self.args: Any = args
        self.kwargs: Any = kwargs
        self.sent: list[StartupMessage] = []

    def __reduce__(self):
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

    def start(self) -> None:
        calls: list[_Call] = []
        self._procspawn_calls = calls  # filled by __getstate__ if the process is pickled
        try:
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
    default start method (``procspawn.get_start_method()``)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return get_context(None).Process._Popen(process_obj)


class SpawnProcess(_ProcessMixin, mpc.SpawnProcess):
    pass


class ForkProcess(_ProcessMixin, mpc.ForkProcess):
    pass


class ForkServerProcess(_ProcessMixin, mpc.ForkServerProcess):
    pass


class _ContextMixin:
    def get_context(self, method: str | None = None) -> Any:
        if method is None:
            return self
        return get_context(method)

    def Pipe(self, duplex: bool = True) -> Any:
        """A pair of procspawn Connections (arrays travel as shared-memory handles)."""
        return _Pipe(duplex)

    def Queue(self, maxsize: int = 0) -> Any:
        """A procspawn Queue (arrays travel as shared-memory handles)."""
        return _Queue(maxsize, ctx=self.get_context())

    def JoinableQueue(self, maxsize: int = 0) -> Any:
        """A procspawn JoinableQueue."""
        return _JoinableQueue(maxsize, ctx=self.get_context())

    def SimpleQueue(self) -> Any:
        """A procspawn SimpleQueue."""
        return _SimpleQueue(ctx=self.get_context())

    def Pool(
        self,
        processes: int | None = None,
        initializer: Any = None,
        initargs: Any = (),
        maxtasksperchild: int | None = None,
    ) -> Any:
        """A ``procspawn.Pool`` whose workers start with this context's method."""
        from .pool import Pool

        return Pool(processes, initializer, initargs, maxtasksperchild, context=self.get_context())


class SpawnContext(_ContextMixin, mpc.SpawnContext):
    Process = SpawnProcess


class ForkContext(_ContextMixin, mpc.ForkContext):
    Process = ForkProcess


class ForkServerContext(_ContextMixin, mpc.ForkServerContext):
    Process = ForkServerProcess


class DefaultContext(_ContextMixin, mpc.BaseContext):
    """Follows procspawn's default start method (``procspawn.set_start_method``)."""

    Process = Process

    def get_context(self, method: str | None = None) -> Any:
        if method is None:
            method = get_start_method()
        return get_context(method)

    def get_start_method(self, allow_none: bool = False) -> str:
        return get_start_method(allow_none)

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        set_start_method(method, force)


_contexts: dict[str, Any] = {
    name: cls()
    for name, cls in [
        ("spawn", SpawnContext),
        ("fork", ForkContext),
        ("forkserver", ForkServerContext),
    ]
    if name in multiprocessing.get_all_start_methods()
}
default_context = DefaultContext()


def get_context(method: str | None = None) -> Any:
    """A multiprocessing context whose Process, queues, Pipe and Pool share arrays.

    Raises:
        ValueError: ``method`` is not a start method of this platform.
    """
    if method is None:
        method = get_start_method()
    if method not in _contexts:
        raise ValueError(
            f"unknown start method {method!r}; this platform has: {', '.join(_contexts)}"
        )
    return _contexts[method]
