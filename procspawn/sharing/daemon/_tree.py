"""Which process tree this process belongs to (its cleanup daemon's address).

Kept apart from the daemon's client (``_client``) so that a rank that never shares a
``file_system`` segment joins its tree without importing the client or the daemon.
"""

from __future__ import annotations

import os
import threading

_lock = threading.Lock()
_address: str | None = None
joined = False  # set by _client once this process talks to the daemon or holds a name


def tree_address() -> str:
    """The address of this process tree's cleanup daemon: handed over by the process that
    started this one, or chosen here for this process and the ones it starts (no daemon
    starts until one is needed)."""
    global _address
    with _lock:
        if _address is None:
            _address = f"procspawn-{os.getuid()}-{os.urandom(8).hex()}"
        return _address


def adopt_tree(address: str | None) -> None:
    """Join the tree of the process that started this one (before any segment is mapped);
    a process that joined a tree already keeps its daemon."""
    global _address
    with _lock:
        if address and not joined:
            _address = address


def _after_fork_in_child() -> None:
    global _lock, joined
    _lock = threading.Lock()
    joined = False  # the parent's connection and names are not the child's


os.register_at_fork(after_in_child=_after_fork_in_child)
