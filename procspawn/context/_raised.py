"""A child's exception on its way to the parent: one codec for ``spawn``'s ranks, their Ray
actors and the pools' workers.

A child that raised sends ``(RAISED, blob, text)`` (``_tags``; ``INIT_FAILED`` for a pool's
initializer): ``text`` is the traceback as the child formatted it, always there; ``blob``
is the exception pickled (:func:`pack`), or None where it cannot travel. The parent
rebuilds it with :func:`unpack` (None where it does not load there) and raises its own
error with the text, the rebuilt exception as the cause or (a pool's task) the very
exception raised.
"""

from __future__ import annotations

import os
import pickle

from ..sharing.wire import _main_names, _pickler

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from types import TracebackType
    from typing import Any

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def traceback_text(exc: BaseException, prefix: str = "", users_only: bool = False) -> str:
    """``exc``'s traceback as text, after ``prefix``; ``users_only``: from its first frame
    that is not procspawn's (what the user sees starts at their own code). Its type and
    message alone where even the traceback module cannot be imported (a process out of
    descriptors)."""
    try:
        import traceback  # on failure only: a child that succeeds does not pay for it
    except OSError:
        return f"{prefix}{type(exc).__name__}: {exc}\n"
    tb = _users(exc.__traceback__) if users_only else exc.__traceback__
    return prefix + "".join(traceback.format_exception(type(exc), exc, tb))


def _users(tb: TracebackType | None) -> TracebackType | None:
    first = tb
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
        tb = tb.tb_next
    return tb if tb is not None else first


def pack(exc: BaseException, receiver_has: dict[str, Any] | str | None = None) -> bytes | None:
    """``exc`` pickled for the parent, or None if it cannot travel. ``receiver_has``: what
    the parent's main module has (``_main_names``), whose classes then go by name (an
    ``except`` of the parent's own class catches it), the rest by value.

    Checked by loading it here: an exception that pickles but does not load back (an
    ``__init__`` with arguments its ``args`` do not hold) goes by the standard library's
    pickle alone if that loads, else not at all. Arrays in it travel by value."""
    for dumps in (_by_procspawn, _by_cloudpickle, _by_pickle):
        try:
            blob = dumps(exc, receiver_has)
            if blob is not None:
                pickle.loads(blob)
                return blob
        except BaseException:
            continue
    return None


def _by_procspawn(exc: BaseException, receiver_has: Any) -> bytes | None:
    """By procspawn's pickler (main-module names as the receiver has them); None when it
    would send descriptors or shared segments (an array in the exception): a blob carries
    neither."""
    if receiver_has is None:
        return None
    with _main_names.sending_to(receiver_has):
        message = _pickler.dumps(exc)
    if message.fds or message.on_abandon:
        message.abandon()  # never sent: what it counted for a receiver goes back
        return None
    blob = bytes(message.data)
    message.close()
    return blob


def _by_cloudpickle(exc: BaseException, receiver_has: Any) -> bytes:
    import cloudpickle

    blob: bytes = cloudpickle.dumps(exc)
    return blob


def _by_pickle(exc: BaseException, receiver_has: Any) -> bytes:
    return pickle.dumps(exc, pickle.HIGHEST_PROTOCOL)


def unpack(blob: bytes | None) -> BaseException | None:
    """The exception a child packed, or None when there is none or it does not load here
    (the traceback text still tells)."""
    if blob is None:
        return None
    try:
        exc = pickle.loads(blob)
    except BaseException:  # (a SystemExit from a __setstate__ too: not the caller's)
        return None
    return exc if isinstance(exc, BaseException) else None


__all__ = ["pack", "traceback_text", "unpack"]
