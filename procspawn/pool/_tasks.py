"""What a pool's callers hand its dispatcher: tasks, and the jobs that wait on them.

A ``Task`` is one message's worth of work (a call, or a chunk of a map); its ``Job`` is
what the caller waits on (a Pool's result object, an executor's futures), told by
``settle`` how each of its tasks ended. The front ends (``_pool``, ``_executor``)
implement ``Job``; the dispatcher only calls it.
"""

from __future__ import annotations

import itertools

from .. import _log
from . import _worker

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any


class Task:
    """One message's worth of work: a call, or a chunk of a map."""

    __slots__ = ("job", "index", "form", "payload", "deaths", "settled")

    def __init__(self, job: Job, index: int, form: int, payload: Any) -> None:
        self.job = job
        self.index = index
        self.form = form  # how the payload is called: _worker.APPLY, MAP or STARMAP
        self.payload = payload
        self.deaths = 0  # workers that died running it (it is retried up to ``retries``)
        # its job was told its outcome: never handed out again (one killed while queued
        # behind another call stays in its worker's list until that worker answers or
        # dies, and must not run elsewhere then)
        self.settled = False


class Job:
    """What callers wait on. The dispatcher calls ``start`` before it hands a task out
    (False: drop it, it was cancelled) and ``settle`` with each task's outcome."""

    _ids = itertools.count(1)
    progress: Any = None  # the call's display (a procspawn.Progress), if it has one

    def __init__(self, fn: Any, timeout: float | None = None) -> None:
        self.id = next(self._ids)
        self.fn = fn
        self.abandoned = False
        self.timeout = timeout  # seconds each task may run (None: the pool's task_timeout)

    def start(self, task: Task) -> bool:
        return not self.abandoned

    def cancel(self, task: Task) -> None:
        """The task will not run (``shutdown(cancel_futures=True)``)."""

    def settle(self, task: Task, ok: bool, value: Any) -> None:
        raise NotImplementedError

    def report(self, n: int) -> None:
        """A running task reported ``n`` steps done (``procspawn.progress`` in it)."""
        if self.progress is not None:
            self.progress.report(n)

    def describe(self, task: Task) -> str:
        """A short repr of the call a task makes, for error messages."""
        return describe_call(self.fn, task.form, task.payload)

    def describe_fn(self) -> str:
        return name_of(self.fn)


def name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def describe_call(fn: Any, form: int, payload: Any) -> str:
    import reprlib

    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxtuple, r.maxdict = 40, 40, 3, 3, 3
    name = name_of(fn)
    if payload is None:
        return f"{name}(...)"
    if form == _worker.APPLY:
        args, kwargs = payload
        calls_of = getattr(fn, "__procspawn_calls__", None)
        if callable(calls_of):  # a runner of other calls (a joblib batch): name those
            try:
                return _describe_calls(list(calls_of(*args, **kwargs)), r)
            except Exception:  # noqa: BLE001 -- then as any other call
                pass
        return _call_text(name, args, kwargs, r)
    items = list(payload)
    calls = [
        f"{name}({', '.join(r.repr(a) for a in item) if form == _worker.STARMAP else r.repr(item)})"
        for item in items[:2]
    ]
    if len(items) > 2:
        calls.append(f"... ({len(items)} calls in this chunk)")
    return ", ".join(calls)


def _call_text(name: str, args: Any, kwargs: dict[str, Any], r: Any) -> str:
    parts = [r.repr(a) for a in args] + [f"{k}={r.repr(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _describe_calls(calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]], r: Any) -> str:
    texts = [_call_text(name_of(fn), args, kwargs, r) for fn, args, kwargs in calls[:2]]
    if len(calls) > 2:
        texts.append(f"... ({len(calls)} calls in this batch)")
    return ", ".join(texts)


def settle(task: Task, ok: bool, value: Any) -> None:
    job = task.job
    task.payload = None
    task.settled = True
    try:
        job.settle(task, ok, value)
    except Exception:
        _log.exception("procspawn: a pool result callback raised")


__all__ = ["Job", "Task", "describe_call", "name_of", "settle"]
