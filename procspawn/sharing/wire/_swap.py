"""Sending an object with its arrays put in place by others: ``Swapped(obj, swap)``.

While ``obj`` is pickled, each NumPy array in it, at any depth (inside the user's own
objects too), is sent as ``swap(array)`` would be: a shared copy made once for many
messages, a read-only view, or the array itself. The receiver gets ``obj`` rebuilt, not a
``Swapped``. The rule holds for ``obj`` only: the rest of the message is pickled as ever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _message


class Swapped:
    """``obj``, to be pickled with ``swap(array)`` in place of each of its arrays."""

    __slots__ = ("obj", "swap")

    def __init__(self, obj: Any, swap: Callable[[Any], Any]) -> None:
        self.obj = obj
        self.swap = swap

    def __reduce__(self) -> Any:
        # pickle saves the arguments in order: obj under the swap, then the marker that
        # puts the previous rule back
        state = _message.sending()
        previous = state.swap_array
        state.swap_array = self.swap
        return (_unwrap, (self.obj, _Restore(previous)))


class _Restore:
    __slots__ = ("previous",)

    def __init__(self, previous: Callable[[Any], Any] | None) -> None:
        self.previous = previous

    def __reduce__(self) -> Any:
        _message.sending().swap_array = self.previous
        return (_nothing, ())


def _unwrap(obj: Any, _restored: None) -> Any:
    return obj


def _nothing() -> None:
    return None
