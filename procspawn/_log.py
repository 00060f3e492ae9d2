"""The package logger, silent by default; ``PROCSPAWN_DEBUG=1`` logs to stderr.

With the variable set, procspawn logs segment allocations and frees and cleanup-daemon
events at DEBUG level on the ``procspawn`` logger. ``logging`` is imported only then, so
a rank that never logs does not pay for it.
"""

from __future__ import annotations

from . import _settings

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

ENABLED: bool | None = None  # PROCSPAWN_DEBUG, read at the first log
_logger: Any = None


def enabled() -> bool:
    """Whether PROCSPAWN_DEBUG is set."""
    global ENABLED
    if ENABLED is None:
        ENABLED = bool(_settings.get("PROCSPAWN_DEBUG"))
    return ENABLED


def debug(text: str, *args: Any) -> None:
    """Log ``text % args`` at DEBUG level when PROCSPAWN_DEBUG is set."""
    if not (ENABLED if ENABLED is not None else enabled()):
        return
    global _logger
    if _logger is None:
        import logging

        _logger = logging.getLogger("procspawn")
        if not _logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("procspawn %(process)d: %(message)s"))
            _logger.addHandler(handler)
        _logger.setLevel(logging.DEBUG)
    _logger.debug(text, *args)


def exception(text: str, *args: Any) -> None:
    """Log ``text % args`` and the exception being handled at ERROR level, always (with
    no handler configured, Python prints it on stderr): for errors of procspawn's own
    threads that no caller can be told about."""
    import logging

    logging.getLogger("procspawn").exception(text, *args)
