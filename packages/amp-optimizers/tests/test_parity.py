"""Every registered optimizer matches torch.optim or the written-out Apex reference (fp32).

Ten steps over two param groups with different hyperparameters; the last param of each group
never gets a gradient and must stay untouched, without state. Each comparison runs on the
compiled kernels and, inside ``amp_fused_ops.extensions.use_reference()``, on the pure-PyTorch
reference ops (counted: every step ran a reference).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from amp_test_support import DEVICES

from _amp_optimizers_helpers import (
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


def _select_path(path: str, device: str) -> AbstractContextManager[extensions.ReferenceCalls]:
    """The block the fused optimizer steps in: the reference ops (their calls counted), or the
    compiled kernels (skipped where they cannot be built)."""
    if path == "reference":
        return extensions.use_reference()
    kind = torch.device(device).type
    if extensions.get_extension(kind) is None:
        pytest.skip(f"no compiled {kind} extension: {extensions.unavailable_reason(kind)}")
    return nullcontext(extensions.ReferenceCalls())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_ten_steps_match_the_reference(spec: OptimizerSpec, path: str, device: str) -> None:
    block = _select_path(path, device)
    params = make_params(device)
    ref_params = make_params(device)
    initial = [p.detach().clone() for p in params]
    opt = spec.factory(two_groups(params, spec.second_group))
    ref = spec.reference(two_groups(ref_params, spec.second_group))

    with block as calls:
        run_steps(opt, params, range(10))
    run_steps(ref, ref_params, range(10))
    if path == "reference":  # every step ran the reference of an amp_C op
        assert sum(calls.values()) >= 10, calls

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
