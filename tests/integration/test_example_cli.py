"""Every example answers --help (without torchrun and without optional packages) and has
--smoke; the multi-process ones, started without torchrun, say how to start them.

All scripts run in one child process (torch is imported once): each is executed with
``runpy`` as ``__main__``, with scikit-learn, matplotlib and Pillow made unimportable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(
    path
    for path in EXAMPLES.glob("*/*.py")
    if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")
)
DISTRIBUTED = [
    "distributed/ddp_amp_o2.py",
    "distributed/syncbn.py",
    "fp16_optimizer/distributed.py",
]

_CHILD = r"""
import contextlib, importlib.abc, io, json, runpy, sys
from pathlib import Path

OPTIONAL = {"sklearn", "matplotlib", "PIL"}

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Missing())
results = []
for script, *args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) or exc.code is None else str(exc.code)
    sys.path.pop(0)
    results.append([script, args, code, out.getvalue(), err.getvalue()])
print("RESULT " + json.dumps(results))
"""


def _run_all(calls: list[list[str]]) -> list[tuple[str, list[str], object, str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    src = os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(calls)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,  # catches a hang, not slowness
        check=False,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    return [tuple(item) for item in json.loads(lines[-1].removeprefix("RESULT "))]


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, str], tuple[object, str, str]]:
    calls = [[str(path), "--help"] for path in SCRIPTS]
    calls += [[str(EXAMPLES / name), "--smoke"] for name in DISTRIBUTED]
    return {
        (str(Path(script).relative_to(EXAMPLES)), " ".join(args)): (code, out, err)
        for script, args, code, out, err in _run_all(calls)
    }


def test_every_example_is_found() -> None:
    names = {str(path.relative_to(EXAMPLES)) for path in SCRIPTS}
    assert {"demo/train_digits.py", "imagenet/main_amp.py", *DISTRIBUTED} <= names, names
    assert len(names) >= 11, names


@pytest.mark.parametrize("script", [str(p.relative_to(EXAMPLES)) for p in SCRIPTS])
def test_help_works_and_lists_smoke(outcomes, script: str) -> None:
    code, out, err = outcomes[(script, "--help")]
    assert code == 0, f"{script} --help exited {code}:\n{out}\n{err}"
    assert out.startswith("usage:"), out
    if script != "collect_results.py":  # the results runner is not an example itself
        assert "--smoke" in out, out


@pytest.mark.parametrize("script", DISTRIBUTED)
def test_distributed_example_without_torchrun_says_how_to_start_it(outcomes, script) -> None:
    code, out, err = outcomes[(script, "--smoke")]
    assert isinstance(code, str), (code, out, err)  # sys.exit(message): exit status 1
    assert f"torchrun --nproc-per-node 2 examples/{script}" in code, code
    assert "RANK expected" not in err + code
