"""The functions and classes of ``__main__`` a receiver has, sent by name.

The standard library pickles a function or class of the main script by name, and the
worker finds it in its own main module: imported again under spawn and forkserver,
inherited under fork. procspawn pickles them by value (cloudpickle), so that what a worker
does not have still travels (a lambda, a function defined under the ``__main__`` guard, a
notebook's). By value alone, though, a worker gets copies with globals of their own: what
an initializer sets with ``global`` is not what the tasks read, and the class of an
argument is not the class the worker's own functions know (``isinstance`` fails).

So the receiver's definitions go by name, as in the standard library, and only the rest by
value. Who knows what the receiver has:

* a pool worker started by spawn or forkserver says so when it is ready
  (:func:`main_index`: name -> the definition's fingerprint, where it was defined), and the
  parent pickles that worker's messages in :func:`sending_to` with it. A name the parent
  binds to another definition (one made only under the guard) goes by value;
* a forked worker has the very objects its parent's main module had at the fork: the
  parent takes a :func:`snapshot` then (name -> weak reference), and what was defined or
  redefined since goes by value; the worker sends back by name what its inherited main
  module still has (:data:`INHERITED`: its parent has the same objects).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
import weakref
from collections.abc import Iterator

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

_local = threading.local()  # .index: the receiver's, while a message for it is pickled
INHERITED = "inherited"  # a receiver that has this process' main module as it is now
_MAIN_MODULES = ("__main__", "__mp_main__")  # __mp_main__: the script imported again


def fingerprint(obj: Any) -> Any:
    """Where ``obj``, a function or class, was defined; None for anything else."""
    if type(obj) is types.FunctionType:
        code = obj.__code__
        return (os.path.normpath(code.co_filename), code.co_firstlineno)
    if isinstance(obj, type):
        methods = sorted(
            (name, os.path.normpath(value.__code__.co_filename), value.__code__.co_firstlineno)
            for name, value in list(vars(obj).items())
            if type(value) is types.FunctionType
        )
        return (tuple(base.__qualname__ for base in obj.__bases__), tuple(methods))
    return None


def _definitions(module: Any) -> Iterator[tuple[str, Any]]:
    """The functions and classes defined in ``module`` (a main module), under their own
    names."""
    for name, value in list(getattr(module, "__dict__", {}).items()):
        if type(value) is not types.FunctionType and not isinstance(value, type):
            continue  # (never asks other objects anything: a proxy may raise)
        if value.__module__ in _MAIN_MODULES and value.__qualname__ == name:
            yield name, value


def main_index() -> dict[str, Any]:
    """This process' main module's definitions: name -> fingerprint."""
    return {name: fingerprint(value) for name, value in _definitions(sys.modules.get("__main__"))}


def snapshot() -> dict[str, Any]:
    """This process' main module's definitions, by name, held weakly: what a child forked
    now has."""
    found: dict[str, Any] = {}
    for name, value in _definitions(sys.modules.get("__main__")):
        with contextlib.suppress(TypeError):  # (a class without weak references)
            found[name] = weakref.ref(value)
    return found


@contextlib.contextmanager
def sending_to(receiver_index: dict[str, Any] | str | None) -> Iterator[None]:
    """Pickle, in this thread, for a receiver whose main module has ``receiver_index``
    (None: nothing known, everything of ``__main__`` by value)."""
    previous = getattr(_local, "index", None)
    _local.index = receiver_index
    try:
        yield
    finally:
        _local.index = previous


def by_name(obj: Any) -> bool:
    """Whether ``obj``, a function or class of ``__main__``, goes by name: the receiver
    has the same definition under its name, and so does this process."""
    receiver = getattr(_local, "index", None)
    if receiver is None:
        return False
    name = getattr(obj, "__qualname__", None)
    if not isinstance(name, str) or getattr(sys.modules.get("__main__"), name, None) is not obj:
        return False  # (what pickle looks up by name must be obj)
    if receiver is INHERITED:
        return True
    mark = receiver.get(name) if isinstance(receiver, dict) else None
    if type(mark) is weakref.ref:
        return mark() is obj
    return mark is not None and fingerprint(obj) == mark
