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


# -- bench_pool.py's own JSON (``--json``), one file per start method ------------------------

POOL_LIBRARIES = [  # (key in bench_pool.py, column)
    ("stdlib", "stdlib Pool"),
    ("ppe", "PPE"),
    ("loky", "loky"),
    ("joblib", "joblib"),
    ("mpire", "mpire"),
    ("pebble", "pebble"),
    ("torch", "torch Pool"),
    ("procspawn", "procspawn Pool"),
    ("procspawn-exec", "procspawn executor"),
]
POOL_CASES = [  # (case key, row name, unit, decimals)
    ("startup", "start-up and first result", "ms", 1),
    ("startup-numpy", "start-up and first result, a script importing NumPy", "ms", 1),
    ("tiny", "20,000 tiny tasks", "µs/task", 2),
    ("tiny-cs1", "20,000 tiny tasks, executors at chunksize=1 (their default)", "µs/task", 1),
    ("fresh", "a fresh 4 MiB array per task", "ms/task", 2),
    ("result", "an 8 MiB result per task", "ms/task", 2),
    ("kill", "a killed worker reported after", "ms", 1),
]
HEADLINE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_static")
HEADLINE_SVG = os.path.join(HEADLINE, "headline.svg")
HEADLINE_METHOD = "forkserver"  # procspawn's default, and Python 3.14's


def _pool_cells(run: dict[str, Any]) -> dict[tuple[str, str], float | str]:
    """(case key, library key) -> the median in the case's unit, or "hangs"."""
    cells: dict[tuple[str, str], float | str] = {}
    for row in run["rows"]:
        case = row["case_key"]
        if case == "tiny" and row.get("chunksize") == 1:
            case = "tiny-cs1"
        if row["hangs"]:
            cells[case, row["library_key"]] = "hangs"
        elif row["median"] is not None and not row.get("error"):
            scale = 1000.0 if case == "kill" else 1.0  # measured in s, shown in ms
            cells[case, row["library_key"]] = row["median"] * scale
    return cells


def _best_peer(cells: dict[tuple[str, str], Any], case: str) -> tuple[str, float] | None:
    peers = [
        (cells[case, key], label)
        for key, label in POOL_LIBRARIES
        if not key.startswith("procspawn") and isinstance(cells.get((case, key)), float)
    ]
    if not peers:
        return None
    value, label = min(peers)
    return label, value


def pool_table(run: dict[str, Any]) -> dict[str, Any]:
    """The table of the benchmarks page for one start method: a row per library, a
    column per case, and a last row of procspawn's best against the best peer's."""
    cells = _pool_cells(run)
    cases = [c for c in POOL_CASES if any(case == c[0] for case, _ in cells)]
    columns = ["library", *(f"{short} ({unit})" for _, short, unit, _ in _short(cases))]
    rows: list[list[Any]] = []
    for key, label in POOL_LIBRARIES:
        row: list[Any] = [label]
        for case, _name, _unit, decimals in cases:
            value = cells.get((case, key))
            row.append(round(value, decimals) if isinstance(value, float) else value or "")
        rows.append(row)
    ratio: list[Any] = ["procspawn / best peer"]
    for case, *_ in cases:
        ours = [cells.get((case, k)) for k in ("procspawn", "procspawn-exec")]
        ours_values = [v for v in ours if isinstance(v, float)]
        best = _best_peer(cells, case)
        if ours_values and best is not None:
            ratio.append(f"{min(ours_values) / best[1]:.2f}× ({best[0]})")
        else:
            ratio.append("")
    rows.append(ratio)
    source = run["source"]
    versions = ", ".join(f"{k} {v}" for k, v in source["versions"].items())
    statistic = f"medians of {run['repeats']}"
    if "start_up_repeats" in run:
        statistic += f", the start-up columns of {run['start_up_repeats']}"
    return {
        "title": f"Process pools, workers started by {run['start_method']}",
        "source": {
            "command": source["command"],
            "date": source["date"],
            "session": "",
            "machine": f"{source['machine']}, idle; {versions}",
            "statistic": statistic,
        },
        "columns": columns,
        "rows": rows,
        "notes": (
            f"Workers started by {run['start_method']} (joblib: always loky's own method), "
            "2 each. PPE is `concurrent.futures.ProcessPoolExecutor`. Tiny tasks: each "
            "library's default chunking for the Pool-likes, `chunksize=2500` for the "
            'executors; "cs=1" is the executors at their default, `chunksize=1`. '
            '"hangs": the call still waited 20 s after the worker\'s SIGKILL. The last '
            "row: the faster of procspawn's Pool and executor divided by the fastest other "
            "library (named); below 1 is faster."
        ),
    }


