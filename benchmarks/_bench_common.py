"""Helpers shared by the benchmark scripts: child-process handling and markdown tables."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

JOIN_SECONDS = 30.0


class ChildError(RuntimeError):
    """A benchmark child reported an error, died, or did not answer in time."""


def torch_problem() -> str | None:
    """None when ``torch.multiprocessing`` imports (it is then imported), else why not."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        import torch.multiprocessing  # noqa: F401
    except Exception as exc:
        return f"torch cannot be imported: {describe(exc)}"
    return None


def receive(conn: Connection, proc: BaseProcess, timeout: float) -> Any:
    """The value of the next ``(kind, value)`` message a child sends on ``conn``.

    Raises:
        ChildError: the child sent ``("error", text)``, exited first, or timed out.
    """
    wait([conn, proc.sentinel], timeout)
    if conn.poll():
        kind, value = conn.recv()
        if kind == "error":
            raise ChildError(value)
        return value
    if not proc.is_alive():
        raise ChildError(f"{proc.name} exited with code {proc.exitcode} before reporting")
    raise ChildError(f"{proc.name} did not report within {timeout:.0f} s")


def finish(procs: Sequence[BaseProcess]) -> None:
    """Join the processes; terminate (then kill) any still running after JOIN_SECONDS."""
    for proc in procs:
        if proc.pid is not None:
            proc.join(JOIN_SECONDS)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def describe(exc: BaseException, limit: int = 160) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters (for a table cell)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def ratio(value: float | None, reference: float | None) -> str:
    """``value / reference`` to 3 significant digits (``1.23x``), or ``-`` if one is missing."""
    if value is None or not reference:
        return "-"
    return f"{value / reference:.3g}x"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-style markdown table."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON."""
    with open(path, "w") as out:
        json.dump(data, out, indent=2)
        out.write("\n")
