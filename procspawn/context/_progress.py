"""Progress: ranks count, the parent shows one bar.

Who holds what: the parent allocates one small shared array (a cache line of int64 per
rank, so ranks never write the same line) when ``spawn(..., progress=...)`` asks for it;
it travels to the ranks with the spawn payload. In a rank, ``procspawn.progress(n)`` adds
``n`` to its own slot: one memory write under a lock of the rank's own (its threads may
all count; the parent only reads), no message. The
parent sums the slots while it joins and renders a bar: tqdm when it is installed
(``tqdm.auto``: a widget in Jupyter), a plain one-line display otherwise, and nothing when
stderr is not a terminal (nor a notebook's) unless asked. Without ``progress=`` nothing is
allocated and ``procspawn.progress`` returns at once.

In a pool's worker, ``procspawn.progress(n)`` goes to the parent as a message instead (at
most one per ``_REPORT_EVERY`` seconds, and before the task's result): the parent adds it
to the display of the call whose task the worker runs.
"""

from __future__ import annotations

import os
import sys
import threading
import time

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from typing import Any

    import numpy as np

_SLOT = 8  # int64 values per rank: 64 bytes, one cache line
_INTERVAL_TTY = 0.1  # seconds between redraws on a terminal
_INTERVAL_LOG = 5.0  # ... and between lines when output is not a terminal (show=True)

# In a rank: (the counters as a memoryview of int64, this rank's index), set by the worker.
_counter: tuple[Any, int] | None = None
# In a pool's worker: what sends the steps to the parent (see pool._worker).
_sink: Callable[[int], None] | None = None
_lock = threading.Lock()  # a read-add-write of the slot is not atomic between threads


def progress(n: int = 1) -> None:
    """Add ``n`` to this rank's progress counter (a no-op unless the parent asked for it).

    Any thread of the rank may call it; it costs one write to shared memory (no message),
    so calling it on every step is fine. The parent asks for it with
    ``spawn(..., progress=...)``. In a task of a pool (``Pool.map``, ``imap``, the
    executor's ``map``, with ``progress=``), the steps go to the call's display, which
    then counts them instead of finished tasks (a message to the parent at most every
    0.05 s). Elsewhere (no such parent, or in the parent itself) it does nothing.

    Args:
        n: the steps done since the last call.

    Example::

        import procspawn

        def work(rank, steps):
            for _ in range(steps):
                procspawn.progress()  # one step done
            return rank

        if __name__ == "__main__":
            procspawn.spawn(work, args=(100,), nprocs=2, progress=200)
    """
    counter = _counter
    if counter is not None:
        view, index = counter
        with _lock:
            view[index] += n
        return
    sink = _sink
    if sink is not None:
        sink(n)


def _reset_after_fork() -> None:
    global _lock, _sink
    _lock = threading.Lock()
    _sink = None  # a pool worker's child: its steps are not the worker's to send


os.register_at_fork(after_in_child=_reset_after_fork)


def attach(counters: Any, rank: int) -> None:
    """In a rank: make ``progress()`` count into ``counters`` (a shared int64 array)."""
    global _counter
    view = memoryview(counters).cast("B").cast("q")
    _counter = (view, rank * _SLOT)


TICK = 0.1  # seconds between progress redraws while a call waits


