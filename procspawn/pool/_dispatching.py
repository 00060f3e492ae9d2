"""What every dispatcher is to the front ends (``_pool``, ``_executor``, ``_results``,
``_imap``): ``_dispatcher.Dispatcher`` (worker processes on this machine) and
``_ray_dispatcher.RayDispatcher`` (Ray tasks) share this base, its state machine
(running, closing, stopping, done; broken) and the calls that do not depend on where the
tasks run. Each subclass runs one thread, ``_thread``, and wakes it with ``_wake``.
"""

from __future__ import annotations

import collections
import copy
import os
import threading

from .. import _log

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from ._tasks import Job, Task

RUNNING, CLOSING, STOPPING, DONE = "running", "closing", "stopping", "done"


class DispatcherBase:
    """The calls the front ends make that every dispatcher answers alike; the others
    (``submit``, ``kill``, ``abandon``, ``cancel_pending``, ``resize``, ``terminate``,
    ``sync``, ``workers``, ``terminated_error``) are each dispatcher's own."""

    executor_rules: bool

    def __init__(self) -> None:
        self.state = RUNNING
        self.broken: BaseException | None = None
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._submitting = 0  # jobs that will submit more tasks (see submitting)
        # run by the dispatcher's thread; a deque, appended to without a lock, so that a
        # finalizer (which the garbage collector may run in any thread, inside any of our
        # locked sections) can hand over work
        self._requests: collections.deque[Callable[[], None]] = collections.deque()

    def _wake(self) -> None:
        """End the dispatcher thread's wait: there is news (safe from a finalizer)."""
        raise NotImplementedError

    def _serve(self) -> None:
        """The dispatcher thread: ``_run`` until done; a failure of ours fails what waits
        rather than hang it; then what the dispatcher holds goes (``_release``)."""
        try:
            self._run()
        except BaseException as exc:  # a bug of ours
            _log.exception("procspawn: a pool dispatcher thread failed")
            self._break(RuntimeError(f"the pool's dispatcher thread failed: {exc!r}"))
        finally:
            self._release()

    def _run(self) -> None:
        raise NotImplementedError

    def _break(self, error: BaseException) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def submitting(self, change: int) -> None:
        """A job that will submit more tasks (an imap reading its input) starts (+1) or
        ends (-1): a closed pool waits for it before it is done."""
        with self._lock:
            self._submitting += change
        self._wake()

    def request(self, action: Callable[[], None]) -> None:
        """Run ``action`` in the dispatcher thread, soon. Safe from a finalizer (a deque
        append is atomic, and a wake-up takes no lock of ours)."""
        self._requests.append(action)
        self._wake()

    def _take_requests(self) -> None:
        requests = self._requests
        while requests:
            requests.popleft()()

    def _check_open(self, at_most: str = RUNNING) -> None:
        if self.broken is not None:
            raise self.broken_error()
        if self.state not in (RUNNING, at_most):
            raise ValueError("Pool not running")

    def broken_error(self) -> BaseException:
        """A fresh copy of the error that broke the pool, to raise (raising one object
        again and again would chain its tracebacks)."""
        broken = self.broken
        assert broken is not None
        error = copy.copy(broken)
        error.__cause__ = broken.__cause__
        return error

    def close(self) -> None:
        """Take no more work; done once every task is."""
        with self._lock:
            if self.state == RUNNING:
                self.state = CLOSING
        self._wake()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the dispatcher thread to finish (after close or terminate)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def alive(self) -> bool:
        return self.state in (RUNNING, CLOSING) and self.broken is None

    def check_owner(self) -> None:
        """Raise in a process forked from the pool's owner: its workers and the thread that
        serves them are the owner's, so a call made here would wait forever."""
        if os.getpid() != self._owner:
            raise RuntimeError(
                f"this pool belongs to process {self._owner}; process {os.getpid()}, forked "
                "from it, cannot use it (its workers and the thread that serves them stayed "
                "with the parent, so the call would never be answered). Make a pool in this "
                "process."
            )

    def check_not_serving(self) -> None:
        """Raise in the thread that serves the pool, where its callbacks run: a wait there
        for the pool's work would never end (nothing else hands out or reads its tasks)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                "a callback of this pool (a callback= or error_callback=, or a future's "
                "done-callback) cannot wait for the pool's work: it runs in the thread that "
                "serves the pool, so the wait would never end. Hand the work to another "
                "thread instead (say, put it in a queue.Queue that the main thread reads)."
            )

    # -- each dispatcher's own ------------------------------------------------------------

    def submit(self, tasks: Iterable[Task], accepted: bool = False) -> None:
        raise NotImplementedError

    def abandon(self, job: Job, kill_running: bool = True) -> None:
        raise NotImplementedError

    def kill(self, which: Callable[[Task], bool], error: BaseException) -> None:
        raise NotImplementedError

    def cancel_pending(self, keep_none: bool = False) -> None:
        raise NotImplementedError

    def resize(self, processes: int) -> None:
        raise NotImplementedError

    def terminate(
        self,
        grace_period: float | None = None,
        error: BaseException | None = None,
        wait: bool = True,
        ctrl_c_raises: bool = True,
    ) -> None:
        raise NotImplementedError

    def sync(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def workers(self) -> list[Any]:
        raise NotImplementedError

    def terminated_error(self) -> BaseException | None:
        raise NotImplementedError


__all__ = ["CLOSING", "DONE", "RUNNING", "STOPPING", "DispatcherBase"]
