"""Package namespaces whose names are imported on first use (PEP 562)."""

from __future__ import annotations

from collections.abc import Callable

from ._late import late_import

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any


def lazy_names(
    package: str, names: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each public name to
    the submodule (relative, like ``"._spawn"``) that defines it; a name is imported on
    first access and then cached in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # (a fork in another thread waits for it: see _late)
        value = getattr(late_import(names[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
