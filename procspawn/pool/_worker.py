"""The child side of a pool: one worker's loop, reading tasks from its own channel.

Each worker has a channel of its own (a socketpair with the parent); nothing is shared
between workers, so a worker's death can leave nothing half-written. Messages::

    parent -> worker   (fn key, fn or None, fn key to forget or None, form, payload)
                       None: exit now (the pool is closing)
    worker -> parent   (READY,)                      ready: the initializer ran
                       (READY, index)                the same, from a worker not forked:
                                                     what its main module has, which
                                                     the parent then sends by name
                       (STARTED,)                    a task arrived and starts now
                       (INIT_FAILED, exception packed or None, text)  the
                                                     initializer raised; exits 1
                       (RESULT, value)               a task's result
                       (RAISED, exception packed or None, text)  a task
                                                     raised (text: its traceback;
                                                     the codec: context._raised)
                       (PROGRESS, n)                 the running task reported n steps
                                                     (procspawn.progress; see _Steps)

(the tags: ``context._tags``, the ranks' too)

A task's function is sent with the first task that calls it which this worker gets, and
kept (under a key the parent chose) until the parent names it in "forget". Results go
back in the order the tasks came, so the parent knows which task each answers; STARTED, sent
as a task is taken off the channel (before it is even unpickled), tells it whether a
worker that died was running one or had only tasks it never started (those run
elsewhere).
A task that calls ``sys.exit`` or ``os._exit`` ends the worker, like a signal would: the
parent reports it as that task's death.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import types

from .._late import renew_lock_in_child
from ..context import _progress, _raised, _tags
from ..context.launch import _posix
from ..sharing import _message
from ..sharing._errors import ChannelClosed, FdLimitError
from ..sharing.channels._fdpass import MessageReader, recv_message, send_message
from ..sharing.wire import _main_names, _pickler

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

try:  # signal.signal's own, without its enum conversions (a tenth of the time)
    from _signal import signal as _set_handler
except ImportError:  # pragma: no cover - not CPython
    _set_handler = signal.signal

APPLY, MAP, STARMAP = 0, 1, 2
_READY = pickle.dumps((_tags.READY,), pickle.HIGHEST_PROTOCOL)
_STARTED = pickle.dumps((_tags.STARTED,), pickle.HIGHEST_PROTOCOL)
_EXIT = pickle.dumps(None, pickle.HIGHEST_PROTOCOL)  # what the parent sends to say "exit"
# what the parent's main module has of this one's (see _main_names): a forked worker's
# inherited main module is its parent's, so its functions and classes go back by name
_parent_has: str | None = None
_REPORT_EVERY = 0.05  # seconds: at most one PROGRESS message per this, per worker
# every message to the parent is sent under it: a thread of a task may report progress
# while this process' main thread sends an answer
_send_lock = threading.Lock()
renew_lock_in_child(globals(), "_send_lock")


def _send(channel: socket.socket, data: bytes, fds: Any = ()) -> None:
    with _send_lock:
        send_message(channel, data, fds)


class _Steps:
    """``procspawn.progress(n)`` in a task: the steps go to the parent as PROGRESS
    messages, at most one per ``_REPORT_EVERY`` seconds, the rest before the answer."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        self.pending = 0
        self.sent_at = 0.0

    def add(self, n: int) -> None:
        with self.lock:
            self.pending += n
            now = time.monotonic()
            if now - self.sent_at >= _REPORT_EVERY:
                self._send(now)

    def flush(self) -> None:
        """Send what is pending (the task is over: its steps come before its answer)."""
        with self.lock:
            if self.pending:
                self._send(time.monotonic())

    def _send(self, now: float) -> None:
        n, self.pending = self.pending, 0
        self.sent_at = now
        try:
            _send(self.channel, pickle.dumps((_tags.PROGRESS, n), pickle.HIGHEST_PROTOCOL))
        except OSError:
            pass  # the parent is gone: the task goes on to its end as it would


