"""The GPU tests' figures, written to a JSON file at the end of the run (see conftest)."""

from __future__ import annotations

FIGURES: dict[str, object] = {}
