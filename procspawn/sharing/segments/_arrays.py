"""The public array helpers: empty, zeros, is_shared, share_memory_, trim."""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from . import _recycled, _slabs
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


def trim() -> int:
    """Give back the shared memory procspawn keeps on purpose in this process: the
    recycled segments, which carried copies at sends (``PROCSPAWN_POOL_BYTES``), and the
    slabs being filled (otherwise held until a second after their last small array was made).

    Returns:
        How many bytes of recycled segments were kept (their sizes).
    """
    _slabs.trim()
    return _recycled.trim()


def is_shared(array: Any) -> bool:
    """True when ``array``'s memory lies in a procspawn shared segment."""
    return isinstance(array, np.ndarray) and segment_of(array) is not None


def share_memory_(obj: Any) -> Any:
    """Move arrays into shared memory: the entry point for Hogwild-style sharing.

    Args:
        obj: an ndarray (a shared copy is returned, ``obj`` is unchanged); or a dict, a
            list, or an object with attributes, whose arrays are replaced in place by
            shared copies, at any depth: dicts, lists and tuples inside it and the
            attributes of objects inside it (``__dict__`` or ``__slots__``) are searched
            too (cycles are fine; a tuple holding arrays is replaced by a new tuple in its
            container). Arrays that were views of one base become views of one shared base;
            arrays already shared are left as they are; ndarray subclasses (``np.matrix``,
            say) keep their type.

    Returns:
        The shared copy for an ndarray; ``obj`` itself otherwise.

    Raises:
        TypeError: ``obj`` is a tuple or has nothing to search; a masked array is found
            (share its ``.data`` and ``.mask`` instead); or an array sits where it cannot
            be replaced (a read-only attribute, a tuple type that cannot be rebuilt):
            nothing would share it, and writes made by the ranks would be lost. The
            check comes before anything is changed when it can (masked arrays, bad
            arguments); a failing attribute is reported as it is met.
    """
    if isinstance(obj, np.ndarray):
        _check_array(obj, "the array")
        return obj if is_shared(obj) else _keep_type(copy_to_segment(obj), obj)
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
    arrays = _collect(obj)
    moved = _share_together(arrays)
    for array in arrays:
        if id(array) in moved:
            moved[id(array)] = _keep_type(moved[id(array)], array)
    _replace(obj, moved)
    return obj


def _check_array(array: np.ndarray, where: str) -> None:
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(
            f"share_memory_ cannot share {where}, a masked array: its mask would stay "
            f"private. Share its .data and .mask (np.ma.getmaskarray) as two arrays."
        )


def _keep_type(shared: np.ndarray, original: np.ndarray) -> np.ndarray:
    """The shared copy as the original's ndarray subclass, with its attributes."""
    if type(original) is np.ndarray:
        return shared
    view = shared.view(type(original))
    if hasattr(original, "__dict__"):
        view.__dict__.update(original.__dict__)
    return view


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return names


def _searchable(obj: Any) -> bool:
    """Containers and plain objects, whose arrays share_memory_ replaces."""
    if isinstance(obj, (dict, list, tuple)):
        return True
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType)):
        return False
    if isinstance(obj, (str, bytes, bytearray, int, float, complex, np.generic)):
        return False
    return hasattr(obj, "__dict__") or bool(_slot_names(type(obj)))


def _items(obj: Any) -> list[tuple[Any, Any]]:
    if isinstance(obj, dict):
        return list(obj.items())
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    items = list(vars(obj).items()) if hasattr(obj, "__dict__") else []
    for name in _slot_names(type(obj)):
        try:
            items.append((name, getattr(obj, name)))
        except AttributeError:
            pass  # an empty slot
    return items


def _collect(obj: Any) -> list[np.ndarray]:
    """Every ndarray reachable from ``obj`` through containers and plain objects."""
    arrays: list[np.ndarray] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        for key, value in _items(item):
            if isinstance(value, np.ndarray):
                _check_array(value, f"{type(item).__name__}[{key!r}]")
                arrays.append(value)
            elif _searchable(value):
                stack.append(value)
    return arrays


def _replace(root: Any, moved: dict[int, np.ndarray]) -> None:
    """Put the shared copies in place, children before parents (a tuple that changes is
    rebuilt, and its container takes the new one). Iterative: depth is no limit."""
    done: dict[int, Any] = {}  # id -> the object, or the tuple rebuilt for it
    entered: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        obj, children_done = stack.pop()
        if not children_done:
            if id(obj) in entered:
                continue  # done, or an ancestor in a cycle: taken as it is
            entered.add(id(obj))
            stack.append((obj, True))
            for _, value in _items(obj):
                if not isinstance(value, np.ndarray) and _searchable(value):
                    stack.append((value, False))
            continue
        changes = []
        for key, value in _items(obj):
            if isinstance(value, np.ndarray):
                new = moved.get(id(value), value)
            elif _searchable(value):
                new = done.get(id(value), value)
            else:
                continue
            if new is not value:
                changes.append((key, new))
        done[id(obj)] = _apply(obj, changes) if changes else obj


def _apply(obj: Any, changes: list[tuple[Any, Any]]) -> Any:
    if isinstance(obj, tuple):
        items = list(obj)
        for key, new in changes:
            items[key] = new
        try:
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        except Exception as exc:
            raise TypeError(
                f"share_memory_ cannot rebuild a {type(obj).__name__} with the shared "
                f"arrays in it ({exc}); writes made by other processes would be lost. Use "
                f"a list or a plain tuple there."
            ) from exc
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
