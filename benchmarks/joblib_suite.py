"""Run joblib's own backend tests (``joblib/test/test_parallel.py``) against procspawn.

Run::

    python benchmarks/joblib_suite.py [--backend NAME] [extra pytest args]

Two pytest runs of the *installed* joblib's ``test_parallel.py``, each in a fresh
interpreter, with procspawn's backend registered before that module is imported (this
file is also the pytest plugin that does it, loaded with ``-p joblib_suite``):

1. ``-k NAME``: the cases parametrized with the backend (its name, or its backend
   instance, which this plugin gives the id ``ProcspawnBackend`` instead of ``backendN``);
2. the whole file with ``NAME`` as joblib's default backend, as joblib's own conftest
   does for ``JOBLIB_TESTS_DEFAULT_PARALLEL_BACKEND`` (set here to ``NAME``).

``--backend`` is ``procspawn`` by default; ``--backend loky`` runs the same two runs for
joblib's default backend, less the cases with procspawn in their ids: the baseline, so a
failure both show is joblib's environment's, not procspawn's. Every test has
``--timeout=60``; a ``-k`` among the extra arguments replaces the script's. The runs use
joblib's settings, not this repository's: ``-c /dev/null`` (no ini file, so no
``filterwarnings = error`` from our setup.cfg) with ``--rootdir`` at site-packages (ids
read ``joblib/test/...``). As joblib's conftest does, a test also fails if it leaves a
``*_NUM_THREADS`` variable set. Each run ends with ``procspawn.joblib.shutdown()``.

Reading the result: each run ends with pytest's summary line (``N passed, M failed, ...``)
and its failures listed (``-rfE``); then this script prints one line per run with its
exit status and wall time. Exit status 0 only if both runs passed. Failures expected by
design: ``test_nested_loop[<process backend>-procspawn]`` (a worker that never called
``register()`` does not know the name) and, in run 2, ``test_backend_hinting_and_constraints``
(it expects ``prefer="processes"`` to give loky; joblib keeps a process-based default).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ENV_VAR = "JOBLIB_TESTS_DEFAULT_PARALLEL_BACKEND"


# -- the pytest plugin (``-p joblib_suite``, in the pytest process) -------------------------


def pytest_configure(config):
    import joblib.parallel

    import procspawn.joblib

    procspawn.joblib.register()  # before pytest imports test_parallel.py (its BACKENDS)
    for mark in ("thread_unsafe", "no_cover"):  # the markers of joblib's plugins
        config.addinivalue_line("markers", mark)
    default = os.environ.get(ENV_VAR)
    if default:
        if default not in joblib.parallel.BACKENDS:
            raise ValueError(f"{ENV_VAR}={default!r}: no such joblib backend")
        joblib.parallel.DEFAULT_BACKEND = default


def pytest_unconfigure(config):
    import procspawn.joblib

    procspawn.joblib.shutdown()


def pytest_make_parametrize_id(config, val, argname):
    from joblib.parallel import ParallelBackendBase

    if isinstance(val, ParallelBackendBase):
        return type(val).__name__  # "ProcspawnBackend", "LokyBackend", ...
    return None


def pytest_runtest_teardown(item, nextitem):
    from joblib.parallel import ParallelBackendBase

    left = [k for k in ParallelBackendBase.MAX_NUM_THREADS_VARS if k in os.environ]
    for k in left:  # one leak must not fail every later test too
        del os.environ[k]
    assert not left, f"the test left {left} set in os.environ"


# -- the runner --------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    import joblib

    backend = "procspawn"
    if argv[:1] == ["--backend"]:
        backend, argv = argv[1], argv[2:]
    test_file = os.path.join(os.path.dirname(joblib.__file__), "test", "test_parallel.py")
    site = os.path.dirname(os.path.dirname(joblib.__file__))
    here = os.path.dirname(os.path.abspath(__file__))
    options = "-c /dev/null -p joblib_suite -p no:cacheprovider --timeout=60 -rfE".split()
    common = [sys.executable, "-m", "pytest", test_file, "--rootdir", site, *options]
    # a baseline (another backend) leaves out the cases with procspawn in their ids
    rest = "" if backend == "procspawn" else " and not procspawn"
    runs = [
        (f"-k '{backend}{rest}'", ["-k", backend + rest], None),
        (f"default backend {backend}", ["-k", "not procspawn"] if rest else [], backend),
    ]
    results = []
    for title, args, default in runs:
        path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        env.pop(ENV_VAR, None)
        if default:
            env[ENV_VAR] = default
        print(f"=== joblib_suite: {title}", flush=True)
        start = time.monotonic()
        rc = subprocess.call(common + args + argv, env=env)
        results.append((title, rc, time.monotonic() - start))
    for title, rc, wall in results:
        print(f"joblib_suite: {title}: exit status {rc}, {wall:.0f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
