"""``spawn(..., backend="ray")``: the ranks as actors of a Ray cluster, with spawn's semantics.

::

    parent: check arguments (no procspawn shared arrays: Hogwild is one-machine only)
            connect: ray_address / RAY_ADDRESS, a Ray already initialised here, or a local
                     cluster of our own (no dashboard, small object store, shut down after)
            placement group of nprocs bundles {"CPU": 1}: every rank gets one or none starts
            one actor per bundle; ray.put((fn, args, kwargs)) once: each rank reads it from
                     the object store (zero-copy on one node: its arrays are read-only)
            run(rank) on every actor  ──▶  (RESULT, pickled result) | (RAISED, exc, traceback)
            join: ray.wait on every rank at once; the first failure (a raise, or an actor
                  that died) stops the others (ray.kill) and removes the group
    close:  every actor killed, the group removed, our own cluster shut down once no
            context uses it (also when a context is dropped without join or terminate)

Ray is imported only here, when ``backend="ray"`` is asked for: ``import procspawn`` never
imports it. Results travel back pickled by the rank (cloudpickle), so the parent's values
are its own, writable, and outlive the cluster.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Generic, TypeVar

import cloudpickle

from .. import _settings
from . import _raised, _tags
from ._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    ProcessTimeoutError,
    RayMissingError,
    RayResourcesError,
)

_OBJECT_STORE_BYTES = 256 << 20  # a local cluster of our own: a small object store
_SETTLE_SECONDS = 3.0  # at most, for a placement group's creation under way to finish
_TICK = 0.2  # seconds between looks while joining, so Ctrl-C is seen promptly
_R = TypeVar("_R")  # what the ranks' function returns


def import_ray(what: str = "spawn(..., backend='ray')") -> Any:
    """Ray, or a clear error saying how to install it (``what`` needs it)."""
    try:
        import ray
    except ImportError as exc:
        raise RayMissingError(
            f"{what} needs Ray, which is not installed in this environment: "
            f"pip install 'procspawn[ray]' (or pip install ray)"
        ) from exc
    return ray


def refuse_shared_arrays(
    args: tuple[Any, ...], kwargs: dict[str, Any], what: str = "spawn(..., backend='ray')"
) -> None:
    """Arrays made with ``share_memory_`` / ``sharing.zeros`` cannot be shared writably
    across machines: refuse them before anything starts (``what`` was given them)."""
    if "numpy" not in sys.modules:
        return  # no array could be in there
    from ..sharing import is_shared

    for where, obj in _walk(args, kwargs):
        if is_shared(obj):
            raise ValueError(
                f"{what}: {where} is a procspawn shared-memory array "
                f"(share_memory_ / sharing.zeros). Writes to shared memory across "
                f"processes (Hogwild) work on one machine only: use backend='process' for "
                f"that. With Ray, pass a plain array (np.array(a)): each rank or task "
                f"reads it from Ray's object store, read-only, and returns what it "
                f"computes."
            )


def _walk(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every object reachable from args and kwargs through containers, attributes
    (``__dict__``, ``__slots__``) and object arrays, with where it is."""
    ndarray = sys.modules["numpy"].ndarray
    stack: list[tuple[str, Any]] = [(f"args[{i}]", a) for i, a in enumerate(args)]
    stack += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    seen: set[int] = set()
    while stack:
        where, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield where, obj
        if isinstance(obj, dict):
            stack += [(f"{where}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue  # pickled by reference (or by code): not a container of data
        elif isinstance(obj, ndarray) and obj.dtype.kind == "O":
            stack += [(f"{where}.flat[{i}]", v) for i, v in enumerate(obj.flat)]
        else:
            if hasattr(obj, "__dict__"):
                stack += [(f"{where}.{k}", v) for k, v in vars(obj).items()]
            for cls in type(obj).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for slot in (slots,) if isinstance(slots, str) else slots:
                    if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                        stack.append((f"{where}.{slot}", getattr(obj, slot)))


class _Rank:
    """One rank, as a Ray actor (made a remote class in ``_actor_class``)."""

    def where(self) -> tuple[int, str]:
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(
        self,
        payload: list[Any],
        path: list[str],
        rank: int,
        local_rank: int,
        world: int,
        local_world: int,
    ) -> Any:
        import ray

        # As multiprocessing's spawn does: the parent's import path, so that a function of
        # the parent's own modules can be found (on one machine; elsewhere what exists).
        sys.path.extend(p for p in path if p not in sys.path)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(local_world),
        )
        what = ""
        try:
            # in a list, so that Ray left it to us to fetch, once the path is in place
            fn, args, kwargs = ray.get(payload[0])
            try:
                result = fn(rank, *args, **kwargs)
            except SystemExit as exc:  # as a process that exits: its code, no result
                return ("exit", _exit_code(exc.code), None)
            what = f"the return value of rank {rank} could not be pickled: "
            return (_tags.RESULT, cloudpickle.dumps(result))
        except BaseException as exc:  # KeyboardInterrupt included: it is a failure
            text = _raised.traceback_text(exc)
            if what:
                text = f"{what}{type(exc).__name__}: {exc}\n\n{text}"
            return (_tags.RAISED, _raised.pack(exc), text)


def _exit_code(code: Any) -> int:
    """The exit status ``sys.exit(code)`` gives a process."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed, status 1


_actor_classes: dict[int, Any] = {}


def _actor_class(ray: Any) -> Any:
    cls = _actor_classes.get(id(ray))
    if cls is None:
        cls = _actor_classes[id(ray)] = ray.remote(max_restarts=0, max_task_retries=0)(_Rank)
    return cls


# A local cluster procspawn started is shared by every RayContext running on it (and by
# whatever else in this process uses Ray meanwhile): it is shut down when the last of
# those contexts is closed, never under another one.
_cluster_lock = threading.Lock()
_cluster_users = 0  # open contexts on a cluster of ours; 0 when it is not ours


def connect(ray: Any, address: str | None, nprocs: int) -> bool:
    """Make sure Ray is initialised here; True when the context runs on a local cluster
    procspawn started (then ``disconnect`` must be called once it is closed)."""
    global _cluster_users
    with _cluster_lock:  # two threads spawning at once must not both call ray.init
        if ray.is_initialized():
            if _cluster_users:
                _cluster_users += 1
                return True
            return False
        address = address or os.environ.get("RAY_ADDRESS") or None
        if address is not None:
            ray.init(address=address, log_to_driver=True, logging_level="warning")
            return False
        ray.init(
            num_cpus=max(os.cpu_count() or 1, nprocs),
            include_dashboard=False,
            object_store_memory=_OBJECT_STORE_BYTES,
            log_to_driver=True,
            logging_level="warning",
        )
        _cluster_users = 1
        return True


def disconnect(ray: Any) -> None:
    """A context on our own cluster is closed: shut it down if it was the last one."""
    global _cluster_users
    with _cluster_lock:
        _cluster_users -= 1
        if _cluster_users == 0:
            ray.shutdown()


def start_ray(
    fn: Callable[..., _R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nprocs: int,
    join: bool,
    timeout: float | None,
    ray_address: str | None,
) -> list[_R] | RayContext[_R]:
    """The body of ``start_processes(..., backend="ray")`` once arguments are checked."""
    refuse_shared_arrays(args, kwargs)
    try:
        payload_bytes = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise pickle.PicklingError(
            f"spawn(..., backend='ray'): fn and args cannot be pickled: "
            f"{type(exc).__name__}: {exc}. No rank was started."
        ) from exc
    del payload_bytes  # a check in the parent; Ray pickles them again for the store
    ray = import_ray()
    deadline = None if timeout is None else time.monotonic() + timeout
    owned = connect(ray, ray_address, nprocs)
    context: RayContext[_R] = RayContext(ray, fn, args, kwargs, nprocs, owned, deadline)
    if not join:
        return context
    return context._run_to_end(None if deadline is None else deadline - time.monotonic())


class _Held:
    """What a RayContext holds in the cluster, given back once: by ``terminate()``, a
    failure, the end of ``join()``, or when the context is dropped unjoined."""

    def __init__(self, ray: Any, owned: bool) -> None:
        self.ray, self.owned = ray, owned
        self.actors: list[Any] = []
        self.group: Any = None
        self.ready: Any = None  # the group's ready() ref until it was seen ready

    def close(self) -> None:
        ray = self.ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass  # already dead
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            if self.ready is not None:
                # Removing a group whose bundles Ray is still preparing can leave them
                # reserved for good, and every later group waiting behind them (seen with
                # Ray 2.60): let a creation under way finish first. A group waiting for
                # busy CPUs is not under way; it is removed after this.
                try:
                    ray.wait([self.ready], timeout=_SETTLE_SECONDS)
                except Exception:
                    pass
            try:
                remove_placement_group(self.group)
            except Exception:
                pass
        self.actors, self.group, self.ready = [], None, None
        if self.owned:
            disconnect(ray)


class RayContext(Generic[_R]):
    """The running ranks of one ``spawn(..., backend="ray", join=False)`` call.

    The same interface as ``ProcessContext``: ``join(timeout)``, ``results``, ``pids()``,
    ``terminate()``, and use as a context manager. ``nodes()`` tells the Ray node of each
    rank.
    """

    def __init__(
        self,
        ray: Any,
        fn: Callable[..., _R],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        nprocs: int,
        owned: bool,
        deadline: float | None = None,
    ) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._held = _Held(ray, owned)
        # a context dropped without join() or terminate() gives back what it holds
        self._release = weakref.finalize(self, self._held.close)
        self._closed = False
        self._error: ProcessException | None = None
        self._results: list[Any] = [None] * nprocs
        self._done = [False] * nprocs
        self._pids: list[int] = [-1] * nprocs
        self._started = time.monotonic()
        ready = float(_settings.get("PROCSPAWN_RAY_READY_TIMEOUT"))
        left = ready if deadline is None else deadline - time.monotonic()
        # spawn's own timeout, when it is the tighter bound, makes running out a timeout
        self._by_timeout = left < ready
        wait = min(left, ready)
        try:
            cpus = ray.cluster_resources().get("CPU", 0)
            if cpus < nprocs:
                raise RayResourcesError(
                    f"spawn(..., backend='ray'): the Ray cluster has {cpus:g} CPU(s) in all, "
                    f"and every one of the {nprocs} ranks needs one; no rank was started. "
                    f"Start fewer ranks, or add nodes to the cluster."
                )
            group = self._held.group = placement_group([{"CPU": 1}] * nprocs, strategy="PACK")
            self._held.ready = group.ready()
            ready, _ = ray.wait([self._held.ready], timeout=max(wait, 0.0))
            if ready:
                self._held.ready = None
            else:
                self._out_of_time(nprocs, "before the cluster reserved a CPU for every rank")
                raise RayResourcesError(
                    f"spawn(..., backend='ray'): the Ray cluster could not reserve one CPU for "
                    f"each of {nprocs} ranks within {wait:.3g} s (available now: "
                    f"{ray.available_resources().get('CPU', 0):g} CPU); no rank was started. "
                    f"Other jobs may hold them; start fewer ranks or wait "
                    f"(PROCSPAWN_RAY_READY_TIMEOUT)."
                )
            actor = _actor_class(ray)
            actors = self._held.actors = [
                actor.options(
                    num_cpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=rank
                    ),
                ).remote()
                for rank in range(nprocs)
            ]
            self._nodes = self._wait_started(actors, wait)
            payload = ray.put((fn, args, kwargs))
            self._pending = {
                a.run.remote([payload], sys.path, rank, *self._local(rank), nprocs): rank
                for rank, a in enumerate(actors)
            }
        except BaseException:
            self._stop()
            raise

    def _wait_started(self, actors: list[Any], wait: float) -> list[str]:
        """Each rank's pid and node, once its actor runs; a rank that could not start
        within ``wait`` seconds, or died starting, is an error naming it."""
        ray = self._ray
        refs = [a.where.remote() for a in actors]
        started, _ = ray.wait(refs, num_returns=len(refs), timeout=max(wait, 0.0))
        waiting = [rank for rank, ref in enumerate(refs) if ref not in started]
        if waiting:
            listed = ", ".join(map(str, waiting))
            self._out_of_time(len(refs), f"before the actor of rank(s) {listed} had started")
        nodes = []
        for rank, ref in enumerate(refs):
            try:
                pid, node = ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                raise RayResourcesError(
                    f"spawn(..., backend='ray'): rank {rank}'s actor did not start within "
                    f"{wait:.3g} s; every rank was stopped. The cluster may be starting "
                    f"workers slowly (PROCSPAWN_RAY_READY_TIMEOUT)."
                ) from None
            except ray.exceptions.RayError as exc:
                raise ProcessExitedException(
                    f"process {rank} (Ray actor) died while starting: {exc}", rank, -1, -1, None
                ) from None
            self._pids[rank] = pid
            nodes.append(node)
        return nodes

    def _out_of_time(self, nprocs: int, when: str) -> None:
        """Raise ProcessTimeoutError if spawn's timeout, not PROCSPAWN_RAY_READY_TIMEOUT,
        bounded the start-up wait that just ran out (no rank has run ``fn``)."""
        if not self._by_timeout:
            return
        elapsed = time.monotonic() - self._started
        exc = ProcessTimeoutError(
            f"spawn(backend='ray') timed out after {elapsed:.1f} s while starting, {when}; "
            f"no rank ran, every rank was stopped",
            0,
            -1,
            list(range(nprocs)),
            elapsed,
        )
        exc.results = [None] * nprocs
        raise exc

    def _local(self, rank: int) -> tuple[int, int]:
        same = [r for r, node in enumerate(self._nodes) if node == self._nodes[rank]]
        return same.index(rank), len(same)

    def pids(self) -> list[int]:
        """The process ids of the ranks' actors (on their nodes), by rank."""
        return list(self._pids)

    def nodes(self) -> list[str]:
        """The Ray node id of each rank."""
        return list(self._nodes)

    @property
    def results(self) -> list[_R | None]:
        """The return values by rank, once ``join()`` returned True (after a failure or
        ``terminate()``: those of the ranks that had finished, None for the others).

        Raises:
            RuntimeError: ranks are still running.
        """
        if not self._closed:
            raise RuntimeError(
                "results are available once join() has returned True (or the ranks were "
                "stopped by a failure or terminate())"
            )
        return list(self._results)

    def __enter__(self) -> RayContext[_R]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.terminate()

    def terminate(self, grace_period: float | None = None) -> None:
        """Stop every rank still running (``ray.kill``, at once), remove the placement
        group, and shut down a local cluster procspawn started. Later ``join()`` calls
        return True.

        Args:
            grace_period: accepted for ``ProcessContext.terminate``'s signature; unused.
        """
        self._stop()

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for the ranks, as ``ProcessContext.join`` does.

        Args:
            timeout: seconds to wait at most; None waits until every rank is done.
            grace_period: accepted for ``ProcessContext.join``'s signature; unused
                (``ray.kill`` stops an actor at once).

        Returns:
            True when all finished (``results`` ready), False when ``timeout`` passed.

        Raises:
            ProcessRaisedException: a rank raised, or Ray could not run it.
            ProcessExitedException: a rank's actor died, or it exited with a non-zero
                code.
            ProcessException: a later call, after the wait was interrupted (Ctrl-C).
        """
        if self._error is not None:
            raise self._error
        if self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                tick = _TICK if remaining is None else min(_TICK, remaining)
                ready, _ = self._ray.wait(list(self._pending), num_returns=1, timeout=tick)
                for ref in ready:
                    self._take(ref, self._pending.pop(ref))
        except ProcessException as exc:
            self._fail(exc)
            raise
        except BaseException as exc:  # Ctrl-C, or anything else that stops us waiting
            self._fail(
                ProcessException(
                    f"the ranks were stopped: the parent got {type(exc).__name__} while "
                    f"joining them",
                    -1,
                    -1,
                )
            )
            raise
        self._stop()
        return True

    def _take(self, ref: Any, rank: int) -> None:
        pid = self._pids[rank]
        try:
            outcome = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            raise ProcessExitedException(
                f"process {rank} (pid {pid}, Ray actor on node {self._nodes[rank][:12]}) "
                f"terminated: its actor died: {exc}",
                rank,
                pid,
                -1,
                None,
            ) from None
        except self._ray.exceptions.RayError as exc:  # Ray could not run the task at all
            raise ProcessRaisedException(
                f"process {rank} (pid {pid}, Ray actor) terminated with the following "
                f"error:\nRay could not run it: {exc}",
                rank,
                pid,
            ) from exc
        if outcome[0] == _tags.RESULT:
            try:
                self._results[rank] = pickle.loads(outcome[1])
            except Exception as exc:
                raise ProcessRaisedException(
                    f"process {rank} (pid {pid}, Ray actor) returned a value the parent "
                    f"could not unpickle: {type(exc).__name__}: {exc} (is every module it "
                    f"needs importable here?)",
                    rank,
                    pid,
                ) from exc
            self._done[rank] = True
            return
        if outcome[0] == "exit":
            code = outcome[1]
            if code == 0:  # sys.exit(0): a clean exit without a result, as a process
                self._done[rank] = True
                return
            raise ProcessExitedException(
                f"process {rank} (pid {pid}, Ray actor) exited with exit code {code} (sys.exit)",
                rank,
                pid,
                code,
            )
        _, blob, text = outcome
        raise ProcessRaisedException(
            f"process {rank} (pid {pid}, Ray actor) terminated with the following error:\n{text}",
            rank,
            pid,
        ) from _raised.unpack(blob)

    def _run_to_end(self, timeout: float | None) -> list[_R]:
        if self.join(timeout):
            # every rank returned (None only for a sys.exit(0), which spawn documents)
            done: list[Any] = self.results
            return done
        running = [r for r, done in enumerate(self._done) if not done]
        elapsed = time.monotonic() - self._started
        listed = ", ".join(f"{r} (pid {self._pids[r]})" for r in running)
        exc = ProcessTimeoutError(
            f"spawn(backend='ray') timed out after {elapsed:.1f} s: rank(s) {listed} still "
            f"running; every rank was stopped (ray.kill)",
            running[0],
            self._pids[running[0]],
            running,
            elapsed,
        )
        self._fail(exc)
        raise exc

    def _fail(self, exc: ProcessException) -> None:
        self._stop()
        exc.results = self.results
        self._error = exc

    def _stop(self) -> None:
        """Kill every actor, remove the group, let go of our own cluster (once)."""
        if self._closed:
            return
        self._closed = True
        self._pending = {}
        self._release()
