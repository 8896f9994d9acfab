"""The per-group step layout that FusedAdam, FusedSGD and FusedLAMB keep between steps.

Each test changes something the cached layout was built from, then steps again and compares
with the float32 reference optimizer that had the same change: a layout that stayed stale would
step the wrong tensors, miss new ones or keep old state.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from _amp_optimizers_helpers import (
    ACTIVE,
    SPECS,
    OptimizerSpec,
    float_copies,
    make_params,
    max_abs_diff,
    run_steps,
    two_groups,
)

# One configuration per cached optimizer, each against a reference that counts steps per
# group as the fused optimizers do (a param that joins late must match it too).
CACHED = [s for s in SPECS if s.name in ("adamw_no_bias_correction", "sgd_momentum", "lamb")]
ALL = tuple(range(8))
BF16_RTOL = 1.6e-2
BF16 = torch.bfloat16


def _pair(
    spec: OptimizerSpec, seed: int = 0
) -> tuple[torch.optim.Optimizer, list[Tensor], torch.optim.Optimizer, list[Tensor]]:
    params = make_params(seed=seed)
    ref_params = float_copies(params)
    fused = spec.factory(two_groups(params, spec.second_group))
    reference = spec.reference(two_groups(ref_params, spec.second_group))
    return fused, params, reference, ref_params


def _both(
    fused: torch.optim.Optimizer,
    params: Sequence[Tensor],
    reference: torch.optim.Optimizer,
    ref_params: Sequence[Tensor],
    steps: range,
    active: Sequence[int] = ACTIVE,
) -> None:
    run_steps(fused, params, steps, active)
    run_steps(reference, ref_params, steps, active)


@pytest.mark.parametrize("spec", CACHED, ids=str)
def test_param_replaced_in_group(spec: OptimizerSpec) -> None:
    fused, params, reference, ref_params = _pair(spec)
    _both(fused, params, reference, ref_params, range(2))
    old, old_ref = params[1], ref_params[1]
    fresh = torch.nn.Parameter(torch.randn(old.shape, generator=torch.Generator().manual_seed(9)))
    params[1], ref_params[1] = fresh, torch.nn.Parameter(fresh.detach().clone())
    fused.param_groups[0]["params"][1] = params[1]
    reference.param_groups[0]["params"][1] = ref_params[1]
    _both(fused, params, reference, ref_params, range(2, 4))
    assert max_abs_diff(params, ref_params) <= spec.atol
    # The param taken out is no longer stepped.
    assert max_abs_diff([old], [old_ref]) <= spec.atol


@pytest.mark.parametrize("spec", CACHED, ids=str)
def test_param_group_added(spec: OptimizerSpec) -> None:
    params = make_params()
    ref_params = float_copies(params)
    first, second = two_groups(params, spec.second_group)
    ref_first, ref_second = two_groups(ref_params, spec.second_group)
    fused, reference = spec.factory([first]), spec.reference([ref_first])
    _both(fused, params[:4], reference, ref_params[:4], range(2), (0, 1, 2))
    fused.add_param_group(second)
    reference.add_param_group(ref_second)
    _both(fused, params, reference, ref_params, range(2, 4))
    assert max_abs_diff(params, ref_params) <= spec.atol


@pytest.mark.parametrize("spec", CACHED, ids=str)
def test_gradient_of_a_param_appears_later(spec: OptimizerSpec) -> None:
    fused, params, reference, ref_params = _pair(spec)
    _both(fused, params, reference, ref_params, range(2))
    _both(fused, params, reference, ref_params, range(2, 4), ALL)
    assert max_abs_diff(params, ref_params) <= spec.atol


@pytest.mark.parametrize("spec", CACHED, ids=str)
def test_param_dtype_changed(spec: OptimizerSpec) -> None:
    fused, params, reference, ref_params = _pair(spec)
    _both(fused, params, reference, ref_params, range(2))
    # As module.bfloat16() does: the same Parameter object, new data (one param of a group).
    params[1].data = params[1].data.bfloat16()
    ref_params[1].data = params[1].data.float()  # the rounded value, stepped in float32
    _both(fused, params, reference, ref_params, range(2, 4))
    assert params[1].dtype == torch.bfloat16
    others = [i for i in range(8) if i != 1]
    assert max_abs_diff([params[i] for i in others], [ref_params[i] for i in others]) <= spec.atol
    torch.testing.assert_close(params[1].float(), ref_params[1].detach(), rtol=BF16_RTOL, atol=0.0)


@pytest.mark.parametrize("spec", CACHED, ids=str)
def test_state_dict_loaded(spec: OptimizerSpec) -> None:
    fused, params, _, _ = _pair(spec, seed=0)
    run_steps(fused, params, range(2))  # its layout and state are cached now
    # Another run, from other values: its state (and params) are loaded into `fused`.
    donor, donor_params, reference, ref_params = _pair(spec, seed=1)
    _both(donor, donor_params, reference, ref_params, range(3))
    fused.load_state_dict(donor.state_dict())
    with torch.no_grad():
        for p, q in zip(params, donor_params, strict=True):
            p.copy_(q)
    _both(fused, params, reference, ref_params, range(3, 5))
    assert max_abs_diff(params, ref_params) <= spec.atol


@pytest.mark.parametrize("spec", CACHED, ids=str)
def test_state_cleared(spec: OptimizerSpec) -> None:
    fused, params, reference, ref_params = _pair(spec)
    _both(fused, params, reference, ref_params, range(2))
    fused.state.clear()
    reference.state.clear()
    _both(fused, params, reference, ref_params, range(2, 4))
    assert max_abs_diff(params, ref_params) <= spec.atol
    assert len(fused.state) == len(ACTIVE)


def _change_state(optimizer: torch.optim.Optimizer, p: Tensor, how: str) -> None:
    """Change the state of ``p`` as user code does (``how`` names the way)."""
    state = optimizer.state
    if how == "clear":
        state[p].clear()
    elif how == "replace":
        state[p] = {}
    elif how == "delete":
        del state[p]
    elif how == "tensors":  # e.g. state offloaded and brought back: new tensors, new values
        for key, value in list(state[p].items()):
            if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
                state[p][key] = value * 0.5
    else:
        raise AssertionError(how)


# The cached optimizers, and those that read their state at every step (checked alike).
STATE_SPECS = CACHED + [s for s in SPECS if s.name in ("adagrad", "novograd")]


@pytest.mark.parametrize("how", ["clear", "replace", "delete", "tensors"])
@pytest.mark.parametrize("spec", STATE_SPECS, ids=str)
def test_state_of_one_param_changed(spec: OptimizerSpec, how: str) -> None:
    """The step follows every change of ``optimizer.state[p]`` that torch.optim follows: state
    cleared or removed is re-created (zero moments, a new momentum buffer), replaced tensors
    are the ones stepped; ``state_dict()`` holds what the step uses."""
    fused, params, reference, ref_params = _pair(spec)
    _both(fused, params, reference, ref_params, range(3))
    _change_state(fused, params[1], how)
    _change_state(reference, ref_params[1], how)
    _both(fused, params, reference, ref_params, range(3, 5))
    assert max_abs_diff(params, ref_params) <= spec.atol
    saved = fused.state_dict()["state"][1]
    for key, value in reference.state[ref_params[1]].items():
        if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
            torch.testing.assert_close(saved[key], value, rtol=0, atol=spec.atol)


@pytest.mark.parametrize("spec", CACHED, ids=str)
def test_sparse_gradient_refused_after_cached_steps(spec: OptimizerSpec) -> None:
    fused, params, _, _ = _pair(spec)
    run_steps(fused, params, range(2))
    fused.zero_grad()
    params[0].grad = torch.ones_like(params[0]).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        fused.step()


@pytest.mark.parametrize("kinds", [(torch.float32,), (torch.float32, BF16, torch.float32)], ids=str)
def test_rows_grouped_by_device_and_dtype_keep_their_order(kinds: tuple[torch.dtype, ...]) -> None:
    from amp_optimizers._step_helpers import group_by_device_dtype

    params = [torch.zeros(i + 1, dtype=kinds[i % len(kinds)]) for i in range(7)]
    rows = [(p, torch.ones(1), torch.full((2,), float(i))) for i, p in enumerate(params)]
    expected: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    for row in rows:  # the first appearance of a kind opens its bucket
        columns = expected.setdefault((row[0].device, row[0].dtype), [[], [], []])
        for column, tensor in zip(columns, row, strict=True):
            column.append(tensor)
    buckets = group_by_device_dtype(iter(rows))
    assert list(buckets) == list(expected)
    for key, columns in expected.items():
        assert [[id(t) for t in c] for c in buckets[key]] == [[id(t) for t in c] for c in columns]


# FusedSGD's first step creates the momentum buffers and rebuilds its layouts once on purpose.
@pytest.mark.parametrize("spec", [s for s in CACHED if s.name != "sgd_momentum"], ids=str)
def test_each_group_layout_is_built_once(
    spec: OptimizerSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second group's first step creates state after the first group's layout was built:
    that layout stays current (it was built again at the second step)."""
    fused, params, _, _ = _pair(spec)
    built: list[int] = []
    build = fused._build_plan  # type: ignore[attr-defined]
    groups = [id(group) for group in fused.param_groups]

    def counting_build(
        name: str, group: dict[str, object], *args: object, **kwargs: object
    ) -> object:
        built.append(groups.index(id(group)))
        return build(name, group, *args, **kwargs)

    monkeypatch.setattr(fused, "_build_plan", counting_build)
    run_steps(fused, params, range(4))
    assert built == [0, 1]