def main(
    payload: Any,
    channel: socket.socket,
    parent_pid: int,
    use_death_signal: bool,
    max_tasks: int | None,
    redirect: Any = None,
    environ: dict[str, str] | None = None,
) -> None:
    """Entry point of every pool worker (the ``multiprocessing.Process`` target)."""
    if redirect is not None:
        redirect.apply()  # fork, forkserver: output to the parent's pipes from here on
        _streams_on_fds()
    if environ is not None:  # forkserver: the parent's environment, not the server's
        os.environ.clear()
        os.environ.update(environ)
    channel.settimeout(None)
    _posix.guard_parent(parent_pid, use_death_signal)
    # Ctrl-C is the parent's to handle: it stops the workers itself, quietly. A handler
    # (not SIG_IGN, which a program the task runs would inherit) keeps the signal away.
    _set_handler(signal.SIGINT, _ignore)
    _posix.unblock_sigint()  # blocked since the parent started us (see sigint_blocked)
    executor = False  # (what the payload says, once it is read)
    try:
        try:
            initializer, initargs, strategy, executor, forked = payload.load()
            if strategy is not None:  # (None: the parent has no settings of its own)
                from ..sharing.segments import _strategy

                _strategy.restore(strategy)
            if executor:
                # the stdlib's executor workers are not daemonic: a call may start a pool,
                # an executor or spawn() of its own (multiprocessing refuses children to a
                # daemonic process). The parent still sees a daemon (never joined at exit).
                multiprocessing.current_process().daemon = False
            if initializer is not None:
                _as_in_main(initializer)(*initargs)
        except SystemExit:
            raise
        except BaseException as exc:
            if executor:  # as the stdlib's executor workers do
                import logging

                logging.getLogger("concurrent.futures").critical(
                    "Exception in initializer:", exc_info=True
                )
            _send_error(channel, _tags.INIT_FAILED, exc)
            sys.exit(1)
        try:
            if forked:
                global _parent_has
                _parent_has = _main_names.INHERITED
                _send(channel, _READY)
            else:
                ready = (_tags.READY, _main_names.main_index())
                _send(channel, pickle.dumps(ready, pickle.HIGHEST_PROTOCOL))
            _serve(channel, max_tasks, executor)
        except (ChannelClosed, BrokenPipeError, ConnectionResetError):
            pass  # the parent closed our channel (it is stopping us, or gone): quietly
    finally:
        channel.close()


def _as_in_main(fn: Any) -> Any:
    """The initializer as the standard library's worker has it. It is pickled with the
    pool, before any worker said what its main module has, so a function of the script's
    top level comes by value; this worker's own copy of the same def (its main module's:
    imported again under spawn and forkserver, inherited under fork) replaces it, so that
    it runs in the main module's globals, where the tasks sent by name run too: what it
    sets with ``global``, they see. Any other function runs as it came."""
    if (
        type(fn) is not types.FunctionType
        or fn.__module__ != "__main__"
        or fn.__qualname__ != fn.__name__  # not defined at the top level
    ):
        return fn
    mine = getattr(sys.modules.get("__main__"), fn.__name__, None)
    if (
        type(mine) is types.FunctionType
        and mine.__qualname__ == fn.__name__
        and _main_names.fingerprint(mine) == _main_names.fingerprint(fn)
    ):
        return mine
    return fn


def _ignore(signum: int, frame: Any) -> None:
    pass


