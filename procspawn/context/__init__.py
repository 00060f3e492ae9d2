"""Spawning and watching worker processes (names imported on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:  # pragma: no cover
    from ._errors import (
        ProcessException,
        ProcessExitedException,
        ProcessRaisedException,
        ProcessTimeoutError,
        RayMissingError,
        RayResourcesError,
    )
    from ._process_context import ProcessContext
    from ._progress import Progress, progress
    from ._spawn import spawn, start_processes

_LAZY = {
    "ProcessContext": "._process_context",
    "ProcessException": "._errors",
    "ProcessExitedException": "._errors",
    "ProcessRaisedException": "._errors",
    "ProcessTimeoutError": "._errors",
    "RayMissingError": "._errors",
    "RayResourcesError": "._errors",
    "Progress": "._progress",
    "progress": "._progress",
    "spawn": "._spawn",
    "start_processes": "._spawn",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
