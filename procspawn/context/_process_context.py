"""ProcessContext: watch every rank at once, collect results, stop everything on a failure.

The parent waits on two things per rank at the same time: the process sentinel (it exited)
and the rank's result channel (a message arrived). Channels are read while waiting, so a
rank sending a large return value never blocks on a full socket buffer, and an error
message surfaces the moment it is sent, whatever the rank.
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import socket
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

from ..sharing import _pickler
from ..sharing._fdpass import ChannelClosed, MessageReader
from ..sharing._limits import FdLimitError
from ._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    signal_name,
)

_DEFAULT_GRACE_PERIOD = 3.0
_MISSING: Any = object()


def default_grace_period() -> float:
    """Seconds a sibling gets between SIGTERM and SIGKILL (env ``PROCSPAWN_GRACE_PERIOD``)."""
    value = os.environ.get("PROCSPAWN_GRACE_PERIOD")
    if value is None:
        return _DEFAULT_GRACE_PERIOD
    try:
        grace = float(value)
    except ValueError:
        raise ValueError(
            f"PROCSPAWN_GRACE_PERIOD must be a number of seconds, got {value!r}"
        ) from None
    if grace < 0:
        raise ValueError(f"PROCSPAWN_GRACE_PERIOD must be >= 0, got {value!r}")
    return grace


class ProcessContext:
    """The running ranks of one ``spawn(..., join=False)`` call.

    Attributes:
        processes: the ``multiprocessing.Process`` objects, by rank.
    """

    def __init__(
        self,
        processes: list[BaseProcess],
        channels: list[socket.socket],
        keepalive: Any = None,
    ) -> None:
        self.processes = processes
        self._readers = [MessageReader(sock) for sock in channels]
        self._results: list[Any] = [_MISSING] * len(processes)
        self._exited = [False] * len(processes)
        self._keepalive = keepalive  # the spawn payload: shared segments the ranks map
        self._error: ProcessException | None = None
        self._closed = False

    def pids(self) -> list[int]:
        """The process ids, by rank."""
        return [p.pid for p in self.processes]  # type: ignore[misc]

    @property
    def results(self) -> list[Any]:
        """The return values by rank, once ``join()`` returned True."""
        if not self._closed or self._error is not None:
            raise RuntimeError("results are available once join() has returned True")
        return list(self._results)

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for the ranks.

        Args:
            timeout: seconds to wait at most; None waits until every rank is done.
            grace_period: on a failure, seconds between SIGTERM and SIGKILL for the
                remaining ranks (default: env ``PROCSPAWN_GRACE_PERIOD`` or 3 s).

        Returns:
            True when every rank finished successfully (``results`` is then ready),
            False when ``timeout`` passed with ranks still running.

        Raises:
            ProcessRaisedException: a rank raised (its traceback is in the message).
            ProcessExitedException: a rank exited with a non-zero code or a signal.
            KeyboardInterrupt: Ctrl-C in the parent; every rank was stopped first (any
                other exception while waiting stops them too). Later calls raise a
                ProcessException saying so.
        """
        if self._error is not None:
            raise _detached(self._error)  # a copy: the raise gives it a traceback to here
        if self._closed:
            return True
        if grace_period is None:
            grace_period = default_grace_period()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                waiting: dict[Any, tuple[str, int]] = {}
                for rank, proc in enumerate(self.processes):
                    if not self._exited[rank]:
                        waiting[proc.sentinel] = ("exit", rank)
                    if self._results[rank] is _MISSING and not self._readers[rank].eof:
                        waiting[self._readers[rank].sock.fileno()] = ("msg", rank)
                if not waiting:
                    self._close()
                    return True
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = wait(list(waiting), remaining)
                if not ready and deadline is not None and time.monotonic() >= deadline:
                    return False
                # Messages first: an error message explains the exit that follows it.
                ready.sort(key=lambda obj: waiting[obj][0] != "msg")
                for obj in ready:
                    kind, rank = waiting[obj]
                    if kind == "msg":
                        self._read(rank)
                    else:
                        self._on_exit(rank)
        except ProcessException as exc:
            self._error = _detached(exc)
            self._stop_all(grace_period)
            raise
        except BaseException as exc:  # Ctrl-C, or anything else that stops us waiting
            self._error = ProcessException(
                f"join() was interrupted by {type(exc).__name__}; every rank was stopped",
                -1,
                -1,
            )
            self._stop_all(grace_period)
            raise

    # -- reading results -------------------------------------------------------------------

    def _read(self, rank: int) -> None:
        """Read what is there (non-blocking) and handle a finished message."""
        reader = self._readers[rank]
        reader.sock.setblocking(False)
        try:
            while True:
                if reader.feed():
                    self._on_message(rank, *reader.pop())
                    return
        except (BlockingIOError, InterruptedError):
            return
        except ChannelClosed:
            return
        except FdLimitError as exc:
            raise ProcessRaisedException(
                f"process {rank} terminated with the following error:\n"
                f"its result could not be received by the parent: {exc}",
                rank,
                self.processes[rank].pid,  # type: ignore[arg-type]
            ) from exc
        except OSError:
            reader.eof = True  # a broken channel: the exit code will tell what happened

    def _on_message(self, rank: int, data: bytes, fds: list[int]) -> None:
        pid: int = self.processes[rank].pid  # type: ignore[assignment]
        try:
            message = _pickler.loads(data, fds)
        except Exception as exc:
            raise ProcessRaisedException(
                f"process {rank} terminated with the following error:\n"
                f"its return value could not be unpickled in the parent: "
                f"{type(exc).__name__}: {exc}",
                rank,
                pid,
            ) from exc
        if message[0] == "ok":
            self._results[rank] = message[1]
            return
        _, exc_blob, text = message
        cause = None
        if exc_blob is not None:
            try:
                cause = pickle.loads(exc_blob)
            except Exception:
                cause = None
        # Raised without a local name: a frame that refers to the exception it raises is a
        # reference cycle (exception -> traceback -> frame -> exception), and this frame
        # refers to the context, whose results (shared arrays) would wait for the cyclic
        # garbage collector.
        raise ProcessRaisedException(
            f"process {rank} terminated with the following error:\n{text}", rank, pid
        ) from (cause if isinstance(cause, BaseException) else None)

    def _on_exit(self, rank: int) -> None:
        proc = self.processes[rank]
        proc.join()
        self._exited[rank] = True
        if self._results[rank] is _MISSING and not self._readers[rank].eof:
            self._read(rank)  # the whole message is in the socket buffer by now
        code = proc.exitcode
        assert code is not None
        if self._results[rank] is not _MISSING and code == 0:
            return
        if code == 0:
            self._results[rank] = None  # sys.exit(0) / sys.exit(None): a clean exit
            return
        pid: int = proc.pid  # type: ignore[assignment]
        if code < 0:
            name = signal_name(-code)
            msg = f"process {rank} (pid {pid}) was terminated by signal {name}"
            if -code == signal.SIGKILL:
                msg += (
                    " (nothing in procspawn sent it: the kernel's out-of-memory killer is a "
                    "common cause; check `dmesg` and the ranks' memory use)"
                )
            raise ProcessExitedException(msg, rank, pid, code, name)
        raise ProcessExitedException(
            f"process {rank} (pid {pid}) exited with exit code {code}", rank, pid, code
        )

    # -- stopping --------------------------------------------------------------------------

    def _stop_all(self, grace_period: float) -> None:
        """SIGTERM every live rank, SIGKILL what is left after the grace period, reap all."""
        alive = [p for p in self.processes if p.exitcode is None]
        for p in alive:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.exitcode is None:
                _signal(p, signal.SIGKILL)
        for p in alive:
            p.join()
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for reader in self._readers:
            reader.close()
            reader.sock.close()
        for p in self.processes:
            p.join()
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None


def _detached(exc: ProcessException) -> ProcessException:
    """A copy of ``exc`` for later ``join()`` calls to raise again, holding no traceback:
    the context keeping the raised exception itself would be a reference cycle through the
    traceback's frames (which refer to the context and its results)."""
    twin = copy.copy(exc)
    cause = exc.__cause__
    twin.__cause__ = cause if cause is None or cause.__traceback__ is None else None
    return twin


def _signal(proc: BaseProcess, signum: int) -> None:
    try:
        os.kill(proc.pid, signum)  # type: ignore[arg-type]
    except ProcessLookupError:
        pass
