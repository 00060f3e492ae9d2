"""Fixtures: start methods, sharing strategies, and the leak check every test gets.

After each test, looked at from outside as a user would, with nothing of procspawn called
first and procspawn's environment left as it is: no process of ours alive that was not
there before (this process is made a child subreaper, so orphaned grandchildren are
reparented here and counted too), no new ``/dev/shm/procspawn_*`` file, no new shared
mapping in ``/proc/self/maps`` and no new open descriptor in ``/proc/self/fd``. OS state
takes a moment to settle after a kill, so each check waits a few seconds before it fails.

The one exception is memory kept on purpose: the recycled segments (the producer-side
segment cache), which a user sees as mappings with no access (``---s``) of memfds or
``/dev/shm`` names, and the memfds' descriptors. They are not counted as leaks, but their
total must stay within the cache's bound.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import time

import _leaks
import pytest

import procspawn
from procspawn import _settings
from procspawn.sharing.segments import _recycled

_PR_SET_CHILD_SUBREAPER = 36
_PATIENCE = 10.0

# A cleanup daemon waits this long for a new client once its last has gone: every test
# that starts a tree of its own (a script, a stdlib Process) would otherwise wait out the
# default 2 s in its leak check. The daemons still do everything they do by default.
os.environ.setdefault("PROCSPAWN_DAEMON_GRACE", "0.2")
# Likewise the slab being filled is held this long after the last small array was made
# (default 1 s), which every leak check would wait out.
os.environ.setdefault("PROCSPAWN_SLAB_LINGER", "0.03")
# Recycled segments nobody reused for 5 s are given back by default: tests that look at
# what is kept must not race that on a loaded machine (test_recycled checks the default in
# a script).
os.environ.setdefault("PROCSPAWN_POOL_IDLE", "60")


def _compile_sources() -> None:
    """Write the bytecode of procspawn and of the test helpers the ranks import, as a
    normal Python install does: where ``PYTHONDONTWRITEBYTECODE`` is set, every rank would
    otherwise compile procspawn from source again (about a tenth of a spawn's start)."""
    import compileall

    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.dirname(procspawn.__file__), here):
        compileall.compile_dir(folder, quiet=2, workers=1)


@pytest.fixture(scope="session", autouse=True)
def _session_setup():
    _compile_sources()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # Long-lived helpers of multiprocessing, started once so they are part of the baseline.
    from multiprocessing import forkserver, resource_tracker

    forkserver.ensure_running()
    resource_tracker.ensure_running()
    from procspawn.context.launch import _forkserver

    _forkserver.ensure_running()  # procspawn's own fork server, alive until we exit
    procspawn.get_sharing_strategy()
    from procspawn.sharing.daemon import _client

    _client.ensure()  # this session's cleanup daemon (file_system), alive until we exit
    yield


@pytest.fixture(autouse=True)
def settings_read_again():
    """A test that changed the environment does not leave its settings to the next."""
    yield
    _settings.reload()


@pytest.fixture(autouse=True)
def leak_check(request):
    """Fail a test that leaves a process, a shared segment or a descriptor behind (a test
    marked ``ray_tasks``: but for sockets, Ray's driver's connections to the Ray workers
    its tasks leased, which Ray keeps for their next tasks; that test checks the cluster
    instead)."""
    ray_tasks = request.node.get_closest_marker("ray_tasks") is not None
    children, segments, fds, maps = (
        _leaks.children(),
        _leaks.segments(),
        _leaks.fds(),
        _leaks.shared_mappings(),
    )
    yield
    deadline = time.monotonic() + _PATIENCE
    passes = 0
    collected_at = 0.0
    pause = 0.002
    while True:
        # a clean test (most) is not made to pay for a full collection; later passes
        # collect at most every 0.1 s (the wait is mostly for other processes)
        if passes and time.monotonic() - collected_at > 0.1:
            gc.collect()
            collected_at = time.monotonic()
        passes += 1
        new_children = _leaks.children() - children
        new_segments = _leaks.segments() - segments - set(_leaks.recycled_kept())
        new_fds = _leaks.fds() - fds
        if ray_tasks:
            new_fds = {fd for fd in new_fds if not _leaks.is_socket(fd)}
        new_maps = _leaks.shared_mappings() - maps
        if not (new_children or new_segments or new_fds or new_maps):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(pause)
        pause = min(0.02, pause * 2)  # most settle within a few milliseconds
    for pid in new_children:  # do not let one leak cascade into the next tests
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for name in new_segments:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass
    problems = []
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ()):
        # children started from here would never see a Ctrl-C either
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT,))
        problems.append("SIGINT was left blocked in the test's thread")
    kept = _leaks.recycled_kept()
    if sum(kept.values()) > _recycled.limit() or len(kept) > _recycled.MAX_SEGMENTS:
        problems.append(f"the recycled segments kept exceed their bound: {kept}")
    if new_maps:
        problems.append(f"shared mappings left: {sorted(new_maps)}")
    if new_children:
        problems.append(f"child processes left alive: {sorted(new_children)}")
    if new_segments:
        problems.append(f"/dev/shm segments left: {sorted(new_segments)}")
    if new_fds:
        targets = []
        for fd in sorted(new_fds):
            try:
                targets.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                targets.append(str(fd))
        problems.append(f"file descriptors left open: {targets}")
    assert not problems, "; ".join(problems)


# the parameters that name the start method a test's processes use
_START_METHOD_PARAMS = ("start_method", "method")


@pytest.hookimpl(tryfirst=True)  # (before the -m option deselects by marker)
def pytest_collection_modifyitems(session, config, items):
    """The Ray tests run last. Ray's driver keeps native threads in this process after
    ``ray.shutdown()``, which open and close descriptors now and then: in a later test a
    descriptor number freed meanwhile (say by ``sharing.trim()``) would be taken by one
    of them and reported as that test's leak.

    The spawn cells of the tests repeated under every start method are marked ``slow``
    (out of README's run, in ``.ci/run``'s second one): a spawn child starts as a
    forkserver child does, a fresh interpreter that imports the main module (the server
    forks it), and forkserver, procspawn's default, runs in the default run (~25 s)."""
    items.sort(key=lambda item: item.module.__name__ == "test_ray")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        names = _START_METHOD_PARAMS + (
            ("pool",) if item.module.__name__ == "test_pool_deaths" else ()
        )
        if any(params.get(name) == "spawn" for name in names):
            item.add_marker(pytest.mark.slow)
    # test_sharing's start method x strategy cells: under spawn (a fresh interpreter, the
    # parent's settings carried over) only file_system's, which needs the settings and the
    # cleanup daemon carried over; file_descriptor is the default, and its spawn path is
    # the one every other spawn test takes. (~4 s of the suite.)
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        redundant = (
            item.module.__name__ == "test_sharing"
            and params.get("start_method") == "spawn"
            and params.get("strategy") == "file_descriptor"
        )
        (dropped if redundant else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


START_METHODS = multiprocessing.get_all_start_methods()


@pytest.fixture(params=START_METHODS)
def start_method(request) -> str:
    return request.param


@pytest.fixture(params=sorted(procspawn.get_all_sharing_strategies()))
def strategy(request):
    previous = procspawn.get_sharing_strategy()
    procspawn.set_sharing_strategy(request.param)
    yield request.param
    procspawn.set_sharing_strategy(previous)
