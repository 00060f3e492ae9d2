"""What a fork must not cut in half: modules imported after start-up, from any
thread, and module locks.

procspawn imports some modules at their first use rather than as a pool starts (ctypes,
``logging``, the errors of a broken pool): ~1.5-7 ms each that a pool which never needs
them never pays; so are the public names of the packages (``procspawn.Pool``). That
first use can come in any thread (a pool's thread, its output thread, a thread of the
program that makes a pool while another forks), and a fork made by another thread in
the middle of the import handed the child a half-imported module, and an import lock held
by a thread the child has not: the child failed or hung at its own first use.
:func:`late_import` holds a lock that every fork takes first (``os.register_at_fork``),
so a fork waits for the import to finish. :func:`renew_lock_in_child` gives a forked
child a new module lock: a fork made while another thread held one handed the child a lock
that nobody would release.
"""

from __future__ import annotations

import importlib
import os
import threading

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from types import ModuleType

_importing = threading.RLock()  # (an import may import late in turn)
os.register_at_fork(
    before=_importing.acquire,
    after_in_parent=_importing.release,
    after_in_child=_importing.release,
)


def late_import(name: str, package: str | None = None) -> ModuleType:
    """``importlib.import_module(name, package)``, which no fork of this process
    interrupts."""
    with _importing:
        return importlib.import_module(name, package)


def renew_lock_in_child(namespace: dict[str, object], name: str = "_lock") -> None:
    """In every child forked from now on, ``namespace[name]`` (a module's globals) is a
    new ``threading.Lock``."""
    os.register_at_fork(after_in_child=lambda: namespace.__setitem__(name, threading.Lock()))
