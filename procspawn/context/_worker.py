"""The child side of ``spawn``: run ``fn(rank, *args)`` and report back on the rank's channel.

The channel carries exactly one message, ``(RESULT, result)`` or
``(RAISED, pickled exception or None, traceback text)`` (``_tags``). Exiting on ``sys.exit(n)`` or a
signal sends nothing; the parent reads the exit code instead.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

from ..sharing import _message
from ..sharing.channels._fdpass import send_message
from ..sharing.wire import _pickler
from . import _raised, _tags
from .launch import _posix


def main(
    payload: Any,
    rank: int,
    world_size: int,
    channel: socket.socket,
    parent_pid: int,
    use_death_signal: bool,
    redirect: Any = None,
    environ: dict[str, str] | None = None,
) -> None:
    """Entry point of every rank (the ``multiprocessing.Process`` target)."""
    if redirect is not None:
        redirect.apply()  # fork, forkserver: output to the parent's pipes from here on
    if environ is not None:  # forkserver: the parent's environment, not the server's
        os.environ.clear()
        os.environ.update(environ)
    channel.settimeout(None)  # blocking, whatever socket.setdefaulttimeout() says
    _posix.guard_parent(parent_pid, use_death_signal)
    _set_rank_environment(rank, world_size)
    _interrupt_once()
    try:
        try:
            fn, args, kwargs, config = payload.load()
            _apply_config(config, rank)
        except BaseException as exc:
            _report(channel, exc, "while unpickling the arguments in the child: ")
            sys.exit(1)
        try:
            # blocked since the parent started us (see sigint_blocked): a Ctrl-C that
            # came meanwhile is this rank's KeyboardInterrupt now, as if fn had begun
            _posix.unblock_sigint()
            result = fn(rank, *args, **kwargs)
        except SystemExit:
            raise
        except BaseException as exc:  # KeyboardInterrupt included: it is a failure
            _report(channel, exc)
            sys.exit(1)
        try:
            durable = _message.set_durable(True)  # read after this rank exited
            try:
                message = _pickler.dumps((_tags.RESULT, result))
            finally:
                _message.set_durable(durable)
        except BaseException as exc:
            _report(channel, exc, f"the return value of rank {rank} could not be pickled: ")
            sys.exit(1)
        try:
            send_message(channel, message.data, message.fds)
        finally:
            message.close()
    finally:
        channel.close()


def rank_environment(rank: int, world_size: int) -> dict[str, str]:
    """torchrun's names, so code written for it finds its rank (one machine: local = global).

    Under spawn they are also set before the main module is imported again in the rank
    (see ``_popen``), so its top level sees them too.
    """
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def _set_rank_environment(rank: int, world_size: int) -> None:
    os.environ.update(rank_environment(rank, world_size))


def _interrupt_once() -> None:
    """The first SIGINT raises KeyboardInterrupt; later ones are ignored.

    Ctrl-C in a terminal reaches every process of the group, ranks included, and the parent
    forwards it to the ranks as well: a rank sees it twice. Raising only once lets its
    ``finally`` blocks run to the end, within the parent's grace period.
    """
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # the user's own handler (or SIG_IGN, inherited): leave it

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def _apply_config(config: dict[str, Any], rank: int) -> None:
    from ..sharing.segments import _strategy

    _strategy.restore(config["sharing_strategy"])
    if config.get("progress") is not None:
        from . import _progress

        _progress.attach(config["progress"], rank)


def _report(channel: socket.socket, exc: BaseException, prefix: str = "") -> None:
    text = _raised.traceback_text(exc, prefix, users_only=True)
    message = _pickler.dumps((_tags.RAISED, _raised.pack(exc), text))
    try:
        send_message(channel, message.data, message.fds)
    except OSError:
        pass  # the parent is gone or stopped listening; the exit code still tells
    finally:
        message.close()
