"""Starting one child under any start method, its stdout and stderr on the parent's pipes
from its first instruction (``_popen``), for ``spawn``'s ranks and the pools' workers.

The target is called as ``target(*args, redirect, environ)``: ``redirect`` (fork,
forkserver) points the child's descriptors 1 and 2 at the pipes, ``environ``
(forkserver) is the parent's environment of now. Under spawn both are done before the
child's interpreter runs a line (``_popen``) and the target gets neither.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from ..._late import late_import
from ..._output import OutputForwarder
from . import _cuda_guard, _posix
from ._redirect import EarlyRedirect, RedirectFds

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from typing import Any


def start_child(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    start_method: str,
    output: OutputForwarder,
    key: int,
    name: str,
    daemon: bool = False,
    spawn_env: dict[str, str] | None = None,
    pool_worker: bool = False,
) -> BaseProcess:
    """Start ``target`` in a new process whose output ``output`` forwards under ``key``.

    ``spawn_env`` is set in a spawn child's environment before its main module is
    imported again (fork and forkserver children set what they need themselves).
    ``pool_worker``: the child runs a pool's worker loop, not a rank (a fork server
    started for it preloads what a worker needs first, see ``_forkserver``).
    """
    redirect: dict[int, int] = {}
    try:
        # Both streams go through the parent: lines of children do not mix, a notebook
        # shows them, and a child that dies early is explained by its stderr.
        redirect[1] = output.pipe(key, "stdout")
        redirect[2] = output.pipe(key, "stderr")
        # procspawn's Process classes read the _procspawn_* attributes set here, which
        # BaseProcess does not declare; get_context(a str) is a BaseContext to typeshed,
        # which declares no Process
        proc: BaseProcess
        # The modules a start needs are imported at its first use (the spawn machinery,
        # procspawn's fork server, multiprocessing's Popen of the method), in whatever
        # thread starts it: under the lock that every fork takes first (see _late), or a
        # fork by another thread meanwhile hands its child their import locks, held.
        if start_method == "spawn":
            proc = late_import("._popen", __package__).RankSpawnProcess(
                target=target, args=args, name=name
            )
            proc._procspawn_redirect = redirect  # type: ignore[attr-defined]
            proc._procspawn_env = spawn_env or {}  # type: ignore[attr-defined]
        elif start_method == "forkserver":
            # procspawn's server (NumPy & co. imported once); it forked with the environment
            # of its own start, so the child takes this process' environment of now
            proc = late_import("._forkserver", __package__).RankForkServerProcess(
                target=target, args=(*args, RedirectFds(redirect), dict(os.environ)), name=name
            )
            # applied before the child imports the main module again (see _popen)
            proc._procspawn_early_redirect = EarlyRedirect(redirect)  # type: ignore[attr-defined]
            proc._procspawn_pool_worker = pool_worker  # type: ignore[attr-defined]
        else:
            _cuda_guard.refuse_fork("procspawn")
            _posix.load_prctl()  # inherited by the child (see parent_death_signal_is_safe)
            late_import(f"multiprocessing.popen_{start_method}")  # (what start() imports)
            mp_context = multiprocessing.get_context(start_method)
            proc = mp_context.Process(  # type: ignore[attr-defined]
                target=target, args=(*args, RedirectFds(redirect)), name=name
            )
        proc.daemon = daemon
        if start_method != "fork":
            # started now if need be, before SIGINT is blocked here: its own start
            # unblocks SIGINT in this thread when it is done
            late_import("multiprocessing.resource_tracker").ensure_running()
        with _posix.sigint_blocked():  # the child unblocks it once it has its handler
            proc.start()
    finally:
        for fd in redirect.values():
            os.close(fd)
    return proc


def check_can_start_children(what: str) -> None:
    """Raise, in the caller, what ``Process.start`` would only assert: a daemonic process
    (a ``Pool``'s worker, a ``Process(daemon=True)``) may not have children."""
    if multiprocessing.current_process().daemon:
        raise RuntimeError(
            f"{what} cannot start processes here: this process is daemonic (a Pool's "
            "worker, or a Process started with daemon=True), and multiprocessing lets no "
            "daemonic process have children. Run the outer work on a "
            "ProcessPoolExecutor or with procspawn.spawn() (their workers and ranks are "
            "not daemonic), or do the inner work in this process."
        )


def parent_death_signal_is_safe(start_method: str) -> bool:
    """Whether a child started now from this thread may ask for PR_SET_PDEATHSIG.

    It fires when the *thread* that forked the child exits, not the process: use it only
    when the main thread starts the child and is its direct parent (not under forkserver).
    The pidfd watchdog covers every other case.
    """
    return start_method != "forkserver" and threading.current_thread() is threading.main_thread()
