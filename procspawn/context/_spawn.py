"""spawn() / start_processes(): check, pickle once, start every rank.

Data flow::

    parent: check nprocs/fn/start_method
            dumps((fn, args)) once  ──▶ Message: pickle bytes + segment fds + keepalive
                                         + deferred objects (Queue, Lock, Pipe ends ...)
            per rank: socketpair; Process(target=_worker.main,
                                          args=(StartupMessage, rank, child end, ...)).start()
              spawn/forkserver: multiprocessing pickles StartupMessage while the process starts:
                 the bytes as they are, each fd as a DupFd, the deferred objects through
                 multiprocessing's own reducers (so Queues and Locks work as with Process)
              fork: nothing is pickled; the child inherits the StartupMessage
    child:  _worker.main → loads → fn(rank, *args) → one message back on its channel
    parent: ProcessContext.join watches sentinels and channels together
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import threading
from multiprocessing.process import BaseProcess
from typing import Any

from ..sharing import _pickler
from ..sharing._startup import StartupMessage
from . import _worker
from ._process_context import ProcessContext


def _check(fn: Any, args: Any, nprocs: Any, start_method: Any) -> tuple[Any, ...]:
    if not callable(fn):
        raise TypeError(f"fn must be callable (it is called as fn(rank, *args)), got {fn!r}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(
            f"nprocs must be an int >= 1 (the number of ranks to start), got {nprocs!r}"
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be a tuple of arguments passed after the rank, got "
            f"{type(args).__name__}; for one argument write args=(x,)"
        )
    methods = multiprocessing.get_all_start_methods()
    if start_method not in methods:
        raise ValueError(
            f"unknown start method {start_method!r}; this platform has: {', '.join(methods)}"
        )
    return tuple(args)


def _pickle_payload(fn: Any, args: tuple[Any, ...], config: dict[str, Any]) -> StartupMessage:
    deferred: list[Any] = []
    try:
        message = _pickler.dumps((fn, args, config), deferred=deferred)
    except Exception as exc:
        _raise_pickling_error(fn, args, exc)
    return StartupMessage(message, deferred)


def _raise_pickling_error(fn: Any, args: tuple[Any, ...], exc: Exception) -> None:
    """Name the culprit: fn, or args[i] with its type."""
    for what, obj in [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]:
        try:
            _pickler.dumps(obj, deferred=[]).close()
        except Exception as err:
            raise pickle.PicklingError(
                f"spawn(): {what} (of type {type(obj).__module__}.{type(obj).__qualname__}) "
                f"cannot be pickled to send to the ranks: {type(err).__name__}: {err}. "
                f"No process was started. Pass something picklable, or create the object "
                f"inside fn."
            ) from err
    raise pickle.PicklingError(
        f"spawn(): fn and args cannot be pickled: {type(exc).__name__}: {exc}. "
        f"No process was started."
    ) from exc


def start_processes(
    fn: Any,
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes.

    Args:
        fn: a callable; lambdas, closures and functions defined in ``__main__`` work.
        args: arguments passed after the rank. NumPy arrays go through shared memory;
            multiprocessing Queues, Pipes, Locks and Events work as with ``Process``.
        nprocs: the number of ranks, an int >= 1.
        join: wait for all ranks and return their results (True), or return a
            ``ProcessContext`` at once (False).
        daemon: start the ranks as daemonic processes (they may not start their own).
        start_method: "spawn", "forkserver" or "fork".

    Returns:
        With ``join=True``, the list of return values by rank; else a ``ProcessContext``.

    Raises:
        ValueError: bad ``nprocs`` or an unknown start method.
        TypeError: ``fn`` is not callable or ``args`` is not a tuple.
        pickle.PicklingError: ``fn`` or an argument cannot be pickled (nothing started).
        ProcessRaisedException, ProcessExitedException: a rank failed (see ``join``).
    """
    args = _check(fn, args, nprocs, start_method)
    mp_context = multiprocessing.get_context(start_method)
    payload = _pickle_payload(fn, args, _child_config())
    processes: list[BaseProcess] = []
    channels: list[socket.socket] = []
    try:
        for rank in range(nprocs):
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            channels.append(parent_end)
            try:
                proc = mp_context.Process(  # type: ignore[attr-defined]
                    target=_worker.main,
                    args=(
                        payload,
                        rank,
                        child_end,
                        os.getpid(),
                        _parent_death_signal_is_safe(start_method),
                    ),
                    name=f"procspawn-rank-{rank}",
                    daemon=daemon,
                )
                proc.start()
            finally:
                child_end.close()
            processes.append(proc)
    except BaseException:
        context = ProcessContext(processes, channels[: len(processes)], payload)
        context._stop_all(0.0)
        for sock in channels[len(processes) :]:
            sock.close()
        raise
    context = ProcessContext(processes, channels, payload)
    if not join:
        return context
    while not context.join():
        pass
    return context.results


def _parent_death_signal_is_safe(start_method: str) -> bool:
    # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process:
    # use it only when the main thread starts the ranks and is their direct parent (not
    # under forkserver). The pidfd watchdog covers every other case.
    return start_method != "forkserver" and threading.current_thread() is threading.main_thread()


def spawn(
    fn: Any,
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | list[Any]:
    """Run ``fn(rank, *args)`` for rank in ``range(nprocs)``; see ``start_processes``."""
    return start_processes(fn, args, nprocs, join, daemon, start_method)


def _child_config() -> dict[str, Any]:
    """What a rank must know of its parent's procspawn settings, whatever the start method."""
    from ..sharing import _strategy

    return {"sharing_strategy": _strategy.snapshot()}
