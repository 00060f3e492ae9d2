"""Everything the documentation makes at build time, written into ``docs/_generated/``.

``conf.py`` calls :func:`write_all` before Sphinx reads the pages; the tests call the
pieces. Nothing here is committed: ``docs/_generated/`` is ignored by git.

- ``settings_table.md``: ``procspawn._settings.markdown_table()``, exactly, which
  ``settings.md`` includes;
- ``api.md``: an autodoc directive for every public name (``api_page.py``), which
  ``api.md`` includes;
- ``bench_*.md`` and ``bench_*.png``: the benchmark tables and plots, from
  ``docs/benchmarks/*.json`` (``bench_plots.py``), which ``benchmarks.md`` includes.
"""

from __future__ import annotations

import os

import api_page
import bench_plots

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARK_DATA = os.path.join(DOCS, "benchmarks")


def _write(path: str, text: str) -> str:
    """Write ``text`` to ``path`` unless it holds it already (keeps incremental builds)."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return path
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def write_settings_table(out_dir: str) -> str:
    from procspawn import _settings

    return _write(os.path.join(out_dir, "settings_table.md"), _settings.markdown_table() + "\n")


def write_api(out_dir: str) -> str:
    return _write(os.path.join(out_dir, "api.md"), api_page.api_markdown())


def write_all(out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = [write_settings_table(out_dir), write_api(out_dir)]
    written += bench_plots.build(BENCHMARK_DATA, out_dir)
    return written
