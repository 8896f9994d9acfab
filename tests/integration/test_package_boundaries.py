"""No package reaches into another package's private names.

Each package's private modules and names (a leading underscore) may change in any release;
code of another package, the tests of another package, the integration tests, the benchmarks,
the examples, the CI scripts and noxfile.py use public, documented names only. A package's
own code and tests may use its own private names. Also forbidden across packages: naming
another package's private module in a string (``import_module("amp_fused_ops._flatten")``,
a ``monkeypatch`` target, code run with ``python -c``) and looking another package up in
``sys.modules`` instead of importing it.

A text (AST) scan, no imports: it runs in well under a second.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "amp-core": "amp_core",
    "amp-fused-ops": "amp_fused_ops",
    "amp-optimizers": "amp_optimizers",
    "amp-parallel": "amp_parallel",
    "amp-legacy-fp16": "amp_legacy_fp16",
}
NAMES = tuple(PACKAGES.values())
# A dotted module path of the toolkit with a private part, inside any string.
_PRIVATE_PATH = re.compile(r"\b(" + "|".join(NAMES) + r")((?:\.\w+)*?)\.(_(?!_)\w*)")


def _private(part: str) -> bool:
    """``_name`` is private; ``__dunder__`` names (``__version__``, ``__main__``) are not."""
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree`` (text for readers, not names in use)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _is_sys_modules(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "modules"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def violations(source: str, owner: str | None) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for every use of another package's private names in ``source``.

    Args:
        source: Python source text.
        owner: The import name of the package the file belongs to (its own private names are
            allowed), or ``None`` for files of no package (integration tests, benchmarks,
            noxfile.py).
    """
    tree = ast.parse(source)
    foreign = {name for name in NAMES if name != owner}
    aliases: dict[str, str] = {}  # local name -> module of another package it stands for
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _top(alias.name) not in foreign:
                    continue
                if any(_private(part) for part in alias.name.split(".")[1:]):
                    yield node.lineno, f"import {alias.name}"
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases[_top(alias.name)] = _top(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _top(node.module) not in foreign:
                continue
            if any(_private(part) for part in node.module.split(".")[1:]):
                yield node.lineno, f"from {node.module} import ..."
                continue
            for alias in node.names:
                if _private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
                else:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            parts = []
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                yield (
                    node.lineno,
                    f"{base.id}.{'.'.join(reversed(parts))}.{node.attr}".replace("..", "."),
                )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings:
                continue
            for match in _PRIVATE_PATH.finditer(node.value):
                if match.group(1) in foreign:
                    yield node.lineno, f"string {match.group(0)!r}"
            if "import" in node.value:  # Python code in a string (python -c, a subprocess)
                try:
                    inner = list(violations(node.value, owner))
                except SyntaxError:
                    inner = []
                for _line, what in inner:
                    if what.startswith("string "):
                        continue  # found by the pattern above already
                    yield node.lineno, f"code in a string: {what}"
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
            key = node.slice
            if isinstance(key, ast.Constant) and str(key.value).startswith(tuple(foreign)):
                yield node.lineno, f"sys.modules[{key.value!r}]"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _is_sys_modules(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith(tuple(foreign))
        ):
            yield node.lineno, f"sys.modules.{node.func.attr}({node.args[0].value!r})"
        elif isinstance(node, ast.Compare) and any(
            _is_sys_modules(right) for right in node.comparators
        ):
            left = node.left
            if isinstance(left, ast.Constant) and str(left.value).startswith(tuple(foreign)):
                yield node.lineno, f"{left.value!r} in sys.modules"


def _scanned_files() -> Iterator[tuple[Path, str | None]]:
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / "packages" / folder).rglob("*.py")):
            yield path, name
    for folder in ("benchmarks", "tests", "examples", ".ci", "docs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, None
    yield ROOT / "noxfile.py", None


def test_no_file_uses_another_packages_private_names() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path, owner in _scanned_files()
        if path != Path(__file__).resolve()
        for line, what in violations(path.read_text(), owner)
    ]
    assert not found, (
        "private names of another package are used (use or add a public, documented name of "
        "the owning package instead):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "source",
    [
        "import amp_fused_ops._flatten",
        "import amp_fused_ops._flatten as f",
        "from amp_fused_ops._loader import get_extension",
        "from amp_fused_ops.normalization._x import y",
        "from amp_fused_ops import _loader",
        "from amp_fused_ops import amp_C, _amp_C as c",
        "import amp_fused_ops\namp_fused_ops._loader.clear_cache()",
        "import amp_fused_ops as afo\nafo._loader",
        "from amp_fused_ops import syncbn\nsyncbn._impl",
        "import importlib\nimportlib.import_module('amp_fused_ops._flatten')",
        "ALIAS = ('amp_fused_ops._multi_tensor_apply',)",
        "monkeypatch.setattr('amp_core._casting.active_casting', None)",
        "import sys\ncore = sys.modules.get('amp_core')",
        "import sys\ncore = sys.modules['amp_core']",
        "import sys\nif 'amp_core' in sys.modules: pass",
        "CHECK = '''\nfrom amp_fused_ops import _loader\n_loader.clear_cache()\n'''",
    ],
)
def test_the_scan_finds_each_kind_of_use(source: str) -> None:
    assert list(violations(source, owner="amp_parallel"))


@pytest.mark.parametrize(
    "source",
    [
        "from amp_fused_ops import amp_C, multi_tensor_applier, __version__",
        "import amp_fused_ops\namp_fused_ops.syncbn.welford_mean_var",
        "from amp_parallel import _comm",  # its own private module
        "import sys\nsys.modules.get('amp_parallel._ddp')",
        "'''Docstring that names amp_fused_ops._loader for readers.'''",
        "import sys\nmonkeypatch.setitem(sys.modules, 'amp_fused_ops', None)",
        "import torch\ntorch._C",
    ],
)
def test_the_scan_allows_public_names_and_own_private_names(source: str) -> None:
    assert not list(violations(source, owner="amp_parallel"))
