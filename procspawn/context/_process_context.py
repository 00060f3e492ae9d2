"""ProcessContext: watch every rank at once, collect results, stop everything on a failure.

The parent waits on two things per rank at the same time, in one ``Watcher`` (the pools'
too): the rank's exit handle (its pidfd: it exited) and its result channel (a message
arrived). Channels are read while waiting, so a
rank sending a large return value never blocks on a full socket buffer, and an error
message surfaces the moment it is sent, whatever the rank.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, Generic, TypeVar

from .._output import OutputForwarder
from ..sharing._errors import FdLimitError
from ..sharing.wire import _pickler
from . import _raised, _tags
from ._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    ProcessTimeoutError,
    ctrl_c_in_caller,
)
from ._progress import Progress
from ._watch import (
    CHANNEL,
    WatchedChild,
    Watcher,
    default_grace_period,
    oom_kills,
    stop,
)

TYPE_CHECKING = False  # as typing's (this package's one convention)
if TYPE_CHECKING:  # pragma: no cover
    from ..sharing.channels._startup import StartupMessage

__all__ = ["ProcessContext", "default_grace_period"]

_PROGRESS_TICK = 0.1  # seconds between progress redraws while joining
_OUTPUT_DRAIN = 1.0  # seconds to wait for a dead rank's last output
_MISSING: Any = object()
_R = TypeVar("_R")  # what the ranks' function returns


class ProcessContext(Generic[_R]):
    """The running ranks of one ``spawn(..., join=False)`` call.

    ``spawn`` makes it; it is not made by hand. Poll it with ``join(timeout)``; stop it
    with ``terminate()``; or use it as a context manager, which stops whatever still runs
    when the block is left (Ctrl-C in the block stops the ranks as ``join`` does)::

        with procspawn.spawn(fn, nprocs=4, join=False) as ctx:
            while not ctx.join(timeout=1.0):
                ...
            print(ctx.results)

    A context dropped without ``join`` or ``terminate`` lets go of its channels and
    shared memory when it is garbage-collected; its processes are not stopped then.

    Args:
        processes: the started ranks, by rank.
        channels: the parent's end of each rank's result channel, by rank.
        keepalive: the spawn payload, closed with the context (the ranks map its
            shared segments while they start).
        output: the forwarder of the ranks' stdout and stderr, closed with the context.
        progress: the progress display, or None.
        grace_period: the default of ``join`` and ``terminate``.

    Attributes:
        processes: the ``multiprocessing.Process`` objects, by rank.
        progress: the ``procspawn.Progress`` asked for with ``progress=``, or None.
    """

    def __init__(
        self,
        processes: list[BaseProcess],
        channels: list[socket.socket],
        keepalive: StartupMessage | None = None,
        *,
        output: OutputForwarder | None = None,
        progress: Progress | None = None,
        grace_period: float | None = None,
    ) -> None:
        self.processes = processes
        self.progress = progress
        self._results: list[Any] = [_MISSING] * len(processes)
        self._exited = [False] * len(processes)
        self._output = output
        # every rank's exit handle and channel, watched together by join()
        self._watcher = Watcher()
        self._children: list[WatchedChild] = []
        count = oom_kills()  # the kernel's count as the ranks started
        try:
            for rank, (proc, sock) in enumerate(zip(processes, channels, strict=True)):
                self._children.append(WatchedChild(proc, sock, self._watcher, rank, rank, count))
        except BaseException:
            _close_watcher(self._watcher, self._children)
            raise
        # keepalive: the spawn payload, whose shared segments the ranks map
        self._release = weakref.finalize(
            self,
            _release_dropped,
            processes,
            grace_period,
            (self._children, output, progress, keepalive, self._watcher),
        )
        self._grace_period = grace_period
        self._started = time.monotonic()
        self._error: ProcessException | None = None
        self._closed = False
        self._terminating = False  # terminate() runs (maybe in another thread than join())
        self._lock = threading.RLock()  # join()'s handling of news against terminate()
        self._done = threading.Event()  # set once closed

    def pids(self) -> list[int]:
        """The process ids of the ranks.

        Returns:
            The pid of each rank, by rank (the processes are started by then).
        """
        # a started process has its pid (BaseProcess.pid is typed int | None)
        return [p.pid for p in self.processes]  # type: ignore[misc]

    @property
    def results(self) -> list[_R | None]:
        """The return values by rank.

        Complete once ``join()`` returned True (None for a rank that ended with
        ``sys.exit(0)``). After a failure or ``terminate()``, the values of the ranks
        that had finished, None for the others (the same list as the exception's
        ``results``).

        Raises:
            RuntimeError: ranks are still running (``join()`` has not returned True and
                nothing stopped them).
        """
        if not self._closed:
            raise RuntimeError(
                "results are available once join() has returned True (or the ranks were "
                "stopped by a failure or terminate())"
            )
        return [None if r is _MISSING else r for r in self._results]

    def __enter__(self) -> ProcessContext[_R]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._closed:
            return
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C in the block: as in join()
            self._interrupted(exc, self._grace(None))
        else:
            self.terminate()

    def terminate(self, grace_period: float | None = None) -> None:
        """Stop every rank still running and release the context.

        Each rank gets SIGTERM, then SIGKILL after the grace period. Ranks that had
        finished keep their ``results``; later ``join()`` calls return True. Does nothing
        once the context is closed. A ``join()`` waiting in another thread returns.

        Args:
            grace_period: seconds between SIGTERM and SIGKILL (default: spawn's
                ``grace_period``, env ``PROCSPAWN_GRACE_PERIOD`` or 3 s).
        """
        if self._closed:
            return
        with self._lock:  # a join() in another thread is between two waits
            self._terminating = True  # its ranks' deaths are not failures: it stops
        self._watcher.wake()
        self._stop_all(self._grace(grace_period))

    @ctrl_c_in_caller
    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for the ranks.

        The first failure, whatever the rank, stops every other rank before it is
        raised; once a call raised, every later call raises the same error again.

        Args:
            timeout: seconds to wait at most; None waits until every rank is done.
            grace_period: on a failure, seconds between SIGTERM and SIGKILL for the
                remaining ranks (default: spawn's ``grace_period``, env
                ``PROCSPAWN_GRACE_PERIOD`` or 3 s).

        Returns:
            True when every rank finished successfully, or the context was stopped by
            ``terminate()`` (``results`` is then ready), False when ``timeout`` passed
            with ranks still running.

        Raises:
            ProcessRaisedException: a rank raised (its traceback is in the message).
            ProcessExitedException: a rank exited with a non-zero code or a signal.
            KeyboardInterrupt: Ctrl-C in the parent; the ranks got SIGINT (their
                ``finally`` blocks run) and were stopped (any other exception while
                waiting stops them too, with SIGTERM). Later calls raise a
                ProcessException saying so.
        """
        if self._error is not None:
            raise _detached(self._error)  # a copy: the raise gives it a traceback to here
        if self._closed:
            return True
        grace_period = self._grace(grace_period)
        deadline = None if timeout is None else time.monotonic() + timeout
        shown = self.progress
        with _first_sigint_raises():
            try:
                while True:
                    if self._terminating or self._closed:  # terminate() in another thread
                        left = None if deadline is None else max(0.0, deadline - time.monotonic())
                        return self._done.wait(left)
                    if all(self._exited) and all(
                        r is not _MISSING or child.reader.eof
                        for r, child in zip(self._results, self._children, strict=True)
                    ):
                        self._close()
                        return True
                    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if shown is not None:
                        shown.render()
                        remaining = (
                            _PROGRESS_TICK if remaining is None else min(remaining, _PROGRESS_TICK)
                        )
                    ready = self._watcher.wait(remaining)
                    with self._lock:
                        if self._terminating or self._closed:
                            continue
                        if not ready and deadline is not None and time.monotonic() >= deadline:
                            return False
                        # Messages first: an error message explains the exit that follows it.
                        ready.sort(key=lambda item: item[0][0] != CHANNEL)
                        for (source, rank), _readable, _writable in ready:
                            if source == CHANNEL:
                                self._read(rank)
                            else:
                                self._on_exit(rank)
            except ProcessException as exc:
                self._fail(exc, grace_period)
                raise
            except KeyboardInterrupt as exc:
                self._interrupted(exc, grace_period)
                raise
            except BaseException as exc:  # anything else that stops us waiting
                self._fail(_stopped_by(exc), grace_period)
                raise

    def _grace(self, grace_period: float | None) -> float:
        if grace_period is not None:
            return grace_period
        if self._grace_period is not None:
            return self._grace_period
        return default_grace_period()

    def _run_to_end(self, timeout: float | None) -> list[_R]:
        """spawn(join=True): join until done or ``timeout`` seconds after the start."""
        deadline = None if timeout is None else self._started + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.join(remaining):
                # every rank returned (None only for a sys.exit(0), which spawn documents)
                done: list[Any] = self.results
                return done
            if deadline is not None and time.monotonic() >= deadline:
                self._time_out()

    def _time_out(self) -> None:
        running = [r for r, done in enumerate(self._exited) if not done]
        elapsed = time.monotonic() - self._started
        grace = self._grace(None)
        first = running[0] if running else -1
        pid = self.processes[first].pid if running else -1
        listed = ", ".join(f"{r} (pid {self.processes[r].pid})" for r in running)
        exc = ProcessTimeoutError(
            f"spawn() timed out after {elapsed:.1f} s: rank(s) {listed} still running after "
            f"{elapsed:.1f} s; every rank was stopped (SIGTERM, then SIGKILL after "
            f"{grace:g} s)",
            first,
            pid,  # type: ignore[arg-type]  # started processes: it has a pid
            running,
            elapsed,
        )
        self._fail(exc, grace)
        raise exc

    def _fail(self, exc: ProcessException, grace_period: float) -> None:
        """Stop everything; the exception (and later joins) carry the finished results."""
        self._stop_all(grace_period)
        exc.results = self.results
        self._error = _detached(exc)

    def _interrupted(self, exc: BaseException, grace_period: float) -> None:
        """Ctrl-C: SIGINT to the ranks (KeyboardInterrupt there, ``finally`` blocks run),
        SIGKILL after the grace period; further Ctrl-Cs are held off meanwhile, so the
        user sees one traceback."""
        self._stop_all(grace_period, signal.SIGINT)
        self._fail(_stopped_by(exc), grace_period)

    # -- reading results -------------------------------------------------------------------

    def _read(self, rank: int) -> None:
        """Read what is there (non-blocking) and handle a finished message; a channel that
        has given its message or reached its end is not watched any more."""
        child = self._children[rank]

        def on_message(data: bytes, fds: list[int]) -> bool:
            self._on_message(rank, data, fds)
            return True  # a rank sends one message

        try:
            child.read(on_message)
        except FdLimitError as exc:
            _pickler.give_back_unreceived(exc)  # the result is lost: what it held goes back
            raise ProcessRaisedException(
                f"process {rank} (pid {child.pid}) terminated with the following "
                f"error:\nits result could not be received by the parent: {exc}",
                rank,
                child.pid,
            ) from exc
        finally:
            if self._results[rank] is not _MISSING:
                self._watcher.remove(child.sock.fileno())

    def _on_message(self, rank: int, data: bytes, fds: list[int]) -> None:
        pid: int = self.processes[rank].pid  # type: ignore[assignment]  # started: has a pid
        try:
            message = _pickler.loads_received(data, fds)
        except Exception as exc:
            raise ProcessRaisedException(
                f"process {rank} (pid {pid}) terminated with the following error:\n"
                f"its return value could not be unpickled in the parent: "
                f"{type(exc).__name__}: {exc}",
                rank,
                pid,
            ) from exc
        if message[0] == _tags.RESULT:
            self._results[rank] = message[1]
            return
        _, exc_blob, text = message
        # Raised without a local name: a frame that refers to the exception it raises is a
        # reference cycle (exception -> traceback -> frame -> exception), and this frame
        # refers to the context, whose results (shared arrays) would wait for the cyclic
        # garbage collector.
        raise ProcessRaisedException(
            f"process {rank} (pid {pid}) terminated with the following error:\n{text}",
            rank,
            pid,
        ) from _raised.unpack(exc_blob)

    def _on_exit(self, rank: int) -> None:
        child = self._children[rank]
        code = child.exit_status()
        self._exited[rank] = True
        self._watcher.remove(child.exit_fd)
        if self._results[rank] is _MISSING and not child.reader.eof:
            self._read(rank)  # the whole message is in the socket buffer by now
        if self._results[rank] is not _MISSING and code in (0, None):
            return  # its result came: an unknown exit status does not undo it
        if code == 0:
            self._results[rank] = None  # sys.exit(0) / sys.exit(None): a clean exit
            return
        pid = child.pid
        who = f"process {rank} (pid {pid})"
        unguarded = child.missing_guard(self._output, _OUTPUT_DRAIN, who)
        if unguarded is not None:
            raise ProcessExitedException(unguarded, rank, pid, code or 1, None)
        how, name, code = child.how_it_ended(code)
        words = child.last_words(self._output, _OUTPUT_DRAIN)
        raise ProcessExitedException(f"{who} {how}{words}", rank, pid, code, name)

    # -- stopping --------------------------------------------------------------------------

    def _stop_all(self, grace_period: float, signum: int = signal.SIGTERM) -> None:
        """Signal every live rank, SIGKILL what is left after the grace period, reap all,
        keep the results already sent, release everything.

        Whatever happens meanwhile, every rank ends up killed and reaped: a Ctrl-C during
        the grace period does not interrupt the stopping, it only cuts the grace short.
        """
        try:
            stop(self.processes, grace_period, signum)
        finally:
            self._keep_sent_results()
            self._close()

    def _keep_sent_results(self) -> None:
        """Every rank has exited: a result it sent is whole in its channel. Keep those
        (an error message there is not the first failure any more, and is dropped)."""
        for rank, child in enumerate(self._children):
            if self._results[rank] is _MISSING and not child.reader.eof and not self._closed:
                try:
                    self._read(rank)
                except Exception:
                    pass

    def _close(self) -> None:
        if self._closed:
            return
        for child in self._children:  # first: a rank blocked sending its result gets EPIPE
            child.close_channel()
        for p in self.processes:
            p.join()
        self._closed = True
        self._release()
        self._done.set()


