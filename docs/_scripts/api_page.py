"""The API reference's body, made from the public names at build time.

``conf.py`` writes :func:`api_markdown` to ``docs/_generated/api.md``, which ``api.md``
includes, so a name added to ``procspawn.__all__`` (or to a subpackage's ``__all__``) shows
up in the reference without editing a page. Names are grouped for reading; a name no group
lists goes under "Other names", never nowhere. multiprocessing's own names, which procspawn
re-exports unchanged, are listed in one table instead of being documented again.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import types
import typing
from typing import Any

# Reading order of the top-level names; exceptions are found by type, not listed here, and
# go after these groups, then any name no group lists, then the version.
GROUPS: list[tuple[str, list[str]]] = [
    (
        "Spawning ranks",
        [
            "spawn",
            "start_processes",
            "ProcessContext",
            "progress",
            "Progress",
            "get_start_method",
            "set_start_method",
            "set_forkserver_preload",
        ],
    ),
    (
        "Pools and executors",
        ["Pool", "ProcessPoolExecutor", "get_reusable_executor", "process_map"],
    ),
    (
        "Drop-in for multiprocessing",
        ["Process", "Queue", "JoinableQueue", "SimpleQueue", "Pipe", "get_context"],
    ),
    (
        "Sharing strategies",
        ["get_sharing_strategy", "set_sharing_strategy", "get_all_sharing_strategies"],
    ),
    ("Version", ["__version__"]),
]
# multiprocessing's primitives tied to a start method: the stdlib's classes, made by
# procspawn's default context (bound methods, whose signatures autodoc would cut short):
# a table with their signatures
PRIMITIVES = "Synchronization and shared values"
PRIMITIVE_NAMES = [
    "Lock",
    "RLock",
    "Condition",
    "Semaphore",
    "BoundedSemaphore",
    "Event",
    "Barrier",
    "Value",
    "Array",
    "Manager",
]
ERRORS = "Errors"
OTHER = "Other names"
ORDER = [title for title, _ in GROUPS[:-1]] + [ERRORS, OTHER, GROUPS[-1][0]]
SUBPACKAGES = ("context", "pool", "sharing")
EXTRAS = ("joblib",)  # modules of an optional extra: ``import procspawn`` does not import them
CLASS_OPTIONS = (":members:", ":show-inheritance:")


def _directive(qualname: str, obj: Any) -> str:
    """A block with the autodoc directive that fits ``obj``."""
    if isinstance(obj, type) and issubclass(obj, BaseException):
        kind, options = "autoexception", CLASS_OPTIONS
    elif isinstance(obj, type):
        kind, options = "autoclass", CLASS_OPTIONS
    elif inspect.isroutine(obj):
        kind, options = "autofunction", ()
    elif isinstance(obj, types.ModuleType):
        kind, options = "automodule", ()
    else:
        kind, options = "autodata", ()
    # autodoc writes reStructuredText, so its directives go in an eval-rst block (in a
    # MyST directive, the docstrings would be read as Markdown)
    signature = _one_signature(obj)
    if signature:  # (conf.py's autodoc directive that shows only the signature given)
        kind = "autoonesignature"
    lines = ["```{eval-rst}", f".. {kind}:: {qualname}{signature}", *(f"   {o}" for o in options)]
    return "\n".join([*lines, "```", ""])


def _one_signature(obj: Any) -> str:
    """For a function with typing overloads (``spawn``: one per ``join``), its one
    signature, names and defaults, as the reader calls it: autodoc would list every
    overload, four near-identical ones before a word of description. "" otherwise."""
    get_overloads = getattr(typing, "get_overloads", None)  # Python 3.11+
    if not inspect.isroutine(obj) or get_overloads is None or not get_overloads(obj):
        return ""
    parameters = [
        parameter.replace(annotation=inspect.Parameter.empty)
        for parameter in inspect.signature(obj).parameters.values()
    ]
    return str(inspect.Signature(parameters))


def _summary(module: types.ModuleType) -> str:
    """The first paragraph of a module's docstring, on one line."""
    doc = inspect.getdoc(module) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _is_stdlib(name: str, obj: Any) -> bool:
    return obj is getattr(multiprocessing, name, object())


