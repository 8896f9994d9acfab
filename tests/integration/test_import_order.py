"""Every module of every package imports first, in any order, in a fresh interpreter.

A runtime import cycle shows as an ImportError ("partially initialized module") when the
module in the middle of the cycle happens to be imported first; shuffling the order over a few
seeds finds it without knowing where it is. A cycle whose modules only read each other's
attributes at call time imports in every order, so the module-level import graph of every
package is also read from the sources (ast) and must have no cycle at all.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "packages").glob("*/src"))
# Run as programs or by the interpreter at start-up, not imported by the toolkit.
SKIPPED_NAMES = ("__main__", "sitecustomize")


def _module_files(sources: list[Path]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's ``__init__``)."""
    files = {}
    for src in sources:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            if parts and parts[-1] not in SKIPPED_NAMES:
                files[".".join(parts)] = (path, is_package)
    return files


def _modules() -> list[str]:
    return list(_module_files(SOURCES))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported (not those in functions or classes)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _module_level_imports(node.body)
            found += _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                found += _module_level_imports(block)
            for handler in node.handlers:
                found += _module_level_imports(handler.body)
        elif isinstance(node, ast.With):
            found += _module_level_imports(node.body)
    return found


def import_graph(sources: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports at module level.

    ``from package import name`` points at the submodule ``package.name`` when there is one,
    else at ``package``. The implicit import of a module's parent packages is left out: Python
    always finishes a parent's ``__init__`` (which may import its children) first.
    """
    files = _module_files(sources)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in files.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str | None] = set()
        for node in _module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                edges.update(known(alias.name) for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                edges.add(full if full in files else known(base))
        graph[name] = {edge for edge in edges if edge is not None and edge != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (no recursion limit)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            for edge in edges:
                if edge not in index:
                    index[edge] = low[edge] = len(index)
                    stack.append(edge)
                    work.append((edge, iter(sorted(graph[edge]))))
                    break
                if edge in stack:
                    low[node] = min(low[node], index[edge])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


_CHECK = """
import importlib, random, sys
names = sys.argv[2:]
random.Random(int(sys.argv[1])).shuffle(names)
first = names[0]
importlib.import_module(first)  # alone first: a cycle through it breaks here
for name in names[1:]:
    importlib.import_module(name)
print(first)
"""


def test_the_module_list_covers_every_package() -> None:
    tops = {name.split(".")[0] for name in _modules()}
    assert tops == {"amp_core", "amp_fused_ops", "amp_optimizers", "amp_parallel",
                    "amp_legacy_fp16"}  # fmt: skip


def test_no_package_has_a_module_level_import_cycle() -> None:
    graph = import_graph(SOURCES)
    assert {"amp_fused_ops.amp_C", "amp_fused_ops.syncbn"} <= graph["amp_fused_ops"]  # read
    assert import_cycles(graph) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("files", "cycle"),
    [
        (  # relative imports of two modules of one folder (the old cache <-> toolkit)
            {
                "pkg/__init__.py": "",
                "pkg/sub/__init__.py": "",
                "pkg/sub/cache.py": "from . import toolkit\n",
                "pkg/sub/toolkit.py": "from . import cache\n",
            },
            ["pkg.sub.cache", "pkg.sub.toolkit"],
        ),
        (  # a submodule that takes a name from its package's __init__, which imports it
            {
                "pkg/__init__.py": "from pkg.a import f\nVALUE = 1\n",
                "pkg/a.py": "import os\nfrom pkg import VALUE\ndef f(): pass\n",
            },
            ["pkg", "pkg.a"],
        ),
        (  # three modules, absolute imports, one of them under a module-level `if`
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "import pkg.b\n",
                "pkg/b.py": "import sys\nif sys.platform:\n    from pkg.c import x\n",
                "pkg/c.py": "from pkg import a\nx = 1\n",
            },
            ["pkg.a", "pkg.b", "pkg.c"],
        ),
    ],
)
def test_the_cycle_check_finds_a_cycle(
    tmp_path: Path, files: dict[str, str], cycle: list[str]
) -> None:
    _write(tmp_path, files)
    assert import_cycles(import_graph([tmp_path])) == [cycle]


def test_the_cycle_check_ignores_deferred_and_type_only_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",
            "pkg/a.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
            ),
            "pkg/b.py": "from pkg import a\ndef f():\n    from pkg import b\n",
        },
    )
    assert import_cycles(import_graph([tmp_path])) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_modules_import_in_a_random_order(seed: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, SOURCES))}
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, str(seed), *_modules()],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


_EACH_FIRST = """
import importlib, os, sys, torch  # torch once: each child below starts from this state
failures = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException as error:
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failures.append(name)
sys.exit(1 if failures else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (one child per module)")
def test_each_module_imports_first() -> None:
    """Each module first in its own child of an interpreter that has imported only torch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, SOURCES))}
    done = subprocess.run(
        [sys.executable, "-c", _EACH_FIRST, *_modules()],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


_COMPILER_STACK = """
import sys
import amp_core, amp_fused_ops, amp_legacy_fp16, amp_optimizers, amp_parallel  # noqa: F401
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_importing_the_packages_leaves_the_compiler_stack_unloaded() -> None:
    """torch._dynamo and torch._inductor take seconds to import: only torch.compile loads them
    (a decorator from torch.compiler, applied at import time, once loaded torch._dynamo)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, SOURCES))}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILER_STACK],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