def _close_watcher(watcher: Watcher, children: list[WatchedChild]) -> None:
    """Close the watcher (which wakes a join() blocked in it in another thread), then each
    rank's exit handle (if ours), channel and reader."""
    watcher.close()
    for child in children:
        child.close_handles()


def _release_dropped(
    processes: list[BaseProcess], grace: float | None, held: tuple[Any, ...]
) -> None:
    """``_release(*held)``, for ``_close`` or the garbage collector. A context dropped
    while ranks ran (nothing could join them or read their results, and their output pipes
    go with it) stops them first, as ``terminate()`` would, in a thread of its own: the
    collector may run this in any thread, inside any locked section."""
    alive = [p for p in processes if p.exitcode is None]
    if not alive:
        _release(*held)
        return
    if grace is None:
        grace = default_grace_period()
    warnings.warn(
        f"a ProcessContext was dropped while {len(alive)} of its ranks ran: they are "
        f"stopped (SIGTERM, SIGKILL after {grace:g} s). Call join() or terminate() on it",
        ResourceWarning,
        stacklevel=2,
    )

    def stop_then_release() -> None:
        try:
            stop(alive, grace)
        finally:
            _release(*held)

    threading.Thread(target=stop_then_release, name="procspawn-dropped", daemon=True).start()


