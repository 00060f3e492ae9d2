"""``get_reusable_executor()``: one executor per program, reused by every call, as loky's.

Calls with the same settings return the same executor, resized in place when only
``max_workers`` differs (so a thread holding it never finds it shut down under it, the race
of loky's issue #458). A broken or shut-down executor is replaced by a working one at the
next call. Workers idle for ``timeout`` seconds exit and start again when work comes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from multiprocessing.context import BaseContext

from .._late import renew_lock_in_child
from ..context.launch._start_method import start_method_of
from ._executor import ProcessPoolExecutor
from ._failures import check_seconds

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any

_lock = threading.Lock()

renew_lock_in_child(globals())
# one executor per kind: the stdlib's rules (a death breaks it), and one whose deaths fail
# only the calls they ran (the joblib backend's)
_executors: dict[bool, tuple[ProcessPoolExecutor, tuple[Any, ...]]] = {}
# a forked child has its parent's executors without their threads and workers: none of
# them is its to reuse, nor to shut down (a worker's exit would wait on threads it has not)
os.register_at_fork(after_in_child=_executors.clear)


def get_reusable_executor(
    max_workers: int | None = None,
    timeout: float | None = 300,
    *,
    mp_context: str | BaseContext | None = None,
    context: str | BaseContext | None = None,
    reuse: bool | str = "auto",
    initializer: Callable[..., object] | None = None,
    initargs: Iterable[object] = (),
    max_tasks_per_child: int | None = None,
    task_timeout: float | None = None,
    retries: int = 0,
    max_memory_per_child: int | None = None,
    kill_workers: bool = False,
    backend: str = "process",
    ray_address: str | None = None,
    _break_on_death: bool = True,
) -> ProcessPoolExecutor:
    """The program's reusable ``ProcessPoolExecutor``, made or adjusted as asked.

    Args:
        max_workers: at most this many workers (default ``os.cpu_count()``); a different
            number than last time resizes the executor in place.
        timeout: seconds a worker may stay idle before it exits (it starts again when
            work comes); None: workers never exit for being idle.
        mp_context: as for ``ProcessPoolExecutor``.
        context: loky's name for ``mp_context`` (give one or the other).
        reuse: ``"auto"`` (or True): the executor of an earlier call with the same
            settings, as loky's; False: a new one every call (the old one finishes what it
            was given).
        initializer: as for ``ProcessPoolExecutor``.
        initargs: as for ``ProcessPoolExecutor``.
        max_tasks_per_child: as for ``ProcessPoolExecutor``.
        task_timeout: as for ``ProcessPoolExecutor``.
        retries: as for ``ProcessPoolExecutor``.
        max_memory_per_child: as for ``ProcessPoolExecutor``.
        kill_workers: with other settings than last time, stop the old executor's
            workers now instead of letting them finish.
        backend: as for ``ProcessPoolExecutor``: ``"ray"`` runs the calls as Ray tasks
            (``timeout`` does not apply: Ray keeps its idle workers; a different
            ``max_workers`` makes a new executor, whose CPUs Ray reserves anew).
        ray_address: as for ``ProcessPoolExecutor``.

    Returns:
        The executor: the one made by an earlier call with the same settings (resized
        if only ``max_workers`` differs), or a new one. Other values than last time for
        the ``ProcessPoolExecutor`` arguments make a new executor; the old one finishes
        the calls it was given and takes no more. A broken or shut-down executor is
        replaced.

    Raises:
        ValueError: ``max_workers`` or ``timeout`` is not a positive number, or both
            ``context`` and ``mp_context`` are given.

    Safe to call from several threads at once.

    Example::

        from procspawn import get_reusable_executor

        if __name__ == "__main__":
            executor = get_reusable_executor(max_workers=2)
            assert list(executor.map(abs, [-1, -2])) == [1, 2]
            assert get_reusable_executor(max_workers=2) is executor
    """
    if max_workers is None:
        max_workers = os.cpu_count() or 1
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers <= 0:
        raise ValueError(f"max_workers must be an int greater than 0, got {max_workers!r}")
    if isinstance(timeout, str):
        raise ValueError(
            f"timeout must be a number of seconds > 0, got {timeout!r}; loky's second "
            f"argument is its context: pass the start method by name, "
            f"mp_context={timeout!r}"
        )
    check_seconds("timeout", timeout)
    if context is not None:
        if mp_context is not None:
            raise ValueError("give mp_context or context (loky's name for it), not both")
        mp_context = context
    if reuse not in ("auto", True, False):
        raise ValueError(f"reuse must be 'auto', True or False, got {reuse!r}")
    idle = None if timeout is None or backend == "ray" else float(timeout)
    settings = (
        backend,
        ray_address,
        max_workers if backend == "ray" else None,  # (Ray's reservation has its size)
        start_method_of(mp_context),
        initializer,
        tuple(initargs),
        max_tasks_per_child,
        idle,
        task_timeout,
        retries,
        max_memory_per_child,
    )
    with _lock:
        executor, previous = _executors.get(_break_on_death, (None, None))
        if executor is not None and executor._dispatcher.alive() and not executor._shutdown:
            if reuse and _same(settings, previous):
                if executor._max_workers != max_workers:
                    executor._max_workers = max_workers
                    executor._dispatcher.resize(max_workers)
                return executor
            if kill_workers:
                executor._dispatcher.terminate(wait=False)
            else:
                executor.shutdown(wait=False)
        executor = ProcessPoolExecutor(
            max_workers,
            mp_context,
            initializer,
            initargs,
            max_tasks_per_child=max_tasks_per_child,
            task_timeout=task_timeout,
            retries=retries,
            max_memory_per_child=max_memory_per_child,
            backend=backend,
            ray_address=ray_address,
            _idle_timeout=idle,
            _break_on_death=_break_on_death,
        )
        _executors[_break_on_death] = (executor, settings)
        return executor


def current_reusable_executor(break_on_death: bool = True) -> ProcessPoolExecutor | None:
    """The reusable executor of that kind made last, if any (None after none was)."""
    with _lock:
        executor, _ = _executors.get(break_on_death, (None, None))
    return executor


def _same(settings: tuple[Any, ...], previous: tuple[Any, ...] | None) -> bool:
    """Whether two calls' settings are the same. A tuple compares its items by identity
    first, so the same NumPy array in ``initargs`` is the same setting; a different one,
    whose ``==`` has no truth value, makes a new executor (its contents may differ)."""
    try:
        return bool(settings == previous)
    except Exception:
        return False


__all__ = ["get_reusable_executor"]
