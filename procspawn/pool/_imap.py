"""``Pool.imap`` and ``imap_unordered``: their iterators, and the feeder thread that
reads a call's input and hands its chunks to the dispatcher as room frees up.
"""

from __future__ import annotations

import collections
import itertools
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import TimeoutError as _MpTimeoutError

from ..context._errors import ctrl_c, ctrl_c_in_caller
from ..context._progress import TICK, Progress
from ..sharing._errors import descriptors_used_past, raise_fd_limit
from . import _worker
from ._tasks import Job, Task

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any, Generic, TypeVar

    from ._dispatching import DispatcherBase
else:
    from .._generic import Generic, TypeVar

_T = TypeVar("_T")  # what a call returns

_STOP_CHECK = 0.5  # imap: how often a waiting next() looks whether the pool was stopped
# imap over an iterator: chunks handed to the pool per worker ahead of the results taken.
# Two per worker are held by the workers (one running, one prefetched); the dispatcher
# prefetches only with more waiting than workers (see Dispatcher._may_prefetch). At 4,
# when it wanted more than two per worker, a worker waited for each round trip and imap
# was 2-3x map's time per task
_FEED_AHEAD = 8
# imap over a list, tuple or range: its items exist already and reading them never
# waits, so more chunks per worker go ahead, in batches (one submit each), and the feeder
# is woken again only once a quarter of them is done. (Not all at once: a task per item
# of a list of a million, in memory, for nothing)
_SEQUENCES = (list, tuple, range)
_SEQUENCE_AHEAD = 32


