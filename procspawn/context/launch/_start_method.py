"""The one default start method of procspawn: ``spawn``, ``Pool``, the executors and the
drop-in ``Process`` all start their processes with it.

It is procspawn's fork server ("forkserver") where the platform has one, else "spawn":
a child is a fork of a single-threaded server that imported procspawn, cloudpickle and
(for a program that uses it) NumPy once: fast, and safe in a parent with threads, which
the pools' dispatcher thread makes every program (plain fork from a threaded parent can
deadlock the child); and a missing ``if __name__ == "__main__":`` guard fails the same
way everywhere. CPython 3.14 made forkserver multiprocessing's default on Linux for the
same reasons.

Order: ``set_start_method()``, else ``PROCSPAWN_START_METHOD`` (``procspawn run
--start-method`` sets it), else the default. multiprocessing's own global default is
neither read nor changed.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from ... import _settings
from . import _cuda_guard

TYPE_CHECKING = False  # as typing's, without importing typing
if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

ENV = "PROCSPAWN_START_METHOD"
_chosen: str | None = None


def default_start_method() -> str:
    """ "forkserver" where the platform has it, else "spawn"."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _check(method: object, where: str) -> str:
    methods = multiprocessing.get_all_start_methods()
    if method not in methods:
        error = _settings.SettingError if where else ValueError  # (the variable's, or not)
        raise error(
            f"{where}{method!r} is not a start method of this platform; "
            f"use one of: {', '.join(methods)}"
        )
    return method


# What a child that reached code starting processes while it imported the main module
# again writes, alone, before it exits: the parent, which reads its stderr, tells the user
# the fix once (see _watch.last_words), instead of a traceback per child.
GUARD_MARKER = "procspawn: this child reached code that starts processes while it imported"
GUARD_EXIT_CODE = 1


def refuse_while_starting(what: str) -> None:
    """In a child of spawn or forkserver that is still importing the main module again (it
    has no ``if __name__ == "__main__":`` guard): say so in one line, for the parent, and
    exit, with no traceback. Nothing otherwise."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        package = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
            frame = frame.f_back  # the user's line that called procspawn
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        os.write(2, f"{GUARD_MARKER} the main module ({what} at {where})\n".encode())
        os._exit(GUARD_EXIT_CODE)


def get_start_method(allow_none: bool = False) -> str:
    """The start method procspawn uses when none is given: the one set with
    ``set_start_method``, else ``PROCSPAWN_START_METHOD``, else "forkserver" (or "spawn"
    where there is no fork server).

    multiprocessing's own default is neither read nor changed.

    Args:
        allow_none: accepted for ``multiprocessing.get_start_method``'s signature; there
            is always a method, so it changes nothing.

    Returns:
        "forkserver", "spawn" or "fork".

    Raises:
        ValueError: ``PROCSPAWN_START_METHOD`` names no start method of this platform.
    """
    if _chosen is not None:
        return _chosen
    value = _settings.get(ENV)
    if value:
        return _check(value, f"{ENV}=")
    return default_start_method()


def set_start_method(method: str | None, force: bool = False) -> None:
    """Set procspawn's default start method (for ``spawn``, ``Pool``, the executors and
    ``Process``); ``None`` with ``force=True`` goes back to the default.

    multiprocessing's own default is not changed. An explicit ``start_method=`` (or
    ``context=``) argument still wins over it.

    Args:
        method: "forkserver", "spawn" or "fork"; None: back to the default.
        force: change a method that was set already.

    Raises:
        RuntimeError: it was set already (pass ``force=True`` to change it).
        ValueError: ``method`` is not a start method of this platform.
    """
    global _chosen
    if _chosen is not None and not force:
        raise RuntimeError(
            f"the start method was set already (to {_chosen!r}); pass force=True to change it"
        )
    _chosen = None if method is None else _check(method, "")


def force_start_method(method: str) -> None:
    """In a child: the method that started it becomes its start method, as
    multiprocessing's children report theirs (``Process._bootstrap``); set, so a later
    ``set_start_method`` needs ``force=True`` there too."""
    global _chosen
    _chosen = method


def start_method_of(context: str | BaseContext | None) -> str:
    """The start method a pool's ``context`` argument names: a multiprocessing context
    (procspawn's or the stdlib's), a method name, or None (procspawn's default,
    ``get_start_method()``). Every setting is checked first (the pools' constructors
    come here)."""
    _settings.check_all()
    refuse_while_starting(
        "a procspawn pool or executor"
    )  # (a child importing the main module again)
    if context is None:
        method = get_start_method()
        if method == "fork":
            _cuda_guard.refuse_fork("a pool")
        return method
    if isinstance(context, str):
        method = context
    else:
        getter = getattr(context, "get_start_method", None)
        if getter is None:
            raise TypeError(
                f"context must be a multiprocessing context (get_context('spawn')) or a "
                f"start method name, got {context!r}"
            )
        method = getter()
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"unknown start method {method!r}; this platform has: "
            f"{', '.join(multiprocessing.get_all_start_methods())}"
        )
    if method == "fork":
        _cuda_guard.refuse_fork("a pool")
    return method


__all__ = [
    "ENV",
    "GUARD_MARKER",
    "refuse_while_starting",
    "default_start_method",
    "force_start_method",
    "get_start_method",
    "set_start_method",
    "start_method_of",
]
