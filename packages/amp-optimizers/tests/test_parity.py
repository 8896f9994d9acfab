"""Every registered optimizer matches torch.optim or the written-out Apex reference (fp32).

Ten steps over two param groups with different hyperparameters; the last param of each group
never gets a gradient and must stay untouched, without state. Each comparison runs on the
compiled kernels and, with ``AMP_FUSED_OPS_DISABLE=1``, on the pure-PyTorch reference ops.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from _amp_optimizers_helpers import (
    DEVICES,
    NO_GRAD,
    SPECS,
    OptimizerSpec,
    make_params,
    max_abs_diff,
    run_steps,
    two_groups,
)
from amp_fused_ops import extensions

PATHS = ["kernel", "reference"]


@pytest.fixture(autouse=True)
def _fresh_loader() -> Iterator[None]:
    """The loader reads AMP_FUSED_OPS_DISABLE once per process: start over around each test."""
    extensions.clear_cache()
    yield
    extensions.clear_cache()


def _select_path(path: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the reference ops, or make sure the compiled kernels are the ones tested."""
    kind = torch.device(device).type
    if path == "reference":
        monkeypatch.setenv(extensions.DISABLE_ENV, "1")
        extensions.clear_cache()
        assert extensions.get_extension(kind) is None
    elif extensions.get_extension(kind) is None:
        pytest.skip(f"no compiled {kind} extension: {extensions.unavailable_reason(kind)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_ten_steps_match_the_reference(
    spec: OptimizerSpec, path: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _select_path(path, device, monkeypatch)
    params = make_params(device)
    ref_params = make_params(device)
    initial = [p.detach().clone() for p in params]
    opt = spec.factory(two_groups(params, spec.second_group))
    ref = spec.reference(two_groups(ref_params, spec.second_group))

    run_steps(opt, params, range(10))
    run_steps(ref, ref_params, range(10))

    active = [i for i in range(len(params)) if i not in NO_GRAD]
    moved = max_abs_diff([params[i] for i in active], [initial[i] for i in active])
    assert moved > 100 * spec.atol, "the optimizer barely moved the params: a vacuous test"
    diff = max_abs_diff([params[i] for i in active], [ref_params[i] for i in active])
    assert diff <= spec.atol, f"max |fused - reference| = {diff:.3g} > {spec.atol}"
    for i in NO_GRAD:
        assert torch.equal(params[i], initial[i]), "a param without gradient was changed"
        assert params[i] not in opt.state, "a param without gradient got optimizer state"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [s for s in SPECS if s.group_step], ids=str)
def test_param_whose_first_gradient_comes_later(spec: OptimizerSpec, device: str) -> None:
    # Param 1 joins at step 3: its state starts then while the others' continues (the SGD
    # momentum buffer of a late param starts from its gradient, the others keep theirs).
    params = make_params(device)
    ref_params = make_params(device)
    opt = spec.factory(two_groups(params, spec.second_group))
    ref = spec.reference(two_groups(ref_params, spec.second_group))
    early = [i for i in range(len(params)) if i not in (*NO_GRAD, 1)]
    for optimizer, ps in ((opt, params), (ref, ref_params)):
        run_steps(optimizer, ps, range(3), active=early)
        run_steps(optimizer, ps, range(3, 8))

    diff = max_abs_diff(params, ref_params)
    assert diff <= spec.atol, f"max |fused - reference| = {diff:.3g} > {spec.atol}"
