"""fp16 and bf16 params: float32 state, and results close to float32 references.

The fused optimizers step low-precision params in place (no master copy), reading and writing
the param in its dtype with float32 math and float32 state. Two references bound the result,
relative to the param scale:

* a float32-master reference (the algorithm on float32 copies): after two steps, two roundings
  of half an ulp each stay within the dtype's tolerance (fp16 1e-3, bf16 1.6e-2);
* the same reference with its params rounded to the dtype after every step: over eight steps
  only the rounding of the last bit may differ, so the state must have kept float32 precision.

Float32 params sharing the optimizer with half ones must match to float32 precision.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from amp_test_support import DEVICES, HALF_DTYPES

from _amp_optimizers_helpers import (
    ACTIVE,
    FP32_ATOL,
    HALF_RTOL,
    NO_GRAD,
    SPECS,
    OptimizerSpec,
    float_copies,
    loss_of,
    make_params,
    max_abs_diff,
    run_steps,
    two_groups,
)

MASTER_STEPS = 2
ROUNDED_STEPS = 8
MIXED = (
    torch.float32,
    torch.bfloat16,
    torch.float32,
    torch.float16,
    torch.float16,
    torch.float32,
    torch.bfloat16,
    torch.float32,
)


def _run_reference(
    spec: OptimizerSpec,
    params: Sequence[torch.Tensor],
    dtypes: Sequence[torch.dtype],
    steps: int,
    *,
    round_params: bool,
) -> list[torch.Tensor]:
    """The reference on float32 copies of ``params``, fed the gradients the fused optimizer
    sees (rounded to each param's dtype); with ``round_params``, each param is rounded to its
    dtype after every step."""
    ref_params = float_copies(params)
    ref = spec.reference(two_groups(ref_params, spec.second_group))
    for step in range(steps):
        ref.zero_grad()
        loss_of(ref_params, step).backward()
        with torch.no_grad():
            for p, dtype in zip(ref_params, dtypes, strict=True):
                if p.grad is not None:
                    p.grad.copy_(p.grad.to(dtype))
        ref.step()
        if round_params:
            with torch.no_grad():
                for p, dtype in zip(ref_params, dtypes, strict=True):
                    p.copy_(p.to(dtype))
    return ref_params


def _check_against_references(
    spec: OptimizerSpec, device: str, dtypes: Sequence[torch.dtype]
) -> None:
    params = make_params(device, list(dtypes))
    master_params = _run_reference(spec, params, dtypes, MASTER_STEPS, round_params=False)
    rounded_params = _run_reference(spec, params, dtypes, ROUNDED_STEPS, round_params=True)
    opt = spec.factory(two_groups(params, spec.second_group))
    run_steps(opt, params, range(MASTER_STEPS))
    after_master_steps = [p.detach().clone() for p in params]
    run_steps(opt, params, range(MASTER_STEPS, ROUNDED_STEPS))

    assert [p.dtype for p in params] == list(dtypes)
    for i in ACTIVE:
        for key, value in opt.state[params[i]].items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert value.dtype == torch.float32, f"state {key!r} of param {i} is {value.dtype}"
    for i in NO_GRAD:
        assert params[i] not in opt.state
    scale = max(master_params[i].abs().max().item() for i in ACTIVE)
    for i in ACTIVE:
        if dtypes[i] == torch.float32:
            bound = FP32_ATOL
            rounded_bound = FP32_ATOL
        else:
            bound = HALF_RTOL[dtypes[i]] * scale
            # One ulp of the dtype at the param scale: a last-bit rounding difference.
            rounded_bound = torch.finfo(dtypes[i]).eps * scale
        diff = max_abs_diff([after_master_steps[i]], [master_params[i]])
        assert diff <= bound, (
            f"param {i} ({dtypes[i]}) vs float32 masters: {diff:.3g} > {bound:.3g}"
        )
        diff = max_abs_diff([params[i]], [rounded_params[i]])
        assert diff <= rounded_bound, (
            f"param {i} ({dtypes[i]}) vs rounded reference: {diff:.3g} > {rounded_bound:.3g}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_half_params_track_float32_references(
    spec: OptimizerSpec, dtype: torch.dtype, device: str
) -> None:
    _check_against_references(spec, device, [dtype] * len(MIXED))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_float32_and_half_params_in_one_optimizer(spec: OptimizerSpec, device: str) -> None:
    _check_against_references(spec, device, MIXED)
