"""The parent's side of one pool worker: its process and channel, the tasks it holds, what
is queued to send it, the functions it was sent, and how it is stopped.

Only the dispatcher thread touches a ``Worker``; the dispatcher decides, a worker carries
out (start, send, retire, stop, kill, close) and keeps its own state.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import time
import weakref

from .. import _log
from ..context._watch import WatchedChild, send_signal
from ..context.launch._child import parent_death_signal_is_safe, start_child
from ..context.launch._posix import kill_tree
from ..sharing.channels._fdpass import (
    message_size,
    send_message,
    send_more,
    try_send_message,
)
from ..sharing.wire import _main_names, _pickler
from . import _worker

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from typing import Any

    from .._output import OutputForwarder
    from ..context._watch import Watcher
    from ..sharing._message import Message
    from ..sharing.channels._startup import StartupMessage
    from ._tasks import Task

FUNCTIONS_KEPT = 16  # functions a worker keeps, the most recently used
_MAX_FDS_NONBLOCKING = 253  # a message with more descriptors is sent blocking


class Worker(WatchedChild):
    """One worker process as the dispatcher sees it: a watched child (its key in the
    watcher is the worker itself, its output's the slot) with the pool's state."""

    __slots__ = (
        "slot",
        "tasks",
        "functions",
        "tasks_left",
        "ready",
        "main_index",
        "outbox",
        "running",
        "started_at",
        "deadline",
        "idle_since",
        "stopping",
        "kill_at",
        "killed_for",
    )

    def __init__(
        self,
        slot: int,
        proc: BaseProcess,
        sock: socket.socket,
        watcher: Watcher,
        tasks_left: int | None,
        oom_count: int | None,
        main_index: dict[str, Any] | None,
    ) -> None:
        self.slot = slot
        self.tasks: collections.deque[Task] = collections.deque()
        # the functions it was sent, by the id of the parent's object (held weakly)
        self.functions: collections.OrderedDict[int, weakref.ref[Any]] = collections.OrderedDict()
        self.tasks_left = tasks_left  # it may be given this many more (None: no limit)
        self.ready = False  # its initializer ran
        # the functions and classes its main module has (see _main_names): a snapshot at
        # the fork, else what it says when it is ready; no task is pickled for it before
        self.main_index = main_index
        # messages not yet wholly sent: [Message, bytes sent so far]
        self.outbox: collections.deque[list[Any]] = collections.deque()
        self.running = False  # it took tasks[0] off its channel (and may be running it)
        self.started_at: float | None = None  # when it took tasks[0]
        self.deadline: float | None = None  # task_timeout: when its running task is late
        self.idle_since = time.monotonic()
        self.stopping: str | None = None  # why procspawn stops it, if it does
        self.kill_at: float | None = None  # when to SIGKILL it (stopping)
        # (task, error): killed because of its running task (a timeout, kill()); that
        # task fails with the error unless it answered first
        self.killed_for: tuple[Task, BaseException] | None = None
        super().__init__(proc, sock, watcher, None, slot, oom_count)

    @classmethod
    def start(
        cls,
        slot: int,
        *,
        payload: StartupMessage,
        start_method: str,
        max_tasks: int | None,
        output: OutputForwarder,
        watcher: Watcher,
        name: str,
        oom_count: int | None,
        main_index: dict[str, Any] | None,
    ) -> Worker:
        """Start a worker process with its channel; ``payload``: what it starts with."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            args = (
                payload,
                child_end,
                os.getpid(),
                parent_death_signal_is_safe(start_method),
                max_tasks,
            )
            proc = start_child(
                _worker.main,
                args,
                start_method=start_method,
                output=output,
                key=slot,
                name=f"procspawn-{name}-worker-{slot}",
                # daemonic: never waited for at exit (an executor's worker drops the
                # flag on its side, to start processes of its own as the stdlib's can)
                daemon=True,
                pool_worker=True,
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        try:
            return cls(slot, proc, parent_end, watcher, max_tasks, oom_count, main_index)
        except BaseException:  # out of descriptors for its exit handle, say
            parent_end.close()
            send_signal(proc, signal.SIGKILL)
            proc.join()
            raise

    # -- its state --------------------------------------------------------------------------

    def counts(self) -> bool:
        """Whether it counts toward the pool's size: not stopping, and not given its last
        task (``max_tasks``)."""
        return not self.stopping and self.tasks_left != 0

    def takes_tasks(self) -> bool:
        """Whether a task may be handed to it: it counts, is not dying (its channel's end
        seen) and what its main module has is known."""
        return self.counts() and not self.reader.eof and self.main_index is not None

    def took_task(self, timeout: float | None) -> None:
        """It took ``tasks[0]`` off its channel; ``timeout``: the seconds it may run."""
        self.running = True
        self.started_at = time.monotonic()
        if timeout is not None and self.kill_at is None:  # not being stopped
            self.deadline = self.started_at + timeout

    def answered(self) -> float | None:
        """It answered its running task (popped off ``tasks`` already): how long that ran,
        if it was seen to start."""
        self.running = False
        self.deadline = None
        if self.killed_for is not None and (
            not self.tasks or self.tasks[0] is not self.killed_for[0]
        ):
            self.killed_for = None  # the killed task answered first: nothing to blame
        ran = self.run_time()
        self.started_at = None
        return ran

    def run_time(self) -> float | None:
        """How long its running task has run, if it was seen to start."""
        return None if self.started_at is None else time.monotonic() - self.started_at

    # -- stopping it ----------------------------------------------------------------------

    def retire(self, why: str) -> None:
        """It finishes the tasks it has and exits (it is given no more)."""
        _log.debug("pool worker pid %s retires: %s", self.pid, why)
        self.stopping = why
        self.send(None)

    def stop(self, why: str, grace: float) -> None:
        """Stop it now, on purpose: SIGTERM, SIGKILL after ``grace`` (see ``kill_at``)."""
        if self.stopping and self.kill_at is not None:
            return
        _log.debug("stopping pool worker pid %s: %s", self.pid, why)
        self.stopping = why
        send_signal(self.proc, signal.SIGTERM)
        self.kill_at = time.monotonic() + grace

    def kill_for_task(self, error: BaseException, why: str) -> bool:
        """Kill it now because of the task it runs (SIGKILL, with what the task started:
        a task past its time or killed by the caller is not asked to finish); that task
        fails with ``error`` when the death is seen. False if it was already so killed,
        or holds no task."""
        self.deadline = None
        if self.killed_for is not None or not self.tasks:
            return False
        self.killed_for = (self.tasks[0], error)
        _log.debug("killing pool worker pid %s: %s", self.pid, why)
        self.stopping = why
        self.kill_at = None
        # not once its exit handle says it is gone (its pid may be another process' by
        # now: not ours to walk)
        if not self.has_exited():
            kill_tree(self.pid)
        return True

    def close(self) -> None:
        """Let go of it: out of the watcher, its channel and exit handle closed, what was
        queued for it given back, the process reaped if it has exited."""
        super().close()
        for message, _sent in self.outbox:
            if message is not None:
                message.abandon()
        self.outbox.clear()
        self.proc.is_alive()  # reaps it if it has exited (join(0) imports a module)

    # -- sending ---------------------------------------------------------------------------

    def message_for(self, task: Task) -> Message:
        """``task`` pickled for this worker, its function with it if the worker does not
        have it yet; raises the pickler's error (which names what failed).

        A worker keeps the functions it was sent, under the id of the parent's object,
        which the parent holds only weakly: a loop of submits of one function pickles it
        once per worker, and an object whose bound method ran is not kept alive. An id
        whose object died (maybe reused) is sent again.
        """
        fn_now = task.job.fn
        key = id(fn_now)
        fn = None
        forget = None
        sent = self.functions.get(key)
        if sent is not None and sent() is fn_now:
            self.functions.move_to_end(key)
        else:
            fn = fn_now
            if sent is None and len(self.functions) >= FUNCTIONS_KEPT:
                forget = next(iter(self.functions))
        # what its main module has goes by name, as the standard library sends it
        with _main_names.sending_to(self.main_index):
            message = _pickler.dumps((key, fn, forget, task.form, task.payload))
        if fn is not None:
            if forget is not None:
                del self.functions[forget]
            try:
                self.functions[key] = weakref.ref(fn_now)
            except TypeError:  # no weak references to it: sent with every task
                self.functions.pop(key, None)
        return message

    def send(self, message: Message | None) -> None:
        """Queue a message (None: the request to exit) and send what the socket takes; the
        rest goes as the watcher says the socket is writable (``flush``)."""
        if message is None:
            message = _pickler.dumps(None)
        self.outbox.append([message, 0])
        self.flush()

    def flush(self) -> None:
        try:
            while self.outbox:
                entry = self.outbox[0]
                message, sent = entry
                size = message_size(message.data)
                if len(message.fds) > _MAX_FDS_NONBLOCKING and sent == 0:
                    self.sock.setblocking(True)
                    try:
                        send_message(self.sock, message.data, message.fds)
                    finally:
                        self.sock.setblocking(False)
                    sent = size
                elif sent == 0:
                    sent = try_send_message(self.sock, message.data, message.fds)
                    if sent and sent < size:
                        sent = send_more(self.sock, message.data, len(message.fds), sent)
                else:
                    sent = send_more(self.sock, message.data, len(message.fds), sent)
                entry[1] = sent
                if sent < size:
                    self.want_write(True)
                    return
                self.outbox.popleft()
                message.close()
            self.want_write(False)
        except OSError:
            # the worker is gone (EPIPE, ECONNRESET): its exit handle tells the rest
            self.want_write(False)


__all__ = ["FUNCTIONS_KEPT", "Worker"]
