"""Spawning and watching worker processes (names imported on first use)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ._errors import ProcessException, ProcessExitedException, ProcessRaisedException
    from ._process_context import ProcessContext
    from ._spawn import spawn, start_processes

_LAZY = {
    "ProcessContext": "._process_context",
    "ProcessException": "._errors",
    "ProcessExitedException": "._errors",
    "ProcessRaisedException": "._errors",
    "spawn": "._spawn",
    "start_processes": "._spawn",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'procspawn.context' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
