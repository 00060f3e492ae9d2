"""CPython's own Pool and ProcessPoolExecutor tests, run against procspawn's.

Nothing of the standard library is patched; only attributes of the *test* modules are
(with monkeypatch, for the duration of a test), and their TestCases are subclassed.

``multiprocessing.pool.Pool`` -> ``procspawn.Pool``: from ``test._test_multiprocessing``,
``_TestPool``, ``_TestPoolWorkerErrors`` and ``_TestPoolWorkerLifetime``, each combined
with its ``ProcessesMixin`` as its ``install_tests_in_module_dict`` does, for the start
methods fork, forkserver and spawn:

- ``Pool`` is ``procspawn.Pool(..., context=<start method>)``;
- the two classes that call ``multiprocessing.Pool(...)`` see, as the module global
  ``multiprocessing``, a module whose ``Pool`` is that and whose every other attribute is
  the real ``multiprocessing``'s;
- ``test.support.script_helper.assert_python_ok`` runs its script with
  ``from multiprocessing import Pool`` made procspawn's Pool of the same start method
  (``test_worker_finalization_via_atexit_handler_of_multiprocessing``);
- as ``setUpModule`` does, the class runs with ``multiprocessing.set_start_method(method,
  force=True)``, the start method before restored afterwards. Its other steps are not
  replicated: the stdlib's forkserver preload (procspawn has its own fork server) and
  ``multiprocessing.util._cleanup_tests()`` (it would stop the session's resource
  tracker and fork server, which conftest.py starts once as part of every leak check's
  baseline); dangling processes and descriptors are the leak check's.

``concurrent.futures.ProcessPoolExecutor`` -> ``procspawn.ProcessPoolExecutor``: from
``test_concurrent_futures`` (see ``_cpython_pool_helpers`` for where its source comes
from: this machine's Python lacks it, Debian's ``libpython3.11-testsuite`` has it), the
process-pool classes ``create_executor_tests`` makes, for fork, forkserver and spawn:
``Initializer``, ``FailingInitializer``, ``ProcessPoolShutdown``, ``Wait``,
``AsCompleted``, ``ProcessPoolExecutor`` and ``ExecutorDeadlock``, with ``executor_type =
procspawn.ProcessPoolExecutor`` (``ExecutorMixin.setUp`` makes it with ``max_workers`` and
``mp_context=self.get_context()``, the stdlib context of the start method). The thread-pool
classes and ``FutureTests`` test no process pool and do not run here. For each test:

- the module global ``futures`` is ``concurrent.futures`` with procspawn's
  ``ProcessPoolExecutor`` (the tests that make their own executor with
  ``futures.ProcessPoolExecutor(...)``), everything else the real one's;
- ``assert_python_ok`` runs its script with ``from concurrent.futures import
  ProcessPoolExecutor`` made procspawn's, and the test module it imports from made this
  one (``test_interpreter_shutdown``, ``test_submit_after_interpreter_shutdown``).

Not applicable, skipped (they read internals of the stdlib's executor that procspawn's,
built on its own dispatcher, does not have):

- ``ProcessPoolShutdown.test_del_shutdown``, ``ProcessPoolShutdown.test_shutdown_no_wait``:
  read ``ProcessPoolExecutor._executor_manager_thread`` and ``._call_queue`` (and join
  them: ``call_queue.join_thread()``);
- ``ExecutorDeadlock.test_shutdown_deadlock_pickle``: reads
  ``ProcessPoolExecutor._executor_manager_thread``.

``test_hang_gh83386`` is skipped by CPython itself for every process pool (its reason
names gh-83386), and ``test_max_workers_too_large`` is Windows-only.

``_TestPoolWorkerErrors.test_unpickleable_result`` gets a result that cannot be pickled
through the module global ``unpickleable_result``: CPython's returns a lambda, which
procspawn's cloudpickle sends back fine, so ``_cpython_pool_helpers.unpicklable_result``
returns a generator instead.

Start methods and time: with ``PROCSPAWN_CPYTHON_TESTS=all`` everything runs under fork,
and under forkserver and spawn all of ``_test_multiprocessing``'s classes and of
``test_concurrent_futures`` all but ``Wait`` and ``AsCompleted`` (futures' semantics and
timeouts, sleeps of 1.5 to 6 s), ``ProcessPoolExecutor.test_map_timeout`` and
``.test_no_stale_references`` (the parent's side), which run under fork only: 209 passed,
31 skipped in about 65 s here. By default, to keep the suite within its time budget,
spawn is left out (procspawn's own crash matrix runs under it), ``test_concurrent_futures``
runs under forkserver (procspawn's default) only, and ``Wait``, ``AsCompleted`` and
``test_map_timeout`` are left out: they test ``concurrent.futures.wait`` / ``as_completed``
and timeouts on the stdlib's own Future objects, which procspawn's executor uses as they
are (procspawn's own tests cover ``map(timeout=)``).

Known failures of procspawn, marked ``xfail(strict=True)`` until procspawn/pool is fixed:
see ``_XFAIL`` below, each with its cause. What such a test leaves behind when it fails
(its pools and executors, its multiprocessing children) is stopped right away, so that an
expected failure neither waits out nor trips the leak check.
"""

