"""Producer and consumer processes for bench_transfer.py, importable by spawn children.

A transport is named by its family and mode:

* family "small" (a tiny int, the floor of any Queue), "stdlib" (ndarray pickled through
  the pipe), "shm" (``multiprocessing.shared_memory`` by hand: the array is made once and
  only its name is sent), "procspawn" or "torch";
* mode "shared" (one array in shared memory, made once, the same one put every time),
  "unshared" (a fresh plain copy put every time, which the transport must move) or
  "filled" (procspawn and torch only: a new array filled with FILL, then moved into shared
  memory, for every item: ``sharing.share_memory_(np.full(...))`` /
  ``torch.full(...).share_memory_()``, every page written as fresh data would be), or
  "fresh" (procspawn and torch only: a new zero-filled shared array made for every item,
  its last byte set to FILL, put and dropped by the producer).

Messages to the parent are ``(kind, value)`` tuples on a stdlib Pipe; ``("error", text)``
reports a failure. procspawn and torch are imported only by the children that use them.
"""

from __future__ import annotations

import queue
import resource
import time
from collections.abc import Callable
from contextlib import ExitStack
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

FILL = 7  # every byte the producer sends; the consumer checks the last one
FRESH_MODES = ("fresh", "filled")  # a new shared array per item
LIVE_FD_LIMIT = 1024  # RLIMIT_NOFILE (soft and hard) of the many-live-arrays consumer
LIVE_ITEM_FLOATS = 64
PUT_POLL_SECONDS = 0.2
GET_TIMEOUT_SECONDS = 60.0


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# -- per-item latency -------------------------------------------------------------------------


def produce(
    q: Any,
    conn: Connection,
    family: str,
    mode: str,
    strategy: str | None,
    nbytes: int,
    n: int,
    rounds: int,
) -> None:
    """For each round: wait for "go", put ``n`` items, report the time of the first put.

    Stays alive until the parent's final message, so that whatever the items refer to
    (torch's descriptor server, the SharedMemory name) outlives their delivery.
    """
    try:
        with ExitStack() as stack:
            make_item = _item_maker(family, mode, strategy, nbytes, stack)
            conn.send(("ready", None))
            for _ in range(rounds):
                conn.recv()
                start = time.time()
                for _ in range(n):
                    q.put(make_item())
                conn.send(("start", start))
            conn.recv()
    except Exception as exc:
        conn.send(("error", _describe(exc)))


def consume(q: Any, conn: Connection, family: str, nbytes: int, n: int, rounds: int) -> None:
    """For each round: get ``n`` items, check each, report the time of the last get."""
    try:
        with ExitStack() as stack:
            resolve = _shm_resolver(nbytes, stack) if family == "shm" else _as_is
            conn.send(("ready", None))
            for _ in range(rounds):
                for _ in range(n):
                    _check(resolve(q.get()), family, nbytes)
                conn.send(("end", time.time()))
    except Exception as exc:
        conn.send(("error", _describe(exc)))


def produce_paced(
    q: Any,
    conn: Connection,
    ack: Connection,
    family: str,
    mode: str,
    strategy: str | None,
    nbytes: int,
    n: int,
) -> None:
    """On "go", put ``n`` items ("shared" or "fresh") one at a time, each once the consumer
    acknowledged the one before on ``ack``, dropping each once put; report the
    ``time.monotonic()`` just before every put ("shared") or every item's making
    ("fresh")."""
    try:
        with ExitStack() as stack:
            make_item = _item_maker(family, mode, strategy, nbytes, stack)
            conn.send(("ready", None))
            conn.recv()
            starts = []
            for _ in range(n):
                before_make = time.monotonic()
                item = make_item()
                starts.append(before_make if mode in FRESH_MODES else time.monotonic())
                q.put(item)
                del item  # the Queue keeps it until it is sent
                ack.recv()
            conn.send(("starts", starts))
            conn.recv()
    except Exception as exc:
        conn.send(("error", _describe(exc)))


def consume_paced(
    q: Any, conn: Connection, ack: Connection, family: str, mode: str, nbytes: int, n: int
) -> None:
    """Get ``n`` items, check each, drop it, acknowledge it on ``ack``; report the
    ``time.monotonic()`` of each once checked ("shared") or once dropped ("fresh": the
    drop releases the item's memory here, part of its cost)."""
    try:
        with ExitStack() as stack:
            resolve = _shm_resolver(nbytes, stack) if family == "shm" else _as_is
            conn.send(("ready", None))
            ends = []
            for _ in range(n):
                item = resolve(q.get(timeout=GET_TIMEOUT_SECONDS))
                _check(item, family, nbytes)
                checked = time.monotonic()
                del item
                ends.append(time.monotonic() if mode in FRESH_MODES else checked)
                ack.send(None)
            conn.send(("ends", ends))
    except Exception as exc:
        conn.send(("error", _describe(exc)))


