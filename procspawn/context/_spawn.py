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
from collections.abc import Callable, Mapping
from multiprocessing.process import BaseProcess
from typing import Any, Literal, TypeVar, overload

from .. import _settings
from .._output import OutputForwarder
from .._settings import SettingError
from ..sharing.channels._startup import StartupMessage
from ..sharing.wire import _pickler
from . import _worker
from ._errors import ctrl_c_in_caller
from ._process_context import ProcessContext
from ._progress import Progress, as_progress
from .launch._child import check_can_start_children, parent_death_signal_is_safe, start_child
from .launch._cuda_guard import refuse_fork
from .launch._start_method import get_start_method, refuse_while_starting

TYPE_CHECKING = False  # as typing's (this package's one convention)
if TYPE_CHECKING:  # pragma: no cover
    from ._ray import RayContext


def _check(
    fn: Any,
    args: Any,
    kwargs: Any,
    nprocs: Any,
    start_method: Any,
    join: bool,
    timeout: Any,
    grace_period: Any,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    refuse_while_starting("procspawn.spawn()")  # (a child importing the main module again)
    if not callable(fn):
        raise TypeError(
            f"fn must be callable (it is called as fn(rank, *args, **kwargs)), got {fn!r}"
        )
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(
            f"nprocs must be an int >= 1 (the number of ranks to start), got {nprocs!r}"
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be a tuple of arguments passed after the rank, got "
            f"{type(args).__name__}; for one argument write args=(x,)"
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(
            f"kwargs must be a dict of keyword arguments for fn, got {type(kwargs).__name__}"
        )
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise TypeError(f"kwargs keys must be strings (argument names), got {bad[0]!r}")
    methods = multiprocessing.get_all_start_methods()
    if start_method not in methods:
        raise ValueError(
            f"unknown start method {start_method!r}; this platform has: {', '.join(methods)}"
        )
    if start_method == "fork":
        refuse_fork("spawn")
    if timeout is not None:
        if not join:
            raise ValueError(
                "timeout applies to join=True; with join=False, call "
                "context.join(timeout) in your loop and context.terminate() to stop"
            )
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if grace_period is not None and (
        isinstance(grace_period, bool)
        or not isinstance(grace_period, (int, float))
        or grace_period < 0
    ):
        raise ValueError(f"grace_period must be a number of seconds >= 0, got {grace_period!r}")
    return tuple(args), dict(kwargs)


def _pickle_payload(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: dict[str, Any]
) -> StartupMessage:
    deferred: list[Any] = []
    try:
        message = _pickler.dumps((fn, args, kwargs, config), deferred=deferred)
    except SettingError:
        raise  # a bad PROCSPAWN_* variable, not the user's data
    except Exception as exc:
        _raise_pickling_error(fn, args, kwargs, exc)
    return StartupMessage(message, deferred)


def _raise_pickling_error(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception
) -> None:
    """Name the culprit: fn, args[i] or kwargs[name], with its type."""
    candidates = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
    candidates += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    for what, obj in candidates:
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


_R = TypeVar("_R")  # what ``fn`` returns


@overload
def start_processes(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    join: Literal[True] = True,
    daemon: bool = False,
    start_method: str | None = None,
    *,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: str = "process",
    ray_address: str | None = None,
) -> list[_R]: ...


@overload
def start_processes(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = None,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: Literal["process"] = "process",
    ray_address: str | None = None,
) -> ProcessContext[_R]: ...


@overload
def start_processes(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = None,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: Literal["ray"],
    ray_address: str | None = None,
) -> RayContext[_R]: ...


@overload
def start_processes(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = None,
    *,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: str = "process",
    ray_address: str | None = None,
) -> list[_R] | ProcessContext[_R] | RayContext[_R]: ...


@ctrl_c_in_caller
def start_processes(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = None,
    *,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: str = "process",
    ray_address: str | None = None,
) -> list[_R] | ProcessContext[_R] | RayContext[_R]:
    """Run ``fn(rank, *args, **kwargs)`` in ``nprocs`` new processes: :func:`spawn` itself.

    ``spawn`` calls it with the same arguments; the two names are there because
    ``torch.multiprocessing`` has both. Everything :func:`spawn` says holds here.

    Args:
        fn: as for :func:`spawn`.
        args: as for :func:`spawn`.
        nprocs: as for :func:`spawn`.
        join: as for :func:`spawn`.
        daemon: as for :func:`spawn`.
        start_method: as for :func:`spawn`.
        kwargs: as for :func:`spawn`.
        timeout: as for :func:`spawn`.
        grace_period: as for :func:`spawn`.
        progress: as for :func:`spawn`.
        prefix_output: as for :func:`spawn`.
        backend: as for :func:`spawn`.
        ray_address: as for :func:`spawn`.

    Returns:
        With ``join=True``, the list of ``fn``'s return values by rank; with
        ``join=False``, a :class:`ProcessContext` (a ``RayContext`` with
        ``backend="ray"``).

    Raises:
        ValueError: a bad argument; see :func:`spawn`.
        TypeError: a bad argument; see :func:`spawn`.
        pickle.PicklingError: ``fn`` or an argument cannot be pickled (nothing started).
        ProcessRaisedException: a rank raised.
        ProcessExitedException: a rank exited with a non-zero code or was killed; or
            it reached a ``spawn`` at the top level of the main module, which it imports
            again as it starts (the message leads with the fix: the ``__main__`` guard).
        ProcessTimeoutError: ``timeout`` passed.
        RayMissingError: ``backend="ray"`` without Ray installed.
        RayResourcesError: the Ray cluster cannot give every rank a CPU.

    Example::

        import procspawn

        def square(rank):
            return rank * rank

        if __name__ == "__main__":
            assert procspawn.start_processes(square, nprocs=3) == [0, 1, 4]
    """
    if backend == "ray":
        _check_ray_options(start_method, daemon, progress, prefix_output)
        args, kwargs = _check(fn, args, kwargs, nprocs, "spawn", join, timeout, grace_period)
        from ._ray import start_ray

        return start_ray(fn, args, kwargs, nprocs, join, timeout, ray_address)
    if backend != "process":
        raise ValueError(f"unknown backend {backend!r}; use 'process' (default) or 'ray'")
    if ray_address is not None:
        raise ValueError("ray_address applies to backend='ray' only")
    _settings.check_all()  # a bad PROCSPAWN_* variable: its SettingError, before anything
    if start_method is None:
        start_method = get_start_method()
    args, kwargs = _check(fn, args, kwargs, nprocs, start_method, join, timeout, grace_period)
    check_can_start_children("procspawn.spawn")
    shown = as_progress(progress)
    config = _child_config()
    if shown is not None:
        config["progress"] = shown._allocate(nprocs)
    payload = _pickle_payload(fn, args, kwargs, config)
    output = OutputForwarder(prefix=prefix_output)
    processes, channels = _start_all(nprocs, payload, start_method, daemon, output)
    context: ProcessContext[_R] = ProcessContext(
        processes, channels, payload, output=output, progress=shown, grace_period=grace_period
    )
    if not join:
        return context
    return context._run_to_end(timeout)


def _check_ray_options(start_method: Any, daemon: Any, progress: Any, prefix_output: Any) -> None:
    given = [
        name
        for name, value, default in (
            ("start_method", start_method, None),
            ("daemon", daemon, False),
            ("progress", progress, None),
            ("prefix_output", prefix_output, False),
        )
        if value != default
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} do(es) not apply to backend='ray': Ray starts the ranks' "
            f"processes and shows their output (prefixed with the actor's pid). Leave "
            f"{'it' if len(given) == 1 else 'them'} out."
        )


# Under forkserver the parent's share of a rank's start (pickling, connecting, waiting for
# the server's fork) overlaps with another rank's when two threads start ranks. Not under
# fork (a child would inherit the other thread's half-made pipes) nor spawn (the parent's
# share is small next to a new interpreter's).
_STARTER_THREADS = {"forkserver": 2}


def _start_all(
    nprocs: int, payload: StartupMessage, start_method: str, daemon: bool, output: OutputForwarder
) -> tuple[list[BaseProcess], list[socket.socket]]:
    """Start every rank; if one cannot start, stop those that did and raise."""
    procs: list[BaseProcess | None] = [None] * nprocs
    socks: list[socket.socket | None] = [None] * nprocs
    errors: list[BaseException] = []

    def start(ranks: range) -> None:
        for rank in ranks:
            if errors:
                return
            made: list[socket.socket] = []
            try:
                procs[rank] = _start_rank(rank, nprocs, payload, start_method, daemon, output, made)
            except BaseException as exc:
                errors.append(exc)
            finally:
                socks[rank] = made[0] if made else None

    workers = min(_STARTER_THREADS.get(start_method, 1), nprocs)
    helpers = [
        threading.Thread(target=start, args=(range(i, nprocs, workers),), daemon=True)
        for i in range(1, workers)
    ]
    try:
        for thread in helpers:
            thread.start()
        start(range(0, nprocs, workers))
    except BaseException as exc:  # Ctrl-C while starting
        errors.append(exc)
    finally:
        for thread in helpers:
            thread.join()
    if errors:
        # the ranks in started have their process and channel; with no error, every rank
        started = [r for r in range(nprocs) if procs[r] is not None]
        context: ProcessContext[Any] = ProcessContext(
            [procs[r] for r in started],  # type: ignore[misc]
            [socks[r] for r in started],  # type: ignore[misc]
            payload,
            output=output,
        )
        context._stop_all(0.0)
        for r in range(nprocs):
            sock = socks[r]
            if procs[r] is None and sock is not None:
                sock.close()
        raise errors[0]
    return procs, socks  # type: ignore[return-value]


def _start_rank(
    rank: int,
    nprocs: int,
    payload: StartupMessage,
    start_method: str,
    daemon: bool,
    output: OutputForwarder,
    channels: list[socket.socket],
) -> BaseProcess:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channels.append(parent_end)
    try:
        worker_args = (
            payload,
            rank,
            nprocs,
            child_end,
            os.getpid(),
            parent_death_signal_is_safe(start_method),
        )
        return start_child(
            _worker.main,
            worker_args,
            start_method=start_method,
            output=output,
            key=rank,
            name=f"procspawn-rank-{rank}",
            daemon=daemon,
            spawn_env=_worker.rank_environment(rank, nprocs),
        )
    finally:
        child_end.close()


@overload
def spawn(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    join: Literal[True] = True,
    daemon: bool = False,
    start_method: str | None = None,
    *,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: str = "process",
    ray_address: str | None = None,
) -> list[_R]: ...


@overload
def spawn(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = None,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: Literal["process"] = "process",
    ray_address: str | None = None,
) -> ProcessContext[_R]: ...


@overload
def spawn(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    *,
    join: Literal[False],
    daemon: bool = False,
    start_method: str | None = None,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: Literal["ray"],
    ray_address: str | None = None,
) -> RayContext[_R]: ...


@overload
def spawn(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = None,
    *,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: str = "process",
    ray_address: str | None = None,
) -> list[_R] | ProcessContext[_R] | RayContext[_R]: ...


@ctrl_c_in_caller
def spawn(
    fn: Callable[..., _R],
    args: tuple[object, ...] | list[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = None,
    *,
    kwargs: Mapping[str, object] | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    progress: bool | int | Progress | None = None,
    prefix_output: bool = False,
    backend: str = "process",
    ray_address: str | None = None,
) -> list[_R] | ProcessContext[_R] | RayContext[_R]:
    """Run ``fn(rank, *args, **kwargs)`` in ``nprocs`` new processes and collect the results.

    Each rank, from 0 to ``nprocs - 1``, is a process of its own (or, with
    ``backend="ray"``, an actor of a Ray cluster). ``fn`` and its arguments are pickled
    once for all ranks, code by cloudpickle, so lambdas, closures and functions defined in
    ``__main__`` work. NumPy arrays in the arguments travel through shared memory: an array
    made with :func:`procspawn.sharing.zeros` or :func:`procspawn.sharing.share_memory_`
    is the same memory in the parent and in every rank, so what one writes the others see
    (Hogwild-style training); any other array arrives as a copy (copied once into shared
    memory when it has 64 KiB or more, ``PROCSPAWN_INLINE_BYTES``).

    Every rank has ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` in its
    environment. Its stdout and stderr go through the parent, live, line by line
    (prefixed with ``prefix_output``) to ``sys.stdout`` / ``sys.stderr`` (so a notebook
    shows them), and a rank that dies before ``fn`` runs is explained by what it printed
    last on stderr.

    The first rank to fail (it raises, exits with a non-zero code or is killed) stops
    every other rank (SIGTERM, then SIGKILL after ``grace_period``) and its failure is
    raised in the parent, with the return values of the ranks that had finished in the
    exception's ``results``. Ctrl-C in the parent sends SIGINT to the ranks (their
    ``finally`` blocks run), stops them the same way and raises ``KeyboardInterrupt``.

    Args:
        fn: the function each rank runs, as ``fn(rank, *args, **kwargs)``; lambdas,
            closures and functions defined in ``__main__`` work.
        args: arguments passed after the rank, a tuple (or a list). NumPy arrays go
            through shared memory; Queues, Pipes, Locks and Events work as with
            ``Process`` when made for the ranks' start method (``procspawn.Lock()``,
            ``procspawn.Queue()``: procspawn's default context makes them).
        nprocs: the number of ranks, an int >= 1.
        join: wait for all ranks and return their results (True), or return a
            :class:`ProcessContext` at once (False).
        daemon: start the ranks as daemonic processes (they may not start their own).
        start_method: "spawn", "forkserver" or "fork"; default:
            ``procspawn.get_start_method()`` (``set_start_method``, else the environment
            variable ``PROCSPAWN_START_METHOD``, else "forkserver").
        kwargs: keyword arguments for ``fn``, a mapping of argument names.
        timeout: with ``join=True``, seconds the ranks may run in all; past it every
            rank is stopped and ``ProcessTimeoutError`` raised. None: no limit.
        grace_period: seconds between SIGTERM (SIGINT after Ctrl-C) and SIGKILL when
            ranks are stopped (default: env ``PROCSPAWN_GRACE_PERIOD`` or 3 s).
        progress: show progress while joining: an int total of ``procspawn.progress()``
            steps, True (no total), or a :class:`Progress`; None or False: none.
        prefix_output: prefix each line the ranks print with ``[rank r]``.
        backend: ``"process"`` (processes on this machine) or ``"ray"``: the ranks as
            actors of a Ray cluster, one CPU each, reserved all at once (a placement
            group), with the same results, failures, timeout and Ctrl-C; needs
            ``pip install 'procspawn[ray]'``. Arrays in ``args`` reach the ranks through
            Ray's object store, read-only; procspawn shared arrays are refused (shared
            writes are one-machine only). ``start_method``, ``daemon``, ``progress`` and
            ``prefix_output`` do not apply to it.
        ray_address: with ``backend="ray"``, the cluster to connect to (default
            ``RAY_ADDRESS``), unless Ray is initialised in this process already (then that
            one is used); with neither, a local cluster is started for this call and shut
            down after it.

    Returns:
        With ``join=True``, the list of ``fn``'s return values, by rank (None for a rank
        that ended with ``sys.exit(0)`` instead of returning). With ``join=False``, a
        :class:`ProcessContext` at once, to ``join()`` or ``terminate()``
        (with ``backend="ray"``, a ``RayContext`` with the same methods).

    Raises:
        ValueError: ``nprocs`` is not an int >= 1, ``timeout`` not a number > 0 (or given
            with ``join=False``), ``grace_period`` not a number >= 0; an unknown start
            method or backend; ``ray_address`` without ``backend="ray"``, or options that
            do not apply to it with it; with ``backend="ray"``, a procspawn shared array
            in the arguments.
        TypeError: ``fn`` is not callable, ``args`` not a tuple or list, ``kwargs`` not a
            mapping with string keys, or ``progress`` of another type.
        pickle.PicklingError: ``fn`` or an argument cannot be pickled; the message names
            which. No process was started.
        ProcessRaisedException: a rank raised; its traceback is in the message and its
            exception, when it unpickles here, is the ``__cause__``.
        ProcessExitedException: a rank exited with a non-zero code or was killed by a
            signal.
        ProcessTimeoutError: ``timeout`` passed with ranks still running.
        KeyboardInterrupt: Ctrl-C while waiting; every rank was stopped.
        RayMissingError: ``backend="ray"`` but Ray is not installed.
        RayResourcesError: the Ray cluster cannot give every rank a CPU (nothing
            started).

    Example::

        import numpy as np
        import procspawn
        from procspawn import sharing

        def work(rank, weights):
            weights[rank] = rank + 1.0  # writes the parent's array: it is shared
            return float(weights.sum())

        if __name__ == "__main__":
            weights = sharing.zeros(4)
            results = procspawn.spawn(work, args=(weights,), nprocs=4)
            assert len(results) == 4
            assert np.array_equal(weights, [1.0, 2.0, 3.0, 4.0])
    """
    return start_processes(
        fn,
        args,
        nprocs,
        join,
        daemon,
        start_method,
        kwargs=kwargs,
        timeout=timeout,
        grace_period=grace_period,
        progress=progress,
        prefix_output=prefix_output,
        backend=backend,
        ray_address=ray_address,
    )


def _child_config() -> dict[str, Any]:
    """What a rank must know of its parent's procspawn settings, whatever the start method."""
    from ..sharing.segments import _strategy

    return {"sharing_strategy": _strategy.snapshot()}
