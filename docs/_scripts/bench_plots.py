"""Tables and plots of the benchmarks page, made from ``docs/benchmarks/*.json``.

``conf.py`` calls :func:`build` before the pages are read; it can also be run by hand::

    python docs/_scripts/bench_plots.py [docs/benchmarks] [docs/_generated]

Each JSON file holds one measured table, transcribed from the run that measured it::

    {
      "title": "...",
      "source": {"command": "...", "date": "...", "session": "...", "machine": "..."},
      "columns": ["case", "procspawn", ...],
      "rows": [["spawn+join 1 rank", 170.3, ...], ...],
      "notes": "...",                                    (optional, Markdown)
      "plot": {                                          (optional)
        "series": ["procspawn", ...],                    columns drawn as bars
        "series_labels": ["procspawn", ...],             their legend (default: the columns)
        "rows": ["spawn+join 1 rank", ...],              rows drawn (default: all)
        "labels": ["1", ...],                            x tick labels (default: row names)
        "ylabel": "ms", "log": true, "title": "..."
      }
    }

A cell is a number or a string (a range, "hangs", a figure with its ratio); a plot reads the
number a string starts with and leaves out a cell that has none. For ``NAME.json`` this
writes ``bench_NAME.md`` (the table and where it comes from) and, with a plot,
``bench_NAME.png``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

_NUMBER = re.compile(r"\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float):
        return f"{value:,}"
    return str(value)


def number(value: Any) -> float | None:
    """The number a cell holds or starts with, else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    match = _NUMBER.match(str(value))
    return float(match.group(1).replace(",", "")) if match else None


def markdown(table: dict[str, Any]) -> str:
    """The table as Markdown, with the command and date that measured it."""
    columns = table["columns"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in table["rows"]:
        if len(row) != len(columns):
            raise ValueError(f"{table['title']}: row {row[0]!r} has {len(row)} cells")
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    source = table["source"]
    commands = source["command"]
    if isinstance(commands, str):
        commands = [commands]
    measured = f"Measured {source['date']} on {source['machine']}"
    if source.get("statistic"):
        measured += f"; {source['statistic']}"
    lines += ["", measured + ". Command:", "", "```console"]
    lines += commands
    lines += ["```", ""]
    if table.get("notes"):
        lines += [table["notes"], ""]
    return "\n".join(lines)


def plot(table: dict[str, Any], path: str) -> None:
    """Grouped bars: one group per row, one bar per series column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = table["plot"]
    columns = table["columns"]
    by_name = {row[0]: row for row in table["rows"]}
    names = spec.get("rows") or list(by_name)
    labels = spec.get("labels") or names
    series = spec["series"]
    legend = spec.get("series_labels") or series
    width = 0.8 / len(series)

    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=110)
    for i, column in enumerate(series):
        index = columns.index(column)
        xs, ys = [], []
        for g, name in enumerate(names):
            value = number(by_name[name][index])
            if value is not None:
                xs.append(g + (i - (len(series) - 1) / 2) * width)
                ys.append(value)
        ax.bar(xs, ys, width=width, label=legend[i])
    ax.set_xticks(range(len(names)), labels)
    if spec.get("log"):
        ax.set_yscale("log")
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.set_title(spec.get("title", table["title"]), fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    for key in ("title", "source", "columns", "rows"):
        if key not in table:
            raise ValueError(f"{path}: no {key!r}")
    for key in ("command", "date", "session", "machine"):
        if key not in table["source"]:
            raise ValueError(f"{path}: its source says no {key!r}")
    return table


def build(data_dir: str, out_dir: str) -> list[str]:
    """Write every table's Markdown and plot into ``out_dir``; return the names written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name in sorted(os.listdir(data_dir)):
        if not name.endswith(".json"):
            continue
        stem = name[: -len(".json")]
        table = load(os.path.join(data_dir, name))
        text = markdown(table)
        md_path = os.path.join(out_dir, f"bench_{stem}.md")
        with open(md_path, "w", encoding="utf-8") as f:
            f.write(text)
        written.append(md_path)
        if "plot" in table:
            png_path = os.path.join(out_dir, f"bench_{stem}.png")
            plot(table, png_path)
            written.append(png_path)
    return written


if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "benchmarks")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "_generated")
    for written in build(data, out):
        print(written)
