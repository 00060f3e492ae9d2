"""Sphinx configuration of procspawn's documentation.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (the ``docs``
extra installs what it needs). Nothing here uses the network. Before the pages are read,
this file writes what is made from the code and the data into ``docs/_generated/`` (never
committed): the settings table, the API reference's list of names, and the benchmark
tables and plots.
"""

from __future__ import annotations

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
GENERATED = os.path.join(DOCS, "_generated")

sys.path.insert(0, os.path.join(DOCS, "_scripts"))
sys.path.insert(0, ROOT)  # this checkout's procspawn, never another one installed

import docgen  # noqa: E402

import procspawn  # noqa: E402

project = "procspawn"
author = "the procspawn authors"
copyright = "the procspawn authors, MIT licence"
release = procspawn.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "_scripts", "Thumbs.db", ".DS_Store"]

myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"procspawn {release}"
html_static_path = ["_static"]
html_css_files = ["tables.css"]  # tables wrap to fit the page


docgen.write_all(GENERATED)


def setup(app):  # type: ignore[no-untyped-def]
    from sphinx.ext.autodoc import Documenter, FunctionDocumenter

    class OneSignature(FunctionDocumenter):
        """``autoonesignature``: ``autofunction`` that shows the signature it is given,
        not every typing overload (``spawn`` has four, one per ``join`` and ``backend``;
        the API page gives its one signature, see _scripts/api_page.py)."""

        objtype = "onesignature"
        directivetype = "function"
        priority = -100  # never chosen for a module's members

        def format_signature(self, **kwargs):  # type: ignore[no-untyped-def]
            if self.args is not None:
                return Documenter.format_signature(self, **kwargs)
            return super().format_signature(**kwargs)

    app.add_autodocumenter(OneSignature)