def wait_showing(wait: Callable[[float], bool], progress: Progress, timeout: float | None) -> bool:
    """Call ``wait(seconds)`` (True once what it waits for is there) in ticks until it is
    there or ``timeout`` passed, redrawing ``progress`` between ticks; whether it is."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = TICK if deadline is None else min(TICK, deadline - time.monotonic())
        if left <= 0:
            return False
        if wait(left):
            return True
        progress.render()


class Progress:
    """What ``spawn(..., progress=...)`` shows, and the counts the ranks report.

    Args:
        total: the number of steps all ranks together will report (None: unknown).
        per_rank: also show each rank's rate (steps/s).
        show: True to always display, False never, None (default) only when stderr is a
            terminal.
        desc: the label in front of the bar.
        use_tqdm: None uses tqdm when it is installed; False forces the plain display.
        tqdm_class: the tqdm class to draw with (``tqdm.rich.tqdm``,
            ``tqdm.notebook.tqdm``, one of your own); default ``tqdm.auto.tqdm``, a widget
            in Jupyter and a text bar elsewhere. Given, the bar is shown (``show`` True).
        callback: called as ``callback(count, total)`` instead of drawing, from the thread
            that waits, each time the count changed (at most every 0.1 s, and at the
            end): for a GUI, a log, a web page.
        bar_options: more keyword arguments for the tqdm class (``unit``, ``leave``...).

    ``count`` and ``counts`` can be read at any time, e.g. while polling a
    ``ProcessContext`` (``ctx.progress.count``); ``render()`` redraws the display at most
    once per interval and ``close()`` ends it. The pools take one too
    (``Pool.map(..., progress=...)``), counting finished items, or the steps the tasks
    report with ``procspawn.progress()`` once one does (then ``total`` counts steps; a
    total the pool took from the number of items is dropped).

    Raises:
        TypeError: ``total`` is not an int or None.
        ValueError: ``total`` is negative.
        ImportError: (when it first draws) ``use_tqdm=True`` but tqdm is not installed.

    Example::

        import procspawn

        def work(rank, steps):
            for _ in range(steps):
                procspawn.progress()
            return rank

        if __name__ == "__main__":
            shown = procspawn.Progress(total=40, desc="steps", per_rank=True)
            procspawn.spawn(work, args=(10,), nprocs=4, progress=shown)
            assert shown.count == 40 and shown.counts == [10, 10, 10, 10]
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        per_rank: bool = False,
        show: bool | None = None,
        desc: str = "progress",
        use_tqdm: bool | None = None,
        tqdm_class: Any = None,
        callback: Callable[[int, int | None], object] | None = None,
        bar_options: dict[str, Any] | None = None,
    ) -> None:
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
            raise TypeError(f"progress total must be an int or None, got {total!r}")
        if total is not None and total < 0:
            raise ValueError(f"progress total must be >= 0, got {total}")
        if callback is not None and not callable(callback):
            raise TypeError(f"progress callback must be callable, got {callback!r}")
        self.total = total
        self.per_rank = per_rank
        self.show = True if tqdm_class is not None and show is None else show
        self.desc = desc
        self.use_tqdm = use_tqdm
        self.tqdm_class = tqdm_class
        self.callback = callback
        self.bar_options = dict(bar_options or {})
        self._total_given = total is not None
        self._steps = 0  # a pool's: what its tasks reported with procspawn.progress()
        self._called: int | None = None  # the count callback was last called with
        self._counters: Any = None
        self._nprocs = 0
        self._started = 0.0
        self._last_draw = 0.0
        self._bar: Any = None
        self._plain_width = 0
        self._logged: int | None = None  # off a terminal: the count of the last line
        self._closed = False

    # -- the parent side ---------------------------------------------------------------

    def _allocate(self, nprocs: int) -> np.ndarray:
        """Make the shared counters for ``nprocs`` ranks (called by spawn)."""
        from ..sharing import zeros

        counters = self._counters = zeros(nprocs * _SLOT, dtype="int64")
        self._nprocs = nprocs
        self._started = time.monotonic()
        self._last_draw = 0.0  # a Progress used again: a display of its own
        self._bar = None
        self._plain_width = 0
        self._logged = None
        self._closed = False
        return counters

    def reset(self, total: int | None = None) -> None:
        """Count in this process from 0, for a new display: what a pool does at the start
        of each call it shows (it then counts the finished tasks with ``update``, from
        one thread). ``total``, when known, unless the Progress was given one.

        Args:
            total: the number of steps the call makes, if known.
        """
        self._counters = [0] * _SLOT
        self._nprocs = 1
        self._steps = 0
        self._called = None
        if self.total is None:
            self.total = total
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._bar = None
        self._plain_width = 0
        self._logged = None
        self._closed = False

    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps done in this process (after ``reset``); the display is
        redrawn by whoever waits (``render``).

        Args:
            n: the steps done.
        """
        self._counters[0] += n

    def report(self, n: int) -> None:
        """Count ``n`` steps a task reported with ``procspawn.progress()`` (a pool calls
        it, from its thread): from the first, the display counts these steps, not tasks.

        Args:
            n: the steps reported.
        """
        if not self._steps and not self._total_given and self.total is not None:
            self.total = None  # a count of tasks, not of steps
            if self._bar is not None:
                self._bar.total = None
        self._steps += n

    @property
    def counts(self) -> list[int]:
        """Steps reported so far, by rank."""
        if self._counters is None:
            return []
        if self._steps:
            return [self._steps]
        return [int(v) for v in self._counters[::_SLOT][: self._nprocs]]

    @property
    def count(self) -> int:
        """Steps reported so far by all ranks together."""
        return sum(self.counts)

    def rates(self) -> list[float]:
        """Average steps per second of each rank since the ranks started.

        Returns:
            One rate per rank, by rank (empty before the ranks start).
        """
        elapsed = max(1e-9, time.monotonic() - self._started)
        return [c / elapsed for c in self.counts]

    def _visible(self) -> bool:
        if self.show is not None:
            return self.show
        return self._is_tty() or _in_notebook()

    def render(self, force: bool = False) -> None:
        """Redraw the display (at most once per interval unless ``force``).

        ``ProcessContext.join`` and the pools call it while they wait; it draws nothing
        when the display is not shown (see ``show``) or was closed.

        Args:
            force: draw now, however recently the last drawing was.
        """
        if self._closed or self._counters is None:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < _INTERVAL_TTY:
            return  # (cheap enough to call on every step)
        if self.callback is not None:
            self._last_draw = now
            count = self.count
            if count != self._called:
                self._called = count
                self.callback(count, self.total)
            return
        if not self._visible():
            return
        tty = self._is_tty()
        interval = _INTERVAL_TTY if tty else _INTERVAL_LOG
        if not force and now - self._last_draw < interval:
            return
        self._last_draw = now
        if self._use_tqdm():
            self._draw_tqdm()
        else:
            self._draw_plain(tty)

    def close(self) -> None:
        """Draw the last state and end the display's line."""
        if self._closed:
            return
        self.render(force=True)
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._plain_width and self._is_tty():
            _write("\n")

    def _is_tty(self) -> bool:
        try:
            return sys.stderr.isatty()
        except (AttributeError, ValueError):
            return False

    def _use_tqdm(self) -> bool:
        if self.use_tqdm is False:
            return False
        if self._bar is not None or self.tqdm_class is not None:
            return True
        try:
            import tqdm  # noqa: F401
        except ImportError:
            if self.use_tqdm:
                raise ImportError(
                    "Progress(use_tqdm=True) needs tqdm: pip install 'procspawn[progress]'"
                ) from None
            return False
        return True

    def _draw_tqdm(self) -> None:
        if self._bar is None:
            cls = self.tqdm_class
            if cls is None:
                import tqdm.auto

                cls = tqdm.auto.tqdm
            # the bar's rate as the per-rank ones: steps since the ranks started over the
            # seconds since then (not tqdm's recent average), so that the ranks' rates add
            # up to the bar's
            options = {"file": sys.stderr, "smoothing": 0, **self.bar_options}
            self._bar = cls(total=self.total, desc=self.desc, **options)
            if hasattr(self._bar, "start_t"):
                self._bar.start_t -= time.monotonic() - self._started
        if self.per_rank:
            self._bar.set_postfix_str(self._rank_rates(), refresh=False)
        self._bar.update(self.count - self._bar.n)  # redraws as tqdm sees fit

    def _draw_plain(self, tty: bool) -> None:
        count = self.count
        elapsed = max(1e-9, time.monotonic() - self._started)
        rate = count / elapsed
        if self.total:
            pct = 100.0 * count / self.total
            left = (self.total - count) / rate if rate > 0 else float("inf")
            eta = f"ETA {_duration(left)}" if left != float("inf") else "ETA ?"
            line = f"{self.desc}: {count}/{self.total} ({pct:5.1f}%) {rate:,.0f}/s {eta}"
        else:
            line = f"{self.desc}: {count} {rate:,.0f}/s {_duration(elapsed)}"
        if self.per_rank:
            line += " | " + self._rank_rates()
        if tty:
            padded = line.ljust(self._plain_width)
            self._plain_width = len(line)
            _write("\r" + padded)
        elif count != self._logged:  # off a terminal: a line per new count, once
            self._plain_width = len(line)
            self._logged = count
            _write(line + "\n")

    def _rank_rates(self) -> str:
        return " ".join(f"r{r} {rate:,.0f}/s" for r, rate in enumerate(self.rates()))


def _in_notebook() -> bool:
    """Whether this is a Jupyter kernel (whose stderr is no terminal, and shows widgets)."""
    if "ipykernel" not in sys.modules:
        return False
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}:{seconds % 60:02d}"


def _write(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        try:
            os.write(2, text.encode())
        except OSError:
            pass


def as_progress(value: Any) -> Progress | None:
    """The ``progress=`` argument of spawn and the pools: None/False, True (no total), an
    int total, a ``Progress``, a tqdm class (the bar drawn with it) or a callable
    (called as ``callback(count, total)``)."""
    if value is None or value is False:
        return None
    if value is True:
        return Progress()
    if isinstance(value, Progress):
        return value
    if isinstance(value, int):
        return Progress(value)
    if isinstance(value, type) and all(hasattr(value, a) for a in ("update", "close")):
        return Progress(tqdm_class=value)
    if callable(value) and not isinstance(value, type):
        return Progress(callback=value)
    raise TypeError(
        f"progress must be an int (the total number of steps), True, a procspawn.Progress, "
        f"a tqdm class or a callable(count, total), got {type(value).__name__}"
    )
