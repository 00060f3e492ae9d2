"""What of GPU support needs no GPU: the import rule, the start-method guard's wiring, the
strategy's registration and the settings. The GPU itself is tested in tests/gpu."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest
from _helpers import script_env, square

import procspawn
from procspawn import sharing
from procspawn.context.launch import _cuda_guard
from procspawn.sharing.segments import _strategy

_GPU_LIBRARIES = ("cupy", "torch", "cuda", "numba", "jax")


def test_importing_procspawn_and_sharing_numpy_arrays_imports_no_gpu_library():
    code = (
        "import sys\n"
        "import numpy as np\n"
        "import procspawn\n"
        "from procspawn import sharing\n"
        "import procspawn.sharing.cuda\n"
        "procspawn.sharing.cuda.__all__\n"
        "message = sharing.dumps([np.ones(100_000), sharing.zeros(10)])\n"
        "import os\n"
        "sharing.loads(message.data, [os.dup(fd) for fd in message.fds])\n"
        "message.close()\n"
        "sharing.is_shared(np.ones(3))\n"
        f"gpu = {_GPU_LIBRARIES!r}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in gpu\n"
        "                or m.startswith('procspawn.sharing.cuda.'))\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=script_env(),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_device_strategy_is_procspawn_s_own_and_never_a_host_choice():
    assert _strategy.built_in("cuda_fd")
    assert "cuda_fd" not in procspawn.get_all_sharing_strategies()
    with pytest.raises(ValueError, match="unknown sharing strategy"):
        procspawn.set_sharing_strategy("cuda_fd")
    with pytest.raises(ValueError, match="built-in"):
        sharing.register_strategy("cuda_fd", sharing.SharingStrategy())


def test_without_cuda_running_nothing_is_refused():
    assert not _cuda_guard.cuda_started()
    _cuda_guard.refuse_fork("spawn")
    _cuda_guard.check_forked_child()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_fork_with_cuda_running_is_refused_in_the_caller_before_any_child_starts(monkeypatch):
    # CUDA's start is read from /proc/self/fd (tests/gpu checks that reading on a GPU);
    # here it is said to have happened, to check every way to fork asks first
    monkeypatch.setattr(_cuda_guard, "cuda_started", lambda: True)
    with pytest.raises(RuntimeError, match="spawn cannot use start_method='fork'.*forkserver"):
        procspawn.spawn(square, nprocs=2, start_method="fork", timeout=30)
    with pytest.raises(RuntimeError, match="a pool cannot use start_method='fork'"):
        procspawn.Pool(2, context="fork")
    with pytest.raises(RuntimeError, match="a pool cannot use start_method='fork'"):
        procspawn.ProcessPoolExecutor(2, mp_context=procspawn.get_context("fork"))
    process = procspawn.get_context("fork").Process(target=print)
    with pytest.raises(RuntimeError, match=r"Process.start\(\) cannot use"):
        process.start()
    assert process.pid is None
    # the other start methods go on as ever
    assert procspawn.spawn(square, nprocs=2, timeout=60) == [0, 1]


def test_the_gpu_settings_are_read_and_checked(monkeypatch):
    from procspawn import _settings

    monkeypatch.setenv("PROCSPAWN_GPU_INLINE_BYTES", "1M")
    monkeypatch.setenv("PROCSPAWN_GPU_LINGER", "0.5")
    _settings.reload()
    assert _settings.get("PROCSPAWN_GPU_INLINE_BYTES") == 1 << 20
    assert _settings.get("PROCSPAWN_GPU_LINGER") == 0.5
    monkeypatch.setenv("PROCSPAWN_GPU_HOST_COPY", "maybe")
    with pytest.raises(_settings.SettingError, match="PROCSPAWN_GPU_HOST_COPY"):
        _settings.get("PROCSPAWN_GPU_HOST_COPY")
