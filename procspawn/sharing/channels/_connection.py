"""Connection and Pipe over a UNIX socket, through procspawn's pickler.

Like ``multiprocessing.connection.Connection`` (send/recv/poll/send_bytes/recv_bytes/
close), but every message is a procspawn message: arrays travel as shared-memory handles
and their descriptors ride along (SCM_RIGHTS), so ``recv`` never connects back to the
sender. A Connection pickles at process start (``DupFd``) and inside procspawn messages
(its descriptor rides along too).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from .. import _message
from .._errors import ChannelClosed, FdLimitError
from ..wire import _pickler
from ._fdpass import (
    MessageReader,
    recv_message,
    send_message,
    send_rest,
    try_send_message,
)


class Connection:
    """One end of a procspawn Pipe."""

    def __init__(self, sock: socket.socket, readable: bool = True, writable: bool = True):
        self._sock: socket.socket | None = None
        if not (readable or writable):
            raise ValueError("at least one of `readable` and `writable` must be True")
        # blocking whatever socket.setdefaulttimeout() says (a program's network code may
        # set one; it must not turn a recv() of ours into a TimeoutError)
        sock.settimeout(None)
        self._sock = sock
        self._reader = MessageReader(sock)
        self._readable = readable
        self._writable = writable

    # -- state -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def _check(self, writing: bool = False, reading: bool = False) -> socket.socket:
        if self._sock is None:
            raise OSError("handle is closed")
        if writing and not self._writable:
            raise OSError("connection is read-only")
        if reading and not self._readable:
            raise OSError("connection is write-only")
        return self._sock

    def fileno(self) -> int:
        return self._check().fileno()

    def close(self) -> None:
        if self._sock is not None:
            self._reader.close()
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # -- objects -----------------------------------------------------------------------

    def send(self, obj: Any) -> None:
        """Send a picklable object; arrays go through shared memory."""
        sock = self._check(writing=True)
        message = _pickler.dumps(obj)
        try:
            send_message(sock, message.data, message.fds)
        except BaseException:
            message.abandon()
            raise
        message.close()

    def recv(self) -> Any:
        """Receive an object sent with ``send`` (blocks). EOFError when the other end closed."""
        data, fds = self._recv_message()
        return _pickler.loads_received(data, fds)

    # -- raw messages (procspawn's queues; not part of multiprocessing's interface) ----

    def _send_message(self, message: _message.Message) -> None:
        """Send an already pickled message (the caller closes it)."""
        send_message(self._check(writing=True), message.data, message.fds)

    def _try_send_message(self, message: _message.Message) -> int:
        """Send without blocking; how many bytes went (see ``_fdpass.try_send_message``)."""
        return try_send_message(self._check(writing=True), message.data, message.fds)

    def _send_rest(self, message: _message.Message, sent: int) -> None:
        """Finish (blocking) a message ``_try_send_message`` sent ``sent`` bytes of."""
        send_rest(self._check(writing=True), message.data, len(message.fds), sent)

    def _recv_message(self, deadline: float | None = None) -> tuple[bytes, list[int]]:
        """Receive one raw message: (pickle bytes, descriptors owned by the caller).

        Raises:
            TimeoutError: ``deadline`` (``time.monotonic()``) passed first.
            EOFError: the other end closed and nothing is left to receive.
            OSError: the other end closed in the middle of a message (as the stdlib's
                "got end of file during message").
        """
        reader = self._reader
        self._check(reading=True)
        try:
            return recv_message(reader, deadline)
        except ChannelClosed:
            if reader._part != "header" or reader._pos:  # a message was cut short
                raise OSError("got end of file during message") from None
            raise
        except FdLimitError as exc:  # the message is lost: what it held goes back
            _pickler.give_back_unreceived(exc)
            raise

    # -- bytes -------------------------------------------------------------------------

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        """Send ``size`` bytes of a bytes-like object from ``offset`` (default: the rest).

        Raises:
            ValueError: ``offset`` or ``size`` is negative or past the end of ``buf``.
        """
        sock = self._check(writing=True)
        view = memoryview(buf)
        if view.itemsize > 1:
            view = view.cast("B")
        n = view.nbytes
        if offset < 0:
            raise ValueError("offset is negative")
        if n < offset:
            raise ValueError("buffer length < offset")
        if size is None:
            size = n - offset
        elif size < 0:
            raise ValueError("size is negative")
        elif offset + size > n:
            raise ValueError("buffer length < offset + size")
        send_message(sock, view[offset : offset + size], [])

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """Receive one message sent with ``send_bytes``.

        Raises:
            ValueError: ``maxlength`` is negative.
            OSError: the message is longer than ``maxlength``; as with the stdlib, this end
                is no longer readable then (a read-only end is closed).
            EOFError: the other end closed and nothing is left to receive.
        """
        self._check(reading=True)
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        data = self._recv_raw()
        if maxlength is not None and len(data) > maxlength:
            # the message was read whole, but multiprocessing's stream is out of step
            # here and code written for it expects this end unusable for reading
            if self._writable:
                self._readable = False
            else:
                self.close()
            raise OSError("bad message length")
        return bytes(data)

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        """Receive one message into the writable bytes-like ``buf`` from byte ``offset``;
        returns its size.

        Raises:
            ValueError: ``offset`` is negative or past the end of ``buf``.
            multiprocessing.BufferTooShort: the message does not fit; its bytes are the
                exception's ``args[0]``.
        """
        self._check(reading=True)
        with memoryview(buf) as view:
            itemsize = view.itemsize
            bytesize = itemsize * len(view)
            if offset < 0:
                raise ValueError("negative offset")
            if offset > bytesize:
                raise ValueError("offset too large")
            data = self._recv_raw()
            size = len(data)
            if bytesize < offset + size:
                from multiprocessing import BufferTooShort

                raise BufferTooShort(bytes(data))
            view.cast("B")[offset : offset + size] = data
            return size

    def _recv_raw(self) -> bytes | bytearray:
        data, fds = self._recv_message()
        for fd in fds:  # a message of objects read as bytes: its descriptors are not ours
            os.close(fd)
        return data

    def poll(self, timeout: float | None = 0.0) -> bool:
        """True when there is something to receive (waits up to ``timeout`` seconds)."""
        sock = self._check(reading=True)
        if self._reader.ready:
            return True
        # wait() polls (select.select fails on descriptor numbers >= 1024)
        return bool(wait([sock], timeout))

    # -- pickling ----------------------------------------------------------------------

    def __reduce__(self) -> tuple[Callable[..., Connection], tuple[Any, ...]]:
        sock = self._check()
        state = _message.sending_or_none()
        if state is not None:  # inside a procspawn message: a duplicate rides along, so
            # closing this Connection before the message is sent changes nothing
            dup = _OwnedFd(os.dup(sock.fileno()))
            index = state.add_fd(dup.fd, dup)
            return (_rebuild_from_message, (index, self._readable, self._writable))
        from multiprocessing.reduction import DupFd

        return (_rebuild_from_dupfd, (DupFd(sock.fileno()), self._readable, self._writable))


class _OwnedFd:
    """A descriptor closed when the last message holding it lets go."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        os.close(self.fd)


def _from_fd(fd: int, readable: bool, writable: bool) -> Connection:
    return Connection(socket.socket(fileno=fd), readable, writable)


def _rebuild_from_message(index: int, readable: bool, writable: bool) -> Connection:
    return _from_fd(os.dup(_message.received_fd(index)), readable, writable)


def _rebuild_from_dupfd(dupfd: Any, readable: bool, writable: bool) -> Connection:
    return _from_fd(dupfd.detach(), readable, writable)


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """A pair of connected Connections; with ``duplex=False``, (receive end, send end)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if duplex:
        return Connection(a), Connection(b)
    a.shutdown(socket.SHUT_WR)
    b.shutdown(socket.SHUT_RD)
    return Connection(a, writable=False), Connection(b, readable=False)


_pickler.defer_at_start(Connection)
