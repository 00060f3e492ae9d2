"""Messages with file descriptors attached, over a UNIX stream socket.

Every procspawn channel (spawn results, Queue, SimpleQueue, Pipe, Pool) moves *messages*:
a pickle plus the file descriptors its shared segments need. The descriptors travel with
the bytes (SCM_RIGHTS), so the receiver never connects back to the sender and a message
can still be received after its sender exited.

Wire format of one message::

    header   "PSPN" | u64 body length | u32 number of fds      (16 bytes, little endian)
             the first group of at most 253 fds rides on the header's sendmsg
    pads     one byte per further group of 253 fds, each carrying that group
    body     the pickle

The kernel caps one SCM_RIGHTS control message at 253 descriptors (SCM_MAX_FD), hence the
groups. The receiver reads exactly the bytes the current part needs, so it never reads
into the next message, and it collects descriptors in the order they arrive.

If the receiver is at its RLIMIT_NOFILE the kernel drops descriptors and sets MSG_CTRUNC;
the reader still consumes the whole message (the stream stays in step), closes what did
arrive and raises :class:`FdLimitError` with the limit and both fixes, the message's bytes
on it for ``wire._pickler.give_back_unreceived``.
"""

from __future__ import annotations

import array
import errno
import os
import select
import socket
import struct
import time
from collections.abc import Sequence

from .._errors import ChannelClosed, FdLimitError, raise_fd_limit

