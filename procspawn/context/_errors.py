"""The exceptions that ``spawn`` and ``ProcessContext.join`` raise."""

from __future__ import annotations

import signal


class ProcessException(Exception):
    """A worker rank failed.

    Raised by ``spawn`` / ``ProcessContext.join`` once the first failing rank is known and
    every sibling has been stopped. Catch this to handle any rank failure; the subclasses
    say whether the rank raised or exited. ``error_index`` is the rank, ``pid`` its process id.
    """

    def __init__(self, msg: str, error_index: int, pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = pid

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self):
        return (type(self), (self.msg, self.error_index, self.pid))


class ProcessRaisedException(ProcessException):
    """A rank raised an exception (``KeyboardInterrupt`` included).

    ``str()`` holds the child's full traceback text. When the child's exception could be
    pickled and unpickled in the parent it is attached as ``__cause__``, so
    ``isinstance(err.__cause__, ValueError)`` tells what the rank raised. Fix the bug the
    traceback points at.
    """

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg, error_index=error_index, pid=error_pid)


class ProcessExitedException(ProcessException):
    """A rank exited without raising: ``sys.exit(n)``, ``os._exit(n)`` or a signal.

    ``exit_code`` is the process exit code (negative for a signal, as in
    ``multiprocessing``) and ``signal_name`` the signal's name (``"SIGKILL"``) or None.
    A SIGKILL that nobody sent on purpose is most often the kernel's out-of-memory killer:
    check ``dmesg`` and the memory the ranks use.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index=error_index, pid=error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        return (
            type(self),
            (self.msg, self.error_index, self.pid, self.exit_code, self.signal_name),
        )


def signal_name(signum: int) -> str:
    """The name of a signal number ("SIGKILL"), or "signal <n>" if it has none."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