def _streams_on_fds() -> None:
    """Under fork the worker inherits the parent's ``sys.stdout`` / ``sys.stderr``, which
    may write elsewhere than descriptors 1 and 2 (a notebook's streams, pytest's
    capture): point them at 1 and 2, the pipes the parent forwards and quotes from."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        try:
            if stream is not None and stream.fileno() == fd:
                continue
        except (AttributeError, OSError, ValueError):
            pass
        setattr(sys, name, open(fd, "w", buffering=1, closefd=False, errors="backslashreplace"))


def _serve(channel: socket.socket, max_tasks: int | None, executor: bool) -> None:
    """Run tasks until told to stop, the budget is spent or the parent is gone.

    ``executor``: concurrent.futures' rules, where a task's ``sys.exit()`` and a result
    that cannot be pickled are that task's exception; a Pool's worker exits on the
    first (as the stdlib Pool's) and reports the second as ``MaybeEncodingError``."""
    reader = MessageReader(channel)
    steps = _Steps(channel)
    _progress._sink = steps.add
    functions: dict[int, Any] = {}
    done = 0
    _message.set_durable(True)  # results are read after this worker may have exited
    while max_tasks is None or done < max_tasks:
        try:
            data, fds = recv_message(reader)
        except FdLimitError as exc:
            # at the descriptor limit: a task's arrays could not be received (the message
            # was read whole). That task fails with the error; the worker goes on.
            _pickler.give_back_unreceived(exc)
            _send(channel, _STARTED)
            what = f"the arguments of a task could not be received ({exc.what})"
            _send_error(channel, _tags.RAISED, FdLimitError(what))
            done += 1
            continue
        except (ChannelClosed, OSError):
            return  # the parent is gone or closed the channel
        if data != _EXIT:
            _send(channel, _STARTED)
        try:
            task = _pickler.loads_received(data, fds)
        except SystemExit:
            raise
        except BaseException as exc:
            unpickling = "the task could not be unpickled in the worker: "
            _send_error(channel, _tags.RAISED, exc, unpickling)
            done += 1
            continue
        if task is None:
            return
        key, fn, forget, form, payload = task
        del task
        if forget is not None:
            functions.pop(forget, None)
        if fn is not None:
            functions[key] = fn
        else:
            fn = functions.get(key)
        done += 1
        try:
            if fn is None:
                raise RuntimeError("the task's function did not reach this worker")
            if form == APPLY:
                value = fn(*payload[0], **payload[1])
            elif form == MAP:
                value = [fn(item) for item in payload]
            else:
                value = [fn(*item) for item in payload]
        except BaseException as exc:
            steps.flush()
            if isinstance(exc, SystemExit) and not executor:
                raise
            del fn, payload
            _send_error(channel, _tags.RAISED, exc)
            continue
        steps.flush()
        try:
            with _main_names.sending_to(_parent_has):
                message = _pickler.dumps((_tags.RESULT, value))
        except BaseException as exc:
            error = _encoding_error(exc, value, fn, executor)
            del value, fn, payload
            _send_error(channel, _tags.RAISED, error)
            continue
        del fn, payload
        del value
        try:
            _send(channel, message.data, message.fds)
        finally:
            message.close()


def _encoding_error(exc: BaseException, value: Any, fn: Any, executor: bool) -> BaseException:
    """What a caller gets for a result that cannot be pickled: the stdlib Pool's
    ``MaybeEncodingError``, the value shown once and long enough to name it; the
    executor's pickling error as it is, with a note that says whose result it was."""
    import reprlib

    shown = reprlib.Repr()
    shown.maxother = shown.maxstring = 160
    name = getattr(fn, "__qualname__", None) or repr(fn)
    if executor:
        note = (
            f"the result of {name}() could not be pickled to send it back: "
            f"{shown.repr(value)}; return something picklable (list(...) of a generator)"
        )
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(note)
            return exc
        return type(exc)(f"{exc} ({note})") if type(exc) in (TypeError, ValueError) else exc
    # typeshed leaves MaybeEncodingError out of multiprocessing.pool
    from multiprocessing.pool import MaybeEncodingError  # type: ignore[attr-defined]

    error: BaseException = MaybeEncodingError(exc, _Shown(f"{shown.repr(value)} from {name}"))
    return error


class _Shown:
    """A value as MaybeEncodingError shows it (it takes the ``repr`` of what it is given):
    shown once, without a second pair of quotes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _send_error(channel: socket.socket, tag: str, exc: BaseException, prefix: str = "") -> None:
    """``(tag, exception packed, traceback text)``: see ``context._raised``."""
    text = _raised.traceback_text(exc, prefix)
    exc.__traceback__ = None  # (its frames' locals, a task's arguments, go now)
    blob = _raised.pack(exc, _parent_has)
    try:
        _send(channel, pickle.dumps((tag, blob, text), pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass  # the parent is gone; the exit code still tells
