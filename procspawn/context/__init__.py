"""Spawning and watching worker processes."""

from ._errors import ProcessException, ProcessExitedException, ProcessRaisedException
from ._process_context import ProcessContext
from ._spawn import spawn, start_processes

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "spawn",
    "start_processes",
]
