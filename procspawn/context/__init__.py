"""Spawning and watching worker processes (names imported on first use).

Floors, each importing only from those below it (and from ``procspawn.sharing``):

    4  _spawn: spawn(), start_processes()
    3  _process_context: ProcessContext (join, terminate, results)
    2  _watch: the one watcher (exits and channels in one epoll, stop with a grace
       period, describe an exit) and the watched child (process, channel, exit
       handle, post-mortem), used by spawn, the pools and ``procspawn run``;
       _worker: the child side of spawn; _ray: backend="ray"
    1  _tags: the tags of what a child sends its parent (ranks and pool workers);
       _raised: a child's exception packed for its parent, and unpacked there;
       launch/: how a process starts (start method, parent-death guard, early-output
       Popen, fork server, one child under any start method); _errors; _progress
"""

from __future__ import annotations

from .._lazy import lazy_names

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)

if TYPE_CHECKING:  # pragma: no cover
    from ._errors import ProcessException as ProcessException
    from ._errors import ProcessExitedException as ProcessExitedException
    from ._errors import ProcessRaisedException as ProcessRaisedException
    from ._errors import ProcessTimeoutError as ProcessTimeoutError
    from ._errors import RayMissingError as RayMissingError
    from ._errors import RayResourcesError as RayResourcesError
    from ._process_context import ProcessContext as ProcessContext
    from ._progress import Progress as Progress
    from ._progress import progress as progress
    from ._ray import RayContext as RayContext
    from ._spawn import spawn as spawn
    from ._spawn import start_processes as start_processes

_LAZY = {
    "ProcessContext": "._process_context",
    "RayContext": "._ray",
    "ProcessException": "._errors",
    "ProcessExitedException": "._errors",
    "ProcessRaisedException": "._errors",
    "ProcessTimeoutError": "._errors",
    "RayMissingError": "._errors",
    "RayResourcesError": "._errors",
    "Progress": "._progress",
    "progress": "._progress",
    "spawn": "._spawn",
    "start_processes": "._spawn",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
