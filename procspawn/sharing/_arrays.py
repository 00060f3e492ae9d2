"""Level 4: the public array helpers: empty, zeros, is_shared, share_memory_."""

from __future__ import annotations

import types
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
            list, or an object with attributes, whose arrays are replaced in place by
            shared copies, at any depth: dicts, lists and tuples inside it and the
            attributes of objects inside it are searched too (cycles are fine; a tuple
            holding arrays is replaced by a new tuple in its container). Arrays that were
            views of one base become views of one shared base; arrays already shared are
            left as they are.

    Returns:
        The shared copy for an ndarray; ``obj`` itself otherwise.

    Raises:
        TypeError: ``obj`` is a tuple or has nothing to search, or an array sits where it
            cannot be replaced (a read-only attribute): nothing would share it, and writes
            made by the ranks would be lost.
    """
    if isinstance(obj, np.ndarray):
        return obj if is_shared(obj) else copy_to_segment(obj)
    if isinstance(obj, tuple) or not _searchable(obj):
        raise TypeError(
            f"share_memory_ takes an ndarray, a dict, a list or an object with array "
            f"attributes (changed in place), got {type(obj).__name__}"
            + (
                "; a tuple cannot be changed in place: pass a list"
                if isinstance(obj, tuple)
                else ""
            )
        )
    arrays: list[np.ndarray] = []
    _collect(obj, arrays, set())
    moved = _share_together(arrays)
    _replace(obj, moved, {})
    return obj


def _searchable(obj: Any) -> bool:
    """Containers and plain objects, whose arrays share_memory_ replaces."""
    if isinstance(obj, (dict, list, tuple)):
        return True
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType)):
        return False
    return hasattr(obj, "__dict__")


def _items(obj: Any) -> list[tuple[Any, Any]]:
    if isinstance(obj, dict):
        return list(obj.items())
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    return list(vars(obj).items())


def _collect(obj: Any, arrays: list[np.ndarray], seen: set[int]) -> None:
    """Every ndarray reachable from ``obj`` through containers and plain objects."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        for _, value in _items(item):
            if isinstance(value, np.ndarray):
                arrays.append(value)
            elif _searchable(value):
                stack.append(value)


def _replace(obj: Any, moved: dict[int, np.ndarray], done: dict[int, Any]) -> Any:
    """Put the shared copies in place; returns ``obj``, or a new tuple for a changed tuple."""
    if id(obj) in done:
        return done[id(obj)]
    done[id(obj)] = obj  # a cycle back to a tuple being rebuilt keeps the old one
    changes = []
    for key, value in _items(obj):
        if isinstance(value, np.ndarray):
            new = moved.get(id(value), value)
        elif _searchable(value):
            new = _replace(value, moved, done)
        else:
            continue
        if new is not value:
            changes.append((key, new))
    if not changes:
        return obj
    if isinstance(obj, tuple):
        items = list(obj)
        for key, new in changes:
            items[key] = new
        rebuilt = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        done[id(obj)] = rebuilt
        return rebuilt
    for key, new in changes:
        try:
            if isinstance(obj, (dict, list)):
                obj[key] = new
            else:
                setattr(obj, key, new)
        except (AttributeError, TypeError) as exc:
            raise TypeError(
                f"share_memory_ cannot put the shared copy of {type(obj).__name__}.{key} in "
                f"place ({exc}); writes made by other processes would be lost. Make the "
                f"attribute writable, or share the array with sharing.zeros/empty when "
                f"the object is built."
            ) from exc
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
