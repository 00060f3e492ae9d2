"""Every example runs, as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _helpers import ROOT, script_env

EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    env = script_env()
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name)],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