from __future__ import annotations

import concurrent.futures
import functools
import gc
import multiprocessing
import os
import traceback
import types
import unittest

import _cpython_pool_helpers as _cf_tests
import pytest

try:
    from test import _test_multiprocessing as _mp_tests
    from test.support import script_helper
except ImportError as _missing:  # an interpreter without its test package (Ubuntu's, say)
    pytest.skip(
        f"CPython's test package is not installed with this interpreter ({_missing}): on "
        f"Debian and Ubuntu, apt install libpython3.X-testsuite",
        allow_module_level=True,
    )

import procspawn
from procspawn.pool import _dispatcher as _pool_dispatcher

# All of it, under every start method, with PROCSPAWN_CPYTHON_TESTS=all (about 65 s here);
# by default what fits the suite's time budget (see the module docstring).
FULL = os.environ.get("PROCSPAWN_CPYTHON_TESTS") == "all"
METHODS = ("fork", "forkserver", "spawn") if FULL else ("fork", "forkserver")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _procspawn_pool(method: str):
    return functools.partial(procspawn.Pool, context=method)


class _MultiprocessingWithProcspawnPool(types.ModuleType):
    """``multiprocessing``, but for ``Pool``: procspawn's, with a given start method."""

    def __init__(self, method: str) -> None:
        super().__init__("multiprocessing")
        self.Pool = _procspawn_pool(method)

    def __getattr__(self, name: str):
        return getattr(multiprocessing, name)


class _FuturesWithProcspawnExecutor(types.ModuleType):
    """``concurrent.futures``, but for ``ProcessPoolExecutor``: procspawn's."""

    ProcessPoolExecutor = procspawn.ProcessPoolExecutor

    def __init__(self) -> None:
        super().__init__("concurrent.futures")

    def __getattr__(self, name: str):
        return getattr(concurrent.futures, name)


def _rewriting(assert_python_ok, replacements: dict[str, str]):
    """``assert_python_ok`` running its ``-c`` script with ``replacements`` made; fails a
    script that names none of them (it would test the standard library instead)."""

    @functools.wraps(assert_python_ok)
    def run(*args, **env_vars):
        args = list(args)
        index = args.index("-c") + 1
        script = args[index]
        if not any(old in script for old in replacements):
            pytest.fail(f"this script would not run procspawn's pool:\n{script}")
        for old, new in replacements.items():
            script = script.replace(old, new)
        args[index] = script
        return assert_python_ok(*args, **env_vars)

    return run


# -- which tests are skipped or expected to fail ------------------------------------------
# (class group, test name, start method or None for all) -> mark

