"""Every example runs, as a user would run it, in its short mode (``--quick``)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from _helpers import ROOT, script_env

EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
# example -> the optional module it needs (the `examples` extra installs them)
NEEDS = {"hogwild.py": "sklearn", "pool_images.py": "sklearn", "pool_resilient.py": "sklearn"}
LONGEST = ("pool_resilient.py", "pool_images.py", "hogwild.py")  # 2.5-4 s each, the rest ~1 s


def _runnable(name: str) -> bool:
    needed = NEEDS.get(name)
    return needed is None or importlib.util.find_spec(needed) is not None


def _run(name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), "--quick"],
        capture_output=True,
        text=True,
        timeout=130,
        env=script_env(),
    )


@pytest.fixture(scope="module")
def example_runs():
    """Every example run once, two at a time, before the first example's test starts
    (most of a short run is interpreters starting; each test's leak check sees none of
    them): name -> its run."""
    # the longest first, so that no long one starts last
    order = sorted(EXAMPLES, key=lambda name: name not in LONGEST)
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        runs = {name: threads.submit(_run, name) for name in order if _runnable(name)}
    return {name: future.result() for name, future in runs.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, example_runs):
    if not _runnable(name):
        pytest.skip(f"{name} needs {NEEDS[name]}: pip install -e '.[examples]'")
    result = example_runs[name]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    if name in ("hogwild.py", "pool_images.py"):
        last = result.stdout.strip().splitlines()[-1]
        assert last.startswith("test accuracy: "), last
        assert float(last.split(": ")[1]) >= 0.95, result.stdout
    if name == "hogwild.py":  # the speed-up line, and the one that shows the sharing
        lines = result.stdout.strip().splitlines()
        assert re.fullmatch(r"speed-up with \d+ ranks?: \d+\.\d\d×", lines[-2]), lines[-2]
        shared = [line for line in lines if line.startswith("model: ")]
        assert len(shared) == 1 and "in one shared segment" in shared[0], result.stdout
    if name == "pool_resilient.py":  # the crashing chunk retried, the stuck one timed out
        first = result.stdout.strip().splitlines()[-2]
        assert first.startswith("7 of 8 chunks done (the one that crashed its worker: done, "), (
            first
        )
        assert "skipped by the 1 s task_timeout: 1, at images [384]" in first, first
