"""The public array helpers: empty, zeros, is_shared, share_memory_, trim."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import numpy as np

from .. import _registry
from . import _recycled, _slabs
from ._ndarray import copy_to_segment, empty_like_in_segment
from ._segment import segment_of

TYPE_CHECKING = False  # as typing's (this package's one convention)
if TYPE_CHECKING:  # pragma: no cover
    from numpy.typing import DTypeLike

_T = TypeVar("_T")


def empty(
    shape: int | np.integer | Iterable[int | np.integer], dtype: DTypeLike = float
) -> np.ndarray:
    """A new array in shared memory (its contents are zero: fresh segments are zeroed).

    The same as :func:`zeros`: ``numpy.empty``'s name, for code written with it.

    Args:
        shape: the array's shape, an int or a sequence of ints.
        dtype: anything ``numpy.dtype()`` takes (default float64).

    Returns:
        A C-ordered, writable ndarray over shared memory: passed to ``spawn``, a Pool
        or a procspawn Queue, the receivers get the same memory, not a copy.

    Raises:
        ValueError: a negative dimension.
        TypeError: ``shape`` or ``dtype`` is not one, or ``dtype`` holds Python objects.
        SharedMemoryFullError: under the ``file_system`` strategy, not enough shared
            memory (raised now, never a bus error later).
        FdLimitError: under a ``file_descriptor`` strategy chosen by the user, this
            process is out of file descriptors (the default one turns to
            ``file_system`` instead, with a warning).

    Example::

        from procspawn import sharing

        buffer = sharing.empty((2, 3), dtype="float32")
        assert buffer.shape == (2, 3) and sharing.is_shared(buffer)
    """
    _check_dtype(dtype, "sharing.empty cannot make this array")
    return empty_like_in_segment(shape, dtype)


def zeros(
    shape: int | np.integer | Iterable[int | np.integer], dtype: DTypeLike = float
) -> np.ndarray:
    """A new zero-filled array in shared memory.

    What the ranks write to it, the parent and every other rank see: make the arrays
    the ranks share (weights, results) with it, or move existing ones there with
    :func:`share_memory_`. Its memory goes back when the last array over it, in any
    process, is gone.

    Args:
        shape: the array's shape, an int or a sequence of ints.
        dtype: anything ``numpy.dtype()`` takes (default float64).

    Returns:
        A C-ordered, writable, zero-filled ndarray over shared memory.

    Raises:
        ValueError: a negative dimension.
        TypeError: ``shape`` or ``dtype`` is not one, or ``dtype`` holds Python objects.
        SharedMemoryFullError: under the ``file_system`` strategy, not enough shared
            memory (raised now, never a bus error later).
        FdLimitError: under a ``file_descriptor`` strategy chosen by the user, this
            process is out of file descriptors (the default one turns to
            ``file_system`` instead, with a warning).

    Example::

        import procspawn
        from procspawn import sharing

        def add_rank(rank, totals):
            totals[rank] += rank

        if __name__ == "__main__":
            totals = sharing.zeros(4, dtype="int64")
            procspawn.spawn(add_rank, args=(totals,), nprocs=4)
            assert totals.tolist() == [0, 1, 2, 3]
    """
    _check_dtype(dtype, "sharing.zeros cannot make this array")
    return empty_like_in_segment(shape, dtype)


def trim() -> int:
    """Give back the shared memory procspawn keeps on purpose in this process: the
    recycled segments, which carried copies at sends (``PROCSPAWN_POOL_BYTES``), and the
    slabs being filled (otherwise held until a second after their last small array was made).

    Arrays still in use are not touched.

    Returns:
        How many bytes of recycled segments were kept (their sizes).
    """
    _slabs.trim()
    return _recycled.trim()


def is_shared(array: object) -> bool:
    """Whether ``array``'s memory lies in a procspawn shared segment.

    Args:
        array: any object; only an ndarray (or a view of one) can be shared.

    Returns:
        True for an array made by :func:`zeros` / :func:`empty` / :func:`share_memory_`,
        received from another process through procspawn, or a view of one; for a CuPy
        array, True when it lies in shareable device memory
        (``procspawn.sharing.cuda``); False otherwise, and for anything else.

    Example::

        import numpy as np
        from procspawn import sharing

        shared = sharing.zeros(8)
        assert sharing.is_shared(shared) and sharing.is_shared(shared[2:4])
        assert not sharing.is_shared(np.zeros(8))
    """
    if isinstance(array, np.ndarray):
        return segment_of(array) is not None
    _registry.load_plugins()  # (a GPU array's plug-in answers for its type)
    test = _registry.shared_tests.get(type(array))
    return test is not None and test(array)


def share_memory_(obj: _T) -> _T:
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
            (share its ``.data`` and ``.mask`` instead), or an array of Python objects
            (``dtype=object``, which no other process can read); or an array sits where it cannot
            be replaced (a read-only attribute, a tuple type that cannot be rebuilt):
            nothing would share it, and writes made by the ranks would be lost. The
            check comes before anything is changed when it can (masked arrays, bad
            arguments); a failing attribute is reported as it is met.
        SharedMemoryFullError: as for :func:`zeros`.
        FdLimitError: as for :func:`zeros`.

    Example::

        import numpy as np
        import procspawn
        from procspawn import sharing

        class Model:
            def __init__(self):
                self.weights = np.zeros(4)

        def train(rank, model):
            model.weights[rank] = 1.0  # the parent's model sees it

        if __name__ == "__main__":
            model = sharing.share_memory_(Model())  # its arrays are replaced in place
            procspawn.spawn(train, args=(model,), nprocs=4)
            assert model.weights.tolist() == [1.0, 1.0, 1.0, 1.0]
    """
    if isinstance(obj, np.ndarray):
        _check_array(obj, "the array")
        # _keep_type gives the copy obj's own type (an ndarray subclass stays one)
        return obj if is_shared(obj) else cast(_T, _keep_type(copy_to_segment(obj), obj))
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


def _check_dtype(dtype: Any, what: str) -> None:
    if np.dtype(dtype).hasobject:
        raise TypeError(
            f"{what}: its dtype ({np.dtype(dtype)}) holds references to Python objects of "
            f"this process, which no other process can read through shared memory. Use a "
            f"numeric or fixed-size string dtype, or send the array as it is (it travels "
            f"by value, a copy)."
        )


def _check_array(array: np.ndarray, where: str) -> None:
    _check_dtype(array.dtype, f"share_memory_ cannot share {where}")
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


def _collect(
    obj: Any, kind: type = np.ndarray, check: Callable[[Any, str], None] | None = None
) -> list[Any]:
    """Every array of type ``kind`` (ndarray) reachable from ``obj`` through containers and
    plain objects, each passed to ``check`` (by default ``_check_array``) with its place."""
    checker: Callable[[Any, str], None] = _check_array if check is None else check
    arrays: list[Any] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        for key, value in _items(item):
            if isinstance(value, kind):
                checker(value, f"{type(item).__name__}[{key!r}]")
                arrays.append(value)
            elif _searchable(value):
                stack.append(value)
    return arrays


def _replace(root: Any, moved: dict[int, Any], kind: type = np.ndarray) -> None:
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
                if not isinstance(value, kind) and _searchable(value):
                    stack.append((value, False))
            continue
        changes = []
        for key, value in _items(obj):
            if isinstance(value, kind):
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
    # an ndarray is a buffer; numpy's stubs say so only from Python 3.12 (collections.abc.Buffer)
    return memoryview(root.reshape(-1, order="A").view(np.uint8))  # type: ignore[arg-type]
