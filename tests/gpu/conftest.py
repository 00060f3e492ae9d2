"""GPU tests: skipped, with the reason, where CuPy or a CUDA device is missing.

Run on a GPU machine with::

    timeout 280 python3 -m pytest tests/gpu -x -q --timeout=60

Figures (seconds, bytes) go to the JSON file ``$PROCSPAWN_GPU_REPORT`` names (nowhere
when it is unset), with the device's name, also when a test fails.

These tests start CUDA in the test process (it is the producer), so a later test of the
same run that forks with ``start_method="fork"`` gets procspawn's refusal: run
``tests/gpu`` on its own.

The leak check here is the suite's, seen from outside as a user would look, but for the
CUDA driver's own descriptors (``/dev/nvidia*``, and ``/dev/shm/cuda.shm.*``, which the
driver opens once per process for interprocess events), and with device memory added:
after each test, once CuPy's pool has given its cached blocks back, ``cudaMemGetInfo``
must show what it showed before (within a deadline; this process stays alive).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time

import _leaks
import pytest

_GPU_REASON = ""
try:
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 1:
        _GPU_REASON = "no CUDA device is visible"
except Exception as exc:  # noqa: BLE001 -- CuPy missing, no driver, no device
    _GPU_REASON = f"no GPU here ({type(exc).__name__}: {exc})"

from _gpu_report import FIGURES  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _GPU_REASON:
        skip = pytest.mark.skip(reason=f"GPU tests: {_GPU_REASON}")
        for item in items:
            if "/gpu/" in str(item.fspath):
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("PROCSPAWN_GPU_REPORT")
    if path and FIGURES:
        with open(path, "w") as f:
            json.dump(FIGURES, f, indent=1, sort_keys=True, default=str)


@pytest.fixture(scope="session", autouse=True)
def _cuda_started():
    """CUDA started in this process before any baseline is taken (its descriptors and
    CuPy's kernels are the process', not a test's)."""
    if _GPU_REASON:
        yield
        return
    from procspawn.sharing import cuda

    props = cupy.cuda.runtime.getDeviceProperties(0)
    FIGURES["device"] = (
        props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    )
    warm = cuda.zeros(1024)
    warm += 1
    cupy.cuda.get_current_stream().synchronize()
    del warm
    from procspawn.sharing.cuda import _events

    _events.record(0)  # the driver's interprocess-event file, opened once per process
    yield


def _device_free() -> int:
    cupy.get_default_memory_pool().free_all_blocks()  # CuPy's cache, not procspawn's
    return cupy.cuda.runtime.memGetInfo()[0]


_DRIVER_FILES = ("/dev/nvidia", "/dev/shm/cuda.shm.")


def _fds_not_driver() -> set[int]:
    out = set()
    for fd in _leaks.fds():
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(_DRIVER_FILES):
                continue
        except OSError:
            pass
        out.add(fd)
    return out


@pytest.fixture(autouse=True)
def leak_check():
    """The suite's leak check, with the driver's descriptors left out and device memory
    added (see the module's text)."""
    if _GPU_REASON:
        yield
        return
    children, segments, fds = _leaks.children(), _leaks.segments(), _fds_not_driver()
    free = _device_free()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        new_children = _leaks.children() - children
        new_segments = _leaks.segments() - segments
        new_fds = _fds_not_driver() - fds
        lost = free - _device_free()
        # (64 MiB: what the driver may keep for a context's own use between tests)
        if not (new_children or new_segments or new_fds) and lost <= 64 << 20:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in new_children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    problems = []
    if new_children:
        problems.append(f"child processes left alive: {sorted(new_children)}")
    if new_segments:
        problems.append(f"/dev/shm segments left: {sorted(new_segments)}")
    if new_fds:
        problems.append(
            "file descriptors left open: "
            + str([f"{fd}->{_readlink(fd)}" for fd in sorted(new_fds)])
        )
    if lost > 64 << 20:
        problems.append(f"device memory not given back: {lost >> 20} MiB")
    assert not problems, "; ".join(problems)


def _readlink(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"
