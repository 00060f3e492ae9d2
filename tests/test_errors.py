"""Every public error is exported from procspawn and pickles as itself."""

from __future__ import annotations

import importlib
import pickle
import pkgutil
import sys

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
                and value.__module__ in (module.__name__, "procspawn")  # (public name)
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


def _raise_value_error(rank):
    raise ValueError(f"bad value in rank {rank}")


def test_a_rank_s_error_reads_from_the_user_s_code_under_its_public_name():
    import os
    import traceback

    package = os.path.dirname(os.path.abspath(mp.__file__)) + os.sep
    with pytest.raises(mp.ProcessRaisedException) as caught:
        mp.spawn(_raise_value_error, nprocs=1, timeout=60)
    exc = caught.value
    assert type(exc).__module__ == "procspawn"
    shown = "".join(traceback.format_exception(exc))
    assert "procspawn.ProcessRaisedException: process 0" in shown
    assert "procspawn.context." not in shown
    # of procspawn's frames, only the one that raised it in the caller's call
    ours = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(package)]
    assert len(ours) == 1, ours
    # the rank's traceback starts at the user's function, not at procspawn's rank loop
    remote = str(exc).split("terminated with the following error:\n", 1)[1]
    assert "in _raise_value_error" in remote and package not in remote
    assert isinstance(exc.__cause__, ValueError)


class _NeedsTwo(Exception):
    def __init__(self, a, b):  # args holds one: pickles, but does not load back
        super().__init__(f"{a}-{b}")


class _ExitsAsItLoads:
    def __reduce__(self):
        return (sys.exit, (3,))


def test_a_childs_exception_that_does_not_load_back_travels_as_its_text_alone():
    from procspawn.context import _raised

    try:
        raise _NeedsTwo(1, 2)
    except _NeedsTwo as exc:
        text = _raised.traceback_text(exc, "in the child: ")
        blob = _raised.pack(exc)
    assert blob is None  # it would not load in the parent either
    assert text.startswith("in the child: Traceback") and "_NeedsTwo: 1-2" in text
    assert _raised.unpack(None) is None


def test_unpacking_a_blob_that_exits_as_it_loads_gives_nothing_and_raises_nothing():
    from procspawn.context import _raised

    assert _raised.unpack(pickle.dumps(_ExitsAsItLoads())) is None
    error = ValueError("plain")
    assert repr(_raised.unpack(_raised.pack(error))) == repr(error)
