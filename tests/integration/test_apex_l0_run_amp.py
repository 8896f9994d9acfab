"""Apex's own amp unit tests, run under ``python -m amp_legacy_fp16.apex_run`` on the CPU.

Five test files of Apex's ``tests/L0/run_amp`` and their ``utils.py``, as they are at
NVIDIA/apex commit ``e13873de`` (the last one before amp was removed, PR #1896), are read from
an Apex checkout: ``AMP_APEX_L0_DIR`` names its ``tests/L0/run_amp`` folder (e.g. after ``git
clone https://github.com/NVIDIA/apex && git -C apex checkout e13873de``), and their git blob
ids are checked first. The repository does not carry Apex's files; without the variable these
tests are reported as skipped, and the behaviour they rely on is covered by the toolkit's own
tests (``test_cast_model_type_false.py``, ``test_constructor.py``...), which always run. The
only change made to run them is the device: each file is copied with ``torch.cuda.`` ->
``torch.``, ``'cuda'`` -> ``'cpu'`` and ``.cuda()`` -> ``.cpu()`` (:func:`_on_cpu`), and
unittest runs the copies with ``import apex`` resolving to the toolkit.

They exercise what Apex's multi-model scripts rely on: several models, optimizers and losses
through one ``amp.initialize`` with ``num_losses``, ``cast_model_type=False`` with models that
hold float16 params (and ``_amp_state.allow_incoming_model_not_fp32``), ``add_param_group``
after ``initialize``, ``FusedSGD`` with ``lr`` given per param group only, per-loss scalers
set through ``_amp_state.loss_scalers[i]._loss_scale``, injected infs that skip a step, O1's
weight-cast cache across train / eval / train, and checkpoints.

One case differs on the CPU, on purpose, and is pinned here with its reason:
``test_checkpointing.TestCheckpointing.test_loss_scale_decrease`` overflows the gradients with
inputs times 2**17, which overflows float16 only. On the CPU, amp's half dtype defaults to
bfloat16 (float32's exponent range): no step is skipped and the scale stays at 2**16. (Apex's
``test_restoring`` passes: it builds the restored model with a second ``amp.initialize`` while
the first model trains on; each call keeps its own loss scalers here, where Apex re-created
global ones, which the amp-core README's checkpoint section describes.)

With the checkout, :data:`CI_CASES` run (every file, 12 of the 18 cases, about 30 s on two
busy cores); the other six (:data:`OTHER_CASES`: the three-model variants, ``FusedSGD`` with two
optimizers and ``test_restoring``, about 80 s more) run with ``AMP_APEX_L0_ALL=1`` too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APEX_DIR_ENV = "AMP_APEX_L0_DIR"
APEX_TESTS = Path(os.environ.get(APEX_DIR_ENV) or "/nonexistent")
TIMEOUT = 900  # a cold start imports torch and may compile the CPU extension on a busy machine

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("apex") is not None, reason="a real apex is installed"
    ),
    pytest.mark.skipif(
        not APEX_TESTS.is_dir(),
        reason=f"{APEX_DIR_ENV} does not name Apex's tests/L0/run_amp folder (Apex e13873de)",
    ),
]

# git blob ids of the files at NVIDIA/apex e13873debc4699d39c6861074b9a3b2a02327f92.
APEX_BLOBS = {
    "utils.py": "7aa20c36918f28967ade3d94921a565327c366fe",
    "test_add_param_group.py": "6aa1cbbe9e6214e680544e0d25463e2bdf55992c",
    "test_cache.py": "53bd8802d65ba9e1209818fb7fbfdb0e1a47fa30",
    "test_checkpointing.py": "921985cd7d790e6d226a797b0c92258a33c65c78",
    "test_fused_sgd.py": "3940271b1df8a743993a1efcf6a7b0378625d272",
    "test_multiple_models_optimizers_losses.py": "e8a767f9a4b6c247a4e07ba32ba2bb95369b9633",
}

_MULTI = "TestMultipleModelsOptimizersLosses"
_CACHE_CASES = [
    f"test_cache.TestCache.test_{kind}_module_{dtype}_weight"
    for kind in ("whitelist", "blacklist", "promote")
    for dtype in ("fp16", "fp32")
]
CI_CASES = [
    "test_add_param_group.TestAddParamGroup.test_add_param_group",
    *_CACHE_CASES,
    "test_checkpointing.TestCheckpointing.test_loss_scale_decrease",
    "test_checkpointing.TestCheckpointing.test_state_dict",
    f"test_multiple_models_optimizers_losses.{_MULTI}.test_2models2losses1optimizer",
    f"test_multiple_models_optimizers_losses.{_MULTI}.test_2models2losses2optimizers",
    f"test_fused_sgd.{_MULTI}.test_2models2losses1optimizer",
]
OTHER_CASES = [
    "test_checkpointing.TestCheckpointing.test_restoring",
    f"test_multiple_models_optimizers_losses.{_MULTI}.test_3models2losses1optimizer",
    f"test_multiple_models_optimizers_losses.{_MULTI}.test_3models2losses2optimizers",
    f"test_fused_sgd.{_MULTI}.test_2models2losses2optimizers",
    f"test_fused_sgd.{_MULTI}.test_3models2losses1optimizer",
    f"test_fused_sgd.{_MULTI}.test_3models2losses2optimizers",
]
# What differs on the CPU, with the line unittest reports (see the module docstring).
CPU_FAILURES = {
    "test_checkpointing.TestCheckpointing.test_loss_scale_decrease": "65536.0 != 32768.0",
}


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _on_cpu(source: str) -> str:
    """The device change, and only it: Apex's tests name CUDA in these three ways."""
    source = source.replace("torch.cuda.", "torch.")
    source = source.replace("'cuda'", "'cpu'")
    return source.replace(".cuda()", ".cpu()")


