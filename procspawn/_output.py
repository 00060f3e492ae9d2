"""Forwarding the ranks' output: their pipes in, this process' terminal (and log files) out.

::

    rank r stdout --pipe--+                                   +--> sys.stdout / sys.stderr
    rank r stderr --pipe--+--> one thread (selectors, os.read) +--> log_dir/rank_<r>.log
    rank s ...    --pipe--+                                   +--> tail of each rank's stderr

The caller asks ``pipe(rank, stream)`` for each pipe, hands the write end to the child and
closes it in the parent. One daemon thread drains every read end as data arrives, so a
chatty child never blocks on a full pipe even if nobody ever waits for it. What it reads
goes three ways: to ``sys.stdout`` / ``sys.stderr`` (looked up at each write, so pytest's
capture and Jupyter's streams get it), prefixed ``[rank r]`` per line when asked; raw to the
rank's log file; and, for stderr, into a bounded tail that error messages quote.

A line is held until its newline so lines of different ranks do not mix (with or without
the prefix), but a partial line (a prompt, a progress bar) is shown after ``FLUSH_AFTER``
seconds anyway;
if another stream writes before that line ends, the partial line is ended first so the
other output starts on a line of its own. ``\\r`` starts a new prefixed segment, so a
progress bar redraws as ``[rank r] 40%``.

Only the standard library is used here: the ``procspawn run`` launcher imports this module
without paying for NumPy.
"""

from __future__ import annotations

import array
import codecs
import contextlib
import fcntl
import os
import select
import selectors
import signal
import sys
import termios
import threading
import time
from collections.abc import Callable

from ._late import late_import

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import IO, Any

__all__ = ["OutputForwarder", "FLUSH_AFTER"]

FLUSH_AFTER = 0.2  # seconds a partial line waits for its newline
_READ_SIZE = 65536
_STREAMS = ("stdout", "stderr")
# Asynchronous signals are left to the main thread, which Python runs the handlers in: a
# signal delivered to this thread would not interrupt a main thread blocked in a syscall.
_MAIN_THREAD_SIGNALS = {
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGCHLD,
    signal.SIGALRM,
    signal.SIGUSR1,
    signal.SIGUSR2,
}


def _log() -> Any:
    """This module's logger (``logging`` is imported at the first message: a pool or a
    rank that never logs does not pay ~6 ms of start-up for it)."""
    return late_import("logging").getLogger(__name__)  # (from any thread: see _late)


class _Stream:
    """One pipe: its read end and the state of what was read from it."""

    def __init__(self, rank: int, name: str, fd: int, show: bool, prefix: bool) -> None:
        self.rank = rank
        self.name = name
        self.fd = fd
        self.show = show
        self.prefix = f"[rank {rank}] " if prefix else ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""  # prefix mode: text after the last newline, not yet shown
        self.partial_since = 0.0
        self.mid_line = False  # the last text shown did not end its line
        self.after_cr = False  # prefix mode: ... and it ended with "\r"
        self.done = False  # EOF reached (or given up) and everything forwarded


