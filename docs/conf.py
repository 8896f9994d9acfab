"""Sphinx configuration of the amp toolkit documentation (`nox -s docs`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# autodoc imports the packages straight from their source folders, so no install is needed.
for src in sorted(ROOT.glob("packages/*/src")):
    sys.path.insert(0, str(src))

project = "the amp toolkit"
author = "the amp toolkit contributors"
copyright = "2025-2026, the amp toolkit contributors (BSD 3-Clause License)"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

# Google-style docstrings (Args / Returns / Raises / Example).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
