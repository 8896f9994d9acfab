"""``FusedAdagrad`` state dicts and ``torch.optim.Adagrad`` state dicts, both ways.

A run saved by one optimizer and continued by the other must end where the saving optimizer's
own continuation ends: FusedAdagrad's math is torch's Adagrad with ``lr_decay=0`` and
``initial_accumulator_value=0``, so two float32 implementations of the same update are a few ulps
apart. What the other cannot continue is refused at load.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from _amp_optimizers_helpers import assert_bitwise_equal
from amp_optimizers import FusedAdagrad

N_STEPS, M_STEPS = 4, 3
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
HALF_TOL = {torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}

# (FusedAdagrad kwargs, the torch.optim.Adagrad kwargs of the same math)
SAME_MATH = [
    pytest.param(dict(lr=5e-2), dict(lr=5e-2), id="plain"),
    pytest.param(dict(lr=5e-2, weight_decay=0.1), dict(lr=5e-2, weight_decay=0.1), id="l2"),
    pytest.param(dict(lr=5e-2, adagrad_w_mode=True), dict(lr=5e-2), id="w_mode_no_decay"),
]


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6 + i, generator=gen).to(dtype)) for i in range(4)]


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": params[:3]}, {"params": params[3:], "lr": 2e-2}]


def _copy(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            # The second param skips every other step: per-param step counts differ.
            skip = i == 1 and step % 2 == 1
            grad = torch.randn(p.shape, generator=gen)
            p.grad = None if skip else grad.to(p.dtype)
        opt.step()


def _saved(opt: torch.optim.Optimizer) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # type: ignore[no-any-return]


def _assert_close_runs(
    params: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    ref_params: list[torch.nn.Parameter],
    ref: torch.optim.Optimizer,
    tol: dict[str, float],
) -> None:
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, r, **tol)
        torch.testing.assert_close(opt.state[p]["sum"].float(), ref.state[r]["sum"].float(), **tol)
        assert float(opt.state[p]["step"]) == float(ref.state[r]["step"])


@pytest.mark.parametrize(("fused_kwargs", "torch_kwargs"), SAME_MATH)
def test_fused_adagrad_state_dict_continues_in_torch_adagrad(
    fused_kwargs: dict[str, Any], torch_kwargs: dict[str, Any]
) -> None:
    params = _params()
    fused = FusedAdagrad(_groups(params), **fused_kwargs)
    _train(fused, params, range(N_STEPS))
    saved = _saved(fused)

    moved_params = _copy(params)
    moved = torch.optim.Adagrad(_groups(moved_params), **torch_kwargs)
    moved.load_state_dict(saved)
    assert [float(moved.state[p]["step"]) for p in moved_params] == [4.0, 2.0, 4.0, 4.0]
    assert moved.param_groups[1]["lr"] == 2e-2
    _train(moved, moved_params, range(N_STEPS, N_STEPS + M_STEPS))
    _train(fused, params, range(N_STEPS, N_STEPS + M_STEPS))  # the run it left

    _assert_close_runs(moved_params, moved, params, fused, FP32_TOL)


@pytest.mark.parametrize(("fused_kwargs", "torch_kwargs"), SAME_MATH)
@pytest.mark.parametrize("initial", [0.0, 0.5], ids=["sums_from_0", "sums_from_0.5"])
def test_torch_adagrad_state_dict_continues_in_fused_adagrad(
    fused_kwargs: dict[str, Any], torch_kwargs: dict[str, Any], initial: float
) -> None:
    params = _params()
    ref = torch.optim.Adagrad(_groups(params), initial_accumulator_value=initial, **torch_kwargs)
    _train(ref, params, range(N_STEPS))
    saved = _saved(ref)

    moved_params = _copy(params)
    moved = FusedAdagrad(_groups(moved_params), **fused_kwargs)
    moved.load_state_dict(saved)
    assert set(moved.param_groups[0]) == {"params", "lr", "eps", "weight_decay"}
    _train(moved, moved_params, range(N_STEPS, N_STEPS + M_STEPS))
    _train(ref, params, range(N_STEPS, N_STEPS + M_STEPS))  # the run it left

    _assert_close_runs(moved_params, moved, params, ref, FP32_TOL)
    assert all(moved.state[p]["sum"].dtype == torch.float32 for p in moved_params)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_torch_adagrad_half_sums_load_as_float32(dtype: torch.dtype) -> None:
    # torch's Adagrad keeps a half param's sum in the param's dtype; FusedAdagrad's are float32.
    params = _params(dtype)
    ref = torch.optim.Adagrad(_groups(params), lr=5e-2)
    _train(ref, params, range(N_STEPS))
    moved_params = _copy(params)
    moved = FusedAdagrad(_groups(moved_params), lr=5e-2)
    moved.load_state_dict(_saved(ref))
    for p, r in zip(moved_params, params, strict=True):
        assert moved.state[p]["sum"].dtype == torch.float32
        assert torch.equal(moved.state[p]["sum"], ref.state[r]["sum"].float())
    _train(moved, moved_params, range(N_STEPS, N_STEPS + M_STEPS))
    _train(ref, params, range(N_STEPS, N_STEPS + M_STEPS))
    _assert_close_runs(moved_params, moved, params, ref, HALF_TOL[dtype])


def test_round_trip_through_torch_adagrad_is_bitwise() -> None:
    params = _params()
    fused = FusedAdagrad(_groups(params), lr=5e-2, weight_decay=0.1)
    _train(fused, params, range(N_STEPS))
    moved = torch.optim.Adagrad(_groups(params), lr=5e-2)
    moved.load_state_dict(fused.state_dict())
    back = FusedAdagrad(_groups(params), lr=1.0)
    back.load_state_dict(moved.state_dict())
    assert_bitwise_equal(back.state_dict(), fused.state_dict())


def test_an_apex_state_dict_without_steps_loads_and_counts_from_there() -> None:
    params = _params()
    fused = FusedAdagrad(_groups(params), lr=5e-2)
    _train(fused, params, range(2))
    apex_like = copy.deepcopy(fused.state_dict())  # Apex kept the sums and the group's hyper
    for entry in apex_like["state"].values():
        del entry["step"]
    for group in apex_like["param_groups"]:
        del group["lr_decay"], group["initial_accumulator_value"]
    resumed_params = _copy(params)
    resumed = FusedAdagrad(_groups(resumed_params), lr=5e-2)
    resumed.load_state_dict(apex_like)
    _train(resumed, resumed_params, range(2, 3))
    _train(fused, params, range(2, 3))
    for p, r in zip(resumed_params, params, strict=True):
        assert torch.equal(p, r)
    assert float(resumed.state_dict()["state"][0]["step"]) == 1.0  # counted from the load
    torch.optim.Adagrad(_groups(_copy(params)), lr=5e-2).load_state_dict(resumed.state_dict())


@pytest.mark.parametrize(
    ("torch_kwargs", "match"),
    [
        (dict(lr_decay=0.01), r"lr_decay=0\.01 into FusedAdagrad \(group 0\).*no learning-rate"),
        (dict(maximize=True), r"maximize=True into FusedAdagrad \(group 0\).*negate the loss"),
    ],
    ids=["lr_decay", "maximize"],
)
def test_a_torch_adagrad_state_dict_fused_adagrad_cannot_continue_is_refused(
    torch_kwargs: dict[str, Any], match: str
) -> None:
    params = _params()
    ref = torch.optim.Adagrad(_groups(params), lr=5e-2, **torch_kwargs)
    _train(ref, params, range(2))
    fused = FusedAdagrad(_groups(_copy(params)), lr=5e-2)
    before = copy.deepcopy(fused.state_dict())
    with pytest.raises(ValueError, match=match):
        fused.load_state_dict(ref.state_dict())
    assert_bitwise_equal(fused.state_dict(), before)  # nothing was loaded


def test_sums_starting_above_zero_need_a_sum_for_every_param() -> None:
    params = _params()
    ref = torch.optim.Adagrad(_groups(params), lr=5e-2, initial_accumulator_value=0.5)
    saved = ref.state_dict()
    del saved["state"][2]
    with pytest.raises(ValueError, match=r"initial_accumulator_value=0\.5 and params \[2\]"):
        FusedAdagrad(_groups(_copy(params)), lr=5e-2).load_state_dict(saved)


def test_torch_adagrad_refuses_decoupled_weight_decay() -> None:
    # torch's Adagrad has only L2 weight decay: it must not take over a decoupled run.
    params = _params()
    fused = FusedAdagrad(_groups(params), lr=5e-2, weight_decay=0.1, adagrad_w_mode=True)
    _train(fused, params, range(2))
    with pytest.raises(KeyError, match="step"):
        torch.optim.Adagrad(_groups(_copy(params)), lr=5e-2).load_state_dict(fused.state_dict())
    resumed_params = _copy(params)
    resumed = FusedAdagrad(_groups(resumed_params), lr=5e-2, weight_decay=0.1, adagrad_w_mode=True)
    resumed.load_state_dict(_saved(fused))  # FusedAdagrad itself resumes it, bitwise
    _train(resumed, resumed_params, range(2, 4))
    _train(fused, params, range(2, 4))
    for p, r in zip(resumed_params, params, strict=True):
        assert torch.equal(p, r)