def top_level_sections() -> dict[str, list[str]]:
    """procspawn's own top-level names by section (the stdlib's under the key ``"stdlib"``)."""
    import procspawn

    sections: dict[str, list[str]] = {title: [] for title, _ in GROUPS}
    sections.update({ERRORS: [], OTHER: [], PRIMITIVES: [], "stdlib": []})
    grouped = {name: title for title, names in GROUPS for name in names}
    for name in sorted(procspawn.__all__, key=str.lower):
        obj = getattr(procspawn, name)
        if _is_stdlib(name, obj):
            sections["stdlib"].append(name)
        elif name in PRIMITIVE_NAMES:
            sections[PRIMITIVES].append(name)
        elif name in grouped:
            sections[grouped[name]].append(name)
        elif isinstance(obj, type) and issubclass(obj, BaseException):
            sections[ERRORS].append(name)
        elif name not in SUBPACKAGES:
            sections[OTHER].append(name)
    for title, names in GROUPS:  # the groups keep their reading order
        sections[title].sort(key=names.index)
    return sections


def api_markdown() -> str:
    """The reference's body: an autodoc directive for every public name."""
    import procspawn

    out: list[str] = []
    sections = top_level_sections()
    documented: dict[int, str] = {}  # id of an object -> the name it is documented under
    for title in ORDER:
        if not sections[title]:
            continue
        out += [f"## {title}", ""]
        for name in sections[title]:
            obj = getattr(procspawn, name)
            out.append(_directive(f"procspawn.{name}", obj))
            documented.setdefault(id(obj), f"procspawn.{name}")

    for package in SUBPACKAGES:
        if package not in procspawn.__all__:
            continue
        module = getattr(procspawn, package)
        out += [f"## `procspawn.{package}`", ""]
        # the package's summary, not its whole docstring: the rest is notes on its layout
        out += [f"```{{py:module}} procspawn.{package}", "```", "", _summary(module), ""]
        aliases = []
        for name in sorted(module.__all__, key=str.lower):
            obj = getattr(module, name)
            if id(obj) in documented:
                aliases.append(f"- `procspawn.{package}.{name}`: {{py:obj}}`{documented[id(obj)]}`")
            else:
                out.append(_directive(f"procspawn.{package}.{name}", obj))
                documented[id(obj)] = f"procspawn.{package}.{name}"
        if aliases:
            out += ["Also here, documented above:", "", *aliases, ""]

    for extra in EXTRAS:
        module = importlib.import_module(f"procspawn.{extra}")
        out += [f"## `procspawn.{extra}`", ""]
        out += [f"```{{py:module}} procspawn.{extra}", "```", "", _summary(module), ""]
        for name in module.__all__:
            out.append(_directive(f"procspawn.{extra}.{name}", getattr(module, name)))

    primitives = sections[PRIMITIVES]
    if primitives:
        out += [
            f"## {PRIMITIVES}",
            "",
            "The standard library's primitives, made by procspawn's default context (its "
            "start method: `procspawn.get_start_method()`), so that they can be passed to "
            "procspawn's ranks, workers and processes. They are `multiprocessing`'s "
            "classes, documented there.",
            "",
            "| call | makes |",
            "|---|---|",
        ]
        for name in sorted(primitives, key=PRIMITIVE_NAMES.index):
            signature = inspect.signature(getattr(procspawn, name))
            out.append(f"| `procspawn.{name}{signature}` | `multiprocessing.{name}` |")
        out.append("")

    stdlib = sections["stdlib"]
    if stdlib:
        out += [
            "## Names from `multiprocessing`",
            "",
            "`import procspawn as mp` also gives every other public name of `multiprocessing`, "
            "as the standard library has it (the same objects, unchanged):",
            "",
            "| name | is |",
            "|---|---|",
        ]
        out += [f"| `procspawn.{name}` | `multiprocessing.{name}` |" for name in stdlib]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(api_markdown())
