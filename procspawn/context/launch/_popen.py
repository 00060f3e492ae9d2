"""Starting a rank with its stdout/stderr on pipes from its first instruction (POSIX).

A rank that dies before procspawn's code runs in it (a script without the ``__main__``
guard re-runs ``spawn()`` while it is imported in the child) prints the reason on its
stderr and nowhere else. To show that reason in the parent's exception, the rank's stderr
must be a pipe the parent reads, from the very start of the child:

* spawn: the child is a fresh interpreter started by ``multiprocessing``; our ``Popen``
  passes the pipe's descriptor to it and puts ``os.dup2`` in front of the command line's
  bootstrap code, so it runs before the main module is imported again;
* fork, forkserver: the worker redirects its descriptors first thing (``RedirectFds``).
  Under fork nothing of the user's runs before it. Under procspawn's fork server the child
  imports the main module again first (as under spawn), so the redirect also rides in the
  preparation data (``EarlyRedirect``), which the child unpickles before that import.

Under spawn the rank's ``RANK`` / ``WORLD_SIZE`` variables are set by the same command-line
prefix, so the main module's top level sees them when it is imported again.

It also leaves out the main module's path when it is not a file (a script read from
stdin, ``python -``): the stdlib's child would fail trying to run ``<stdin>``, while
procspawn's pickler sends functions of ``__main__`` by value and needs no re-import.
"""

from __future__ import annotations

import io
import os
from multiprocessing import popen_spawn_posix, reduction, spawn, util
from multiprocessing.context import SpawnProcess, set_spawning_popen

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any


def pickle_for_child(popen: Any, process_obj: Any) -> io.BytesIO:
    """What a spawn or forkserver child reads first: the preparation data (without a main
    path that is not a file: "<stdin>", "-c" have nothing to re-import) and the Process,
    pickled while ``popen`` is the spawning popen (so descriptors go as ``DupFd``)."""
    prep_data = spawn.get_preparation_data(process_obj._name)
    main_path = prep_data.get("init_main_from_path")
    if main_path is not None and not os.path.isfile(main_path):
        del prep_data["init_main_from_path"]
    early = process_obj.__dict__.pop("_procspawn_early_redirect", None)
    if early is not None:
        # a key prepare() does not know (it reads only its own): unpickling it is the point
        prep_data["procspawn_redirect"] = early
    buf = io.BytesIO()
    set_spawning_popen(popen)
    try:
        reduction.dump(prep_data, buf)
        reduction.dump(process_obj, buf)
    finally:
        set_spawning_popen(None)
    return buf


class _SpawnPopen(popen_spawn_posix.Popen):
    """The stdlib's spawn Popen, with the child's output redirected before it runs."""

    def _launch(self, process_obj: Any) -> None:
        from multiprocessing import resource_tracker

        redirect: dict[int, int] = process_obj.__dict__.pop("_procspawn_redirect", {})
        environ: dict[str, str] = process_obj.__dict__.pop("_procspawn_env", {})
        passed: list[int] = self._fds  # type: ignore[attr-defined]  # stdlib, set in __init__
        tracker_fd: Any = resource_tracker.getfd()
        passed.append(tracker_fd)
        fp = pickle_for_child(self, process_obj)

        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            if (redirect or environ) and "-c" in cmd:
                at = cmd.index("-c") + 1
                moves = "".join(f"os.dup2({fd},{t});os.close({fd});" for t, fd in redirect.items())
                env = f"os.environ.update({environ!r});" if environ else ""
                cmd[at] = f"import os;{moves}{env}{cmd[at]}"
                passed.extend(redirect.values())
            passed.extend([child_r, child_w])
            exe: Any = spawn.get_executable()
            self.pid = util.spawnv_passfds(exe, cmd, passed)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            fds_to_close = [fd for fd in (parent_r, parent_w) if fd is not None]
            self.finalizer = util.Finalize(
                self,
                util.close_fds,  # type: ignore[attr-defined]  # not in typeshed
                fds_to_close,
            )
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class RankSpawnProcess(SpawnProcess):
    """A spawn-method Process whose child starts with ``_procspawn_redirect`` applied
    (target descriptor -> write end of a pipe, set on the instance before ``start()``)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _SpawnPopen(process_obj)