_HEADER = struct.Struct("<4sQI")
_MAGIC = b"PSPN"
_MAX_FDS_PER_MSG = 253
_ANC_SPACE = socket.CMSG_SPACE(_MAX_FDS_PER_MSG * array.array("i").itemsize)
_FLAGS = int(getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_CTRUNC = int(socket.MSG_CTRUNC)  # a plain int: IntFlag arithmetic is slow on a hot path


def send_message(sock: socket.socket, data: bytes | memoryview, fds: Sequence[int] = ()) -> None:
    """Send one message (blocking); the caller keeps ownership of ``fds``."""
    if len(fds) <= _MAX_FDS_PER_MSG:
        # the common case: header, body and descriptors in one system call
        header = _HEADER.pack(_MAGIC, len(data), len(fds))
        anc = [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))] if fds else []
        send_rest(sock, data, len(fds), sock.sendmsg([header, data], anc))
        return
    header = _HEADER.pack(_MAGIC, len(data), len(fds))
    groups = [fds[i : i + _MAX_FDS_PER_MSG] for i in range(0, len(fds), _MAX_FDS_PER_MSG)]
    _sendmsg_all(sock, header, [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", groups[0]))])
    for group in groups[1:]:
        _sendmsg_all(sock, b"\0", [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", group))])
    if len(data):
        sock.sendall(data)


def try_send_message(sock: socket.socket, data: bytes, fds: list[int]) -> int:
    """Send one message of at most 253 descriptors without blocking.

    Returns how many of its bytes (header included) went: 0 when the socket is full (then
    nothing went, descriptors neither), all of them, or part (the descriptors went with
    the first byte): finish it with ``send_rest`` before anything else is sent.
    """
    header = _HEADER.pack(_MAGIC, len(data), len(fds))
    anc = [(_SOL_SOCKET, _SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        return sock.sendmsg([header, data], anc, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return 0


def send_rest(sock: socket.socket, data: bytes | memoryview, nfds: int, sent: int) -> None:
    """Send (blocking) what is left of a message of which ``sent`` bytes went already."""
    if sent < _HEADER.size:  # the fds went with the first byte; the rest is plain data
        sock.sendall(_HEADER.pack(_MAGIC, len(data), nfds)[sent:])
        sent = _HEADER.size
    if sent < _HEADER.size + len(data):
        sock.sendall(memoryview(data)[sent - _HEADER.size :])


def send_more(sock: socket.socket, data: bytes | memoryview, nfds: int, sent: int) -> int:
    """Send what the socket takes now (never blocking) of a message of which ``sent``
    bytes went already; returns the new total (``message_size(data)`` when done)."""
    total = _HEADER.size + len(data)
    try:
        while sent < total:
            if sent < _HEADER.size:
                n = sock.send(_HEADER.pack(_MAGIC, len(data), nfds)[sent:], socket.MSG_DONTWAIT)
            else:
                n = sock.send(memoryview(data)[sent - _HEADER.size :], socket.MSG_DONTWAIT)
            sent += n
    except (BlockingIOError, InterruptedError):
        pass
    return sent


def message_size(data: bytes | memoryview) -> int:
    """The bytes a message of ``data`` takes on the wire (at most 253 descriptors)."""
    return _HEADER.size + len(data)


_SOL_SOCKET = socket.SOL_SOCKET
_SCM_RIGHTS = socket.SCM_RIGHTS


def _sendmsg_all(
    sock: socket.socket, chunk: bytes, anc: list[tuple[int, int, array.array[int]]]
) -> None:
    sent = sock.sendmsg([chunk], anc)
    if sent < len(chunk):  # the fds went with the first byte; the rest is plain data
        sock.sendall(chunk[sent:])


_FAST_BODY = 1 << 16  # bodies up to this size are read into bytes in one call


class MessageReader:
    """Reassembles messages from a stream socket, one part at a time.

    ``feed()`` reads only what the current message still needs (never into the next
    one: several processes may read one Queue's socket, each under the queue's lock).
    It works on blocking and non-blocking sockets; a whole small message usually takes
    two calls to the kernel, the header (with the descriptors) and the body.
    """

    def __init__(self, sock: socket.socket) -> None:
        raise_fd_limit()  # descriptors arrive with messages: lift the soft limit first
        self.sock = sock
        self.eof = False
        self._header = bytearray(_HEADER.size)
        self._done: tuple[bytes, list[int]] | None = None
        self._reset()

    def _reset(self) -> None:
        self._part = "header"
        self._buf = self._header
        self._pos = 0
        self._nfds = 0
        self._length = 0
        self._fds: list[int] = []
        self._truncated = False

    @property
    def ready(self) -> bool:
        """True when a whole message waits to be popped."""
        return self._done is not None

    def feed(self) -> bool:
        """Read once (or twice: header, then a body already there). Returns True when a
        whole message is ready (see ``pop``).

        Raises ``ChannelClosed`` at end of stream and ``BlockingIOError`` if a non-blocking
        socket has nothing.
        """
        if self._done is not None:
            return True
        if self._pos < len(self._buf):
            self._read_into(memoryview(self._buf)[self._pos :])
            if self._pos < len(self._buf):
                return False
        return self._advance()

    def _read_into(self, view: memoryview) -> None:
        n, anc, flags, _ = self.sock.recvmsg_into([view], _ANC_SPACE, _FLAGS)
        for level, kind, cdata in anc:
            if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                self._fds.extend(fds)
        if flags & _CTRUNC:
            self._truncated = True
        if n == 0:
            self.eof = True
            raise ChannelClosed("channel closed by the other end")
        self._pos += n

    def _advance(self) -> bool:
        if self._part == "header":
            magic, length, nfds = _HEADER.unpack(self._buf)
            if magic != _MAGIC:
                raise OSError(errno.EPROTO, "procspawn channel out of step: bad message header")
            self._nfds = nfds
            self._length = length
            npads = max(0, (nfds + _MAX_FDS_PER_MSG - 1) // _MAX_FDS_PER_MSG - 1)
            if not npads and length <= _FAST_BODY:
                # the body was sent with the header: usually it is all there already
                try:
                    body = self.sock.recv(length, socket.MSG_DONTWAIT) if length else b""
                except (BlockingIOError, InterruptedError):
                    body = b""
                if len(body) == length:
                    return self._finish(body)
                self._part, self._buf, self._pos = "body", bytearray(length), len(body)
                self._buf[: len(body)] = body
                return False
            self._part, self._buf, self._pos = "pads", bytearray(npads), 0
            if npads:
                return False
        if self._part == "pads":
            self._part, self._buf, self._pos = "body", bytearray(self._length), 0
            if self._length:
                return False
        # body complete
        return self._finish(bytes(self._buf) if len(self._buf) < _FAST_BODY else self._buf)

    def _finish(self, data: bytes | bytearray) -> bool:
        fds = self._fds
        if self._truncated or len(fds) != self._nfds:
            wanted = self._nfds
            for fd in fds:
                os.close(fd)
            self._reset()
            error = FdLimitError(
                f"a message carried {wanted} shared-memory file descriptor(s) and "
                f"{wanted - len(fds)} could not be received"
            )
            # for the catcher to give back what the message's segments counted for this
            # receiver (wire's give_back_unreceived: channels do not unpickle)
            error._unreceived = bytes(data)  # type: ignore[attr-defined]
            raise error
        self._reset()
        # a body read in parts is a bytearray; the readers use it as bytes
        self._done = (data, fds)  # type: ignore[assignment]
        return True

    def pop(self) -> tuple[bytes, list[int]]:
        """Take the finished message: (pickle bytes, received fds owned by the caller)."""
        assert self._done is not None
        done, self._done = self._done, None
        return done

    def close(self) -> None:
        """Close any descriptors of a half-received message."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def wait_readable(fds: list[int], timeout: float | None) -> list[int]:
    """Those of ``fds`` readable or at their end within ``timeout`` seconds (None: no
    limit): ``multiprocessing.connection.wait`` for bare descriptors (a socket, a
    process' sentinel), without importing that module (tempfile, shutil, the compressors:
    ~5 ms of a pool's start)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    ready = poller.poll(None if timeout is None else max(0.0, timeout) * 1000.0)
    return [fd for fd, _events in ready]


def recv_message(reader: MessageReader, deadline: float | None = None) -> tuple[bytes, list[int]]:
    """Wait for one whole message on the reader's (blocking) socket.

    With a ``deadline`` (``time.monotonic()`` seconds) raise TimeoutError when it passes,
    even in the middle of a message (a writer that died mid-send must not hang us); the
    reader keeps what it has, so a later call goes on where this one stopped.
    """
    while True:
        if deadline is not None and not reader.ready:
            remaining = max(0.0, deadline - time.monotonic())
            if not wait_readable([reader.sock.fileno()], remaining):
                raise TimeoutError("no whole message arrived in time")
        if reader.feed():
            return reader.pop()
