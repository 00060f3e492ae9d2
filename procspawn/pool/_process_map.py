"""``process_map``: tqdm's one-liner (``tqdm.contrib.concurrent.process_map``) on procspawn's
executor."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from multiprocessing.context import BaseContext

from ..context._progress import Progress
from ._executor import ProcessPoolExecutor

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any


def process_map(
    fn: Callable[..., Any],
    *iterables: Iterable[Any],
    max_workers: int | None = None,
    chunksize: int = 1,
    tqdm_class: Any = None,
    mp_context: str | BaseContext | None = None,
    task_timeout: float | None = None,
    retries: int = 0,
    **tqdm_kwargs: Any,
) -> list[Any]:
    """``list(map(fn, *iterables))`` in worker processes, under a progress bar.

    tqdm's ``process_map`` signature, on a ``procspawn.ProcessPoolExecutor`` made for the
    call: arrays go through shared memory, a worker's death is named (pid, signal), and
    procspawn's options are there too. The bar counts finished items, or the steps the
    tasks report with ``procspawn.progress()`` once one does.

    Args:
        fn: the function, called as ``fn(*items)`` with one item of each iterable.
        iterables: read whole, at once (as the executor's ``map``).
        max_workers: at most this many workers (default ``os.cpu_count()``).
        chunksize: items per task (as the executor's ``map``; default 1).
        tqdm_class: the tqdm class to draw with (default ``tqdm.auto.tqdm``; without tqdm
            installed, a plain one-line display).
        mp_context: the start method, as for ``ProcessPoolExecutor``.
        task_timeout: seconds a task may run, as for ``ProcessPoolExecutor``.
        retries: as for ``ProcessPoolExecutor``.
        tqdm_kwargs: for the bar, as tqdm takes them: ``total`` (default: the number of
            items; the steps' total, if the tasks report steps), ``desc``, ``disable``,
            ``unit``...
            (``lock_name`` is accepted and has no use: only this process draws.)

    Returns:
        The results, in the order of the items.

    Raises:
        Whatever ``fn`` raised for the first item that failed (its traceback as the
        cause), or the executor's error for a worker's death.

    Example::

        import procspawn

        def square(x):
            return x * x

        if __name__ == "__main__":
            assert procspawn.process_map(square, range(5), max_workers=2) == [0, 1, 4, 9, 16]
    """
    # (without one, map counts the items: a total the tasks' own steps then replace)
    total = tqdm_kwargs.pop("total", None)
    desc = tqdm_kwargs.pop("desc", None) or "process_map"
    disable = tqdm_kwargs.pop("disable", False)
    tqdm_kwargs.pop("lock_name", None)
    shown = None
    if not disable:
        shown = Progress(
            total, desc=desc, show=True, tqdm_class=tqdm_class, bar_options=tqdm_kwargs
        )
    with ProcessPoolExecutor(
        max_workers, mp_context, task_timeout=task_timeout, retries=retries
    ) as executor:
        return list(executor.map(fn, *iterables, chunksize=chunksize, progress=shown))


__all__ = ["process_map"]
