"""How long a pool's functions run, for its one prefetch rule: a worker running a call may
be given the next call to hold only when that call is of a function measured short.

The round trip a held call saves (tens of microseconds; about a millisecond with a large
array to copy) matters for short calls only, and a call held behind a long one waits for
it while another worker may be free. A function not measured yet is not short (the first
calls of a backlog of long ones would wait behind one another).
"""

from __future__ import annotations

import types
import weakref

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a pool's start)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

SHORT = 0.01  # seconds: a function whose calls take less, on average, is short
KEPT = 64  # functions whose run times are kept, the latest used


class RunTimes:
    """A moving mean of the run time of each of the last ``KEPT`` functions used, keyed by
    the function's id and holding it weakly (an id whose function died is not its)."""

    def __init__(self) -> None:
        self._times: dict[int, tuple[Callable[[], Any], float]] = {}

    def note(self, fn: Any, seconds: float) -> None:
        """A call of ``fn`` ran ``seconds``."""
        key = id(fn)
        entry = self._times.pop(key, None)
        if entry is not None and entry[0]() is fn:
            seconds = 0.7 * entry[1] + 0.3 * seconds  # (recent calls weigh more)
        elif len(self._times) >= KEPT:
            self._times.pop(next(iter(self._times)))
        ref = _ref_to(fn)
        if ref is not None:  # (not measured: never short)
            self._times[key] = (ref, seconds)

    def short(self, fn: Any) -> bool:
        """Whether ``fn``'s calls were measured shorter than ``SHORT`` on average."""
        entry = self._times.get(id(fn))
        return entry is not None and entry[0]() is fn and entry[1] < SHORT


def _ref_to(obj: Any) -> Callable[[], Any] | None:
    """A weak reference to ``obj``; a strong one to a builtin function, which takes none
    (it lives as long as its module anyway); None for anything else that takes none (a
    callable that may hold much, not kept alive for this)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        if isinstance(obj, types.BuiltinFunctionType):
            return lambda: obj
        return None


__all__ = ["KEPT", "SHORT", "RunTimes"]
