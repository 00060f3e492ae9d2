"""Keeping a worker from outliving its parent (POSIX; Linux gets the fast path).

Two layers, because either alone has a hole:

* ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux): the kernel kills the worker the moment its
  parent dies, even while the worker holds the GIL in a long C call. It only helps when
  the parent is the process that forked us (spawn and fork start methods; under
  forkserver the parent is the fork server).
* A watchdog thread waiting on the parent's pidfd (Linux >= 5.3), or polling the parent's
  pid elsewhere: works under every start method.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator

from ..._late import late_import

TYPE_CHECKING = False  # as typing's, without importing typing (~3 ms of a worker's start)
if TYPE_CHECKING:
    from typing import Any

_PR_SET_PDEATHSIG = 1
_POLL_INTERVAL = 0.5


def _die() -> None:
    # SIGKILL ourselves rather than exit: no atexit handler or finalizer of a process whose
    # parent is gone can be trusted to finish; our own children watch us the same way.
    os.kill(os.getpid(), signal.SIGKILL)


def _find_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _prctl_from_ctypes_core()
    except Exception:  # noqa: BLE001 -- a ctypes core unlike CPython's: ctypes itself
        pass
    try:  # ~3 ms, which a child using the watchdog never pays
        ctypes = late_import("ctypes")  # (from any thread: see _late)
    except ImportError:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _prctl_from_ctypes_core() -> Any:
    """libc's prctl as ``ctypes.CDLL(None, use_errno=True).prctl`` is, made with ctypes'
    C core alone: ``import ctypes`` takes ~3 ms (its module defines every C type and
    loads every helper), on a fork worker's or a spawn rank's way to its first task."""
    core = late_import("_ctypes")

    class _Int(core._SimpleCData):  # type: ignore[misc,name-defined]  # ctypes.c_int
        _type_ = "i"

    class _Function(core.CFuncPtr):  # type: ignore[misc,name-defined]  # a CDLL's functions
        _flags_ = core.FUNCFLAG_CDECL | core.FUNCFLAG_USE_ERRNO
        _restype_ = _Int

    class _Libc:  # what CFuncPtr reads of a CDLL: its handle
        _handle = core.dlopen(None, os.RTLD_NOW)

    return _Function(("prctl", _Libc()))


_prctl: Any = False  # looked up at the first call (False: not yet)


def load_prctl() -> None:
    """Look prctl up now, in a parent about to fork children that will ask for the death
    signal: they inherit it, instead of each loading ctypes on its way to its first task."""
    global _prctl
    if _prctl is False:
        _prctl = _find_prctl()


def set_parent_death_signal() -> bool:
    """Ask the kernel to SIGKILL us when our parent dies (Linux only)."""
    load_prctl()
    if _prctl is None:
        return False
    result: int = _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return result == 0


def guard_parent(parent_pid: int, use_death_signal: bool) -> None:
    """Make sure this process does not outlive ``parent_pid``: by the death signal alone
    when ``use_death_signal`` (the caller knows the parent is the thread that forked us
    and lives as long as its process) and the kernel took it, else by a watchdog thread."""
    if use_death_signal and set_parent_death_signal():
        if os.getppid() != parent_pid:  # it died before the signal was asked for
            _die()
        return
    watch_parent(parent_pid)


def watch_parent(parent_pid: int) -> None:
    """Kill this process within about a second of ``parent_pid`` exiting."""
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(parent_pid)
        except ProcessLookupError:
            _die()
        except OSError:
            pidfd = None
    if not _alive(parent_pid):  # it may have died before the pidfd was opened
        _die()

    def _watch() -> None:
        if pidfd is not None:
            poller = select.poll()  # not select.select: it fails on descriptors >= 1024
            poller.register(pidfd, select.POLLIN)
            while not poller.poll():  # a pidfd turns readable when the process exits
                pass
            _die()
        while _alive(parent_pid):
            threading.Event().wait(_POLL_INTERVAL)
        _die()

    threading.Thread(target=_watch, name="procspawn-parent-watch", daemon=True).start()


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, and SIGTERM every process below it: what its task started (a
    nested loky executor's workers, which would otherwise outlive it), each free to
    clean up (a resource tracker ignores SIGTERM and exits once its clients are gone,
    removing what they left in /dev/shm). Each process is stopped (SIGSTOP) as it is
    found, so that none starts another while the tree is read; the tree is read from
    ``/proc`` (Linux), elsewhere ``pid`` alone is killed. Whatever happens on the way
    (one not ours to signal), ``pid`` is killed and every process stopped is let go."""
    found = [pid]
    try:
        _signal(pid, signal.SIGSTOP)
        i = 0
        while i < len(found):
            for child in _children(found[i]):
                if child not in found and _signal(child, signal.SIGSTOP):
                    found.append(child)
            i += 1
    finally:
        _signal(pid, signal.SIGKILL)
        for member in found[1:]:
            _signal(member, signal.SIGTERM)
            _signal(member, signal.SIGCONT)


def _signal(pid: int, signum: int) -> bool:
    """``os.kill``; False when the process is gone or not ours to signal."""
    try:
        os.kill(pid, signum)
    except OSError:
        return False
    return True


def _children(pid: int) -> list[int]:
    """The children of ``pid``, from every thread's ``/proc/<pid>/task/<tid>/children``."""
    children: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.extend(int(word) for word in f.read().split())
        except (OSError, ValueError):
            continue
    return children


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while it starts a child (the stdlib does the same
    for its resource tracker, bpo-33613).

    The child inherits the mask (fork keeps it, and so does exec), so a Ctrl-C that lands
    while it boots (an interpreter importing ``site``, the main module imported again, the
    fork server importing its preload list) waits, pending, instead of printing a
    traceback from a process half-started. The child unblocks SIGINT once it has its own
    handler (``unblock_sigint``); a server forked from keeps it blocked for good (it
    ignores SIGINT anyway), and its children unblock it as any other.
    """
    # A Ctrl-C whose handler runs right after a mask call returns raises there: the
    # mask is read first (nothing changed yet if that raises), and blocked inside the
    # try, so a raise after the block still finds the finally that unblocks
    was_blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT,))
        yield
    finally:
        if not was_blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT,))


def unblock_sigint() -> None:
    """In a child started under ``sigint_blocked``, once its SIGINT handler is set: a
    Ctrl-C held back while it booted reaches that handler now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT,))
