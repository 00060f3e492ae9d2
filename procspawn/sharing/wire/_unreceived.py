"""Giving back what a message that will never be unpickled held for its receiver.

A ``file_system`` segment counts every message that carries it, for the receiver to turn
into a hold of its own. A message whose descriptors the kernel dropped (its receiver at
its RLIMIT_NOFILE), or whose unpickling failed halfway, is never received: the counts of
its segments would stay, and their names in /dev/shm after every process has exited
(the daemon's sweeps leave by-name counts alone). ``give_back`` reads such a pickle with
an unpickler that runs none of it: every global it names is an inert stand-in, except
procspawn's two rebuild functions, whose handles go to their strategy's ``discard``.
"""

from __future__ import annotations

import errno
import io
import pickle

from . import _handles

TYPE_CHECKING = False  # as typing's, without importing typing
if TYPE_CHECKING:
    from typing import Any

# the functions a message calls with a segment handle as their first argument
_TAKES_A_HANDLE = {
    ("procspawn.sharing.wire._handles", "segment_from_handle"),
    ("procspawn.sharing.wire._reductions", "_rebuild_ndarray"),
}


class _Inert:
    """What any other global of the pickle is, and what every call in it returns: takes
    any arguments, state and items, and does nothing with them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class _Discarding(pickle.Unpickler):
    def __init__(self, data: bytes, done: set[Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._done = done

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TAKES_A_HANDLE:
            return self._discard
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return _Inert()

    def _discard(self, handle: Any, *rest: Any) -> _Inert:
        if isinstance(handle, tuple) and len(handle) == 4:
            key = (handle[0], handle[2])
            if key not in self._done:
                _handles.discard_handle(handle)
                self._done.add(key)  # (after: one that raised is tried again)
        return _Inert()


def give_back(data: bytes, done: set[Any]) -> None:
    """Give back what the segments in the pickle ``data`` counted for this receiver.

    Args:
        data: a message's pickle bytes, made by ``dumps``.
        done: the ``(strategy, key)`` of its segments already taken over (rebuilt) or
            given back; those given back now are added.

    Raises:
        OSError: EMFILE or ENFILE, out of descriptors (to import a strategy's module):
            call again later with the same ``done``.
    """
    try:
        _Discarding(data, done).load()
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
    except Exception:  # noqa: BLE001,S110 -- what the stand-ins cannot walk keeps its counts
        pass
