"""One message in the making or being read, per thread.

A message is pickle bytes plus the file descriptors of the shared segments inside it.
While ``dumps`` pickles, reducers find the message with :func:`sending` and attach
descriptors to it; while ``loads`` unpickles, rebuild functions find the received ones
with :func:`received`. Descriptors either stay owned by an object the message keeps alive
until it is sent (a segment's own memfd) or belong to the message itself (a file_system
segment opened for this one message), which closes them with ``close()``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

_local = threading.local()


class Message:
    """One pickled object ready to send: bytes, descriptors, and what must stay alive.

    Call ``close()`` once it was sent (or will never be): it lets go of the objects that
    lent their descriptors and closes the descriptors the message owns.
    """

    __slots__ = ("data", "fds", "keepalive", "owned", "on_abandon")

    def __init__(
        self,
        data: bytes,
        fds: list[int] | None = None,
        keepalive: list[Any] | None = None,
        owned: list[int] | None = None,
        on_abandon: list[Callable[[], Any]] | None = None,
    ) -> None:
        self.data = data
        self.fds = fds or []
        self.keepalive = keepalive or []
        self.owned = owned or []
        self.on_abandon = on_abandon or []

    def close(self) -> None:
        """Let go of what the message held for its receiver (once sent or handed over)."""
        owned, self.owned = self.owned, []
        self.fds = []
        self.keepalive = []
        self.on_abandon = []
        for fd in owned:
            os.close(fd)

    def abandon(self) -> None:
        """The message will never be received: give back what it holds for a receiver
        (the slots of segments it carries by name), then close it."""
        callbacks, self.on_abandon = self.on_abandon, []
        for callback in callbacks:
            callback()
        self.close()

    def __del__(self) -> None:
        if self.owned:
            self.close()


class SendState:
    """What reducers add to the message being pickled on this thread."""

    __slots__ = (
        "fds",
        "fd_index",
        "keepalive",
        "owned",
        "memo",
        "on_abandon",
        "durable",
        "swap_array",
    )

    def __init__(self) -> None:
        # the message may outlive its sender (a rank's result): what a sender's death
        # would take away (device memory it allocated) must be copied (see set_durable)
        self.durable: bool = getattr(_local, "durable", False)
        self.fds: list[int] = []
        self.fd_index: dict[int, int] = {}
        self.keepalive: list[Any] = []
        self.owned: list[int] = []
        self.memo: dict[Any, Any] = {}  # what reducers made once per message
        self.on_abandon: list[Callable[[], Any]] = []  # undo what reducers took
        # what goes in place of each array pickled now (see wire/_swap); None: the array
        self.swap_array: Callable[[Any], Any] | None = None

    def add_fd(self, fd: int, owner: Any) -> int:
        """Send ``fd`` (once per message); ``owner`` keeps it open until the message is
        closed. Returns its index for the receiver."""
        index = self.fd_index.get(fd)
        if index is None:
            index = len(self.fds)
            self.fds.append(fd)
            self.fd_index[fd] = index
            self.keepalive.append(owner)
        return index

    def give_fd(self, fd: int) -> int:
        """Send ``fd``, which the message now owns and closes; returns its index."""
        index = len(self.fds)
        self.fds.append(fd)
        self.fd_index[fd] = index
        self.owned.append(fd)
        return index

    def message(self, data: bytes) -> Message:
        return Message(data, self.fds, self.keepalive, self.owned, self.on_abandon)

    def discard(self) -> None:
        """Pickling failed: undo what reducers took, close what the message would own."""
        Message(b"", [], [], self.owned, self.on_abandon).abandon()
        self.owned, self.on_abandon = [], []


class RecvState:
    """The received descriptors of the message being unpickled on this thread."""

    __slots__ = ("fds", "memo", "taken")

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.memo: dict[Any, Any] = {}  # what rebuild functions made once per message
        # the segments whose rebuild started: what the message held for this receiver is
        # this process' from then on, even if the rebuild failed
        self.taken: set[Any] = set()

    def close_rest(self) -> None:
        """Close every descriptor no rebuild function took."""
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []


def set_durable(durable: bool) -> bool:
    """Say whether the messages this thread pickles from now on may be read after their
    sender exited (results of ranks and pool workers); returns the previous value."""
    previous: bool = getattr(_local, "durable", False)
    _local.durable = durable
    return previous


def begin_send(state: SendState | None) -> SendState | None:
    """Make ``state`` the message reducers on this thread add to; returns the previous one,
    for ``begin_send(previous)`` afterwards (plain calls: this is on every message)."""
    previous: SendState | None = getattr(_local, "send", None)
    _local.send = state
    return previous


def begin_receive(state: RecvState | None) -> RecvState | None:
    """Make ``state`` the message rebuild functions on this thread read from; returns the
    previous one, for ``begin_receive(previous)`` afterwards."""
    previous: RecvState | None = getattr(_local, "recv", None)
    _local.recv = state
    return previous


def sending() -> SendState:
    """The message being pickled on this thread (only valid inside a reducer)."""
    state: SendState | None = getattr(_local, "send", None)
    if state is None:
        raise RuntimeError("procspawn reducer called outside procspawn.sharing dumps()")
    return state


def sending_or_none() -> SendState | None:
    """The message being pickled on this thread, or None outside procspawn's dumps."""
    return getattr(_local, "send", None)


def received() -> RecvState:
    """The message being unpickled on this thread (only valid inside a rebuild function)."""
    state: RecvState | None = getattr(_local, "recv", None)
    if state is None:
        raise RuntimeError(
            "a procspawn shared-memory handle can only be unpickled by procspawn's "
            "loads() (it was pickled by procspawn and read back by another unpickler)"
        )
    return state


def attach_fd(fd: int, owner: object) -> int:
    """For a strategy's ``reduce``: send ``fd`` with the message being pickled.

    A descriptor attached twice to one message is sent once.

    Args:
        fd: the descriptor to send; it stays the caller's (not closed).
        owner: what keeps ``fd`` open until the message is sent (the segment); the
            message holds it until then.

    Returns:
        The index ``received_fd`` takes in the receiver.

    Raises:
        RuntimeError: called outside procspawn's pickling (only a strategy's ``reduce``
            may call it).
    """
    return sending().add_fd(fd, owner)


def received_fd(index: int) -> int:
    """For a strategy's ``rebuild``: a descriptor that came with the message.

    Args:
        index: what ``attach_fd`` returned in the sender.

    Returns:
        The descriptor, borrowed: it is closed after unpickling, so ``os.dup`` it to keep
        it.

    Raises:
        RuntimeError: called outside procspawn's unpickling (only a strategy's
            ``rebuild`` may call it).
        IndexError: the message has no descriptor ``index``.
    """
    return received().fds[index]


def take_fd(index: int) -> int:
    """Descriptor ``index`` of the message being unpickled, now owned by the caller."""
    fds = received().fds
    fd = fds[index]
    if fd < 0:
        raise RuntimeError(f"descriptor {index} of this message was already taken")
    fds[index] = -1
    return fd