def _run(cases: list[str], where: Path) -> dict[str, str]:
    """Run ``cases`` with unittest under the runner in one process: case -> outcome line."""
    for name in APEX_BLOBS:
        if name.endswith(".py"):
            (where / name).write_text(_on_cpu((APEX_TESTS / name).read_text()))
    env = dict(os.environ)
    src = os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    args = [sys.executable, "-W", "ignore", "-m", "amp_legacy_fp16.apex_run"]
    run = subprocess.run(
        [*args, "-m", "unittest", "-v", *cases],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        env=env,
        cwd=where,
    )
    outcomes = {}
    for line in run.stderr.splitlines():
        found = re.match(r"(test_\w+) \((test_\w+)\.(\w+)\.test_\w+\) \.\.\. (\w+)", line)
        if found:
            method, module, cls, outcome = found.groups()
            outcomes[f"{module}.{cls}.{method}"] = outcome
    for case, reason in CPU_FAILURES.items():
        if case in outcomes:
            assert reason in run.stderr, run.stderr
            outcomes[case] = f"differs on the CPU: {reason}"
    assert sorted(outcomes) == sorted(cases), f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return outcomes


def _expected(cases: list[str]) -> dict[str, str]:
    return {
        case: f"differs on the CPU: {CPU_FAILURES[case]}" if case in CPU_FAILURES else "ok"
        for case in cases
    }


def test_the_apex_test_files_are_apexs_unedited() -> None:
    found = {name: _blob_id((APEX_TESTS / name).read_bytes()) for name in APEX_BLOBS}
    assert found == APEX_BLOBS
    cases = {c.split(".")[0] for c in CI_CASES + OTHER_CASES}
    assert cases == {n.removesuffix(".py") for n in APEX_BLOBS if n.startswith("test_")}


def test_the_cpu_copies_differ_in_the_device_only() -> None:
    for name in APEX_BLOBS:
        if not name.endswith(".py"):
            continue
        original = (APEX_TESTS / name).read_text()
        cpu = _on_cpu(original)
        assert "cuda" not in cpu, name
        changed = [
            (a, b) for a, b in zip(original.splitlines(), cpu.splitlines(), strict=True) if a != b
        ]
        for before, after in changed:
            assert re.sub(r"cuda\.|'cuda'|\.cuda\(\)", "", before) == re.sub(
                r"'cpu'|\.cpu\(\)", "", after
            ), (before, after)


@pytest.mark.slow  # one Python process for the cases CI runs
def test_apex_amp_tests_pass_on_the_cpu(tmp_path: Path) -> None:
    assert _run(CI_CASES, tmp_path) == _expected(CI_CASES)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("AMP_APEX_L0_ALL") != "1",
    reason="the other 6 of Apex's run_amp cases (about 80 s): set AMP_APEX_L0_ALL=1 to run them",
)
def test_the_other_apex_amp_tests_pass_on_the_cpu(tmp_path: Path) -> None:
    assert _run(OTHER_CASES, tmp_path) == _expected(OTHER_CASES)
