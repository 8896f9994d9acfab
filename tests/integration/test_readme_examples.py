"""Every Python example of a README stands alone: pasted into a new interpreter, it runs.

``nox -s build`` runs the examples (``.ci/readme_examples.py``, each in a fresh namespace,
nothing defined before it); this test catches, without running anything, an example that uses
a name it never defines (a ``model`` the reader is assumed to have), and checks that the runner
defines nothing of its own before an example.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = sorted([ROOT / "README.md", *ROOT.glob("packages/*/README.md")])
EXAMPLES = [
    (readme, number, code)
    for readme in READMES
    for number, code in enumerate(
        re.findall(r"^```python\n(.*?)^```", readme.read_text(), flags=re.M | re.S), start=1
    )
]


def undefined_names(code: str) -> set[str]:
    """Names the code reads but never binds (imports, assignments, defs, loop and with targets),
    builtins aside. Function bodies count their own parameters as bound."""
    tree = ast.parse(code)
    bound: set[str] = set(dir(builtins)) | {"__name__", "__file__"}
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound


def test_undefined_names_are_found() -> None:
    assert undefined_names("x = model(1)\nfor a, b in loader:\n    print(a)") == {"model", "loader"}
    assert undefined_names("import torch.nn as nn\ndef f(m):\n    return nn, m\nf(1)") == set()


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 8, [(str(r), n) for r, n, _ in EXAMPLES]


@pytest.mark.parametrize(
    ("readme", "number", "code"),
    EXAMPLES,
    ids=[f"{r.relative_to(ROOT)}-{n}" for r, n, _ in EXAMPLES],
)
def test_example_defines_every_name_it_uses(readme: Path, number: int, code: str) -> None:
    missing = undefined_names(code)
    assert not missing, (
        f"{readme.relative_to(ROOT)} example {number} uses {sorted(missing)} without defining "
        f"them: a reader who pastes it gets a NameError; define stand-ins in the example"
    )


def test_the_runner_defines_nothing_before_an_example() -> None:
    runner = (ROOT / ".ci" / "readme_examples.py").read_text()
    assert "SETUP" not in runner
    assert 'namespace = {"__name__": "__main__"}' in runner
