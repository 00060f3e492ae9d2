"""The reducer table every procspawn message is pickled with.

``register(type, reducer)`` puts procspawn's reducers in front of ``copyreg``'s, as
``ForkingPickler.register`` does for multiprocessing, without changing either. Reducers
for third-party types are plug-ins named here as data: the module that registers them is
imported when the third-party module first shows up in ``sys.modules`` (so a process that
never uses NumPy never imports it).
"""

from __future__ import annotations

import copyreg
import sys
from collections.abc import Callable

from .._late import late_import

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _T = TypeVar("_T")

reducers: dict[type, Callable[[Any], Any]] = {}
# base class -> the reducer of instances of its subclasses, which the dispatch table (by
# exact type) never sees; it returns NotImplemented for those pickled the usual way.
# Asked by the cloudpickle pickler (the C pickler hands such objects over to it)
subclass_reducers: dict[type, Callable[[Any], Any]] = {}
# type -> whether an instance lies in shared memory, for a plug-in's array type (a CuPy
# array): what sharing.is_shared asks
shared_tests: dict[type, Callable[[Any], bool]] = {}
version = 0  # bumped on every change: a pickler reads its dispatch table when it is made

# third-party module -> the procspawn module registering its reducers
PLUGINS: dict[str, str] = {"numpy": ".wire._reductions", "cupy": ".cuda._cupy"}
_loaded: set[str] = set()


def register(type_: type[_T], reducer: Callable[[_T], str | tuple[object, ...]]) -> None:
    """Make procspawn pickle every exact instance of ``type_`` with ``reducer(obj)``.

    Only procspawn's messages use it (spawn's arguments and results, procspawn's Queues,
    Pipes and Pools); ``copyreg`` and the stdlib's pickler are not changed. A type
    registered again gets the new reducer.

    Args:
        type_: the class; subclasses are not included.
        reducer: returns what ``__reduce__`` would: ``(callable, args)`` (or a longer
            reduce tuple), or a string naming a global.

    Example::

        from procspawn import sharing

        class Point:
            def __init__(self, x, y):
                self.x, self.y = x, y

        def reduce_point(point):
            return (Point, (point.x, point.y))

        sharing.register(Point, reduce_point)
        message = sharing.dumps(Point(1, 2))
        point = sharing.loads(message.data)
        message.close()
        assert (point.x, point.y) == (1, 2)
    """
    global version
    reducers[type_] = reducer
    version += 1


def dispatch_table() -> dict[type, Callable[[Any], Any]]:
    """copyreg's reducers with procspawn's in front, as one plain dict (fast C lookups)."""
    return {**copyreg.dispatch_table, **reducers}


def load_plugins() -> bool:
    """Register the reducers of every plug-in whose third-party module is imported;
    True when one was loaded now."""
    if len(_loaded) == len(PLUGINS):
        return False
    loaded = False
    for module, plugin in PLUGINS.items():
        if module not in _loaded and module in sys.modules:
            _loaded.add(module)
            late_import(plugin, __package__)  # (from any thread: see _late)
            loaded = True
    return loaded
