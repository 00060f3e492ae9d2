"""What the pools do as the program ends: an executor's work is waited for (as the
stdlib's), unless the program ends on Ctrl-C; a Pool's is stopped. A Ctrl-C during the
wait stops the executors too: one line says so, not a traceback of an exit function (the
stdlib's executor hangs there).

Each dispatcher module registers its own exit function, each calling ``finish`` with the
pools it has: the local one right after multiprocessing's (so it runs first), the Ray one
after Ray's (so it runs while Ray still serves).
"""

from __future__ import annotations

import os
import sys

from ..context._errors import ctrl_c

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._dispatching import DispatcherBase


def finish(pools: Iterable[DispatcherBase], what: str) -> None:
    """Wait for the executors among ``pools`` (this process' own) and stop the rest;
    ``what``: how the stopped executors' work is put, after a Ctrl-C."""
    interrupted = ctrl_c(getattr(sys, "last_value", None))
    mine = [p for p in pools if p._owner == os.getpid()]
    try:
        for pool in mine:
            if pool.executor_rules and not interrupted and pool.alive():
                pool.close()
                pool.join()
            else:
                pool.terminate(ctrl_c_raises=False)
    except KeyboardInterrupt:
        sys.stderr.write(
            "KeyboardInterrupt: the program stopped waiting, as it ended, for the work of "
            f"a ProcessPoolExecutor; {what}\n"
        )
        for pool in mine:
            pool.terminate(ctrl_c_raises=False)


__all__ = ["finish"]
