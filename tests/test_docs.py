"""The documentation cannot rot: every Python block of README.md and docs/ runs, the README
stays a front page with the quick-start commands, and the API page covers every public name.

Each ``python`` block is a whole program, run as a file in a fresh interpreter (as a reader
would paste it into a file and run it) and must exit 0. Shell commands and output go in
``console``, ``text`` or ``bash`` blocks, which are not run.
"""

from __future__ import annotations

import concurrent.futures
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from _helpers import ROOT, script_env

DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
README_LIMIT = 8192
QUICK_START = [
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[examples]' "
    "&& .venv/bin/python examples/hogwild.py",
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test,examples,ray,joblib,dask]' "
    "&& .venv/bin/python -m pytest",
]
RUN_TIMEOUT = 60
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def markdown_files() -> list[str]:
    """README.md and every page of docs/ (not what the build generates or writes)."""
    pages = glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
    skip = (os.path.join(DOCS, "_build"), os.path.join(DOCS, "_generated"))
    return [README, *sorted(p for p in pages if not p.startswith(skip))]


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number, code) of every fenced block, the fence's indent removed."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = (opening["info"].split() or [""])[0]
        body = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        blocks.append((language, i + 1, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks() -> list:
    params = []
    for path in markdown_files():
        with open(path, encoding="utf-8") as f:
            blocks = [b for b in fenced_blocks(f.read()) if b[0] == "python"]
        name = os.path.relpath(path, ROOT)
        for index, (_, line, code) in enumerate(blocks):
            params.append(pytest.param(name, line, code, id=f"{name}[{index}]"))
    return params


def _needs_a_gpu(code: str) -> bool:
    """A block that uses CuPy, where there is no CuPy or no NVIDIA device (asked without
    starting CUDA in this process, whose later tests fork)."""
    if "import cupy" not in code:
        return False
    return importlib.util.find_spec("cupy") is None or not os.path.exists("/dev/nvidiactl")


def _run_block(code: str, folder: str) -> subprocess.CompletedProcess:
    script = os.path.join(folder, "example.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(code)
    return subprocess.run(
        [sys.executable, script],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=script_env(),
        cwd=folder,
    )


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory):
    """Every python block run once, three at a time (each in a fresh interpreter and folder;
    most of a block's time is its interpreter's start-up): test id -> its run. Done
    before the first block's test starts, so each test's leak check sees none of them."""
    runs = {}
    # Ray's block first (a cluster's start, ~4 s), so that it does not start last; three
    # at a time, as the blocks spend much of their time waiting on their processes
    params = sorted(python_blocks(), key=lambda param: 'backend="ray"' not in param.values[2])
    with concurrent.futures.ThreadPoolExecutor(3) as threads:
        for param in params:
            name, line, code = param.values
            if 'backend="ray"' in code and importlib.util.find_spec("ray") is None:
                continue
            if _needs_a_gpu(code):
                continue
            folder = str(tmp_path_factory.mktemp("block"))
            runs[param.id] = threads.submit(_run_block, code, folder)
    return {key: future.result() for key, future in runs.items()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "line", "code"), python_blocks())
def test_python_block_runs(name, line, code, block_runs, request):
    if 'backend="ray"' in code and importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'procspawn[ray]')")
    if _needs_a_gpu(code):
        pytest.skip("the block needs CuPy and a GPU, which this machine lacks")
    result = block_runs[request.node.callspec.id]
    assert result.returncode == 0, (
        f"the python block at {name}:{line} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}--- stderr\n{result.stderr}"
    )


def test_every_block_has_a_language():
    """A block without one would be neither run nor known to be a command or output."""
    for path in markdown_files():
        with open(path, encoding="utf-8") as f:
            for language, line, _ in fenced_blocks(f.read()):
                assert language, f"{os.path.relpath(path, ROOT)}:{line}: a block with no language"


def test_the_readme_is_a_front_page_with_the_quick_start_commands():
    with open(README, "rb") as f:
        raw = f.read()
    assert len(raw) < README_LIMIT, f"README.md is {len(raw)} bytes, not under {README_LIMIT}"
    blocks = fenced_blocks(raw.decode("utf-8"))
    for command in QUICK_START:
        assert any(code == command + "\n" for _, _, code in blocks), command


