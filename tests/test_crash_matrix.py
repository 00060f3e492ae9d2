"""The crash matrix: where a rank or a pool worker dies x how it dies.

For every cell: the caller gets the right error within a second of the call (start-up
included; the bound asserted is 2 s for a loaded machine), and within 2 s of it no process
is left and /dev/shm, this process' descriptors and its shared mappings are back to what
they were, looked at from outside (/dev/shm, /proc/self/fd, /proc/self/maps) while this
process lives. ``tests/torture.py --matrix`` runs the same cells for as long as asked.
"""

from __future__ import annotations

import pytest
from _crash_cells import HOW, WHERE, CrashError, left_after, run_cell, snapshot

import procspawn as mp

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("where", WHERE)
def test_crash_cell(where, how):
    before = snapshot()
    error, seconds = run_cell(where, how)
    if where == "pool_worker" and how == "exception":
        assert error is CrashError  # a task's own exception, as the stdlib Pool gives it
    elif how == "exception" or (how == "sys_exit" and where != "pool_worker"):
        assert issubclass(error, mp.ProcessException), error
    else:
        assert issubclass(error, mp.ProcessExitedException), error
    assert seconds < 2.0, f"{where} x {how}: the error came after {seconds:.2f} s"
    left = left_after(before, 2.0)
    assert not left, f"{where} x {how}: left after 2 s: {left}"


@pytest.mark.parametrize("how", HOW)
def test_crash_cell_holding_a_file_system_segment(how):
    # the same, with the cleanup daemon taking the dead rank out of the holders
    mp.set_sharing_strategy("file_system")
    try:
        test_crash_cell("holding_segment", how)
    finally:
        mp.set_sharing_strategy("file_descriptor")
