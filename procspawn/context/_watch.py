"""Watching children: wait on every exit and channel at once, stop with a grace period,
and say how a child ended. Used by ``spawn``'s ProcessContext, the pools and the launcher.

::

    Watcher ──epoll──▶ exit handle of each child (a pidfd, else the Process sentinel)
                       channels (readable; writable while a send is pending)
                       a wake-up pipe (another thread has news: a task, a stop)

A child's death wakes the watcher at once (its pidfd turns readable when it exits, even if
a grandchild still holds the pipes it inherited); nothing polls.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from .. import _settings
from .._output import OutputForwarder
from ..sharing._errors import ChannelClosed, FdLimitError
from ..sharing.channels._fdpass import MessageReader, wait_readable
from ._errors import signal_name
from .launch._start_method import GUARD_MARKER

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)

if TYPE_CHECKING:  # pragma: no cover
    import socket
    from multiprocessing.process import BaseProcess
    from typing import Any

DUPLICATE_SIGINT = 1.0  # seconds within which a second SIGINT is the same Ctrl-C

_GUARD_HINT = (
    "likely cause: code that starts processes runs when the main module is imported: at "
    'its top level without an `if __name__ == "__main__":` guard, or at the top level of a '
    "module it imports. Under the spawn and forkserver start methods every child imports "
    "the main module again (and what it imports), so that code runs again in each child. "
    "Put it under the guard, or in a function that the guarded code calls."
)
# (text in a dead child's stderr, what to tell the user)
_HINTS = [
    (
        "bootstrapping phase",
        _GUARD_HINT,
    ),
]

OOM_HINT = (
    " (nothing in procspawn sent it: the kernel's out-of-memory killer is a "
    "common cause; check `dmesg` and the memory the processes use)"
)


def default_grace_period() -> float:
    """Seconds a child gets between SIGTERM and SIGKILL (env ``PROCSPAWN_GRACE_PERIOD``,
    default 3)."""
    return float(_settings.get("PROCSPAWN_GRACE_PERIOD"))


def describe_exit(
    code: int,
    killed_on_purpose: bool = False,
    *,
    pid: int | None = None,
    oom_kills_before: int | None = None,
) -> tuple[str, str | None]:
    """How a child ended, as words for an error message, and its signal's name (or None):
    ``("was terminated by signal SIGKILL (...)", "SIGKILL")``. For a SIGKILL nobody in
    procspawn sent, ``pid`` and ``oom_kills_before`` (``oom_kills()`` when the child
    started) let it say whether the kernel's out-of-memory killer did it."""
    if code < 0:
        name = signal_name(-code)
        text = f"was terminated by signal {name}"
        if -code == signal.SIGKILL and not killed_on_purpose:
            text += sigkill_cause(pid, oom_kills_before)
        return text, name
    return f"exited with exit code {code}", None


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed since boot, on the
    whole machine (``oom_kill`` in /proc/vmstat, Linux >= 4.13), or None."""
    try:
        fd = os.open("/proc/vmstat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = b"\n" + os.read(fd, 1 << 16)  # about 4 KiB, read whole by the kernel
        finally:
            os.close(fd)
        at = data.find(b"\noom_kill ")
        if at >= 0:
            return int(data[at + 10 : data.index(b"\n", at + 10)])
    except (OSError, ValueError):
        pass
    return None


def sigkill_cause(pid: int | None, oom_kills_before: int | None) -> str:
    """Who killed ``pid`` with SIGKILL, as far as the kernel says: not its out-of-memory
    killer when its count of kills did not move; else its log, when this process may read
    it (a scan of the ring buffer, only then)."""
    now = oom_kills()
    if oom_kills_before is not None and now is not None and now == oom_kills_before:
        return (
            " (not the kernel's out-of-memory killer, whose count of kills did not move: "
            "another process sent SIGKILL)"
        )
    if pid is not None and _kernel_log_names_oom_kill(pid):
        return (
            " (the kernel's out-of-memory killer: the kernel log says it killed pid "
            f"{pid}; the process needed more memory than the machine or its cgroup has)"
        )
    if oom_kills_before is None or now is None:
        return OOM_HINT
    return (
        f" (most likely the kernel's out-of-memory killer: it killed {now - oom_kills_before} "
        f"process(es) on this machine meanwhile, /proc/vmstat oom_kill; `dmesg` names them)"
    )


def _kernel_log_names_oom_kill(pid: int) -> bool:
    """Whether the kernel log (``/dev/kmsg``, where readable) records an out-of-memory
    kill of ``pid``."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    marks = (f"Killed process {pid} (".encode(), f",pid={pid},".encode())
    try:
        for _ in range(100_000):  # the ring buffer's records, one per read
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return False  # the end
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # a record overwritten while we read: go on
                return False
            if not record:
                return False
            if any(mark in record for mark in marks):
                return True
        return False
    finally:
        os.close(fd)


def missing_guard(output: OutputForwarder | None, key: int, drain: float, who: str) -> str | None:
    """The error of a child that stopped because the main module has no ``__main__`` guard
    (it said so on stderr, alone, see ``refuse_while_starting``), leading with the fix; None
    for any other death. ``who``: the child, as "process 1 (pid 42)"."""
    if output is None:
        return None
    output.wait_eof(key, drain)
    said = [line for line in output.tail(key).splitlines() if line.startswith(GUARD_MARKER)]
    if not said:
        return None
    what, _, where = (
        said[-1][len(GUARD_MARKER) :].partition("(")[2].rpartition(")")[0].partition(" at ")
    )
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    file = where.rpartition(":")[0]
    if main and os.path.abspath(main) == os.path.abspath(file):
        fix = f'put it under `if __name__ == "__main__":` in {file}'
    else:
        fix = (
            f"the main module imports {file}: move that code into a function the code under "
            f'`if __name__ == "__main__":` calls'
        )
    return (
        f"{what} is called at {where} when that file is imported: {fix}. Under the spawn and "
        f"forkserver start methods every child imports the main module again (and what it "
        f"imports); {who} reached that line while it did, and stopped."
    )


def last_words(output: OutputForwarder | None, key: int, drain: float) -> str:
    """What a child that died without a report printed last on stderr (waiting at most
    ``drain`` seconds for it), and the likely cause when we know it; "" if nothing."""
    if output is None:
        return ""
    output.wait_eof(key, drain)
    tail = output.tail(key).rstrip()
    if not tail:
        return ""
    text = "\nits last output on stderr was:\n" + "\n".join(
        "    " + line for line in tail.splitlines()
    )
    for marker, hint in _HINTS:
        if marker in tail:
            text += "\n" + hint
            break
    return text


def exit_handle(proc: BaseProcess) -> tuple[int, bool]:
    """A descriptor that turns readable when ``proc`` exits, and whether it is ours to
    close: a pidfd where the kernel has them (not fooled by a grandchild holding the
    sentinel pipe's write end), else the Process sentinel."""
    if hasattr(os, "pidfd_open") and proc.pid is not None:
        try:
            return os.pidfd_open(proc.pid), True
        except OSError:
            pass
    return proc.sentinel, False


# Seconds to wait for another thread that reaped a child to record its exit code
REAPED_ELSEWHERE_WAIT = 1.0
# The exit code reported for a child whose exit status nobody recorded (as multiprocessing's
# own fork server Popen does when it cannot read one)
UNKNOWN_EXIT_CODE = 255


def exit_code(proc: BaseProcess, timeout: float | None = None) -> int | None:
    """The exit code of ``proc``, which its exit handle said has exited: joined (for at
    most ``timeout`` seconds under forkserver, whose server reports it).

    Another thread may have reaped it first: every ``Process.start()``, in any thread,
    polls all of multiprocessing's children (``multiprocessing.process._cleanup``), and a
    join that comes between that poll's ``waitpid`` and its recording of the code finds no
    child; the code is there a moment later. None if it never is (the child was reaped
    outside multiprocessing: SIGCHLD ignored, an ``os.wait()`` of the program's own).
    """
    _join(proc, timeout)
    if proc.exitcode is not None or signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        return proc.exitcode  # (ignored SIGCHLD: the kernel reaps every child, nobody records)
    deadline = time.monotonic() + REAPED_ELSEWHERE_WAIT
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return proc.exitcode


def unknown_exit_text() -> str:
    """The words for a child whose exit status is unknown (see ``exit_code``)."""
    return (
        "exited, with an unknown exit status (something else in this process collected "
        "it: SIGCHLD set to SIG_IGN, or an os.wait() of its own)"
    )


class Watcher:
    """One epoll over children's exits, channels and a wake-up pipe.

    ``add(fd, key, write=False)`` watches a descriptor; ``wait(timeout)`` returns the
    ``(key, readable, writable)`` of those ready; ``wake()`` (any thread) ends a wait.
    ``close()`` from another thread than a waiting one wakes it, and the waiter closes
    the descriptors as it leaves (never one that a thread is blocked on); a wait after
    ``close()`` returns nothing at once.
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._woken = False
        # re-entrant: wake() may run in a finalizer that the garbage collector started
        # inside one of this watcher's own locked sections, in the same thread (every
        # holder keeps it for a few instructions and never blocks under it)
        self._state = threading.RLock()
        self._waiters: set[int] = set()  # threads in wait()
        self._closed = False  # close() was called
        self._gone = False  # its descriptors are closed

    def add(self, fd: int, key: Any, write: bool = False) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        self._selector.register(fd, events, key)

    def want_write(self, fd: int, key: Any, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        with contextlib.suppress(KeyError, ValueError):  # no longer watched: it is gone
            self._selector.modify(fd, events, key)

    def remove(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)

    def wake(self) -> None:
        """End the current or next ``wait()`` (call it after making the news visible)."""
        if self._woken:
            return
        with self._state:  # never a write to a closed (maybe reused) descriptor number
            if self._woken or self._gone:
                return
            self._woken = True
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"x")

    def wait(self, timeout: float | None) -> list[tuple[Any, bool, bool]]:
        me = threading.get_ident()
        try:
            with self._state:
                if self._closed:
                    return []
                self._waiters.add(me)
            return self._wait(timeout)
        finally:  # (a set, not a count: a KeyboardInterrupt anywhere leaves it right)
            with self._state:
                self._waiters.discard(me)
                last = self._closed and not self._waiters
            if last:
                self._close_now()

    def _wait(self, timeout: float | None) -> list[tuple[Any, bool, bool]]:
        ready = []
        for selkey, events in self._selector.select(timeout):
            if selkey.data is None:
                # drain first, then clear: cleared first, a wake() in between would write
                # a byte the drain eats and leave the flag set on an empty pipe, and every
                # later wake() would be lost
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
                self._woken = False
                continue
            ready.append(
                (
                    selkey.data,
                    bool(events & selectors.EVENT_READ),
                    bool(events & selectors.EVENT_WRITE),
                )
            )
        return ready

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            if self._waiters:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")  # the waiter closes it all as it leaves
                return
        self._close_now()

    def _close_now(self) -> None:
        with self._state:
            if self._gone:
                return
            self._gone = True
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


EXIT, CHANNEL = "exit", "chan"  # a WatchedChild's keys in the watcher: (EXIT, key), (CHANNEL, key)


class WatchedChild:
    """One child as its parent watches it: the process, the parent's end of its channel
    and the reader of that channel, its exit handle (both in the parent's ``Watcher``,
    under ``(EXIT, key)`` and ``(CHANNEL, key)``; key None: the child itself), and what
    its post-mortem needs: the kernel's count of out-of-memory kills as it started and
    its key in the output forwarder.

    ``spawn``'s ranks (``ProcessContext``) and the pools' workers (``pool._workers``) are
    watched children; ``procspawn run``'s ranks are not (it waits in ``sigtimedwait``, to
    know who sent a signal) and shares the post-mortem's wording (``how_it_ended``).
    """

    __slots__ = (
        "proc",
        "pid",
        "sock",
        "reader",
        "exit_fd",
        "own_exit_fd",
        "watcher",
        "key",
        "output_key",
        "oom_kills",
    )

    def __init__(
        self,
        proc: BaseProcess,
        sock: socket.socket,
        watcher: Watcher,
        key: Any,
        output_key: int,
        oom_count: int | None,
    ) -> None:
        self.proc = proc
        self.pid: int = proc.pid  # type: ignore[assignment]  # started: it has a pid
        self.sock = sock
        sock.setblocking(False)  # read (and written, by a pool) as the watcher says
        self.reader = MessageReader(sock)
        self.watcher = watcher
        self.key = key  # None: the child itself (not kept here: no reference cycle)
        self.output_key = output_key
        self.oom_kills = oom_count  # the kernel's count as it started (see describe_exit)
        self.exit_fd, self.own_exit_fd = exit_handle(proc)
        try:
            watcher.add(self.exit_fd, (EXIT, self._key()))
            watcher.add(sock.fileno(), (CHANNEL, self._key()))
        except BaseException:
            watcher.remove(self.exit_fd)
            if self.own_exit_fd:
                os.close(self.exit_fd)
            raise

    def read(self, on_message: Callable[[bytes, list[int]], bool]) -> None:
        """Read what its channel has, without blocking, handing each whole message to
        ``on_message`` (True: read no further now). At the channel's end, or a broken
        channel, ``reader.eof`` is set and the channel is not watched any more. An
        FdLimitError (this process at its descriptor limit: a message read whole, its
        descriptors dropped) goes to the caller, and reading may go on after it."""
        reader = self.reader
        while True:
            try:
                whole = reader.feed()
            except (BlockingIOError, InterruptedError):
                return
            except FdLimitError:
                raise
            except (ChannelClosed, OSError):
                reader.eof = True
                self.watcher.remove(self.sock.fileno())
                return
            if whole and on_message(*reader.pop()):
                return

    def want_write(self, write: bool) -> None:
        """Watch its channel for room to write too (a send is pending), or not."""
        self.watcher.want_write(self.sock.fileno(), (CHANNEL, self._key()), write)

    def _key(self) -> Any:
        return self if self.key is None else self.key

    def has_exited(self) -> bool:
        """Whether its exit handle says it is gone, without waiting."""
        poller = select.poll()
        poller.register(self.exit_fd, select.POLLIN)
        return any(events & (select.POLLIN | select.POLLHUP) for _, events in poller.poll(0))

    def exit_status(self, server_wait: float | None = None) -> int | None:
        """Its exit status, once its exit handle said it exited; None: reaped outside
        multiprocessing, unknown (see ``exit_code``). ``server_wait``: under forkserver, the
        seconds to wait for the server to report it, then SIGKILL to be sure it is gone
        and as long again (None: as long as it takes)."""
        code = exit_code(self.proc, server_wait)
        if code is None and server_wait is not None:  # the server never said: be sure
            send_signal(self.proc, signal.SIGKILL)
            code = exit_code(self.proc, server_wait)
        return code

    def how_it_ended(self, code: int | None) -> tuple[str, str | None, int]:
        """Words for its end, its signal's name (or None), and the exit code to report
        (``UNKNOWN_EXIT_CODE`` where ``code`` is None)."""
        return how_it_ended(code, self.pid, self.oom_kills)

    def last_words(self, output: OutputForwarder | None, drain: float) -> str:
        """What it printed last on stderr, and the likely cause (see ``last_words``)."""
        return last_words(output, self.output_key, drain)

    def missing_guard(self, output: OutputForwarder | None, drain: float, who: str) -> str | None:
        """The error of a start stopped by a missing ``__main__`` guard, or None."""
        return missing_guard(output, self.output_key, drain, who)

    def unwatch(self) -> None:
        self.watcher.remove(self.exit_fd)
        self.watcher.remove(self.sock.fileno())

    def close(self) -> None:
        """Out of the watcher; its exit handle (if ours), channel and reader closed."""
        self.unwatch()
        self.close_handles()

    def close_handles(self) -> None:
        """Its exit handle (if ours), channel and reader closed (the watcher closed, or
        left already)."""
        if self.own_exit_fd:
            self.own_exit_fd = False
            with contextlib.suppress(OSError):
                os.close(self.exit_fd)
        self.close_channel()

    def close_channel(self) -> None:
        """Its channel and reader closed (a child blocked sending on it gets EPIPE)."""
        self.reader.close()
        self.sock.close()


def how_it_ended(
    code: int | None, pid: int | None, oom_kills_before: int | None
) -> tuple[str, str | None, int]:
    """Words for a child's end, its signal's name (or None), and the exit code to report
    (``UNKNOWN_EXIT_CODE`` where ``code`` is None: see ``exit_code``)."""
    if code is None:
        return unknown_exit_text(), None, UNKNOWN_EXIT_CODE
    how, name = describe_exit(code, pid=pid, oom_kills_before=oom_kills_before)
    return how, name, code


def stop(processes: list[BaseProcess], grace_period: float, signum: int = signal.SIGTERM) -> None:
    """Signal every live process, SIGKILL what is left after the grace period, reap all.

    Whatever happens meanwhile, every process ends up killed and reaped: a Ctrl-C during
    the grace period does not interrupt the stopping, it only cuts the grace short.
    """
    alive = [p for p in processes if p.exitcode is None]
    begun = time.monotonic()

    def hurry() -> None:
        for p in alive:
            if p.exitcode is None:
                send_signal(p, signal.SIGKILL)

    def on_sigint() -> None:
        # One Ctrl-C often arrives twice (a terminal's SIGINT to the whole group and
        # `timeout -s INT`'s to us): only a later one is the user asking to hurry.
        if time.monotonic() - begun >= DUPLICATE_SIGINT:
            hurry()

    with sigint_held(on_sigint):
        try:
            for p in alive:
                send_signal(p, signum)
            deadline = time.monotonic() + grace_period
            for p in alive:
                _join(p, max(0.0, deadline - time.monotonic()))
        finally:
            hurry()
            for p in alive:
                p.join()


def _join(proc: BaseProcess, timeout: float | None) -> None:
    """``proc.join(timeout)``, whose timeout imports multiprocessing.connection (~5 ms of
    a pool's start or stop): it waits on the sentinel with ``wait_readable`` first."""
    if timeout is not None and proc.exitcode is None:
        try:
            sentinel = proc.sentinel
        except ValueError:  # never started
            return
        if not wait_readable([sentinel], timeout):
            return
    proc.join()


def send_signal(proc: BaseProcess, signum: int) -> None:
    """``os.kill`` that does nothing to a process already gone."""
    if proc.pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signum)


@contextlib.contextmanager
def sigint_held(on_sigint: Callable[[], None]) -> Iterator[None]:
    """While children stop, a SIGINT calls ``on_sigint`` instead of raising (main thread
    only; other threads cannot set handlers, and never get KeyboardInterrupt anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: on_sigint())
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
