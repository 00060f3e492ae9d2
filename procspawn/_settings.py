"""Every ``PROCSPAWN_*`` environment variable procspawn reads, in one table.

Each has a type, a default and a meaning (the documentation's settings page is made from
this table). A variable is read once, the first time procspawn needs it, not at import: a bad
value fails the call that uses it, with a ``SettingError`` that names the variable and a
value it accepts. An empty variable counts as unset. Standard library only.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Callable

from ._late import renew_lock_in_child

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any


class SettingError(ValueError):
    """A ``PROCSPAWN_*`` environment variable has a value procspawn cannot use.

    Raised by the first call that needs the setting (variables are read then, not at
    import); the message names the variable, its value and what it accepts. Fix or
    unset the variable. A ``ValueError``.
    """

    __module__ = "procspawn"  # its public name, in tracebacks and pickles


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_BYTES = r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]?)(?:i?b)?\s*"  # compiled at first use
_FLAGS = {"": False, "0": False, "false": False, "no": False, "off": False}
_FLAGS.update({"1": True, "true": True, "yes": True, "on": True})


def _bytes(text: str) -> int:
    match = re.fullmatch(_BYTES, text, re.IGNORECASE)
    if match is None:
        raise ValueError("a number of bytes, as in 65536, 64k, 4M or 1G (binary units)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError("a number of seconds, 0 or more, as in 2.5")
    return value


def _flag(text: str) -> bool:
    try:
        return _FLAGS[text.strip().lower()]
    except KeyError:
        raise ValueError("1 or 0 (or true/false, yes/no, on/off)") from None


def _name(text: str) -> str:
    return text.strip()


_PARSERS: dict[str, Callable[[str], Any]] = {
    "bytes": _bytes,
    "seconds": _seconds,
    "flag": _flag,
    "name": _name,
}


class Setting:
    """One environment variable: its name, type, default and meaning. (A plain class: a
    dataclass costs every process that imports procspawn's sharing a millisecond.)"""

    __slots__ = ("name", "kind", "default", "meaning", "shown", "old_names")

    def __init__(
        self,
        name: str,
        kind: str,  # "bytes", "seconds", "flag" or "name"
        default: Any,  # the value when unset; None: the reader's own default (``shown``)
        meaning: str,
        shown: str = "",  # the default as the settings page shows it, if not the value
        old_names: tuple[str, ...] = (),  # earlier names, still read (with a FutureWarning)
    ) -> None:
        self.name = name
        self.kind = kind
        self.default = default
        self.meaning = meaning
        self.shown = shown
        self.old_names = old_names

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.kind!r}, {self.default!r})"

    def parse(self, text: str) -> Any:
        try:
            return _PARSERS[self.kind](text)
        except ValueError as exc:
            raise SettingError(f"{self.name}={text!r} is not valid: use {exc}") from None

    def default_text(self) -> str:
        return self.shown or ("unset" if self.kind == "flag" else f"`{self.default}`")


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting(
            "PROCSPAWN_SHARING_STRATEGY",
            "name",
            None,
            "the default sharing strategy",
            "`file_descriptor` on Linux",
        ),
        Setting(
            "PROCSPAWN_START_METHOD",
            "name",
            None,
            "the default start method (`forkserver`, `spawn`, `fork`) of `spawn`, "
            "`start_processes`, `Pool`, the executors and `Process`, unless "
            "`procspawn.set_start_method` was called",
            "`forkserver`",
        ),
        Setting(
            "PROCSPAWN_GRACE_PERIOD",
            "seconds",
            3.0,
            "seconds between SIGTERM (or SIGINT) and SIGKILL for the ranks left after a "
            "failure, a timeout or Ctrl-C; `procspawn run` uses it too, and the pools for "
            "the workers they stop (Ctrl-C, `terminate()`)",
            "`3`",
        ),
        Setting(
            "PROCSPAWN_INLINE_BYTES",
            "bytes",
            65536,
            "unshared arrays smaller than this are pickled inline (`64k` works too)",
        ),
        Setting(
            "PROCSPAWN_GPU_INLINE_BYTES",
            "bytes",
            65536,
            "unshared GPU (CuPy) arrays smaller than this travel by value, a host copy "
            "rebuilt on the same GPU; larger ones are copied into shareable device memory "
            "at the send",
        ),
        Setting(
            "PROCSPAWN_GPU_IPC",
            "flag",
            False,
            "`1`: GPU arrays outside procspawn's shareable memory (CuPy's pool) are shared by "
            "CUDA IPC handle (`cuda_ipc`, not yet run on a GPU) instead of being copied "
            "into shareable memory at each send (`sharing.cuda.set_ipc` says the same "
            "from code)",
            "unset",
        ),
        Setting(
            "PROCSPAWN_GPU_LINGER",
            "seconds",
            1.0,
            "seconds a received GPU array's mapping outlives its last array (receiving the "
            "same memory again then costs no new mapping; `0`: off); "
            "`sharing.cuda.collect()` ends it",
            "`1`",
        ),
        Setting(
            "PROCSPAWN_GPU_HOST_COPY",
            "flag",
            False,
            "`1`: a GPU array whose GPU cannot share memory (no virtual memory management: "
            "MIG, WSL2) travels as a host copy instead of raising an error",
        ),
        Setting(
            "PROCSPAWN_POOL_BYTES",
            "bytes",
            None,
            "the most a process keeps as recycled segments (`0`: off; `file_system` "
            "segments also at most a quarter of `/dev/shm`)",
            "a sixteenth of its memory, at most 1 GiB",
        ),
        Setting(
            "PROCSPAWN_POOL_IDLE",
            "seconds",
            5.0,
            "seconds the pool keeps a segment nobody reuses",
            "`5`",
        ),
        Setting(
            "PROCSPAWN_SLAB_THRESHOLD",
            "bytes",
            262144,
            "arrays smaller than this are carved out of slabs (`0`: off)",
        ),
        Setting(
            "PROCSPAWN_SLAB_BYTES",
            "bytes",
            4194304,
            "the largest size of a slab (at least four times the threshold): a process's "
            "first slab fits its first small array, each that fills makes the next twice "
            "as large",
        ),
        Setting(
            "PROCSPAWN_SLAB_LINGER",
            "seconds",
            1.0,
            "seconds the slab being filled is held after the last small array was made",
            "`1`",
        ),
        Setting(
            "PROCSPAWN_RAY_READY_TIMEOUT",
            "seconds",
            60.0,
            'with `backend="ray"`: seconds to wait for the cluster to reserve every '
            "rank's CPU and start the actors",
            "`60`",
        ),
        Setting(
            "PROCSPAWN_DAEMON_GRACE",
            "seconds",
            2.0,
            "seconds the cleanup daemon waits for a new client once the last has gone "
            "(`PROCSPAWN_MANAGER_GRACE`, its old name, still works, with a warning)",
            old_names=("PROCSPAWN_MANAGER_GRACE",),
        ),
        Setting(
            "PROCSPAWN_DEBUG",
            "flag",
            False,
            "`1`: log allocations, frees and daemon events to stderr (`procspawn` logger)",
        ),
    ]
}