def _release(
    children: list[WatchedChild],
    output: OutputForwarder | None,
    progress: Progress | None,
    keepalive: StartupMessage | None,
    watcher: Watcher,
) -> None:
    """What a context holds besides its processes. Run by ``_close``, or by the garbage
    collector for a context dropped unclosed (ranks joined by hand, say)."""
    _close_watcher(watcher, children)
    if progress is not None:
        progress.close()
    if output is not None:
        output.close(_OUTPUT_DRAIN)
    if keepalive is not None:
        keepalive.close()


def _detached(exc: ProcessException) -> ProcessException:
    """A copy of ``exc`` for later ``join()`` calls to raise again, holding no traceback:
    the context keeping the raised exception itself would be a reference cycle through the
    traceback's frames (which refer to the context and its results)."""
    twin = copy.copy(exc)
    cause = exc.__cause__
    twin.__cause__ = cause if cause is None or cause.__traceback__ is None else None
    return twin


def _stopped_by(exc: BaseException) -> ProcessException:
    return ProcessException(
        f"join() was interrupted by {type(exc).__name__}; every rank was stopped", -1, -1
    )


@contextlib.contextmanager
def _first_sigint_raises() -> Iterator[None]:
    """While joining: the first SIGINT raises KeyboardInterrupt, and one arriving right
    after it (the same Ctrl-C delivered twice) does nothing until the stopping code holds
    SIGINT itself. Only with Python's default handler, in the main thread."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
