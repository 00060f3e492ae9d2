"""The public names: one table per package (``procspawn._PUBLIC``, each subpackage's
``_LAZY``) from which ``__all__`` and the lazy imports are built, and the ``TYPE_CHECKING``
imports that say the same to type checkers, held to it here. Every public name imports and
is documented."""

from __future__ import annotations

import ast
import importlib
import inspect
import multiprocessing

import pytest

import procspawn

PACKAGES = [
    "procspawn",
    "procspawn.context",
    "procspawn.pool",
    "procspawn.sharing",
    "procspawn.sharing.cuda",
]


def _table(package) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute path) as the package's own table says."""
    if package.__name__ == "procspawn":
        return dict(package._PUBLIC)
    return {name: (module, name) for name, module in package._LAZY.items()}


def _type_checking_imports(package) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute path) as the package's ``if TYPE_CHECKING:`` block says."""
    tree = ast.parse(inspect.getsource(package))
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, f"{package.__name__}: one `if TYPE_CHECKING:` block expected"
    found: dict[str, tuple[str, str | None]] = {}
    helpers: dict[str, str] = {}  # names imported only to reach an attribute of theirs
    for node in blocks[0].body:
        if isinstance(node, ast.ImportFrom) and node.module == "typing":
            continue  # for annotations (typing is not imported at run time), not a name
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                name = alias.asname or alias.name
                if node.module is None:  # from . import sub: the subpackage itself
                    found[name] = ("." + alias.name, None)
                else:
                    found[name] = (module, alias.name)
        elif isinstance(node, ast.Assign):  # Queue = default_context.Queue
            (target,) = node.targets
            assert isinstance(target, ast.Name) and isinstance(node.value, ast.Attribute)
            base = ast.unparse(node.value.value)
            module, attr = found[base]
            helpers[base] = module
            found[target.id] = (module, f"{attr}.{node.value.attr}")
        else:
            raise AssertionError(f"unexpected statement: {ast.unparse(node)}")
    for helper in helpers:
        found.pop(helper)
    return found


@pytest.mark.parametrize("name", PACKAGES)
def test_type_checking_imports_are_the_table(name):
    package = importlib.import_module(name)
    assert _type_checking_imports(package) == _table(package)


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_the_table(name):
    package = importlib.import_module(name)
    table = set(_table(package))
    if name == "procspawn":
        extra = {n for n in multiprocessing.__all__ if not n.startswith("_")} - table
        assert set(package.__all__) == table | {"__version__"} | extra
    else:
        assert set(package.__all__) == table
    assert sorted(dir(package)) == sorted(set(dir(package)))  # no name twice


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_imports_and_is_documented(name):
    if name == "procspawn.sharing.cuda":
        pytest.importorskip("cupy", reason="procspawn.sharing.cuda's names need CuPy")
    package = importlib.import_module(name)
    for public in _table(package):
        value = getattr(package, public)
        if name == "procspawn" and (procspawn._PUBLIC[public][1] or "").startswith("default_"):
            assert value.__self__ is procspawn._dropin.default_context
        doc = inspect.getdoc(value)
        assert doc and len(doc.strip()) > 20, f"{name}.{public} has no useful docstring"


def test_a_missing_name_is_an_attribute_error_that_says_so():
    with pytest.raises(AttributeError, match="no attribute 'spwan'"):
        procspawn.spwan  # noqa: B018
