"""Level 4: the public array helpers: empty, zeros, is_shared, share_memory_."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._ndarray import copy_to_segment, empty_like_in_segment
from ._segment import segment_of


def empty(shape: Any, dtype: Any = float) -> np.ndarray:
    """A new array in shared memory (its contents are zero: fresh segments are zeroed).

    Raises:
        SharedMemoryFullError: not enough shared memory (raised now, never a bus error later).
    """
    return empty_like_in_segment(shape, dtype)


def zeros(shape: Any, dtype: Any = float) -> np.ndarray:
    """A new zero-filled array in shared memory."""
    return empty_like_in_segment(shape, dtype)


def is_shared(array: Any) -> bool:
    """True when ``array``'s memory lies in a procspawn shared segment."""
    return isinstance(array, np.ndarray) and segment_of(array) is not None


def share_memory_(obj: Any) -> Any:
    """Move arrays into shared memory: the entry point for Hogwild-style sharing.

    Args:
        obj: an ndarray (a shared copy is returned, ``obj`` is unchanged); or a dict, a
            list, or an object with array attributes, whose arrays are replaced in place
            by shared copies. Arrays that were views of one base become views of one
            shared base; arrays already shared are left as they are.

    Returns:
        The shared copy for an ndarray; ``obj`` itself otherwise.
    """
    if isinstance(obj, np.ndarray):
        return obj if is_shared(obj) else copy_to_segment(obj)
    if isinstance(obj, dict):
        slots = list(obj.items())
        setter = obj.__setitem__
    elif isinstance(obj, list):
        slots = list(enumerate(obj))
        setter = obj.__setitem__
    elif hasattr(obj, "__dict__"):
        slots = list(vars(obj).items())

        def setter(key: Any, value: Any) -> None:
            setattr(obj, key, value)

    else:
        raise TypeError(
            f"share_memory_ takes an ndarray, a dict, a list or an object with array "
            f"attributes, got {type(obj).__name__}"
        )
    moved = _share_together([v for _, v in slots if isinstance(v, np.ndarray)])
    for key, value in slots:
        if isinstance(value, np.ndarray) and id(value) in moved:
            setter(key, moved[id(value)])
    return obj


def _root(array: np.ndarray) -> np.ndarray:
    """The ndarray at the end of ``array``'s base chain (the one owning the memory)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _share_together(arrays: list[np.ndarray]) -> dict[int, np.ndarray]:
    """Shared replacements by id(array); views of one owning array share one new base."""
    shared_roots: dict[int, np.ndarray] = {}
    out: dict[int, np.ndarray] = {}
    for array in arrays:
        if is_shared(array):
            continue
        root = _root(array)
        if root.base is not None or root.dtype.hasobject:
            out[id(array)] = copy_to_segment(array)  # memory not owned by an ndarray
            continue
        if id(root) not in shared_roots:
            base = empty_like_in_segment(root.nbytes, np.uint8)
            base[:] = np.ndarray(root.nbytes, np.uint8, buffer=_bytes_view(root))
            shared_roots[id(root)] = base
        base = shared_roots[id(root)]
        offset = array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        view = np.ndarray(
            array.shape, array.dtype, buffer=base, offset=offset, strides=array.strides
        )
        if not array.flags.writeable:
            view.flags.writeable = False
        out[id(array)] = view
    return out


def _bytes_view(root: np.ndarray) -> memoryview:
    """The raw bytes an owning array allocated (it is contiguous in one of C/F order)."""
    return memoryview(root.reshape(-1, order="A").view(np.uint8))  # type: ignore[arg-type]
