"""The parent side of a pool: one thread hands out tasks to the workers and watches them.

::

    callers (any thread) ──submit(tasks)──▶ pending deque ──wake──┐
                                                                  ▼
    dispatcher thread: Watcher (epoll) over every worker's exit handle and channel
        hand out: a task goes to a worker with room, pickled just then (so a segment
                  the previous task let go is reused), sent without blocking
        results:  each worker answers in the order it got its tasks
        a death:  the oldest task it held failed (or, for an executor, every task: it
                  breaks, as the stdlib's does); the others handed out again; a new
                  worker started in its place

Nothing is shared between workers (no queue, lock or pipe that a dying worker could hold),
and only this thread touches the workers, their channels and the pending deque's head, so
no death can leave state half-written. A death is seen the moment the kernel reports it
(pidfd), never by polling. A worker procspawn stops on purpose (the caller's Ctrl-C, a
shrinking pool, an idle timeout) goes through the same path, marked as such.
"""

from __future__ import annotations

import atexit
import collections
import errno
import itertools
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing import util as _mp_util  # noqa: F401 (see atexit.register below)
from multiprocessing.process import BaseProcess

from .. import _log
from .._output import OutputForwarder
from ..context import _raised, _tags
from ..context._errors import ProcessExitedException, ctrl_c
from ..context._watch import (
    Watcher,
    default_grace_period,
    oom_kills,
    send_signal,
    sigint_held,
    stop,
)
from ..context.launch._child import (
    check_can_start_children,
)
from ..sharing._errors import FdLimitError
from ..sharing.channels._startup import StartupMessage
from ..sharing.wire import _main_names, _pickler
from . import _exit
from ._dispatching import CLOSING, DONE, RUNNING, STOPPING, DispatcherBase
from ._errors import TaskTimeoutError
from ._failures import (
    BROKEN,
    BROKEN_QUIET,
    broken_errors,
    out_of_descriptors,
    remote_error,
    unpickling_error,
)
from ._prefetch import RunTimes
from ._tasks import Job, Task, settle
from ._workers import Worker

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any

_OUTPUT_DRAIN = 0.5  # seconds to wait for a dead worker's last stderr lines
_STARTUP_FAILURES = 3  # workers in a row that die before they are ready: the pool is broken
_STRATEGY = "procspawn.sharing.segments._strategy"


def _sharing_snapshot() -> dict[str, Any] | None:
    """The sharing settings a worker takes from this process (``_strategy.snapshot``), or
    None when this process has none: it never used shared memory or chose a strategy,
    and a worker's own defaults and environment (this process') are the same."""
    strategy = sys.modules.get(_STRATEGY)
    return None if strategy is None else strategy.snapshot()