def _unread(fd: int) -> int:
    """How many bytes wait in pipe ``fd`` (FIONREAD); 1 when that cannot be told."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 1
    return buf[0]


class OutputForwarder:
    """Copies ranks' output pipes to this process' stdout/stderr as it arrives (optionally
    prefixed "[rank r] " per line, optionally also into one log file per rank), and keeps
    the last lines of each rank's stderr for error messages.

    Args:
        prefix: put ``[rank r] `` in front of every line shown on the terminal.
        show: ``show(rank)`` False keeps that rank's output off the terminal (it still goes
            to its log file and its tail). Called once per pipe, in ``pipe()``.
        log_dir: also write each rank's output, stdout and stderr interleaved as they
            arrive and without prefix, to ``log_dir/rank_<r>.log`` (the directory is
            created if needed; an existing file is overwritten).
        tail_lines: at most this many lines of each rank's stderr are kept for ``tail()``.
        tail_bytes: and at most this many bytes.

    Use it as a context manager, or call ``close()`` when the ranks are done.
    """

    def __init__(
        self,
        *,
        prefix: bool = False,
        show: Callable[[int], bool] | None = None,
        log_dir: str | None = None,
        tail_lines: int = 20,
        tail_bytes: int = 8192,
    ) -> None:
        self._prefix = prefix
        self._show = show
        self._log_dir = log_dir
        self._tail_lines = max(0, tail_lines)
        self._tail_bytes = max(0, tail_bytes)
        self._cond = threading.Condition()
        # held while a pipe is read and what came forwarded, and while it is closed (taken
        # before _cond): forward_now() reads from another thread than the forwarder's
        self._io = threading.RLock()
        self._by_rank: dict[int, list[_Stream]] = {}
        self._pending: list[_Stream] = []  # made by pipe(), not yet known to the thread
        # fd -> stream not at EOF: the thread's own (before it runs, pipe() adds to it)
        self._open: dict[int, _Stream] = {}
        self._tails: dict[int, bytearray] = {}
        self._tail_trimmed: set[int] = set()  # ranks whose tail starts mid-line
        self._logs: dict[int, IO[bytes]] = {}
        self._dangling: _Stream | None = None  # prefix mode: whose partial line is shown last
        self._thread: threading.Thread | None = None
        self._held = False  # no thread until release(): see hold()
        self._wake_r = self._wake_w = -1
        self._selector: selectors.BaseSelector | None = None  # made with the first pipe
        self._held_poll: select.poll | None = None  # polls the selector (_held_readable)
        self._stopping = False
        self._closed = False

    # -- the caller's side ---------------------------------------------------------------

    def pipe(self, rank: int, stream: str) -> int:
        """Make a pipe for ``rank``'s ``stream`` ("stdout" or "stderr") and forward it.

        Returns:
            The write end, for the child (dup it onto fd 1 or 2). The caller closes it in
            this process once the child has it, or EOF never comes.

        Raises:
            ValueError: ``stream`` is not "stdout" or "stderr".
            RuntimeError: the forwarder is closed.
            OSError: the pipe or the log file could not be made.
        """
        if stream not in _STREAMS:
            raise ValueError(f'stream must be "stdout" or "stderr", got {stream!r}')
        show = True if self._show is None else bool(self._show(rank))
        with self._cond:
            if self._closed or self._stopping:
                raise RuntimeError("this OutputForwarder is closed: make a new one per run")
            if self._log_dir is not None and rank not in self._logs:
                os.makedirs(self._log_dir, exist_ok=True)
                path = os.path.join(self._log_dir, f"rank_{rank}.log")
                self._logs[rank] = open(path, "wb", buffering=0)  # closed by close()
            read_end, write_end = os.pipe()
            try:
                os.set_blocking(read_end, False)  # only our end: the child's stays blocking
                self._prepare()
                if self._thread is None and not self._held:
                    self._start_thread()
            except BaseException:
                os.close(read_end)
                os.close(write_end)
                raise
            entry = _Stream(rank, stream, read_end, show, self._prefix)
            self._by_rank.setdefault(rank, []).append(entry)
            if self._thread is None:  # held: watched through fileno() until release()
                assert self._selector is not None
                self._selector.register(read_end, selectors.EVENT_READ, entry)
                self._open[read_end] = entry
            else:
                self._pending.append(entry)
                self._wake()  # under the lock: close() cannot close the wake pipe meanwhile
        return write_end

    def forward_now(self, rank: int) -> None:
        """Forward at once, from the caller's thread, what ``rank`` has written so far.

        Its owner calls it before acting on what ``rank`` sent it another way: a pool
        worker's lines come out before the caller gets the result of the task that
        printed them (and are not lost if the caller then leaves with ``os._exit``).
        The end of a pipe (EOF) is left to the thread, or to ``close()``."""
        streams = self._by_rank.get(rank)
        if not streams:
            return
        if self._thread is None and not self._held_readable():
            return  # held, and no pipe has anything (a pool of quiet workers, the rule)
        spoke = False
        with self._io:
            for entry in streams:
                # (done: closed, and under _io the fd is not ours; FIONREAD costs a third
                # of a read that finds nothing, which is what most answers find)
                while not entry.done and _unread(entry.fd) > 0:
                    try:
                        data = os.read(entry.fd, _READ_SIZE)
                    except OSError:  # BlockingIOError: nothing more for now
                        break
                    if not data:
                        break
                    spoke = True
                    self._received(entry, data)
        if spoke and self._thread is None:
            self.release()  # held: a partial line is shown after FLUSH_AFTER by the thread

    def _held_readable(self) -> bool:
        """Whether a held pipe has something to read (or reached its end): one poll of
        the selector's epoll descriptor, a fifth of what reading every pipe costs."""
        with self._cond:
            if self._thread is not None:
                return True
            if self._held_poll is None:
                fileno = getattr(self._selector, "fileno", None)  # an epoll's (Linux)
                if fileno is None:
                    return True
                self._held_poll = select.poll()
                self._held_poll.register(fileno(), select.POLLIN)
            return bool(self._held_poll.poll(0))

    def hold(self) -> None:
        """Start no thread for the pipes made from now on until ``release()``: their owner
        watches ``fileno()``, readable once any of them is, and calls ``release()``
        then (a pipe holds what its child writes meanwhile, 64 KiB before the child
        waits). Children that never write cost no thread at all: ``close()`` reads
        their pipes' ends itself. A pool's workers start so."""
        with self._cond:
            self._held = True
            self._prepare()

    def fileno(self) -> int:
        """A descriptor readable once a pipe made while held has something to read (or
        reached EOF); -1 when there is none to watch (then call ``release()`` at once)."""
        with self._cond:
            fileno = getattr(self._selector, "fileno", None)  # an epoll's (Linux)
            return int(fileno()) if fileno is not None else -1

    def settle_held(self) -> bool:
        """For the owner, when ``fileno()`` turned readable: close here the held pipes
        that reached EOF with nothing to forward (children that exited without a word);
        True when one has something to forward (then call ``release()``), or when the
        thread forwards them already (``forward_now`` or ``wait_eof`` started it): the
        owner stops watching ``fileno()``, which the thread's reads make readable now and
        then."""
        with self._io, self._cond:  # re-entrant: _eof takes them too
            if self._thread is not None:
                return True
            if self._selector is None:
                return False
            speaks = False
            for key, _ in self._selector.select(0):
                entry = key.data
                if entry is None:
                    self._eat_wakeups()
                elif _unread(entry.fd) > 0:
                    speaks = True
                else:
                    self._read(entry, self._selector)  # EOF (or what came just now)
            return speaks

    def release(self) -> None:
        """Start forwarding what ``hold()`` held back (any thread may call it)."""
        with self._cond:
            self._held = False
            if (
                self._thread is None
                and (self._pending or self._open)
                and not (self._closed or self._stopping)
            ):
                self._start_thread()

    def wait_eof(self, rank: int, timeout: float) -> bool:
        """Wait until every pipe of ``rank`` reached EOF and was fully forwarded.

        Returns:
            True when it did (or ``rank`` has no pipe), False if ``timeout`` passed first.
        """
        with self._io, self._cond:  # (_io first, as everywhere)
            if self._thread is None:
                self.settle_held()  # held pipes that only reached their end close here
            quiet = all(s.done for s in self._by_rank.get(rank, ()))
        if not quiet:
            self.release()  # something to read, or not at its end yet: the thread reads
        with self._cond:
            return self._cond.wait_for(
                lambda: all(s.done for s in self._by_rank.get(rank, ())), max(0.0, timeout)
            )

    def tail(self, rank: int) -> str:
        """The last lines (at most ``tail_lines`` / ``tail_bytes``) ``rank`` wrote to stderr."""
        with self._cond:
            data = bytes(self._tails.get(rank, b""))
            trimmed = rank in self._tail_trimmed
        text = data.decode("utf-8", errors="replace")
        if trimmed and "\n" in text:
            text = text.split("\n", 1)[1]  # the first line lost its start: drop it
        lines = text.splitlines(keepends=True)
        return "".join(lines[-self._tail_lines :]) if self._tail_lines else ""

    def close(self, timeout: float = 1.0) -> None:
        """Wait up to ``timeout`` seconds for EOF on every pipe, forward what is left, stop.

        A partial last line gets a newline. A pipe still open after ``timeout`` (a
        grandchild holds its write end) is read once more without waiting, then closed.
        Closing twice does nothing.
        """
        with self._cond:
            if self._closed:
                return
            thread = self._thread
            if thread is None:
                self._stopping = True  # no thread from now on: pipe() and release() refuse
        if thread is None:
            self._drain(timeout)  # held pipes that never spoke: read to their end here
        else:
            with self._cond:
                self._cond.wait_for(
                    lambda: all(s.done for ss in self._by_rank.values() for s in ss),
                    max(0.0, timeout),
                )
                self._stopping = True
            self._wake()
            # The thread ends at once unless a write to the terminal blocks (a stopped
            # terminal): then leave it its descriptors rather than close them under it.
            thread.join(max(0.0, timeout) + 10.0)
            if thread.is_alive():
                _log().warning("procspawn output thread did not stop; its pipes stay open")
                with self._cond:
                    self._closed = True
                return
        with self._cond:
            self._closed = True
            self._stopping = True
            leftovers = [s for ss in self._by_rank.values() for s in ss if not s.done]
            logs, self._logs = list(self._logs.values()), {}
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            if thread is None and self._selector is not None:
                self._selector.close()  # never used: no thread ran (else it closed it)
            self._selector = None
        for entry in leftovers:  # only pipes the thread never got to (none normally)
            with self._io:
                entry.done = True
                try:
                    os.close(entry.fd)
                except OSError:
                    pass
        for f in logs:
            try:
                f.close()
            except OSError:
                pass

    def __enter__(self) -> OutputForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prepare(self) -> None:
        """Make the selector and the wake-up pipe (with ``_cond`` held), by ``hold()`` or
        the first pipe, whenever the thread starts: every descriptor of the forwarder
        exists from then on."""
        if self._selector is not None:
            return
        wake_r, wake_w = os.pipe()
        try:
            os.set_blocking(wake_r, False)
            os.set_blocking(wake_w, False)
            selector = selectors.DefaultSelector()  # epoll: fds may be >= 1024
            try:
                selector.register(wake_r, selectors.EVENT_READ, None)
            except BaseException:
                selector.close()
                raise
        except BaseException:
            os.close(wake_r)
            os.close(wake_w)
            raise
        self._wake_r, self._wake_w, self._selector = wake_r, wake_w, selector

    def _start_thread(self) -> None:
        """Start the thread (with ``_cond`` held, after ``_prepare``)."""
        thread = threading.Thread(target=self._run, name="procspawn-output", daemon=True)
        thread.start()
        self._thread = thread

    def _drain(self, timeout: float) -> None:
        """No thread ever ran: read the held pipes here until each reached EOF or
        ``timeout`` passed, then what is left without waiting."""
        with self._cond:
            selector = self._selector
        if selector is None:
            return
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            while self._open:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                flush = self._flush_timeout()
                self._read_ready(selector, left if flush is None else min(left, flush))
            self._finish(selector)
        except Exception:
            _log().exception("procspawn output forwarding failed while closing")

    def _read_ready(self, selector: selectors.BaseSelector, timeout: float | None) -> None:
        """Wait up to ``timeout`` for a pipe, read what is ready, flush stale partial lines."""
        for key, _ in selector.select(timeout):
            if key.data is None:
                self._eat_wakeups()
            else:
                self._read(key.data, selector)
        self._flush_stale(time.monotonic())

    def _eat_wakeups(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # full (a wake-up is pending anyway) or already closed

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)
        except (OSError, ValueError):
            pass
        selector = self._selector
        assert selector is not None  # made by _prepare before the thread starts
        try:
            while True:
                try:
                    if self._step(selector):
                        break
                except Exception:  # never let the thread die: keep forwarding the rest
                    _log().exception("procspawn output forwarding failed; continuing")
            try:
                self._finish(selector)
            except Exception:
                _log().exception("procspawn output forwarding failed while closing")
        finally:
            selector.close()

    def _step(self, selector: selectors.BaseSelector) -> bool:
        """One round: take new pipes, read what is ready, flush stale partial lines."""
        with self._cond:
            pending, self._pending = self._pending, []
            stopping = self._stopping
        for entry in pending:
            self._open[entry.fd] = entry
            selector.register(entry.fd, selectors.EVENT_READ, entry)
        if stopping:
            return True
        self._read_ready(selector, self._flush_timeout())
        return False

    def _read(self, entry: _Stream, selector: selectors.BaseSelector | None) -> bool:
        """Read once from ``entry``; False at EOF or when nothing is there."""
        with self._io:
            if entry.done:
                return False
            try:
                data = os.read(entry.fd, _READ_SIZE)
            except BlockingIOError:
                return False
            except OSError:
                data = b""
            if not data:
                self._eof(entry, selector)
                return False
            self._received(entry, data)
            return True

    def _received(self, entry: _Stream, data: bytes) -> None:
        log = self._logs.get(entry.rank)
        if log is not None:
            try:
                log.write(data)
            except Exception:
                _log().exception("could not write to the log file of rank %d", entry.rank)
        if entry.name == "stderr" and self._tail_bytes:
            with self._cond:
                tail = self._tails.setdefault(entry.rank, bytearray())
                tail += data
                cut = len(tail) - self._tail_bytes
                if cut > 0:
                    if tail[cut - 1] == 0x0A:  # the kept part starts a line
                        self._tail_trimmed.discard(entry.rank)
                    else:
                        self._tail_trimmed.add(entry.rank)
                    del tail[:cut]
        self._text(entry, entry.decoder.decode(data))

    def _text(self, entry: _Stream, text: str) -> None:
        if not entry.show or not text:
            return
        if not entry.partial:
            entry.partial_since = time.monotonic()
        entry.partial += text
        if "\n" not in entry.partial:
            return
        complete, _, entry.partial = entry.partial.rpartition("\n")
        entry.partial_since = time.monotonic()
        self._show_prefixed(entry, complete + "\n")

    def _show_prefixed(self, entry: _Stream, text: str) -> None:
        """Show ``text`` (whole lines, or a partial line) of ``entry`` with prefixes."""
        dangling = self._dangling
        if dangling is not None and dangling is not entry:
            self._write(dangling.name, "\n")  # end the other stream's partial line first
            dangling.mid_line = False
        out = []
        pieces = text.split("\n")
        for i, body in enumerate(pieces):
            last = i == len(pieces) - 1
            if last and not body:
                break
            ending = "" if last else "\n"
            # "\r" starts a redraw of the line (a progress bar): prefix it again, unless
            # it ends the line ("\r\n")
            continued = entry.mid_line and not (entry.after_cr and body)
            inner, cr = (body[:-1], "\r") if body.endswith("\r") else (body, "")
            out.append(
                ("" if continued else entry.prefix)
                + inner.replace("\r", "\r" + entry.prefix)
                + cr
                + ending
            )
            entry.mid_line = not ending
            entry.after_cr = bool(cr) and not ending
        self._dangling = entry if entry.mid_line else None
        self._write(entry.name, "".join(out))

    def _flush_timeout(self) -> float | None:
        since = [e.partial_since for e in self._open.values() if e.partial]
        if not since:
            return None
        return max(0.0, min(since) + FLUSH_AFTER - time.monotonic())

    def _flush_stale(self, now: float) -> None:
        with self._io:
            for entry in list(self._open.values()):
                if entry.partial and now - entry.partial_since >= FLUSH_AFTER:
                    text, entry.partial = entry.partial, ""
                    self._show_prefixed(entry, text)

    def _end_line(self, entry: _Stream) -> None:
        """At EOF: show what is held and end a partial last line with a newline."""
        text = entry.decoder.decode(b"", final=True)
        if text:
            self._text(entry, text)
        if not entry.show:
            return
        if entry.partial:
            text, entry.partial = entry.partial, ""
            self._show_prefixed(entry, text + "\n")
        elif entry.mid_line:
            self._show_prefixed(entry, "\n")

    def _eof(self, entry: _Stream, selector: selectors.BaseSelector | None) -> None:
        with self._io:
            self._eof_locked(entry, selector)

    def _eof_locked(self, entry: _Stream, selector: selectors.BaseSelector | None) -> None:
        if selector is not None:
            try:
                selector.unregister(entry.fd)
            except (KeyError, ValueError):
                pass
        self._open.pop(entry.fd, None)
        try:
            self._end_line(entry)
        finally:
            try:
                os.close(entry.fd)
            except OSError:
                pass
            with self._cond:
                entry.done = True
                self._cond.notify_all()

    def _finish(self, selector: selectors.BaseSelector) -> None:
        """Stopping: read what is left without waiting, then close every pipe."""
        for entry in list(self._open.values()):
            try:
                while self._read(entry, selector):
                    pass
            except Exception:
                _log().exception("procspawn output forwarding failed while closing")
            if entry.fd in self._open:  # still open: a grandchild holds the write end
                self._eof(entry, selector)

    def _write(self, name: str, text: str) -> None:
        """Write to sys.stdout / sys.stderr as they are now; fall back to fd 1 / 2."""
        stream: Any = sys.stdout if name == "stdout" else sys.stderr
        try:
            stream.write(text)
            stream.flush()
            return
        except Exception:
            pass
        data = text.encode("utf-8", errors="replace")
        fd = 1 if name == "stdout" else 2
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError:
            pass  # nowhere left to write to: drop it, keep draining the pipes
