"""The child side of ``spawn``: run ``fn(rank, *args)`` and report back on the rank's channel.

The channel carries exactly one message, ``("ok", result)`` or
``("err", pickled exception or None, traceback text)``. Exiting on ``sys.exit(n)`` or a
signal sends nothing; the parent reads the exit code instead.
"""

from __future__ import annotations

import socket
import sys
import traceback
from typing import Any

from ..sharing import _pickler
from ..sharing._fdpass import send_message
from . import _posix


def main(
    payload: Any,
    rank: int,
    channel: socket.socket,
    parent_pid: int,
    use_death_signal: bool,
) -> None:
    """Entry point of every rank (the ``multiprocessing.Process`` target)."""
    channel.settimeout(None)  # blocking, whatever socket.setdefaulttimeout() says
    if use_death_signal:
        _posix.set_parent_death_signal()
    _posix.watch_parent(parent_pid)
    try:
        try:
            fn, args, config = payload.load()
            _apply_config(config)
        except BaseException as exc:
            _report(channel, exc, "while unpickling the arguments in the child: ")
            sys.exit(1)
        try:
            result = fn(rank, *args)
        except SystemExit:
            raise
        except BaseException as exc:  # KeyboardInterrupt included: it is a failure
            _report(channel, exc)
            sys.exit(1)
        try:
            message = _pickler.dumps(("ok", result))
        except BaseException as exc:
            _report(channel, exc, f"the return value of rank {rank} could not be pickled: ")
            sys.exit(1)
        try:
            send_message(channel, message.data, message.fds)
        finally:
            message.close()
    finally:
        channel.close()


def _apply_config(config: dict[str, Any]) -> None:
    from ..sharing import _strategy

    _strategy.restore(config["sharing_strategy"])


def _report(channel: socket.socket, exc: BaseException, prefix: str = "") -> None:
    text = prefix + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        import cloudpickle

        exc_blob: bytes | None = cloudpickle.dumps(exc)
    except BaseException:
        exc_blob = None
    message = _pickler.dumps(("err", exc_blob, text))
    try:
        send_message(channel, message.data, message.fds)
    except OSError:
        pass  # the parent is gone or stopped listening; the exit code still tells
    finally:
        message.close()