_SKIP = {
    ("ProcessPoolShutdown", "test_del_shutdown", None): pytest.mark.skip(
        reason="reads the stdlib executor's internals ProcessPoolExecutor."
        "_executor_manager_thread and ._call_queue"
    ),
    ("ProcessPoolShutdown", "test_shutdown_no_wait", None): pytest.mark.skip(
        reason="reads the stdlib executor's internals ProcessPoolExecutor."
        "_executor_manager_thread and ._call_queue"
    ),
    ("ExecutorDeadlock", "test_shutdown_deadlock_pickle", None): pytest.mark.skip(
        reason="reads the stdlib executor's internal ProcessPoolExecutor._executor_manager_thread"
    ),
    # procspawn's choices, where the stdlib's executor behaves otherwise on purpose:
    ("ProcessPoolExecutor", "test_max_tasks_per_child", "fork"): pytest.mark.skip(
        reason="procspawn allows max_tasks_per_child with the fork start method (the stdlib "
        "refuses it); replacements are forked by the dispatcher thread, as the stdlib Pool does"
    ),
    ("ProcessPoolExecutor", "test_max_tasks_per_child_defaults_to_spawn_context", None): (
        pytest.mark.skip(
            reason="procspawn's one default start method is its fork server "
            "(procspawn.get_start_method()), with or without max_tasks_per_child"
        )
    ),
    ("ExecutorDeadlock", "test_error_at_task_unpickle", None): pytest.mark.skip(
        reason="procspawn fails only that future with the error: no worker died, so the "
        "executor is not broken (the stdlib's breaks)"
    ),
    ("ExecutorDeadlock", "test_error_during_result_unpickle_in_result_handler", None): (
        pytest.mark.skip(
            reason="procspawn fails only that future with an UnpicklingError naming the call: "
            "no worker died, so the executor is not broken (the stdlib's breaks)"
        )
    ),
    ("ExecutorDeadlock", "test_exit_during_result_unpickle_in_result_handler", None): (
        pytest.mark.skip(
            reason="procspawn fails only that future with the SystemExit raised while the "
            "parent unpickled the result: no worker died, so the executor is not broken"
        )
    ),
}


# Known failures of procspawn, xfail(strict=True) with the cause, while any are open.
_XFAIL: dict[tuple[str, str, str | None], pytest.MarkDecorator] = {}


def _marks_for(group: str, test: str, method: str, table: dict) -> list[pytest.MarkDecorator]:
    return [table[key] for key in ((group, test, None), (group, test, method)) if key in table]


def _cleaning_up_after_failure(func):
    """An expected failure must not fail the leak check of its test too (nor hang the
    rest): what the test left because it stopped midway is stopped here. The pools and
    executors made since it began (and the test's own executor) are terminated, its locals
    dropped (a manager object's finalizer shuts its process down), then any multiprocessing
    child it started is terminated."""

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        dispatchers = set(_pool_dispatcher._live)
        children = set(multiprocessing.active_children())
        try:
            return func(self, *args, **kwargs)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            gc.collect()
            left = set(_pool_dispatcher._live) - dispatchers
            executor = getattr(self, "executor", None)
            if executor is not None:
                left.add(executor._dispatcher)
            for dispatcher in left:
                dispatcher.terminate(grace_period=0.0)
            for child in set(multiprocessing.active_children()) - children:
                child.terminate()
                child.join()
            raise

    return wrapper


def _overrides(base: type, group: str, method: str) -> dict[str, object]:
    attrs: dict[str, object] = {}
    for name in dir(base):
        if not name.startswith("test"):
            continue
        skips = _marks_for(group, name, method, _SKIP)
        xfails = _marks_for(group, name, method, _XFAIL)
        if not (skips or xfails):
            continue
        func = getattr(base, name)
        wrapper = _cleaning_up_after_failure(func) if xfails else func

        @functools.wraps(func)
        def marked(self, *args, __wrapped=wrapper, **kwargs):
            return __wrapped(self, *args, **kwargs)

        for mark in skips + xfails:
            marked = mark(marked)
        attrs[name] = marked
    return attrs


# -- test._test_multiprocessing -----------------------------------------------------------


class _WithStartMethod:
    """What ``setUpModule`` of ``install_tests_in_module_dict`` does that matters here: the
    start method is the class's while it runs."""

    START_METHOD: str

    @classmethod
    def setUpClass(cls) -> None:
        cls._start_method_before = multiprocessing.get_start_method(allow_none=True)
        multiprocessing.set_start_method(cls.START_METHOD, force=True)
        try:
            super().setUpClass()  # type: ignore[misc]
        except BaseException:
            multiprocessing.set_start_method(cls._start_method_before, force=True)
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            super().tearDownClass()  # type: ignore[misc]
        finally:
            multiprocessing.set_start_method(cls._start_method_before, force=True)


_MP_CLASSES = {
    "Pool": "_TestPool",
    "PoolWorkerErrors": "_TestPoolWorkerErrors",
    "PoolWorkerLifetime": "_TestPoolWorkerLifetime",
}

for _method in METHODS:
    for _group, _base_name in _MP_CLASSES.items():
        _base = getattr(_mp_tests, _base_name)
        _name = f"TestMultiprocessing{_group}_{_method}"
        _attrs = {
            "__module__": __name__,
            "__qualname__": _name,
            "START_METHOD": _method,
            "CPYTHON_GROUP": _group,
            "Pool": staticmethod(_procspawn_pool(_method)),
            **_overrides(_base, _group, _method),
        }
        globals()[_name] = type(
            _name,
            (_WithStartMethod, _base, _mp_tests.ProcessesMixin, unittest.TestCase),
            _attrs,
        )


