"""The SIGKILL torture, short: 4 random rounds, and 3 under one long-lived parent
(tests/torture.py --rounds N [--long-lived-parent] for a soak)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _helpers import ROOT, script_env


@pytest.mark.slow  # a soak: every piece at once, round after round
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["parent-per-round", "long-lived-parent"])
def test_torture(tmp_path, mode):
    out = tmp_path / "figures.json"
    extra = ["--long-lived-parent"] if mode == "long-lived-parent" else []
    rounds = 3 if extra else 4
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "torture.py"),
            "--rounds",
            str(rounds),
            "--json",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=script_env(),
    )
    figures = json.loads(out.read_text())
    rounds += 1 if extra else 0  # the long-lived parent's own death, last
    assert figures["rounds"] == rounds
    counts = ("leaks", "orphans", "hangs", "failed_workloads")
    assert [figures[k] for k in counts] == [0, 0, 0, 0], result.stdout
    assert result.returncode == 0
    assert sum(figures["kills"].values()) == rounds