@pytest.fixture
def docgen(monkeypatch):
    """docs/_scripts/docgen.py, what the documentation build runs to make its pages."""
    monkeypatch.syspath_prepend(os.path.join(DOCS, "_scripts"))
    return importlib.import_module("docgen")


def test_every_public_name_is_on_the_api_page(docgen):
    import procspawn
    from procspawn import pool, sharing

    with open(os.path.join(DOCS, "api.md"), encoding="utf-8") as f:
        assert "_generated/api.md" in f.read(), "api.md does not include the generated list"
    text = docgen.api_page.api_markdown()
    documented = set(re.findall(r"^\.\. auto\w+:: ([\w.]+)", text, re.MULTILINE))
    listed = set(re.findall(r"`(procspawn(?:\.\w+)+)[`(]", text))
    for name in procspawn.__all__:
        assert f"procspawn.{name}" in documented | listed, f"procspawn.{name} is not on the page"
    for package in (sharing, pool):
        for name in package.__all__:
            qualname = f"{package.__name__}.{name}"
            assert qualname in documented | listed, f"{qualname} is not on the page"
    # everything of procspawn's own has its docstring and signature there, not just a line
    for name in ("spawn", "Pool", "ProcessPoolExecutor", "ProcessContext", "Process"):
        assert f"procspawn.{name}" in documented
    for name in ("share_memory_", "zeros", "SharingStrategy"):
        assert f"procspawn.sharing.{name}" in documented
    # a function with overloads (spawn: one per join) shows one signature, not four
    if sys.version_info >= (3, 11):
        assert re.search(r"^\.\. auto\w+:: procspawn\.spawn\(fn, args=\(\)", text, re.M)


def test_the_benchmark_data_makes_tables_and_plots(tmp_path):
    """The script the build runs (in a process of its own: matplotlib keeps its fonts open)
    makes a table of every JSON file, at least two plots, and the page shows them all."""
    pytest.importorskip("matplotlib", reason="the docs extra: pip install -e '.[docs]'")
    script = os.path.join(DOCS, "_scripts", "bench_plots.py")
    data = os.path.join(DOCS, "benchmarks")
    result = subprocess.run(
        [sys.executable, script, data, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    written = sorted(os.listdir(tmp_path))
    tables = [name for name in os.listdir(data) if name.endswith(".json")]
    pool_runs = []  # bench_pool.py's own figures, one file per start method: one table
    for name in tables:
        with open(os.path.join(data, name), encoding="utf-8") as f:
            if json.load(f).get("kind") == "bench_pool":
                pool_runs.append(name)
    assert pool_runs, "no bench_pool.py figures in docs/benchmarks"
    assert len([n for n in written if n.endswith(".md")]) == len(tables) - len(pool_runs) + 1
    assert len([n for n in written if n.endswith(".png")]) >= 2
    assert "bench_pool.md" in written and "bench_pool.png" in written
    with open(os.path.join(DOCS, "benchmarks.md"), encoding="utf-8") as f:
        page = f.read()
    for name in written:
        assert f"_generated/{name}" in page, f"{name} is not on the benchmarks page"


def test_the_readme_picture_is_the_one_the_kept_figures_make():
    """docs/_static/headline.svg is kept in the repository (the README shows it): it must be
    what ``python benchmarks/plots.py`` makes from the figures in docs/benchmarks/."""
    spec = importlib.util.spec_from_file_location(
        "bench_plots", os.path.join(DOCS, "_scripts", "bench_plots.py")
    )
    assert spec is not None and spec.loader is not None
    plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plots)
    runs = plots.pool_runs(os.path.join(DOCS, "benchmarks"))
    with open(os.path.join(DOCS, "_static", "headline.svg"), encoding="utf-8") as f:
        kept = f.read()
    assert kept == plots.headline_svg(runs), "run: python benchmarks/plots.py"
    for name in ("procspawn Pool", "stdlib Pool", "best peer"):
        assert name in kept
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    assert 0 < readme.find("docs/_static/headline.svg") < readme.index("\n## "), (
        "the picture is on the README's first screen, before its first section"
    )
