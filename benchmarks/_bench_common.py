"""Helpers shared by the benchmark scripts: child-process handling and markdown tables."""

from __future__ import annotations

import compileall
import importlib.util
import json
import os
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


def compile_package(name: str) -> str | None:
    """Write the bytecode of package ``name`` where it is missing or stale.

    Every library a benchmark compares is timed in fresh interpreters, whose start-up
    includes importing it. A library installed from a wheel has its bytecode (pip
    compiles it at install time), and so does the stdlib; procspawn installed from this
    checkout in editable mode gets it only from its first import, and never under
    ``PYTHONDONTWRITEBYTECODE=1`` (this sandbox's default), which would make every fresh
    interpreter compile its modules from source. Compiling it once here puts it on the
    footing of the others, as a user's installed copy is.

    Returns:
        A note for the table, or None when the package is not found or its folder is
        read-only (then it stays as it is).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    if not os.access(folder, os.W_OK) or not compileall.compile_dir(folder, quiet=1):
        return None
    return f"{name}'s bytecode compiled before the runs (compileall), as an install has it"


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


def versions(modules: Sequence[str]) -> dict[str, str]:
    """The installed version of each distribution that is installed (Python's too)."""
    import platform
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in modules:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def machine() -> str:
    """The machine in a few words: its cores, memory and kernel."""
    import platform

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {memory:.0f} GiB, {platform.system()} {platform.release()}"


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON."""
    with open(path, "w") as out:
        json.dump(data, out, indent=2)
        out.write("\n")
