"""Every public error is exported from procspawn and pickles as itself."""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import pytest

import procspawn as mp

_INTERNAL = {"UsageError"}  # the command line's own, printed and never raised to a caller
_OPTIONAL = {"cupy"}  # packages some modules need, which the tests do not install


def _instances() -> dict[str, BaseException]:
    return {
        "ChannelClosed": mp.ChannelClosed("channel closed by the other end"),
        "CudaError": mp.CudaError("cuMemCreate failed (CUDA_ERROR_OUT_OF_MEMORY)", 2),
        "FdLimitError": mp.FdLimitError("receiving a shared array"),
        "InitializerError": mp.InitializerError("initializer raised ValueError"),
        "ProcessException": mp.ProcessException("rank 1 failed", 1, 4242),
        "ProcessExitedException": mp.ProcessExitedException("killed", 1, 4242, -9, "SIGKILL"),
        "ProcessRaisedException": mp.ProcessRaisedException("Traceback ...", 0, 4242),
        "ProcessTimeoutError": mp.ProcessTimeoutError("ran out", 0, 4242, [0, 1], 2.5),
        "RayMissingError": mp.RayMissingError("pip install 'procspawn[ray]'"),
        "RayResourcesError": mp.RayResourcesError("2 CPUs for 4 ranks"),
        "SettingError": mp.SettingError("PROCSPAWN_DEBUG='maybe' is not valid: use 1 or 0"),
        "SharedMemoryFullError": mp.SharedMemoryFullError(28, "not enough shared memory"),
        "TaskTimeoutError": mp.TaskTimeoutError("f(1) ran past 2 s", 2.0, 4242),
        "TerminatedWorkerError": mp.TerminatedWorkerError("worker died", -1, 4242, -9, "SIGKILL"),
    }


def _defined_errors() -> set[str]:
    """Every public exception class defined anywhere in the package."""
    found = set()
    for info in pkgutil.walk_packages(mp.__path__, "procspawn."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if exc.name in _OPTIONAL:
                continue  # a plug-in of an optional package (procspawn.sharing.cuda: CuPy)
            raise
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found.add(name)
    return found - _INTERNAL


def test_every_public_error_is_exported_from_procspawn():
    exported = {
        name
        for name in mp.__all__
        if isinstance(getattr(mp, name), type)
        and issubclass(getattr(mp, name), BaseException)
        and getattr(mp, name).__module__.startswith("procspawn")
    }
    assert exported == _defined_errors() == set(_instances())


@pytest.mark.parametrize("name", sorted(_instances()))
def test_each_error_pickles_as_itself(name):
    error = _instances()[name]
    if isinstance(error, mp.ProcessException):
        error.results = [None, 3]
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    for attr in ("pid", "exit_code", "signal_name", "error_index", "ranks", "elapsed", "results"):
        assert getattr(back, attr, None) == getattr(error, attr, None)
    if isinstance(error, OSError):
        assert back.errno == error.errno


def _raise_shared_memory_full(rank):
    raise mp.SharedMemoryFullError(28, "not enough shared memory: asked for 1 GiB")


def test_a_rank_s_shared_memory_error_reaches_the_parent_as_itself():
    with pytest.raises(mp.ProcessRaisedException) as caught:
        mp.spawn(_raise_shared_memory_full, nprocs=1)
    assert type(caught.value.__cause__) is mp.SharedMemoryFullError
    assert caught.value.__cause__.errno == 28
