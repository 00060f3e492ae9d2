"""procspawn's fork server: ranks start as a fork of a process that has imported everything.

Under ``spawn`` every rank is a new interpreter that imports NumPy, cloudpickle and
procspawn before it runs a line of ``fn``: most of a trivial rank's start-up. The stdlib's
fork server imports only the main module. ``spawn(..., start_method="forkserver")`` uses a
fork server of procspawn's own instead: started once per program, at its first use, with
the modules a rank runs and cloudpickle already imported, NumPy too when this process
has imported it (plus whatever the user names with ``set_forkserver_preload``), and
reused by every later ``spawn``. A rank then costs a fork and its own work. Started for a
pool, the server imports a worker's modules only, and the rest once idle
(``_server_idle``): the pool's first workers are forked sooner.

It is the stdlib's fork server program (``multiprocessing.forkserver.main``), run as a
second instance: the same protocol, the same guarantees (single-threaded, so a threaded
parent forks nothing of its threads; it exits when the program does), and
``multiprocessing``'s own Process objects on our side, so ranks are joined, watched and
stopped exactly as under the other start methods. What differs is the preload list, and
that a rank gets the parent's environment of the moment it starts (the server's is that
of the moment the server started).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
from multiprocessing import forkserver, popen_forkserver, resource_tracker, util
from multiprocessing.context import ForkServerProcess

from ...sharing.channels._fdpass import wait_readable
from . import _cuda_guard, _posix
from ._popen import pickle_for_child

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

# What the first children import to run, loaded in the server before it serves anyone:
# a rank's modules and cloudpickle (a rank's ``fn`` goes by value), or a pool worker's
# loop (the script's functions go by name). _server_idle (first) imports the rest, and
# the other kind's, once the server is idle (DEFERRED there), so later children of
# either kind have them.
PRELOAD = [
    "procspawn.context.launch._server_idle",
    "cloudpickle",
    "procspawn.context._worker",
    "procspawn.context._progress",
    "procspawn.sharing.channels._startup",
    "procspawn.sharing.segments._file_descriptor",
]
POOL_PRELOAD = [
    "procspawn.context.launch._server_idle",
    "procspawn.pool._worker",
    # what every worker imports as it starts: its Process class (unpickled), and
    # runpy's pkgutil (the main module imported again)
    "procspawn.context.launch._forkserver",
    "procspawn.context.launch._redirect",
    "procspawn.sharing.channels._startup",
    "pkgutil",
]
# Loaded in the server only when this process has imported the first module when the
# server starts: a program that uses NumPy has its children use it too, and one that does
# not spares the server importing it (~80 ms of a cold start, more than all the rest).
PRELOAD_IF_IMPORTED = {
    "numpy": ["numpy", "procspawn.sharing.wire._reductions", "procspawn.sharing.segments._arrays"],
    # the sharing settings a pool's worker restores, when this process has some
    "procspawn.sharing.segments._strategy": ["procspawn.sharing.segments._strategy"],
}

_user_preload: list[str] = []
_server = forkserver.ForkServer()


def _forget_server_in_child() -> None:
    """In a forked child (a fork-method worker, a program's own ``os.fork()``): a server
    of its own when it needs one. Its parent's would fork children that are not this
    process' own, which it cannot wait for (ECHILD: "the pool could not start a worker
    process"), and the parent's server keeps running only as long as the parent."""
    global _server
    inherited = getattr(_server, "_forkserver_alive_fd", None)
    if inherited is not None:
        with contextlib.suppress(OSError):
            os.close(inherited)
    _server = forkserver.ForkServer()


os.register_at_fork(after_in_child=_forget_server_in_child)


def _preload(pool_worker: bool = False) -> list[str]:
    """The server's preload list if it started now for a rank or a pool's worker."""
    wanted = list(POOL_PRELOAD if pool_worker else PRELOAD)
    for module, modules in PRELOAD_IF_IMPORTED.items():
        if module in sys.modules:
            wanted += modules
    return wanted + [m for m in _user_preload if m not in wanted]


def set_forkserver_preload(modules: list[str]) -> None:
    """Import ``modules`` in the fork servers once, so ranks do not: procspawn's (used by
    ``spawn(..., start_method="forkserver")`` and the pools, on top of what procspawn's
    children import and, when this process has imported it, NumPy) and the stdlib's
    (``multiprocessing.set_forkserver_preload``, for the drop-in
    ``get_context("forkserver")``). Takes effect when a server starts: call it before the
    first forkserver start. A module that fails to import there is skipped (the ranks
    import it themselves).

    Args:
        modules: module names, as ``import`` takes them ("torch", "mypackage.model");
            they replace the list given by an earlier call.

    Raises:
        TypeError: ``modules`` is not a list of strings (a single string, say).

    Example::

        import procspawn

        procspawn.set_forkserver_preload(["json", "numpy"])
    """
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise TypeError(f"set_forkserver_preload takes a list of module names, got {modules!r}")
    _user_preload[:] = list(modules)
    multiprocessing.set_forkserver_preload(list(modules))


def _connect(fds: list[int], pool_worker: bool) -> tuple[int, int]:
    """``connect_to_new_process`` of our server, started (with today's preload list)
    first if it is not running."""
    _server.set_forkserver_preload(_preload(pool_worker))  # read only at a (re)start
    resource_tracker.ensure_running()  # (re)started first: its start unblocks SIGINT
    _room_for_a_request()
    with _posix.sigint_blocked():  # a server started now never sees a SIGINT
        return _server.connect_to_new_process(fds)


def _room_for_a_request() -> None:
    """Raise EMFILE here if this process has no descriptors for a request: the stdlib's
    client makes its two pipes once connected, and its server dies on a request cut
    short (EOFError, a traceback on stderr), taking the next start's time to restart."""
    made: list[int] = []
    try:
        made.extend(os.pipe())
        made.extend(os.pipe())
        made.append(os.dup(made[0]))  # the connection's socket
    finally:
        for fd in made:
            os.close(fd)


def ensure_running() -> None:
    """Start the server now (it starts by itself at the first forkserver spawn)."""
    _server.set_forkserver_preload(_preload())
    resource_tracker.ensure_running()
    with _posix.sigint_blocked():
        _server.ensure_running()


class _Popen(popen_forkserver.Popen):
    """The stdlib's forkserver Popen, talking to procspawn's server."""

    def _launch(self, process_obj: Any) -> None:
        self._read_lock = threading.Lock()  # see poll
        buf = pickle_for_child(self, process_obj)
        passed: list[int] = self._fds  # type: ignore[attr-defined]  # stdlib, set in __init__
        pool_worker = getattr(process_obj, "_procspawn_pool_worker", False)
        self.sentinel, w = _connect(passed, pool_worker)  # starts it if need be
        # a duplicate of the data pipe's write end: the child's sentinel of this process
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(
            self,
            util.close_fds,  # type: ignore[attr-defined]  # not in typeshed
            (parent_w, self.sentinel),
        )
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        # The stdlib's, but for two threads at once: each saw the sentinel readable, one
        # read the exit code and the other found the pipe at its end and wrote 255 over
        # it (another thread's Process.start polls every child). The reading is locked.
        if self.returncode is None:
            if not wait_readable([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            with self._read_lock:
                if self.returncode is None:
                    try:
                        self.returncode = forkserver.read_signed(self.sentinel)
                    except (OSError, EOFError):  # the server itself was killed
                        self.returncode = 255
        return self.returncode


class RankForkServerProcess(ForkServerProcess):
    """A forkserver-method Process started by procspawn's fork server."""

    def run(self) -> None:
        _cuda_guard.check_forked_child()  # before anything of the user's runs
        super().run()

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _Popen(process_obj)