class Dispatcher(DispatcherBase):
    """A set of worker processes and the thread that hands them tasks and watches them.

    Args:
        processes: how many workers to keep.
        start_method: "fork", "spawn" or "forkserver".
        initializer, initargs: run in each worker as it starts.
        max_tasks: a worker exits after this many tasks and is replaced (None: never).
        break_on_death: an unexpected death fails every task and stops the pool (what
            ``concurrent.futures`` does); otherwise only the dead worker's task fails.
        executor_rules: ``concurrent.futures``' rules for what a task does and raises (a
            ``sys.exit()`` in a task is its error, the traceback's type) and for the
            program's exit (the work given is done); otherwise ``multiprocessing.Pool``'s.
        lazy: start workers as work comes (up to ``processes``), not all at once.
        idle_timeout: a worker idle this long exits; started again when work comes.
        task_timeout: a task (a call, or a map chunk) running longer than this many
            seconds has its worker killed and replaced, and fails with TaskTimeoutError.
        retries: a task whose worker died while running it runs again, up to this many
            times, then fails with that death's error; with ``retries`` the deaths do not
            break a ``break_on_death`` pool.
        max_memory: bytes; a worker whose resident memory is above it after a task
            exits (once its queued task is done) and a new one takes its place.
        name: for thread and process names.

    Raises:
        RuntimeError: this process is daemonic and may not start workers.
    """

    def __init__(
        self,
        processes: int,
        *,
        start_method: str,
        initializer: Callable[..., Any] | None = None,
        initargs: Iterable[Any] = (),
        max_tasks: int | None = None,
        break_on_death: bool = False,
        executor_rules: bool = False,
        lazy: bool = False,
        idle_timeout: float | None = None,
        task_timeout: float | None = None,
        retries: int = 0,
        max_memory: int | None = None,
        name: str = "pool",
    ) -> None:
        api = {"pool": "Pool", "executor": "ProcessPoolExecutor"}.get(name, name)
        check_can_start_children(f"procspawn.{api}")
        super().__init__()
        self.size = processes
        self.task_timeout = task_timeout
        self.retries = retries
        self.max_memory = max_memory
        self.lazy = lazy or idle_timeout is not None
        self.start_method = start_method
        self.max_tasks = max_tasks
        self.break_on_death = break_on_death
        self.executor_rules = executor_rules
        self.idle_timeout = idle_timeout
        self.name = name
        self._terminated = False
        self._pending: collections.deque[Task] = collections.deque()
        self._run_times = RunTimes()  # how long each function's calls run: _may_prefetch
        self._in_hand: Task | None = None  # a task taken off a worker, not settled yet
        self._workers: dict[int, Worker] = {}
        self._slots = itertools.count()
        self._startup_failures = 0
        self._init_failed: BaseException | None = None  # an initializer raised: breaking
        # an executor's thread imports the errors of a broken pool ahead of a death, once a
        # worker has answered and the thread then had nothing to do for BROKEN_QUIET (a
        # Pool's only such error, an initializer's, comes as it starts): see broken_errors
        self._broken_ahead = break_on_death and BROKEN not in sys.modules
        self._answers = 0
        self._quiet_since = time.monotonic()
        self._demand = 0  # lazy: how many workers the work so far asked for
        self._output = OutputForwarder()
        try:
            self._watcher = Watcher()
        except OSError as exc:
            error = out_of_descriptors(exc, f"procspawn.{api} could not be made")
            if error is exc:
                raise
            raise error from exc
        deferred: list[Any] = []
        payload = (
            initializer,
            tuple(initargs) if initializer else (),
            _sharing_snapshot(),
            executor_rules,
            start_method == "fork",  # forked: it has its parent's main module
        )
        # Queues, Locks in initargs only pickle as a process starts (deferred); with no
        # initializer the payload is plain data, pickled without cloudpickle
        message = _pickler.dumps(payload, deferred=deferred if initializer is not None else None)
        # plain data without an initializer: a forked worker takes it as it inherits it
        self._payload = (
            StartupMessage(message, deferred)
            if initializer is not None
            else StartupMessage(message, deferred, value=payload)
        )
        self._grace = default_grace_period()
        try:
            # no output thread until a worker writes something (the watcher sees it on
            # output.fileno()): workers that print nothing cost none
            self._output.hold()
            # read once for the first workers, which start together
            count = oom_kills()
            index = _main_names.snapshot() if start_method == "fork" else None
            for _ in range(0 if self.lazy else processes):
                self._start_worker(count, index)
        except BaseException as exc:
            self._stop_all(0.0)
            for worker in list(self._workers.values()):
                self._forget(worker)
            self._release()
            error = out_of_descriptors(exc, f"procspawn.{api} could not start its workers")
            if error is exc:
                raise
            raise error from exc
        output_fd = self._output.fileno()
        if output_fd >= 0:
            self._watcher.add(output_fd, ("output", None))
        else:
            self._output.release()
        self._thread = threading.Thread(
            target=self._serve, name=f"procspawn-{name}-dispatcher", daemon=True
        )
        self._thread.start()
        _live.add(self)

    # -- the callers' side (any thread) ----------------------------------------------------

    def submit(self, tasks: Iterable[Task], accepted: bool = False) -> None:
        """Queue tasks; raises if the pool no longer takes work (``accepted``: tasks of
        a job accepted before ``close()``, which still runs them)."""
        with self._lock:
            if accepted and self.state in (STOPPING, DONE) and self.broken is None:
                raise self._stopped_error()  # what the job's other unfinished tasks get
            self._check_open(CLOSING if accepted else RUNNING)
            self._pending.extend(tasks)
            # lazy: the workers this work asks for, even if its tasks end before any
            # worker took them (as the stdlib's executor starts one per submit)
            self._demand = min(self.size, max(self._demand, len(self._pending)))
        self._watcher.wake()

    def abandon(self, job: Job, kill_running: bool = True) -> None:
        """Drop a job's tasks not handed out yet and (``kill_running``) stop the workers
        running its others, quietly; they are replaced."""
        job.abandoned = True

        def act() -> None:
            self._drop_pending(lambda task: task.job is job)
            if kill_running:
                for worker in list(self._workers.values()):
                    if worker.tasks and worker.tasks[0].job is job:
                        worker.stop("its task was abandoned", self._grace)

        self.request(act)

    def kill(self, which: Callable[[Task], bool], error: BaseException) -> None:
        """Stop the tasks ``which`` picks among those handed out (soon, in the dispatcher
        thread), failing them with ``error`` unless their answer came first: a worker's
        first task (running, or about to) by killing that worker (a new one takes its
        place); one queued behind another call's task at once (its answer, when the
        worker gets to it, is dropped)."""

        def act() -> None:
            for worker in list(self._workers.values()):
                for index, task in enumerate(list(worker.tasks)):
                    if not which(task):
                        continue
                    if index == 0:
                        self._kill_running(worker, error)
                    else:
                        settle(task, False, error)

        self.request(act)

    def cancel_pending(self, keep_none: bool = False) -> None:
        """Drop the tasks not handed out yet, telling their jobs, but for those that
        workers free or starting take next (as the stdlib's executor keeps what is in its
        call queue), unless ``keep_none``."""
        with self._lock:
            busy = sum(1 for w in list(self._workers.values()) if w.tasks)
            keep = 0 if keep_none else max(0, self.size - busy)
            pending = list(self._pending)
            dropped = pending[keep:]
            self._pending = collections.deque(pending[:keep])
        for task in dropped:
            task.job.cancel(task)
        self._watcher.wake()

    def resize(self, processes: int) -> None:
        def act() -> None:
            self.size = processes
            self._demand = min(self._demand, processes)
            self._fill()
            self._shrink()

        self.request(act)

    def terminate(
        self,
        grace_period: float | None = None,
        error: BaseException | None = None,
        wait: bool = True,
        ctrl_c_raises: bool = True,
    ) -> None:
        """Stop every worker now (SIGTERM, SIGKILL after the grace period); tasks not done
        fail with ``error`` (default: the pool was terminated). ``wait``: until done.

        A Ctrl-C while it waits cuts the grace period short (the workers are killed and
        reaped all the same), then raises KeyboardInterrupt here, unless one is already
        on its way (this stopping is that Ctrl-C's: the second only hurries it) or
        ``ctrl_c_raises`` is false (at the program's exit)."""
        grace = self._grace if grace_period is None else grace_period
        procs: list[BaseProcess] = []
        with self._lock:
            if self.state in (RUNNING, CLOSING):
                self.state = STOPPING
                self._terminated = True
                self._stop_grace = grace
                self._stop_error = error
                procs = [w.proc for w in list(self._workers.values())]
        # SIGTERM now, from this thread: the workers' exits overlap the hand-over to the
        # dispatcher thread, which sees STOPPING before it looks at any of their deaths
        # and stops them all (again) with the grace period
        for proc in procs:
            send_signal(proc, signal.SIGTERM)
        self._watcher.wake()
        if wait:
            interrupted: list[bool] = []

            def hurry() -> None:
                interrupted.append(True)
                self._hurry()

            with sigint_held(hurry):
                self.join()
            handling = sys.exc_info()[1]
            if interrupted and ctrl_c_raises and not ctrl_c(handling):
                raise KeyboardInterrupt

    def _hurry(self) -> None:
        self._stop_grace = 0.0
        for worker in list(self._workers.values()):
            send_signal(worker.proc, signal.SIGKILL)

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until the dispatcher thread has started the workers its work needs (an
        executor starts them in that thread, after ``submit`` returned)."""
        if threading.current_thread() is self._thread or not self.alive():
            return
        done = threading.Event()

        def act() -> None:
            self._fill()
            done.set()

        self.request(act)
        done.wait(timeout)

    def workers(self) -> list[BaseProcess]:
        return [w.proc for w in list(self._workers.values())]

    def _wake(self) -> None:
        self._watcher.wake()

    # -- the dispatcher thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._take_requests()
            if self.state == STOPPING:
                self._finish_stopping()
                return
            if self.broken is not None:
                return
            if self.state == CLOSING and self._all_done():
                for worker in list(self._workers.values()):
                    if not worker.stopping:
                        worker.retire("the pool was closed")
                if not self._workers:
                    self.state = DONE
                    return
            else:
                self._hand_out()
                if self.state == CLOSING and self._all_done():
                    # the hand-out dropped the last tasks (cancelled, or unpicklable)
                    # and nothing else will wake the wait: retire the workers now
                    continue
            for key, readable, writable in self._watcher.wait(self._timeout()):
                self._quiet_since = time.monotonic()
                source, worker = key
                if source == "output":
                    # a worker wrote: the output thread takes over (pipes that only
                    # reached their end, workers that exited quietly, close here)
                    if self._output.settle_held():
                        self._watcher.remove(self._output.fileno())
                        self._output.release()
                    continue
                if worker.slot not in self._workers:
                    continue
                if self.state == STOPPING:
                    break  # terminate(): the stopping takes care of every worker
                if source == "exit":
                    self._on_exit(worker)
                    continue
                if writable:
                    worker.flush()
                if readable:
                    self._read(worker)
                    # the end of its channel comes with its death: no second round
                    if worker.slot in self._workers and worker.reader.eof:
                        if worker.has_exited():
                            self._on_exit(worker)
            self._on_timers()

    def _timeout(self) -> float | None:
        now = time.monotonic()
        times = [w.kill_at for w in self._workers.values() if w.kill_at is not None]
        times += [w.deadline for w in self._workers.values() if w.deadline is not None]
        if self.idle_timeout is not None:
            times += [
                w.idle_since + self.idle_timeout
                for w in self._workers.values()
                if not w.tasks and not w.stopping
            ]
        if self._broken_ahead and self._answers:
            times.append(self._quiet_since + BROKEN_QUIET)
        if not times:
            return None
        return max(0.0, min(times) - now)

    def _on_timers(self) -> None:
        now = time.monotonic()
        if self._broken_ahead and self._answers and now - self._quiet_since >= BROKEN_QUIET:
            self._broken_ahead = False
            broken_errors()  # now, while the program runs and the thread is idle
        for worker in list(self._workers.values()):
            if worker.kill_at is not None and now >= worker.kill_at:
                send_signal(worker.proc, signal.SIGKILL)
                worker.kill_at = None
            elif worker.deadline is not None and now >= worker.deadline and worker.tasks:
                self._kill_running(worker, self._timeout_error(worker))
            elif (
                self.idle_timeout is not None
                and not worker.tasks
                and not worker.stopping
                and now - worker.idle_since >= self.idle_timeout
                and not self._pending
            ):
                self._demand = max(0, self._demand - 1)
                worker.retire("idle for longer than the timeout")

    def _all_done(self) -> bool:
        return (
            not self._submitting
            and not self._pending
            and not any(w.tasks for w in self._workers.values())
        )

    # -- starting and stopping workers ------------------------------------------------------

    def _start_worker(
        self,
        oom_count: int | None = None,
        main_index: dict[str, Any] | None = None,
    ) -> Worker:
        """Start a worker; ``oom_count`` and ``main_index`` (fork): the OOM killer's count
        and what ``__main__`` has, when read just before (else read here)."""
        slot = next(self._slots)
        if oom_count is None:
            oom_count = oom_kills()
        if main_index is None and self.start_method == "fork":
            main_index = _main_names.snapshot()
        worker = Worker.start(
            slot,
            payload=self._payload,
            start_method=self.start_method,
            max_tasks=self.max_tasks,
            output=self._output,
            watcher=self._watcher,
            name=self.name,
            oom_count=oom_count,
            main_index=main_index,
        )
        self._workers[slot] = worker
        return worker

    def _live_count(self) -> int:
        return sum(1 for w in self._workers.values() if w.counts())

    def _fill(self) -> None:
        """Start workers up to the pool's size (lazily when idle workers time out)."""
        if self.state not in (RUNNING, CLOSING) or self.broken is not None:
            return
        if self._init_failed is not None:
            return
        wanted = self.size
        if self.lazy:
            busy = len(self._pending) + sum(len(w.tasks) for w in self._workers.values())
            wanted = min(wanted, max(busy, self._demand))
        if self.state == CLOSING and not self._pending:
            return
        while self._live_count() < wanted:
            try:
                self._start_worker()
            except (OSError, EOFError) as exc:
                if self.state == STOPPING:
                    # terminate() or Ctrl-C came meanwhile, and the program's exit may have
                    # stopped the fork server under this start: nothing more to start
                    return
                if isinstance(exc, EOFError):  # the fork server closed on us: it is gone
                    exc = OSError(errno.EPIPE, "the fork server exited while starting it")
                what = "the pool could not start a worker process"
                error = out_of_descriptors(exc, what)
                if error is exc:
                    error = OSError(exc.errno, f"{what}: {exc.strerror}")
                else:
                    error.__cause__ = exc
                self._break(error)
                return

    def _shrink(self) -> None:
        extra = self._live_count() - self.size
        for worker in sorted(self._workers.values(), key=lambda w: len(w.tasks)):
            if extra <= 0:
                break
            if worker.counts():
                worker.retire("the pool was made smaller")
                extra -= 1

    def _kill_running(self, worker: Worker, error: BaseException) -> None:
        """Kill ``worker`` now because of the task it runs: that task fails with ``error``
        when the death is seen, the others it held run elsewhere, and a new worker starts
        at once."""
        why = "its task timed out" if isinstance(error, TaskTimeoutError) else "its task was killed"
        if worker.kill_for_task(error, why):
            self._fill()

    def _timeout_of(self, task: Task) -> float | None:
        """The seconds ``task`` may run: its call's own ``task_timeout``, else the pool's."""
        return self.task_timeout if task.job.timeout is None else task.job.timeout

    def _timeout_error(self, worker: Worker) -> TaskTimeoutError:
        task = worker.tasks[0]
        timeout = self._timeout_of(task)
        whose = "the pool's" if task.job.timeout is None else "its call's"
        return TaskTimeoutError(
            f"{task.job.describe(task)} ran longer than {whose} task_timeout of "
            f"{timeout:g} s; its worker (pid {worker.pid}) was killed and a new "
            f"one took its place",
            timeout,  # type: ignore[arg-type]  # set: the task timed out
            worker.pid,
        )

    def _stop_all(self, grace: float) -> None:
        procs = [w.proc for w in self._workers.values()]
        stop(procs, grace)

    def terminated_error(self) -> BaseException | None:
        """Once ``terminate()`` has failed every task it stopped: the error they got, for
        work that never became a task (an imap whose input was still being read);
        None before, or for a pool that ended after ``close()``."""
        if self.state == DONE and self._terminated:
            return self._stopped_error()
        return None

    def _stopped_error(self) -> BaseException:
        """What a task not finished when the pool was stopped fails with."""
        return getattr(self, "_stop_error", None) or RuntimeError(
            "the pool was terminated before this task finished"
        )

    def _finish_stopping(self) -> None:
        error = self._stopped_error()
        self._stop_all(getattr(self, "_stop_grace", self._grace))
        for worker in list(self._workers.values()):
            self._read(worker)  # results already sent are kept
        self._fail_all(error)

    def _break(self, error: BaseException) -> None:
        """The pool cannot go on: fail every task with ``error`` and stop every worker.
        The callers learn it first (as the stdlib's executor tells them before it stops
        its workers); the results of tasks that finish meanwhile are not taken."""
        with self._lock:
            if self.broken is None:
                self.broken = error
        self._fail_tasks(error)
        time.sleep(0)  # the GIL to a caller woken by the failure, before the stopping
        self._stop_all(0.0)
        self._fail_all(error)

    def _fail_tasks(self, error: BaseException) -> None:
        """Fail every task the workers hold and every pending one with ``error`` (and the
        one this thread had in hand, if it failed meanwhile)."""
        task, self._in_hand = self._in_hand, None
        if task is not None and not task.settled:
            settle(task, False, error)
        for worker in list(self._workers.values()):
            tasks = list(worker.tasks)
            worker.tasks.clear()
            for task in tasks:
                settle(task, False, error)
        self._drop_pending(lambda task: True, error)

    def _fail_all(self, error: BaseException) -> None:
        """The workers are stopped: fail every task they held and every pending one."""
        self._fail_tasks(error)
        for worker in list(self._workers.values()):
            self._forget(worker)
        self.state = DONE

    def _drop_pending(
        self, which: Callable[[Task], bool], error: BaseException | None = None
    ) -> None:
        with self._lock:
            dropped = [t for t in self._pending if which(t)]
            if dropped:
                self._pending = collections.deque(t for t in self._pending if not which(t))
        if error is not None:
            for task in dropped:
                settle(task, False, error)

    def _forget(self, worker: Worker) -> None:
        self._workers.pop(worker.slot, None)
        worker.close()

    def _release(self) -> None:
        self._watcher.close()
        self._payload.close()
        self._output.close(_OUTPUT_DRAIN)
        _live.discard(self)

    # -- handing out tasks -----------------------------------------------------------------

    def _hand_out(self) -> None:
        if self.broken is not None or self.state not in (RUNNING, CLOSING):
            return
        if self._init_failed is not None:
            return
        self._fill()
        if not self._pending:
            return
        open_workers = [w for w in self._workers.values() if w.takes_tasks()]
        # One task to each worker with none. Then, with a deep backlog, one more to a
        # ready worker whose task calls the same function as the next one (a map, a loop
        # of submits): see _may_prefetch.
        for room in (1, 2):
            for worker in open_workers:
                if not self._pending:
                    return
                # a worker given its last task in the first round gets no more
                if len(worker.tasks) >= room or worker.tasks_left == 0:
                    continue
                if room == 2 and worker.tasks and not self._may_prefetch(worker):
                    continue
                self._give(worker)

    def _may_prefetch(self, worker: Worker) -> bool:
        """Whether ``worker``, running a task, may be given the next one to hold behind
        it: it then never waits for the round trip between two tiny tasks. Only the same
        function (a short call never waits behind an unrelated long one), only one whose
        calls were measured short (a call held behind a long one of a backlog's end
        waited for it while the other workers were done), and only with more tasks
        waiting than workers, the workers still starting counted (a call held behind a
        long one while another worker is idle waits for nothing, as it would with the
        stdlib's shared queue; a worker that started first took the next call while the
        others booted). A pool of one worker has no other worker a call could wait for:
        there, two waiting are enough."""
        live = self._live_count()
        fn = self._pending[0].job.fn
        return (
            worker.ready
            and len(self._pending) > live
            and worker.tasks[0].job.fn is fn
            and (live <= 1 or self._run_times.short(fn))
        )

    def _give(self, worker: Worker) -> None:
        """Hand the next task that can go to ``worker``: cancelled ones are dropped, and
        one that cannot be pickled fails at once and the next is tried."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                task = self._pending.popleft()
            if task.settled or not task.job.start(task):
                continue
            try:
                message = worker.message_for(task)
            except BaseException as exc:
                settle(task, False, exc)  # the pickler's error names what failed
                continue
            worker.tasks.append(task)
            if worker.tasks_left is not None:
                worker.tasks_left -= 1
            worker.send(message)
            return

    # -- results ----------------------------------------------------------------------------

    def _read(self, worker: Worker) -> None:
        """Take the messages ``worker`` sent, until there are none or it is gone."""

        def on_message(data: bytes, fds: list[int]) -> bool:
            self._on_message(worker, data, fds)
            return worker.slot not in self._workers or self.broken is not None

        while True:
            try:
                worker.read(on_message)
                return
            except FdLimitError as exc:
                # this process is at its descriptor limit: the message (an answer: only
                # those carry arrays) was read whole and its descriptors dropped. Its task
                # fails with the error, which names the limit and the fixes; the channel
                # goes on. What its segments held for this process goes back.
                _pickler.give_back_unreceived(exc)
                self._lost_answer(worker, exc)
                if worker.slot not in self._workers or self.broken is not None:
                    return

    def _lost_answer(self, worker: Worker, exc: FdLimitError) -> None:
        """The answer to ``worker``'s oldest task could not be received."""
        if not worker.tasks:
            return
        task = worker.tasks.popleft()
        self._answered(worker, task)
        error = FdLimitError(f"the result of {task.job.describe(task)} could not be received")
        error.__cause__ = exc
        settle(task, False, error)
        self._done_with(worker)

    def _on_message(self, worker: Worker, data: bytes, fds: list[int]) -> None:
        try:
            message = _pickler.loads_received(data, fds)
        except BaseException as exc:  # SystemExit from a __reduce__ too: not this thread's end
            if not worker.tasks:
                return
            task = worker.tasks.popleft()
            self._answered(worker, task)
            settle(task, False, unpickling_error(task, worker.pid, exc))
            self._done_with(worker)
            return
        tag = message[0]
        if tag == _tags.STARTED:
            worker.took_task(self._timeout_of(worker.tasks[0]) if worker.tasks else None)
        elif tag in (_tags.RESULT, _tags.RAISED):
            # in hand until settled: a failure of this thread meanwhile fails it too
            self._in_hand = task = worker.tasks.popleft()
            self._answered(worker, task)
            self._output.forward_now(worker.slot)  # what the task printed comes first
            if tag == _tags.RESULT:
                settle(task, True, message[1])
            else:
                settle(
                    task,
                    False,
                    remote_error(_raised.unpack(message[1]), message[2], self.executor_rules),
                )
            self._in_hand = None
            self._done_with(worker)
        elif tag == _tags.PROGRESS:
            if worker.tasks:
                worker.tasks[0].job.report(message[1])
        elif tag == _tags.READY:
            worker.ready = True
            if len(message) > 1:  # spawn, forkserver: what its main module has
                worker.main_index = message[1]
            self._startup_failures = 0
        elif tag == _tags.INIT_FAILED:
            broken = broken_errors()
            error = (broken.InitializerError if broken else RuntimeError)(
                f"the pool's initializer raised in worker pid {worker.pid}; the pool cannot "
                f"run tasks. Fix the initializer (or catch the error in it). Its "
                f"traceback:\n{message[2]}"
            )
            error.__cause__ = _raised.unpack(message[1])
            # The pool breaks once the worker has exited (as the stdlib's, which sees the
            # death): a log record its initializer put in a Queue is flushed by then.
            # Nothing more is started or handed out meanwhile; SIGKILL if it lingers.
            self._init_failed = error
            worker.stopping = "its initializer raised"
            worker.kill_at = time.monotonic() + self._grace

    def _answered(self, worker: Worker, task: Task) -> None:
        """``worker`` answered ``task``, its running one: the run time noted (see
        ``_may_prefetch``); too big now (``max_memory``): it retires (after the task it may
        already have) and a new one takes its place."""
        ran = worker.answered()
        if ran is not None:
            self._run_times.note(task.job.fn, ran)
        self._answers += 1
        if self.max_memory is not None and not worker.stopping:
            rss = _resident_bytes(worker.pid)
            if rss > self.max_memory:
                worker.retire(
                    f"its resident memory, {rss} bytes, is above max_memory_per_child "
                    f"({self.max_memory} bytes)"
                )
                self._fill()

    def _done_with(self, worker: Worker) -> None:
        """A worker answered a task: give it the next one now, before the other answers
        that came with it are unpickled, so it does not wait on them."""
        if (
            self._pending
            and self.broken is None
            and self.state in (RUNNING, CLOSING)
            and not worker.stopping
            and worker.tasks_left != 0
            and not worker.reader.eof
            and len(worker.tasks) < 2
            and (not worker.tasks or self._may_prefetch(worker))
        ):
            self._give(worker)
        if not worker.tasks:
            worker.idle_since = time.monotonic()

    # -- deaths -----------------------------------------------------------------------------

    def _on_exit(self, worker: Worker) -> None:
        """A worker exited: what it sent first is read, then its death is classified
        (``_death_outcome``) and taken by one act per outcome (``_DEATH_ACTS``)."""
        if self.state == STOPPING:
            # terminate() came meanwhile (from another thread, maybe while this one read
            # the worker's last message) and its SIGTERM may be this death: the stopping
            # fails every task not done with the terminate's error, not as a death
            return
        self._watcher.remove(worker.exit_fd)
        if not worker.reader.eof:
            self._read(worker)  # what it sent before it died is all there by now
            if worker.slot not in self._workers:
                return
        # a forked worker is a zombie now (its exit handle said so); under forkserver
        # the status comes from the server, which is not waited for without limit
        code = worker.exit_status(None if self.start_method == "fork" else 5.0)
        tasks = list(worker.tasks)
        worker.tasks.clear()
        # only the task it took off its channel can have killed it; the others never
        # reached it and run elsewhere
        running = tasks.pop(0) if tasks and worker.running else None
        ran = worker.run_time()
        if running is not None and ran is not None:
            self._run_times.note(running.job.fn, ran)  # (killed late: its calls are not short)
        self._forget(worker)  # (reaped first: its Process holds descriptors)
        outcome = self._death_outcome(worker, code, running)
        self._DEATH_ACTS[outcome](self, worker, code, running, tasks)

    def _death_outcome(self, worker: Worker, code: int | None, running: Task | None) -> str:
        """How a worker's death is taken, from what is known of it (no side effects):

        - ``init_failed``: its initializer raised; the pool breaks with that error
        - ``stopped``: procspawn stopped it (a timeout, a kill, a shrink, terminate of a
          job), or it exited cleanly after its last task or at the pool's close
        - ``retry``: it died running a task that has retries left
        - ``start_failed``: it died before it was ready, running nothing
        - ``break``: an executor's worker died (the pool breaks, as the stdlib's)
        - ``failed``: its running task fails with the death's error
        """
        if self._init_failed is not None:
            return "init_failed"
        if worker.stopping is not None or (
            code in (0, None)
            and running is None
            and (worker.tasks_left == 0 or self.state == CLOSING)
        ):
            return "stopped"
        if running is not None and running.deaths < self.retries:
            return "retry"
        if not worker.ready and running is None:
            return "start_failed"
        return self._death_breaks()

    def _death_breaks(self) -> str:
        return "break" if self.break_on_death and not self.retries else "failed"

    def _after_init_failed(
        self, worker: Worker, code: int | None, running: Task | None, tasks: list[Task]
    ) -> None:
        self._requeue(([running] if running is not None else []) + tasks)
        self._break(self._init_failed)  # type: ignore[arg-type]  # set: the outcome's

    def _after_stopped(
        self, worker: Worker, code: int | None, running: Task | None, tasks: list[Task]
    ) -> None:
        killed_for = worker.killed_for
        if killed_for is not None and killed_for[0] in tasks:  # killed before it started
            tasks.remove(killed_for[0])
            settle(killed_for[0], False, killed_for[1])
        if running is not None and killed_for is not None and killed_for[0] is running:
            settle(running, False, killed_for[1])  # timed out, or killed by the caller
        # stopped on purpose: a task it was running belonged to an abandoned job
        elif running is not None and not running.job.abandoned:
            tasks.insert(0, running)
        self._requeue(tasks)
        self._fill()

    def _retry(
        self, worker: Worker, code: int | None, running: Task | None, tasks: list[Task]
    ) -> None:
        assert running is not None
        running.deaths += 1
        _log.debug(
            "pool worker pid %s died running %s; running it again (retry %d of %d)",
            worker.pid,
            running.job.describe(running),
            running.deaths,
            self.retries,
        )
        self._requeue([running, *tasks])
        self._fill()

    def _after_start_failed(
        self, worker: Worker, code: int | None, running: Task | None, tasks: list[Task]
    ) -> None:
        """Died before it was ready: no ``__main__`` guard (every worker would die the same
        way: the pool breaks, saying so), else one start-up failure more (too many in a
        row: the pool breaks), else a death like any other."""
        unguarded = None
        if self.start_method != "fork":
            who = f"pool worker (pid {worker.pid})"
            unguarded = worker.missing_guard(self._output, _OUTPUT_DRAIN, who)
        if unguarded is not None:
            self._requeue(tasks)
            self._break(RuntimeError(unguarded))
            return
        self._startup_failures += 1
        if self._startup_failures < _STARTUP_FAILURES:
            self._DEATH_ACTS[self._death_breaks()](self, worker, code, running, tasks)
            return
        error = self._death_error(worker, code, running)
        errors = broken_errors()
        broken = (errors.InitializerError if errors else RuntimeError)(
            f"{_STARTUP_FAILURES} pool workers in a row died before they were "
            f"ready; the pool cannot run tasks. The last one: {error.msg}"
        )
        broken.__cause__ = error
        self._requeue(tasks)
        self._break(broken)

    def _break_on_death(
        self, worker: Worker, code: int | None, running: Task | None, tasks: list[Task]
    ) -> None:
        error = self._death_error(worker, code, running)
        self._requeue(([running] if running is not None else []) + tasks)
        self._break(self._broken_error(error))

    def _fail_running(
        self, worker: Worker, code: int | None, running: Task | None, tasks: list[Task]
    ) -> None:
        if running is not None:
            settle(running, False, self._death_error(worker, code, running))
        self._requeue(tasks)
        self._fill()

    _DEATH_ACTS = {
        "init_failed": _after_init_failed,
        "stopped": _after_stopped,
        "retry": _retry,
        "start_failed": _after_start_failed,
        "break": _break_on_death,
        "failed": _fail_running,
    }

    def _requeue(self, tasks: list[Task]) -> None:
        tasks = [task for task in tasks if not task.settled]
        if not tasks:
            return
        with self._lock:
            self._pending.extendleft(reversed(tasks))

    def _death_error(
        self, worker: Worker, code: int | None, task: Task | None
    ) -> ProcessExitedException:
        """The error of a worker's unexpected exit; ``code`` None: its status is unknown."""
        how, name, code = worker.how_it_ended(code)
        if task is not None:
            when = f" while running {task.job.describe(task)}"
        elif worker.ready:
            when = " while idle"
        else:
            when = " while starting, before it ran any task"
        msg = f"pool worker (pid {worker.pid}) {how}{when}"
        if task is not None and task.deaths:
            msg += (
                f"; the task ran {task.deaths + 1} times (retries={self.retries}) and every "
                f"worker that ran it died"
            )
        words = worker.last_words(self._output, _OUTPUT_DRAIN)
        msg += words
        if not worker.ready and not words and self.start_method != "fork":
            msg += (
                f"\nlikely cause: under the {self.start_method} start method a worker imports "
                f"the main module again (and what it imports) as it starts; code that makes a "
                f"pool when the main module is imported (at its top level without an "
                f'`if __name__ == "__main__":` guard, or at the top level of a module it '
                f"imports) fails there (the error is printed on this program's stderr). Put "
                f"that code under the guard, or in a function that the guarded code calls."
            )
        return ProcessExitedException(msg, worker.slot, worker.pid, code, name)

    def _broken_error(self, error: ProcessExitedException) -> BaseException:
        broken = broken_errors()
        if broken is None:
            return error  # (see broken_errors) the same words, a ProcessExitedException
        terminated: BaseException = broken.TerminatedWorkerError(
            "A process in the process pool was terminated abruptly while the future was "
            "running or pending: " + error.msg,
            error.error_index,
            error.pid,
            error.exit_code,
            error.signal_name,
        )
        return terminated


def _resident_bytes(pid: int) -> int:
    """A process' resident memory (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE")


_live: weakref.WeakSet[Dispatcher] = weakref.WeakSet()


def _at_exit() -> None:
    _exit.finish(list(_live), "its workers were stopped")


# Registered after multiprocessing's own exit function (imported above for that), so it
# runs first (atexit runs the last registered first): that one terminates every daemonic
# child at once, and an executor's workers would not finish their work.
atexit.register(_at_exit)
__all__ = ["Dispatcher"]