def _item_maker(
    family: str, mode: str, strategy: str | None, nbytes: int, stack: ExitStack
) -> Callable[[], Any]:
    """What the producer puts each time: the same shared object, a fresh copy, or a new
    shared array."""
    if family == "small":
        return lambda: 1
    if family == "shm":
        return _shm_maker(nbytes, stack)
    if family == "torch":
        return _torch_maker(mode, strategy, nbytes)
    if family == "procspawn":
        sharing = _procspawn_sharing(strategy)
        if mode == "shared":
            array = sharing.zeros(nbytes, np.uint8)
            array.fill(FILL)
            return lambda: array
        if mode == "fresh":
            return lambda: _marked(sharing.zeros(nbytes, dtype=np.uint8))
        if mode == "filled":
            return lambda: sharing.share_memory_(np.full(nbytes, FILL, np.uint8))
    return np.full(nbytes, FILL, np.uint8).copy


def _marked(item: Any) -> Any:
    """``item`` with its last element set to FILL (what _check reads), so not all zero."""
    item[-1] = FILL
    return item


def _shm_maker(nbytes: int, stack: ExitStack) -> Callable[[], str]:
    """A SharedMemory block made and filled once; each item is its name."""
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    stack.callback(shm.unlink)
    stack.callback(shm.close)  # ExitStack runs callbacks last-in first-out
    np.ndarray((nbytes,), np.uint8, buffer=shm.buf).fill(FILL)
    name = shm.name
    return lambda: name


def _procspawn_sharing(strategy: str | None) -> Any:
    """procspawn.sharing, once checked that this child inherited the parent's strategy."""
    import procspawn

    inherited = procspawn.get_sharing_strategy()
    if inherited != strategy:
        raise RuntimeError(f"the child uses sharing strategy {inherited!r}, not {strategy!r}")
    return procspawn.sharing


def _torch_maker(mode: str, strategy: str | None, nbytes: int) -> Callable[[], Any]:
    """The same tensor after ``share_memory_()``, a fresh clone of a plain one, or a new
    tensor after ``share_memory_()``."""
    import torch
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy(strategy)
    if mode == "fresh":
        return lambda: _marked(torch.zeros(nbytes, dtype=torch.uint8).share_memory_())
    if mode == "filled":
        return lambda: torch.full((nbytes,), FILL, dtype=torch.uint8).share_memory_()
    tensor = torch.full((nbytes,), FILL, dtype=torch.uint8)
    if mode == "shared":
        tensor.share_memory_()
        return lambda: tensor
    return tensor.clone


def _as_is(item: Any) -> Any:
    return item


def _shm_resolver(nbytes: int, stack: ExitStack) -> Callable[[str], np.ndarray]:
    """Name -> ndarray over the SharedMemory block, attached once per name."""
    arrays: dict[str, np.ndarray] = {}

    def resolve(name: str) -> np.ndarray:
        if name not in arrays:
            shm = shared_memory.SharedMemory(name=name)
            stack.callback(shm.close)
            arrays[name] = np.ndarray((nbytes,), np.uint8, buffer=shm.buf)
            stack.callback(arrays.pop, name)  # runs before close: no buffer exported then
        return arrays[name]

    return resolve


def _check(item: Any, family: str, nbytes: int) -> None:
    if family != "small" and (len(item) != nbytes or int(item[-1]) != FILL):
        raise ValueError(f"received a wrong item: {len(item)} bytes, last byte {item[-1]}")


# -- many live arrays -----------------------------------------------------------------------


def hold_many(q: Any, conn: Connection, count: int) -> None:
    """Under RLIMIT_NOFILE = 1024, receive and keep up to ``count`` arrays.

    Reports ``("held", (how many were held, error text or None, seconds per item from
    the first get to the last, or None))``.
    """
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIVE_FD_LIMIT, LIVE_FD_LIMIT))
    held: list[Any] = []
    error = None
    first = last = time.monotonic()
    try:
        while len(held) < count:
            item = q.get(timeout=GET_TIMEOUT_SECONDS)
            if item is None:
                error = "the producer stopped early (see its error)"
                break
            held.append(item)
            last = time.monotonic()
            if len(held) == 1:
                first = last
    except Exception as exc:
        error = _describe(exc)
    per_item = (last - first) / (len(held) - 1) if len(held) > 1 else None
    conn.send(("held", (len(held), error, per_item)))
    held.clear()


def send_many(q: Any, conn: Connection, family: str, strategy: str, count: int) -> None:
    """Make and put up to ``count`` small shared arrays, each dropped once put.

    Stops early when the parent sends "stop" (the consumer has reported); reports
    ``("sent", (how many were put, error text or None))``, then waits for "stop".
    """
    sent, error = 0, None
    try:
        make_item = _live_maker(family, strategy)
        while sent < count and _put(q, make_item(), conn):
            sent += 1
    except Exception as exc:
        error = _describe(exc)
        _put(q, None, conn)
    conn.send(("sent", (sent, error)))
    conn.recv()
    q.cancel_join_thread()  # items the consumer never took must not block the exit


def _live_maker(family: str, strategy: str) -> Callable[[], Any]:
    if family == "procspawn":
        sharing = _procspawn_sharing(strategy)
        return lambda: sharing.zeros(LIVE_ITEM_FLOATS, np.float32)
    import torch
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy(strategy)
    return lambda: torch.zeros(LIVE_ITEM_FLOATS).share_memory_()


def _put(q: Any, item: Any, conn: Connection) -> bool:
    """Put ``item`` into the bounded queue unless the parent says stop first."""
    while not conn.poll():
        try:
            q.put(item, timeout=PUT_POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False