class IMapIterator(Generic[_T]):
    """The iterator ``imap`` returns: results in order, ``next(timeout)`` as the stdlib's.

    A failed call raises its error when its place comes (once for its whole chunk);
    iterating on goes on with the next results. Dropping the iterator before its end
    lets the calls that run finish and drops the others. The pool makes it.

    Args:
        dispatcher: the pool's dispatcher.
    """

    def __init__(self, dispatcher: DispatcherBase) -> None:
        self._dispatcher = dispatcher
        self._pool: object = None  # the Pool that made it (see ApplyResult)
        self._pool_joining: Callable[[], bool] = bool  # whether it waits in join()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the callers of next() wait on it
        self._room = threading.Condition(lock)  # the feeder waits on it
        # the feeder, waiting for room, is woken once this many chunks settled or were
        # taken (None: it does not wait)
        self._feeder_wants: tuple[int, int] | None = None
        self._items: dict[int, tuple[bool, Any]] = {}  # chunk index -> outcome
        self._buffer: list[Any] = []  # values of the current chunk not yet taken
        self._next_chunk = 0
        self._chunks_total: int | None = None  # known once the input is exhausted
        self._input_error: BaseException | None = None
        self._settled = 0  # chunks whose outcome came (the feeder waits on it)
        self.job: Job | None = None
        self._progress: Progress | None = None  # redrawn while next() waits

    def __iter__(self) -> IMapIterator[_T]:
        return self

    @ctrl_c_in_caller
    def next(self, timeout: float | None = None) -> _T:
        """The next result, waiting for it at most ``timeout`` seconds.

        Args:
            timeout: seconds to wait at most; None: until it is there.

        Returns:
            The next value of ``func``.

        Raises:
            StopIteration: every result was taken.
            multiprocessing.TimeoutError: it was not there within ``timeout`` seconds
                (call ``next`` again to go on waiting).
            Exception: what ``func`` raised in the worker (the worker's traceback is
                its ``__cause__``), or what pickling an argument or the result raised;
                once the results before it were taken, what the input iterable raised.
            ProcessExitedException: the worker died while running it (a signal,
                ``os._exit``, the out-of-memory killer), ``retries`` times over.
            TaskTimeoutError: it ran longer than the pool's ``task_timeout``.
            InitializerError: the pool's ``initializer`` raised: no task can run.
            RuntimeError: the pool was terminated before it finished.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        progress = self._progress
        with self._cond:
            try:
                while True:
                    if self._buffer:
                        item: _T = self._buffer.pop(0)
                        return item
                    outcome = self._take_next()
                    if outcome is not None:
                        self._wake_feeder()  # it may wait for room
                        ok, value = outcome
                        if not ok:
                            raise value
                        self._buffer = list(value)
                        continue
                    if self._chunks_total is not None and self._next_chunk >= self._chunks_total:
                        error, self._input_error = self._input_error, None
                        if error is not None:
                            raise error
                        raise StopIteration
                    terminated = self._dispatcher.terminated_error()
                    if terminated is not None:  # no more results will come
                        raise terminated
                    self._dispatcher.check_not_serving()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise _MpTimeoutError
                    if progress is None:
                        # (woken by terminate(); the slice covers a pool stopped otherwise)
                        self._cond.wait(
                            _STOP_CHECK if remaining is None else min(_STOP_CHECK, remaining)
                        )
                    else:
                        progress.render()
                        self._cond.wait(TICK if remaining is None else min(TICK, remaining))
            except KeyboardInterrupt as interrupt:
                if self.job is not None and ctrl_c(interrupt):  # (not a task's own)
                    self._dispatcher.abandon(self.job)
                if progress is not None:
                    progress.close()
                raise
            except _MpTimeoutError:
                raise
            except BaseException:  # the end (StopIteration), or a task's error
                if progress is not None:
                    progress.close()
                raise

    __next__ = next

    def _take_next(self) -> tuple[bool, Any] | None:
        outcome = self._items.pop(self._next_chunk, None)
        if outcome is not None:
            self._next_chunk += 1
        return outcome

    def _put(self, index: int, ok: bool, value: Any) -> None:
        with self._cond:
            self._store(index, (ok, value))
            self._settled += 1
            if self._awaited(index):
                self._cond.notify_all()
            self._wake_feeder()

    def _store(self, index: int, outcome: tuple[bool, Any]) -> None:
        self._items[index] = outcome

    def _awaited(self, index: int) -> bool:
        """Whether a caller of next() may be waiting for the chunk ``index``."""
        return index == self._next_chunk

    def _wake_feeder(self) -> None:
        wants = self._feeder_wants
        if wants is not None and (self._settled >= wants[0] or self._next_chunk >= wants[1]):
            self._room.notify()

    def _wake_all(self) -> None:
        """Wake the callers and the feeder to look again (the input ended, the pool is
        stopping)."""
        with self._cond:
            self._cond.notify_all()
            self._room.notify_all()

    def _input_done(self, chunks: int, error: BaseException | None) -> None:
        with self._cond:
            self._chunks_total = chunks
            self._input_error = error
            self._cond.notify_all()

    def _wait_room(self, sent: int, ahead: int, room: int, step: int) -> int | None:
        """The feeder: how many chunks it may send now, once at least ``step`` may go:
        fewer than ``ahead`` chunks are being worked on and fewer than ``room`` wait for
        the caller (done or not), unless the results waiting hold no descriptors or the
        pool is being joined (see ``_results_room``). 0: not yet, after a wait of at most
        half a second (the feeder lets go of this iterator in between, so a caller that
        drops it ends the call); None: never (the caller stopped, or the pool ended)."""
        with self._cond:
            if not self._wants_input():
                return None
            free = ahead - (sent - self._settled)
            waiting = sent - self._next_chunk
            bounded = waiting + max(free, step) > room and self._results_hold_descriptors()
            if bounded:
                free = min(free, room - waiting)
            if free >= step:
                return free
            # woken by _put or next() once that much is there (or by _wake_all)
            self._feeder_wants = (
                sent - ahead + step,
                sent - room + step if bounded else sys.maxsize,
            )
            try:
                self._room.wait(0.5)
            finally:
                self._feeder_wants = None
            return 0

    def _wants_input(self) -> bool:
        """Whether the feeder should go on reading the input: the caller has not
        abandoned the job and the pool takes its tasks (after terminate() or a broken
        pool every task would fail at once: an endless input was read forever)."""
        job = self.job
        return job is not None and not job.abandoned and self._dispatcher.alive()

    def _results_hold_descriptors(self) -> bool:
        """Whether the results waiting for the caller may run this process out of
        descriptors: it uses more than a quarter of them, and nobody waits in the pool's
        ``join()`` (which returns once every task is done, as the stdlib's, so the results
        may not wait for a caller who is waiting there: past the limit a result is an
        ``FdLimitError``, never a hang)."""
        if self._pool_joining():
            return False
        return descriptors_used_past(0.25)

    def __del__(self) -> None:
        job = self.job
        if job is not None and not job.abandoned:
            try:
                self._dispatcher.abandon(job, kill_running=False)
            except Exception:
                pass


class IMapUnorderedIterator(IMapIterator[_T]):
    """The iterator ``imap_unordered`` returns: results as they come.

    Args:
        dispatcher: the pool's dispatcher.
    """

    def __init__(self, dispatcher: DispatcherBase) -> None:
        super().__init__(dispatcher)
        self._arrived: collections.deque[tuple[bool, Any]] = collections.deque()

    def _store(self, index: int, outcome: tuple[bool, Any]) -> None:
        self._arrived.append(outcome)

    def _awaited(self, index: int) -> bool:
        return True

    def _take_next(self) -> tuple[bool, Any] | None:
        if not self._arrived:
            return None
        self._next_chunk += 1
        return self._arrived.popleft()


class _IMapJob(Job):
    """imap's tasks. The iterator is held weakly, here and by the feeder: the caller
    that drops it (a loop left with ``break``) ends the call, which goes on no longer
    for an endless input."""

    def __init__(self, fn: Any, iterator: IMapIterator[Any]) -> None:
        super().__init__(fn)
        self.iterator = weakref.ref(iterator)

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        iterator = self.iterator()
        if iterator is None:  # dropped: nobody takes the result
            return
        progress = iterator._progress
        if ok and progress is not None:
            progress.update(len(value))
        iterator._put(task.index, ok, value)


def _results_room(chunksize: int, ahead: int) -> int:
    """imap: how many chunks' results may wait for a caller that takes them slowly.

    Under the ``file_descriptor`` strategy each array of a result waiting to be taken
    holds a descriptor: a slow consumer of an imap over arrays ran the parent out of
    them (FdLimitError, the rest of the results lost) at a limit of 1,024. The results
    waiting are kept under a quarter of the limit (one array per item counted): no bound
    in effect where the limit is high (procspawn lifts the soft limit to the hard one),
    as the stdlib's imap has none. Past it, the feeder still goes on while this process
    uses under a quarter of its descriptors (results of plain values hold none), and
    while ``join()`` waits (``imap(); close(); join()`` returned at once with the stdlib
    and waited forever here, the results waiting for a caller who waited in ``join``)."""
    raise_fd_limit()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return sys.maxsize
    return max(ahead, soft // (4 * chunksize))


def _feed(
    dispatcher: DispatcherBase,
    job: _IMapJob,
    source: Iterator[Any],
    chunksize: int,
    ahead: int,
    room: int,
    sequence: bool,
) -> None:
    """imap's input, read in a thread of its own (a slow or blocking iterable never holds
    up the dispatcher): at most ``ahead`` chunks worked on at once, and ``room`` waiting
    for the caller (see ``_results_room``). Each chunk of an iterator goes as soon as it
    was read (the next item may be long to come); a list, tuple or range is read without
    waiting, so what may go goes in one submit, and the feeder waits for room again only
    once a quarter of it is free. It holds the iterator only for a moment at a time (see
    ``_IMapJob``)."""
    iterator = job.iterator
    step = max(1, min(ahead, room) // 4)
    sent = 0
    error: BaseException | None = None
    try:
        done = False
        while not done:
            it = iterator()
            free = None if it is None else it._wait_room(sent, ahead, room, step)
            del it
            if free is None:
                break
            tasks: list[Task] = []
            try:
                for _ in range(free):
                    # an input that may wait: nothing more is read once the caller
                    # stopped or the pool ended (each item read then would be lost)
                    if not sequence and not _wants_input(iterator):
                        done = True
                        break
                    chunk = list(itertools.islice(source, chunksize))
                    if chunk:
                        tasks.append(Task(job, sent + len(tasks), _worker.MAP, chunk))
                    if len(chunk) < chunksize:
                        done = True
                        break
                    if not sequence:
                        sent, taken = _submit(dispatcher, iterator, tasks, sent)
                        tasks = []
                        if not taken:
                            done = True
                            break
            finally:  # what was read goes, even when the iterable raised after it
                sent, taken = _submit(dispatcher, iterator, tasks, sent)
                if not taken:
                    done = True
    except BaseException as exc:  # the iterable raised: its results end there
        error = exc
    finally:
        del source
        it = iterator()
        if it is not None:
            it._input_done(sent, error)
        del it
        dispatcher.submitting(-1)


def _wants_input(iterator: weakref.ref[IMapIterator[Any]]) -> bool:
    it = iterator()
    return it is not None and it._wants_input()


def _submit(
    dispatcher: DispatcherBase,
    iterator: weakref.ref[IMapIterator[Any]],
    tasks: list[Task],
    sent: int,
) -> tuple[int, bool]:
    """Hand imap's chunks to the pool: how many were sent in all, and whether the pool
    took them (when not, each failed with the error that says why)."""
    if not tasks:
        return sent, True
    try:
        # accepted before any close(): goes on after it, as the stdlib's does
        dispatcher.submit(tasks, accepted=True)
    except BaseException as exc:
        it = iterator()
        if it is not None:
            for task in tasks:
                it._put(task.index, False, exc)
        return sent + len(tasks), False
    return sent + len(tasks), True


__all__ = ["IMapIterator", "IMapUnorderedIterator"]
