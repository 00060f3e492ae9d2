"""``Generic`` and ``TypeVar`` at run time, without importing ``typing``.

Importing ``typing`` costs ~3 ms, a tenth of a pool's start: procspawn's modules use it
for the type checker only, but for their generic classes (``AsyncResult[int]``,
``Future[str]``), which need a base and type variables at run time. A module imports
``typing``'s under ``TYPE_CHECKING`` and these otherwise.
"""

from __future__ import annotations

import types


def TypeVar(name: str, *constraints: object, **options: object) -> str:  # noqa: N802
    """A type variable, at run time only its name (what ``Cls[T]`` is given)."""
    return name


class Generic:
    """``typing.Generic`` at run time: ``Cls[T]`` is a ``types.GenericAlias``, and
    ``class C(Generic[T])`` derives from this class."""

    __slots__ = ()

    def __class_getitem__(cls, params: object) -> types.GenericAlias:
        return types.GenericAlias(cls, params)
