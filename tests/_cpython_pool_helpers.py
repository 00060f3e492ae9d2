"""CPython's own ``test_concurrent_futures``, importable by name in the pool's workers.

This module holds no test code of its own: importing it executes, in its own namespace,
the source of the standard library's ``test/test_concurrent_futures.py`` of this Python
version (``X.Y``), read from where it is installed:

1. this interpreter's own ``test`` package, when it ships that file;
2. else Debian's ``libpythonX.Y-testsuite`` package (``/usr/lib/pythonX.Y/test/``), which
   this machine's pyenv build of Python lacks (its ``test`` package is cut down) and
   ``apt-get install libpython3.11-testsuite`` brings.

Why not import ``test.test_concurrent_futures`` there: the pool's spawn and forkserver
workers unpickle the test's functions (``mul``, ``init``, ``sleep_and_raise`` ...) by
reference, so the module must be importable under its name in a fresh interpreter too,
and a file outside this interpreter's ``test`` package cannot be imported as part of it.
Run under this module's name (``tests/`` is on ``sys.path``, and the workers get the
parent's ``sys.path``), every function and class of it is found again in any worker.

``SOURCE`` is the file executed, None when neither place has it (``WHY_MISSING`` says why).

Besides, ``unpicklable_result``: what ``_test_multiprocessing.unpickleable_result`` means to
return, a result the pool cannot send back (see ``test_cpython_pool``).
"""

from __future__ import annotations

import os
import sys
import sysconfig

_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"
_CANDIDATES = (
    os.path.join(sysconfig.get_paths()["stdlib"], "test", "test_concurrent_futures.py"),
    f"/usr/lib/python{_VERSION}/test/test_concurrent_futures.py",
)

SOURCE: str | None = next((path for path in _CANDIDATES if os.path.isfile(path)), None)
WHY_MISSING = (
    f"CPython's test_concurrent_futures.py for Python {_VERSION} is installed in neither "
    f"{' nor '.join(os.path.dirname(p) for p in _CANDIDATES)}: "
    f"`apt-get install libpython{_VERSION}-testsuite` brings it"
)
if SOURCE is None and any(os.path.isdir(path[: -len(".py")]) for path in _CANDIDATES):
    WHY_MISSING = (
        f"Python {_VERSION}'s test_concurrent_futures is a package (since 3.12), which this "
        "file does not load: its executor tests run on Python 3.10 and 3.11"
    )

if SOURCE is not None:
    with open(SOURCE, encoding="utf-8") as _file:
        _code = compile(_file.read(), SOURCE, "exec", dont_inherit=True)
    # The tests' own tracebacks and the workers' (test_traceback reads the source line
    # back from the worker's traceback) name the file itself.
    try:
        exec(_code, globals())
    except ImportError as _missing:  # the file without the test package it imports
        WHY_MISSING = f"{SOURCE} cannot be imported here ({_missing})"
        SOURCE = None
    del _file, _code


def unpicklable_result():
    """A result no pickler can send back: ``_test_multiprocessing.unpickleable_result``
    returns a lambda for that, which procspawn's cloudpickle sends back fine."""
    return (i for i in range(3))