# -- test_concurrent_futures --------------------------------------------------------------

_CF_GROUPS = (
    "Initializer",
    "FailingInitializer",
    "ProcessPoolShutdown",
    "Wait",
    "AsCompleted",
    "ProcessPoolExecutor",
    "ExecutorDeadlock",
)
# What does not depend on how the workers start (futures' semantics, the parent's side,
# timeouts), and takes most of the time (sleeps of 1.5 to 6 s): under fork only, so that
# the file stays within the suite's time budget.
_FORK_ONLY_GROUPS = {"Wait", "AsCompleted"}
_FORK_ONLY_TESTS = {
    ("ProcessPoolExecutor", "test_map_timeout"),
    ("ProcessPoolExecutor", "test_no_stale_references"),
}


def _closing_the_log_queue(self) -> None:
    """``FailingInitializerMixin`` makes a ``multiprocessing.Queue`` for the workers' log
    and keeps it on the test (as ``log_queue`` and in ``executor_kwargs``): the test's own
    pipe and semaphores, which the stdlib's test runner leaves to the garbage collector
    and the leak check would count."""
    try:
        super(type(self), self).tearDown()
    finally:
        queue = getattr(self, "log_queue", None)
        if queue is not None:
            queue.close()
            queue.join_thread()
        self.log_queue = self.mp_context = None
        self.executor_kwargs = {}


if _cf_tests.SOURCE is not None:
    for _method in METHODS:
        for _group in _CF_GROUPS:
            if _group in _FORK_ONLY_GROUPS and (_method != "fork" or not FULL):
                continue
            if not FULL and _method != "forkserver":
                continue  # by default under procspawn's default start method only
            # the names create_executor_tests gives them
            _base = getattr(_cf_tests, f"ProcessPool{_method.capitalize()}{_group}Test")
            assert _base.ctx == _method
            _name = f"TestFutures{_group}_{_method}"
            _attrs = {
                "__module__": __name__,
                "__qualname__": _name,
                "CPYTHON_FUTURES": True,
                "executor_type": procspawn.ProcessPoolExecutor,
                **_overrides(_base, _group, _method),
            }
            if _group == "FailingInitializer":
                _attrs["tearDown"] = _closing_the_log_queue
            if _method != "fork":
                for _group_of, _test in _FORK_ONLY_TESTS:
                    if _group_of == _group:
                        _attrs[_test] = None  # not a test of this class
            globals()[_name] = type(_name, (_base,), _attrs)
else:

    def test_concurrent_futures_suite_is_installed():
        pytest.skip(_cf_tests.WHY_MISSING)


for _leftover in ("_method", "_group", "_base", "_name", "_attrs", "_group_of", "_test"):
    globals().pop(_leftover, None)  # (some unbound where the file above is missing)


@pytest.fixture(autouse=True)
def _cpython_test_modules(request, monkeypatch):
    """The test modules' globals the tests reach procspawn's pools through."""
    cls = request.cls
    method = getattr(cls, "START_METHOD", None)
    if method is not None:
        monkeypatch.setattr(_mp_tests, "multiprocessing", _MultiprocessingWithProcspawnPool(method))
        monkeypatch.setattr(_mp_tests, "unpickleable_result", _cf_tests.unpicklable_result)
        monkeypatch.setattr(
            script_helper,
            "assert_python_ok",
            _rewriting(
                script_helper.assert_python_ok,
                {
                    "from multiprocessing import Pool": (
                        f"import functools, procspawn; "
                        f"Pool = functools.partial(procspawn.Pool, context={method!r})"
                    )
                },
            ),
        )
    elif getattr(cls, "CPYTHON_FUTURES", False):
        monkeypatch.setattr(_cf_tests, "futures", _FuturesWithProcspawnExecutor())
        monkeypatch.setattr(
            _cf_tests,
            "assert_python_ok",
            _rewriting(
                _cf_tests.assert_python_ok,
                {
                    "from concurrent.futures import ProcessPoolExecutor": (
                        "from procspawn import ProcessPoolExecutor"
                    ),
                    "from test.test_concurrent_futures import": (
                        f"import sys; sys.path.insert(0, {_HERE!r}); "
                        f"from _cpython_pool_helpers import"
                    ),
                },
            ),
        )
    yield