_SHORT = {
    "startup": "start-up",
    "startup-numpy": "start-up, NumPy script",
    "tiny": "tiny task",
    "tiny-cs1": "tiny task, cs=1",
    "fresh": "4 MiB argument",
    "result": "8 MiB result",
    "kill": "killed worker seen",
}


def _short(cases: list[tuple[str, str, str, int]]) -> list[tuple[str, str, str, int]]:
    return [(case, _SHORT[case], unit, decimals) for case, _name, unit, decimals in cases]


def pool_plot(runs: list[dict[str, Any]], path: str) -> None:
    """One panel per case: a horizontal bar per library and start method, procspawn's
    in colour, the peers' in grey, the figure at the bar's end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in POOL_CASES if c[0] != "tiny-cs1"]
    fig, axes = plt.subplots(3, 2, figsize=(11, 12), dpi=100)
    shades = {"fork": 0, "forkserver": 1, "spawn": 2}
    colours = {True: ["#c0392b", "#f1948a", "#fadbd8"], False: ["#5d6d7e", "#aab7b8", "#d5dbdb"]}
    height = 0.8 / len(runs)
    for ax, (case, name, unit, decimals) in zip(axes.flat, cases, strict=False):
        top = 0.0
        for j, run in enumerate(runs):
            cells = _pool_cells(run)
            for i, (key, _label) in enumerate(POOL_LIBRARIES):
                value = cells.get((case, key))
                y = i + (j - (len(runs) - 1) / 2) * height
                ours = key.startswith("procspawn")
                colour = colours[ours][shades.get(run["start_method"], 2)]
                if isinstance(value, float):
                    ax.barh(y, value, height=height, color=colour)
                    ax.text(value, y, f" {value:,.{decimals}f}", va="center", fontsize=7)
                    top = max(top, value)
                elif value == "hangs":
                    ax.text(0, y, " hangs", va="center", fontsize=7, color="#922b21")
        ax.set_yticks(range(len(POOL_LIBRARIES)), [label for _, label in POOL_LIBRARIES])
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.25 if top else 1)
        ax.set_title(f"{name} ({unit})", fontsize=10)
        ax.tick_params(axis="both", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    legend = [
        plt.Rectangle((0, 0), 1, 1, color=colours[False][shades.get(run["start_method"], 2)])
        for run in runs
    ]
    fig.legend(
        legend,
        [f"workers started by {run['start_method']}" for run in runs],
        loc="lower center",
        ncol=len(runs),
        frameon=False,
        fontsize=9,
    )
    fig.suptitle("Process pools, 2 workers each: shorter is better", fontsize=12)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path)
    plt.close(fig)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def headline_svg(runs: list[dict[str, Any]]) -> str:
    """The README's picture: arrays through a pool, procspawn against the standard
    library and the best peer, as a small SVG written by hand (no plotting library: the
    same figures always give the same bytes)."""
    run = next((r for r in runs if r["start_method"] == HEADLINE_METHOD), runs[0])
    cells = _pool_cells(run)
    groups = [
        ("fresh", "a fresh 4 MiB array to each task"),
        ("result", "an 8 MiB result from each task"),
    ]
    width, left, bar_h, gap = 720, 190, 20, 6
    scale_w = width - left - 150
    lines: list[tuple[str, str, float | None]] = []  # (kind, label, value)
    for case, title in groups:
        best = _best_peer(cells, case)
        bars = [("peer", "stdlib Pool", cells.get((case, "stdlib")))]
        if best is not None and best[0] != "stdlib Pool":
            bars.append(("peer", f"{best[0]} (best peer)", best[1]))
        bars.append(("ours", "procspawn Pool", cells.get((case, "procspawn"))))
        lines.append(("title", title, None))
        lines += [(kind, label, v if isinstance(v, float) else None) for kind, label, v in bars]
    top = max(v for _, _, v in lines if v is not None)
    y = 46
    out = []
    for kind, label, value in lines:
        if kind == "title":
            y += 10
            out.append(f'<text x="10" y="{y + 14}" class="t">{_escape(label)}</text>')
            y += bar_h + gap
            continue
        length = 0.0 if value is None else max(1.0, scale_w * value / top)
        fill = "#c0392b" if kind == "ours" else "#95a5a6"
        out.append(f'<text x="{left - 8}" y="{y + 14}" class="l">{_escape(label)}</text>')
        out.append(
            f'<rect x="{left}" y="{y}" width="{length:.1f}" height="{bar_h}" fill="{fill}"/>'
        )
        text = "n/a" if value is None else f"{value:.1f} ms"
        out.append(f'<text x="{left + length + 6:.1f}" y="{y + 14}" class="v">{text}</text>')
        y += bar_h + gap
    height = y + 30
    versions = run["source"]["versions"]
    caption = (
        f"2 workers, {run['start_method']}; medians of {run['repeats']}; "
        f"{run['source']['machine']}; Python {versions.get('python', '?')}, "
        f"{run['source']['date']}"
    )
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        "<style>.h{font-size:17px;font-weight:bold}.t{font-size:14px;font-weight:bold}"
        ".l{font-size:13px;text-anchor:end}.v{font-size:13px}.c{font-size:11px;fill:#666}"
        "</style>",
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="10" y="26" class="h">NumPy arrays through a process pool: time per task, '
        "shorter is better</text>",
    ]
    tail = [f'<text x="10" y="{height - 10}" class="c">{_escape(caption)}</text>', "</svg>"]
    return "\n".join(head + out + tail) + "\n"


def pool_runs(data_dir: str) -> list[dict[str, Any]]:
    """bench_pool.py's JSON files in ``data_dir``, fork before forkserver before spawn."""
    runs = []
    for name in sorted(os.listdir(data_dir)):
        if name.endswith(".json"):
            with open(os.path.join(data_dir, name), encoding="utf-8") as f:
                data = json.load(f)
            if data.get("kind") == "bench_pool":
                runs.append(data)
    order = {"fork": 0, "forkserver": 1, "spawn": 2}
    return sorted(runs, key=lambda r: order.get(r["start_method"], 3))


def build(data_dir: str, out_dir: str) -> list[str]:
    """Write every table's Markdown and plot into ``out_dir``; return the names written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    runs = pool_runs(data_dir)
    if runs:
        md_path = os.path.join(out_dir, "bench_pool.md")
        with open(md_path, "w", encoding="utf-8") as f:
            f.write("\n".join(markdown(pool_table(run)) for run in runs))
        png_path = os.path.join(out_dir, "bench_pool.png")
        pool_plot(runs, png_path)
        written += [md_path, png_path]
    for name in sorted(os.listdir(data_dir)):
        if not name.endswith(".json"):
            continue
        stem = name[: -len(".json")]
        with open(os.path.join(data_dir, name), encoding="utf-8") as f:
            if json.load(f).get("kind") == "bench_pool":
                continue  # drawn above
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


def write_headline(data_dir: str, path: str = HEADLINE_SVG) -> str:
    """Write the README's picture from the pool figures; return its path."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(headline_svg(pool_runs(data_dir)))
    return path


if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "benchmarks")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "_generated")
    for written in build(data, out):
        print(written)
