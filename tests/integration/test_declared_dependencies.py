"""Every toolkit package a package imports is declared in its pyproject.toml.

A package's test session (``nox -s "tests(package='amp-core')"``) installs that package and the
toolkit packages its pyproject.toml declares (``dependencies`` and the extras'), nothing else
of the toolkit; this scan finds what would fail there, and more, without running anything:

- the package's code (``src/``) imports a toolkit package at run time only if it is in
  ``dependencies`` (what ``pip install <package>`` brings), or inside a ``try`` whose
  ``except`` catches ImportError (an optional integration: amp-parallel's ``amp`` and
  ``kernels`` extras, amp-fused-ops asking amp-core whether O1 casting is on), or under ``if
  TYPE_CHECKING:``;
- the package's tests (``tests/``, helpers and conftest.py too) import only the package itself
  and the toolkit packages it declares, also through ``pytest.importorskip``,
  ``importlib.import_module``, ``__import__`` and Python code in a string (``python -c``); an
  importorskip of another package would skip silently in the package's own session. A test of
  two packages together belongs in tests/integration, whose session installs all five.

A text (AST) scan, no imports: it runs in well under a second.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "amp-core": "amp_core",
    "amp-fused-ops": "amp_fused_ops",
    "amp-optimizers": "amp_optimizers",
    "amp-parallel": "amp_parallel",
    "amp-legacy-fp16": "amp_legacy_fp16",
}
NAMES = set(PACKAGES.values())
# The calls that import the module named by their first argument.
_IMPORT_CALLS = {"importorskip", "import_module", "__import__"}


def _requirement_name(text: str) -> str:
    """The distribution a requirement string names, normalized (``amp_core>=0.1`` -> amp-core)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", text)
    assert match, f"cannot read the requirement {text!r}"
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def declared(package: str) -> tuple[set[str], set[str]]:
    """The import names of the toolkit packages ``package`` requires, and of those only its
    extras bring (both read from its pyproject.toml)."""
    with (ROOT / "packages" / package / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    required = {_requirement_name(text) for text in project.get("dependencies", [])}
    extras = {
        _requirement_name(text)
        for texts in project.get("optional-dependencies", {}).values()
        for text in texts
    }
    names = {dist: PACKAGES[dist] for dist in PACKAGES if dist != package}
    return (
        {name for dist, name in names.items() if dist in required},
        {name for dist, name in names.items() if dist in extras - required},
    )


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = []
    if handler.type is None:
        return True
    for node in ast.walk(handler.type):
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
    return bool({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"} & set(names))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _optional_nodes(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside a ``try`` that catches ImportError or ``if TYPE_CHECKING``."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body: list[ast.stmt] = []
        guarded = isinstance(node, ast.Try) and any(map(_catches_import_error, node.handlers))
        if guarded or (isinstance(node, ast.If) and _is_type_checking(node.test)):
            body = node.body
        for statement in body:
            found.update(id(inner) for inner in ast.walk(statement))
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree`` (text for readers, not code)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def imports(source: str) -> Iterator[tuple[int, str, bool, str]]:
    """``(line, toolkit module, optional, how)`` for every import of a toolkit package.

    ``optional`` is true inside a ``try`` that catches ImportError or under ``if
    TYPE_CHECKING``.
    """
    tree = ast.parse(source)
    optional = _optional_nodes(tree)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        modules: list[tuple[str, str]] = []
        if isinstance(node, ast.Import):
            modules = [(alias.name, f"import {alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [(node.module, f"from {node.module} import ...")]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if name in _IMPORT_CALLS and isinstance(first, ast.Constant):
                modules = [(str(first.value), f"{name}({first.value!r})")]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and "import" in node.value
            and any(name in node.value for name in NAMES)
        ):  # Python code in a string (python -c, a subprocess)
            try:
                inner = list(imports(node.value))
            except SyntaxError:
                inner = []
            for _line, module, inner_optional, how in inner:
                yield node.lineno, module, inner_optional, f"code in a string: {how}"
        for module, how in modules:
            if _top(module) in NAMES:
                yield node.lineno, _top(module), id(node) in optional, how


def violations(source: str, package: str, kind: str) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for every toolkit import ``package``'s pyproject.toml does not allow.

    Args:
        source: Python source text of a file of ``package``.
        package: The distribution the file belongs to (``amp-core``).
        kind: ``"src"`` for the package's code, ``"tests"`` for its tests.
    """
    own = PACKAGES[package]
    required, extras = declared(package)
    for line, module, optional, how in imports(source):
        if module == own or module in required:
            continue
        if kind == "src" and optional:
            continue
        if kind == "tests" and module in extras:
            continue
        why = (
            "an extra's package outside a try/except ImportError"
            if module in extras
            else ("a package it does not declare")
        )
        yield line, f"{how}: {why}"


def _scanned_files() -> Iterator[tuple[Path, str, str]]:
    for package in PACKAGES:
        for kind in ("src", "tests"):
            for path in sorted((ROOT / "packages" / package / kind).rglob("*.py")):
                yield path, package, kind


def test_every_toolkit_import_is_declared() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path, package, kind in _scanned_files()
        for line, what in violations(path.read_text(), package, kind)
    ]
    assert not found, (
        "imports of toolkit packages that the package's pyproject.toml does not declare (they "
        "fail in the package's own test session, or for users who install it alone): declare "
        "the dependency, make the import optional (try/except ImportError), or move a test of "
        "several packages to tests/integration:\n" + "\n".join(found)
    )


def test_the_op_library_imports_no_other_toolkit_package() -> None:
    # amp-fused-ops is the bottom of the toolkit: not even an optional import of another
    # package (amp O1's rule for its norm is a row of amp-core's policy table instead).
    found = [
        f"{path.relative_to(ROOT)}:{line}: {how}"
        for path, package, kind in _scanned_files()
        if package == "amp-fused-ops" and kind == "src"
        for line, module, _optional, how in imports(path.read_text())
        if module != "amp_fused_ops"
    ]
    assert not found, found


def test_the_scan_reads_every_package() -> None:
    # A package whose folder moved or whose files the scan missed would pass unchecked.
    for package in PACKAGES:
        kinds = {kind for path, owner, kind in _scanned_files() if owner == package}
        assert kinds == {"src", "tests"}, (package, kinds)
    # amp-parallel's extras are the packages it may import optionally; amp-optimizers requires
    # two (read from the real pyproject.toml files, as the test sessions read them).
    assert declared("amp-parallel") == (set(), {"amp_core", "amp_fused_ops"})
    assert declared("amp-optimizers") == ({"amp_core", "amp_fused_ops"}, set())


@pytest.mark.parametrize(
    ("source", "package", "kind"),
    [
        ("import amp_optimizers", "amp-core", "tests"),
        ("from amp_optimizers import FusedAdam", "amp-core", "tests"),
        ("import amp_optimizers.fused_adam as f", "amp-core", "src"),
        ("import pytest\nopt = pytest.importorskip('amp_optimizers')", "amp-core", "tests"),
        ("import importlib\nimportlib.import_module('amp_core.amp')", "amp-fused-ops", "tests"),
        ("core = __import__('amp_core')", "amp-parallel", "src"),
        ("CHILD = '''\nfrom amp_parallel import DistributedDataParallel\n'''", "amp-core", "tests"),
        ("def f():\n    from amp_core import amp\n    return amp", "amp-parallel", "src"),
        ("try:\n    import amp_parallel\nexcept ImportError:\n    pass", "amp-core", "tests"),
        ("from amp_core import amp", "amp-fused-ops", "src"),
    ],
)
def test_the_scan_finds_each_kind_of_undeclared_import(source: str, package: str, kind: str):
    assert list(violations(source, package, kind))


@pytest.mark.parametrize(
    ("source", "package", "kind"),
    [
        ("from amp_core import amp\nimport amp_fused_ops", "amp-optimizers", "src"),
        ("from amp_core import amp", "amp-legacy-fp16", "tests"),
        ("import amp_parallel.syncbn", "amp-parallel", "tests"),
        (
            "try:\n    from amp_core import x\nexcept ImportError:\n    x = None",
            "amp-parallel",
            "src",
        ),
        (
            "try:\n    from amp_core import x\nexcept ImportError:\n    x = None",
            "amp-fused-ops",
            "src",
        ),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import amp_core",
            "amp-parallel",
            "src",
        ),
        ("import pytest\namp = pytest.importorskip('amp_core').amp", "amp-parallel", "tests"),
        (
            "import sys\nmonkeypatch.setitem(sys.modules, 'amp_fused_ops', None)",
            "amp-parallel",
            "tests",
        ),
        ("MESSAGE = 'pip install amp-optimizers'", "amp-legacy-fp16", "tests"),
        ("'''Docstring:\n\nfrom amp_optimizers import FusedAdam\n'''", "amp-core", "tests"),
    ],
)
def test_the_scan_allows_declared_and_optional_imports(source: str, package: str, kind: str):
    assert not list(violations(source, package, kind))
