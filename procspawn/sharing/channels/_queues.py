"""Queue, JoinableQueue and SimpleQueue over procspawn Connections.

Same interface and semantics as ``multiprocessing``'s, with two differences that follow
from the data path: an object is pickled in ``put`` itself (so an unpicklable object raises
there, in the caller, instead of being lost in the feeder thread), and arrays move through
shared memory with their descriptors inside the message. Queue keeps multiprocessing's
feeder thread, so ``put`` never blocks on a full socket buffer.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import types
import weakref
from multiprocessing import context as mp_context
from multiprocessing.synchronize import SEM_VALUE_MAX  # type: ignore[attr-defined]  # untyped
from multiprocessing.util import Finalize, register_after_fork
from queue import Empty, Full
from typing import Any

from .. import _message
from .._errors import FdLimitError
from ..wire import _pickler
from ._connection import Pipe
from ._fdpass import message_size

_SENTINEL = object()
_DIRECT_BYTES = 1 << 16  # put() itself may send messages up to this size (see _send_now)
_DIRECT_FDS = 253


class _Rest:
    """What ``put`` could not send without blocking of a message it began: the feeder
    sends it, then releases the write lock ``put`` took."""

    __slots__ = ("message", "sent")

    def __init__(self, message: _message.Message, sent: int) -> None:
        self.message = message
        self.sent = sent


class Queue:
    """A process-shared FIFO queue (``multiprocessing.Queue`` that shares arrays)."""

    def __init__(self, maxsize: int = 0, *, ctx: Any) -> None:
        if maxsize <= 0:
            maxsize = SEM_VALUE_MAX
        self._maxsize = maxsize
        self._reader, self._writer = Pipe(duplex=False)
        self._rlock = ctx.Lock()
        self._wlock = ctx.Lock()
        self._sem = ctx.BoundedSemaphore(maxsize)
        self._opid = os.getpid()
        self._reset()
        register_after_fork(self, Queue._after_fork)

    _STATE = ("_maxsize", "_reader", "_writer", "_rlock", "_wlock", "_sem", "_opid")

    def __getstate__(self) -> tuple[Any, ...]:
        mp_context.assert_spawning(self)
        return tuple(getattr(self, name) for name in Queue._STATE)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(Queue._STATE, state, strict=True):
            setattr(self, name, value)
        self._reset()

    def _after_fork(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._notempty = threading.Condition(threading.Lock())
        self._buffer: collections.deque[Any] = collections.deque()
        self._pending = [0]  # messages handed to the feeder and not yet sent
        self._thread: threading.Thread | None = None
        self._jointhread: Finalize | None = None
        self._joincancelled = False
        self._closed = False
        self._close: Finalize | None = None

    # -- put/get -----------------------------------------------------------------------

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` on the queue; it is pickled now, arrays go through shared memory."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if not self._sem.acquire(block, timeout):
            raise Full
        try:
            message = _pickler.dumps(obj)
        except BaseException:
            self._sem.release()
            raise
        self._count_task()
        if not self._send_now(message):
            with self._notempty:
                self._enqueue_locked(message)

    def _count_task(self) -> None:
        """A new item is about to become visible (JoinableQueue counts it)."""

    def _send_now(self, message: _message.Message) -> bool:
        """Send ``message`` from this thread when that cannot block and keeps the order:
        nothing of this process waits for the feeder, no other process is writing, and
        the socket takes at least its first byte at once (the feeder sends the rest).
        Saves the hand-over to the feeder thread. False: not sent, nothing changed."""
        if len(message.data) > _DIRECT_BYTES or len(message.fds) > _DIRECT_FDS:
            return False
        with self._notempty:
            if self._pending[0] or not self._wlock.acquire(False):
                return False
            try:
                sent = self._writer._try_send_message(message)
            except OSError:
                self._wlock.release()
                message.abandon()  # the reading end is gone: nobody will get it
                return True
            if sent == 0:
                self._wlock.release()
                return False
            if sent < message_size(message.data):
                self._enqueue_locked(_Rest(message, sent))  # keeps the write lock
                return True
            self._wlock.release()
        message.close()
        return True

    def _enqueue_locked(self, item: Any) -> None:
        # with self._notempty held
        if self._thread is None:
            self._start_thread()
        self._buffer.append(item)
        self._pending[0] += 1
        self._notempty.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return an item; ``queue.Empty`` after ``timeout`` seconds."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if block and timeout is None:
            with self._rlock:
                data, fds = self._receive()
        else:
            deadline = time.monotonic() + (timeout or 0.0)
            if not self._rlock.acquire(block, timeout):
                raise Empty
            try:
                if not block:
                    deadline = time.monotonic()
                data, fds = self._receive(deadline)
            except TimeoutError:
                raise Empty from None
            finally:
                self._rlock.release()
        return _pickler.loads_received(data, fds)

    def _receive(self, deadline: float | None = None) -> tuple[bytes, list[int]]:
        """One message off the pipe; its slot is given back even if receiving it failed
        (FdLimitError consumes the whole message). TimeoutError once ``deadline`` passed,
        even mid-message: a writer killed mid-send must not hang every reader."""
        try:
            message = self._reader._recv_message(deadline)
        except FdLimitError:
            self._sem.release()
            raise
        self._sem.release()
        return message

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        taken: int = self._sem._semlock._get_value()  # the stdlib's SemLock, untyped
        return self._maxsize - taken

    def empty(self) -> bool:
        return not self._reader.poll()

    def full(self) -> bool:
        return bool(self._sem._semlock._is_zero())

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """No more puts from this process; the feeder flushes what is buffered."""
        self._closed = True
        close = self._close
        if close is not None:
            self._close = None
            close()
        self._reader.close()
        if self._thread is None:
            self._writer.close()

    def join_thread(self) -> None:
        """Wait for the feeder thread to flush (after ``close``)."""
        assert self._closed, f"Queue {self!r} not closed"
        if self._jointhread is not None:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        """Do not wait for the feeder at exit (buffered items may be lost)."""
        self._joincancelled = True
        if self._jointhread is not None:
            self._jointhread.cancel()

    def _start_thread(self) -> None:
        self._buffer.clear()
        self._thread = threading.Thread(
            target=Queue._feed,
            args=(self._buffer, self._notempty, self._writer, self._wlock, self._pending),
            name="procspawn-QueueFeederThread",
            daemon=True,
        )
        self._thread.start()
        if not self._joincancelled:
            self._jointhread = Finalize(
                self._thread,
                Queue._finalize_join,
                [weakref.ref(self._thread)],
                exitpriority=-5,
            )
        self._close = Finalize(
            self, Queue._finalize_close, [self._buffer, self._notempty], exitpriority=10
        )

    @staticmethod
    def _finalize_join(twr: weakref.ref[threading.Thread]) -> None:
        thread = twr()
        if thread is not None:
            thread.join()

    @staticmethod
    def _finalize_close(buffer: collections.deque[Any], notempty: threading.Condition) -> None:
        with notempty:
            buffer.append(_SENTINEL)
            notempty.notify()

    @staticmethod
    def _feed(
        buffer: collections.deque[Any],
        notempty: threading.Condition,
        writer: Any,
        wlock: Any,
        pending: list[int],
    ) -> None:
        while True:
            with notempty:
                while not buffer:
                    notempty.wait()
                items = list(buffer)
                buffer.clear()
            for item in items:
                if item is _SENTINEL:
                    writer.close()
                    for rest in items[items.index(item) + 1 :]:
                        if type(rest) is _Rest:  # a put() racing close(): give all back
                            wlock.release()
                            rest = rest.message
                        if rest is not _SENTINEL:
                            rest.abandon()
                    return
                if type(item) is _Rest:
                    message = item.message
                    try:
                        writer._send_rest(message, item.sent)
                    except OSError:
                        message.abandon()
                    else:
                        message.close()
                    finally:
                        wlock.release()  # taken by put() when it began the message
                else:
                    try:
                        with wlock:
                            writer._send_message(item)
                    except OSError:
                        item.abandon()  # the reading end is gone: nobody will get it
                    else:
                        item.close()
                with notempty:
                    pending[0] -= 1


class JoinableQueue(Queue):
    """A Queue with ``task_done()`` and ``join()``."""

    def __init__(self, maxsize: int = 0, *, ctx: Any) -> None:
        super().__init__(maxsize, ctx=ctx)
        self._unfinished_tasks = ctx.Semaphore(0)
        self._cond = ctx.Condition()

    def __getstate__(self) -> tuple[Any, ...]:
        return super().__getstate__() + (self._cond, self._unfinished_tasks)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        super().__setstate__(state[:-2])
        self._cond, self._unfinished_tasks = state[-2:]

    def _count_task(self) -> None:
        # before the item can be got: task_done() must never see it uncounted
        with self._cond:
            self._unfinished_tasks.release()

    def task_done(self) -> None:
        with self._cond:
            if not self._unfinished_tasks.acquire(False):
                raise ValueError("task_done() called too many times")
            if self._unfinished_tasks._semlock._is_zero():
                self._cond.notify_all()

    def join(self) -> None:
        with self._cond:
            if not self._unfinished_tasks._semlock._is_zero():
                self._cond.wait()


class SimpleQueue:
    """A locked pipe: ``put`` sends at once (``multiprocessing.SimpleQueue`` sharing arrays)."""

    def __init__(self, *, ctx: Any) -> None:
        self._reader, self._writer = Pipe(duplex=False)
        self._rlock = ctx.Lock()
        self._wlock = ctx.Lock()
        self._poll = self._reader.poll

    def __getstate__(self) -> tuple[Any, ...]:
        mp_context.assert_spawning(self)
        return (self._reader, self._writer, self._rlock, self._wlock)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self._reader, self._writer, self._rlock, self._wlock) = state
        self._poll = self._reader.poll

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    def empty(self) -> bool:
        return not self._poll()

    def get(self) -> Any:
        with self._rlock:
            data, fds = self._reader._recv_message()
        return _pickler.loads_received(data, fds)

    def put(self, obj: Any) -> None:
        message = _pickler.dumps(obj)
        try:
            with self._wlock:
                self._writer._send_message(message)
        except BaseException:
            message.abandon()
            raise
        message.close()

    def __class_getitem__(cls, item: Any) -> types.GenericAlias:  # as the stdlib's
        return types.GenericAlias(cls, item)


_pickler.defer_at_start(Queue, SimpleQueue)
