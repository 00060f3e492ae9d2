"""The SIGKILL torture, short: 30 random rounds (tests/torture.py --rounds N for a soak)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _helpers import ROOT, script_env


@pytest.mark.timeout(300)
def test_torture_30_rounds(tmp_path):
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "torture.py"),
            "--rounds",
            "30",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=script_env(),
    )
    figures = json.loads(out.read_text())
    assert figures["rounds"] == 30
    counts = ("leaks", "orphans", "hangs", "failed_workloads")
    assert [figures[k] for k in counts] == [0, 0, 0, 0], result.stdout
    assert result.returncode == 0
    assert sum(figures["kills"].values()) == 30
