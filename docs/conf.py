"""Sphinx configuration of the amp toolkit documentation (`nox -s docs`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# autodoc imports the packages straight from their source folders, so no install is needed.
for src in sorted(ROOT.glob("packages/*/src")):
    sys.path.insert(0, str(src))

PACKAGES = ["amp-core", "amp-fused-ops", "amp-optimizers", "amp-parallel", "amp-legacy-fp16"]


def _package_version(package: str) -> str:
    """The version in ``packages/<package>/src/<module>/_version.py`` (what its wheel gets)."""
    module = package.replace("-", "_")
    text = (ROOT / "packages" / package / "src" / module / "_version.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, flags=re.M)
    if match is None:
        raise RuntimeError(f'no __version__ = "..." line in {package}\'s _version.py')
    return match.group(1)


VERSIONS = {package: _package_version(package) for package in PACKAGES}

project = "the amp toolkit"
author = "the amp toolkit contributors"
copyright = "2025-2026, the amp toolkit contributors (BSD 3-Clause License)"
# Each package has its own version; the documentation describes this set of them.
version = release = ", ".join(f"{package} {number}" for package, number in VERSIONS.items())

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
templates_path = ["_templates"]  # layout.html: versions, license and changelog links in the footer
html_theme = "alabaster"
html_static_path = ["_static"]
html_title = "the amp toolkit documentation"
html_theme_options = {
    "description": "Versions: " + release,
    "extra_nav_links": {
        "License (BSD 3-Clause)": "license.html",
        "Changelogs": "changelog.html",
        "Releases and supported versions": "releasing.html",
    },
}