_values: dict[str, Any] = {}
_lock = threading.Lock()

renew_lock_in_child(globals())


def get(name: str) -> Any:
    """The value of setting ``name``: read and checked the first time, then kept.

    Raises:
        SettingError: the variable is set to something its type does not accept.
    """
    try:
        return _values[name]
    except KeyError:
        pass
    setting = SETTINGS[name]
    text = os.environ.get(name, "")
    for old in setting.old_names:
        if text == "" and os.environ.get(old, ""):
            # a FutureWarning: the one who set the variable is the program's user, and
            # Python shows DeprecationWarnings only to code of __main__
            warnings.warn(
                f"{old} is deprecated: set {name} instead (same meaning and values)",
                FutureWarning,
                stacklevel=3,
            )
            text = os.environ[old]
            setting = Setting(old, setting.kind, setting.default, setting.meaning)
    value = setting.default if text == "" else setting.parse(text)
    with _lock:
        return _values.setdefault(name, value)


_all_checked = False


def check_all() -> None:
    """Read every setting now, once per process (until ``reload``): the calls that start
    processes or send a message call it first, so a bad variable fails any of them with
    its own ``SettingError``, whatever the data (not only the call that would read it).

    Raises:
        SettingError: the first variable set to something its type does not accept.
    """
    global _all_checked
    if _all_checked:
        return
    for name in SETTINGS:
        get(name)
    _all_checked = True


def report() -> list[dict[str, Any]]:
    """Every setting as it stands, for ``procspawn info``: its name, the variable's text
    (None when unset), the value in effect, and the error of a bad one (which leaves the
    default in effect until the call that reads it fails). Reads without keeping."""
    rows = []
    for setting in SETTINGS.values():
        text = os.environ.get(setting.name, "")
        for old in setting.old_names:
            text = text or os.environ.get(old, "")
        row: dict[str, Any] = {"name": setting.name, "text": text or None, "error": None}
        try:
            row["value"] = setting.default if text == "" else setting.parse(text)
        except SettingError as exc:
            row["value"], row["error"] = setting.default, str(exc)
        rows.append(row)
    return rows


def reload(*names: str) -> None:
    """Read ``names`` (default: all) again at next use: for a program (or test) that
    changes its own environment after procspawn read it."""
    global _all_checked
    with _lock:
        _all_checked = False
        for name in names or list(_values):
            _values.pop(name, None)


def markdown_table() -> str:
    """The table of environment variables, as the documentation's settings page shows it."""
    rows = ["| variable | meaning | default |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {s.meaning} | {s.default_text()} |" for s in SETTINGS.values()]
    return "\n".join(rows)
