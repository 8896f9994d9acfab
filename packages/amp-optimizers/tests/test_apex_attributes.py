"""What code written against Apex's optimizers reads off them, and the learning-rate checks.

Apex's constructors set op handles (``self.multi_tensor_adam = amp_C.multi_tensor_adam``), a
skip buffer (``_dummy_overflow_buf``) and flags (``adam_w_mode``, ``set_grad_none``, ...), and
projects build on them: fairseq subclasses ``FusedAdam``, refuses to run unless the instance has
``multi_tensor_adam``, and steps the params itself through ``multi_tensor_applier`` with those
handles. The test below writes such a subclass and checks that its step is the optimizer's own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from _amp_optimizers_helpers import assert_bitwise_equal
from amp_fused_ops import amp_C, multi_tensor_applier
from amp_optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)


def _params(n: int = 3, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5 + i, generator=gen).to(dtype)) for i in range(n)]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(10 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


# --- a subclass that steps itself with Apex's handles, as fairseq does ---------------------------


class HandleAdam(FusedAdam):
    """Adam stepped by the subclass itself through the handles Apex's constructor sets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise RuntimeError("Apex installation is outdated")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            grads, params, exp_avgs, exp_avg_sqs = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                grads.append(p.grad)
                params.append(p)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
            multi_tensor_applier(
                self.multi_tensor_adam,
                self._dummy_overflow_buf,
                [grads, params, exp_avgs, exp_avg_sqs],
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                group["step"],
                self.adam_w_mode,
                1 if group["bias_correction"] else 0,
                group["weight_decay"],
            )
        return None


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_subclass_stepping_with_apex_handles_equals_fused_adam(adam_w_mode: bool) -> None:
    ours, theirs = _params(), _params()
    kwargs = dict(lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    opt, sub = FusedAdam(ours, **kwargs), HandleAdam(theirs, **kwargs)  # type: ignore[arg-type]
    assert sub.adam_w_mode == (1 if adam_w_mode else 0)
    for step in range(3):
        _set_grads(ours, step)
        _set_grads(theirs, step)
        opt.step()
        sub.step()
    assert_bitwise_equal([p.detach() for p in theirs], [p.detach() for p in ours])
    assert_bitwise_equal(sub.state_dict()["state"], opt.state_dict()["state"])


# --- every optimizer's handles, skip buffer and flags ---------------------------------------------

# (constructor, Apex's handle attribute -> the amp_C op it names)
HANDLES: list[Any] = [
    pytest.param(
        lambda ps: FusedAdam(ps),
        {
            "multi_tensor_adam": "multi_tensor_adam",
            "multi_tensor_adam_capturable": "multi_tensor_adam_capturable",
            "multi_tensor_adam_capturable_master": "multi_tensor_adam_capturable_master",
        },
        id="FusedAdam",
    ),
    pytest.param(
        lambda ps: FusedSGD(ps, lr=0.1), {"multi_tensor_sgd": "multi_tensor_sgd"}, id="FusedSGD"
    ),
    pytest.param(
        lambda ps: FusedLAMB(ps),
        {"multi_tensor_l2norm": "multi_tensor_l2norm", "multi_tensor_lamb": "multi_tensor_lamb"},
        id="FusedLAMB",
    ),
    pytest.param(
        lambda ps: FusedNovoGrad(ps),
        {"multi_tensor_novograd": "multi_tensor_novograd"},
        id="FusedNovoGrad",
    ),
    pytest.param(
        lambda ps: FusedAdagrad(ps),
        {"multi_tensor_adagrad": "multi_tensor_adagrad"},
        id="FusedAdagrad",
    ),
    pytest.param(
        lambda ps: FusedMixedPrecisionLamb(ps),
        {
            "multi_tensor_l2norm": "multi_tensor_l2norm_mp",
            "multi_tensor_lamb": "multi_tensor_lamb_mp",
        },
        id="FusedMixedPrecisionLamb",
    ),
]


@pytest.mark.parametrize(("make", "handles"), HANDLES)
def test_op_handles_are_the_amp_C_ops(make: Any, handles: dict[str, str]) -> None:
    opt = make(_params())
    for attr, op_name in handles.items():
        op = getattr(amp_C, op_name, None)
        if op is None:  # an op this amp-fused-ops does not provide: absent, as on old Apex
            assert not hasattr(opt, attr)
            continue
        assert getattr(opt, attr) is op, attr


@pytest.mark.parametrize(("make", "handles"), HANDLES)
def test_dummy_overflow_buf_is_a_zero_int32_flag_on_the_params_device(
    make: Any, handles: dict[str, str]
) -> None:
    opt = make(_params())
    buf = opt._dummy_overflow_buf
    assert isinstance(buf, Tensor)
    assert buf.dtype == torch.int32 and buf.shape == (1,) and buf.device.type == "cpu"
    assert buf.item() == 0


def test_fused_adam_flags_and_masters() -> None:
    params = [*_params(dtype=torch.bfloat16), torch.nn.Parameter(torch.ones(3))]
    opt = FusedAdam(params, adam_w_mode=False, set_grad_none=False, master_weights=True)
    assert (opt.adam_w_mode, opt.set_grad_none, opt.master_weights, opt.capturable) == (
        0,
        False,
        True,
        False,
    )
    assert opt._step_supports_amp_scaling is True
    _set_grads(params, 0)
    opt.step()
    (group,) = opt.param_groups_master
    masters = group["params"]
    assert len(masters) == 4 and masters[3] is None
    for p, m in zip(params[:3], masters[:3], strict=True):
        assert m is not None and m.dtype == torch.float32
        assert torch.equal(m.to(torch.bfloat16), p.detach())


def test_other_optimizers_flags() -> None:
    lamb = FusedLAMB(_params(), adam_w_mode=False, set_grad_none=False, use_nvlamb=True)
    assert (lamb.adam_w_mode, lamb.set_grad_none, lamb.use_nvlamb) == (0, False, True)
    novo = FusedNovoGrad(_params(), reg_inside_moment=True, set_grad_none=False)
    assert (novo.moment_mode, novo.set_grad_none) == (0, False)
    assert FusedNovoGrad(_params()).moment_mode == 1
    ada = FusedAdagrad(_params(), adagrad_w_mode=True, set_grad_none=False)
    assert (ada.adagrad_w_mode, ada.set_grad_none) == (1, False)
    sgd = FusedSGD(_params(), lr=0.1, wd_after_momentum=True, materialize_master_grads=False)
    assert (sgd.wd_after_momentum, sgd.materialize_master_grads, sgd.set_grad_none) == (
        True,
        False,
        False,
    )
    assert (sgd.most_recent_scale, sgd.scale_set_by_backward) == (1.0, False)
    mp = FusedMixedPrecisionLamb(_params(), reduced_precision_dtype=torch.bfloat16)
    assert mp.reduced_precision_dtype is torch.bfloat16
    assert (mp.adam_w_mode, mp.use_nvlamb, mp.param_groups_full_precision) == (1, False, [])
    assert mp._step_supports_amp_scaling is True


def test_a_handle_may_be_replaced_on_the_instance() -> None:
    opt = FusedAdam(_params())
    calls: list[int] = []

    def counting(*args: Any) -> None:
        calls.append(1)

    opt.multi_tensor_adam = counting  # type: ignore[method-assign]
    assert opt.multi_tensor_adam is counting
    assert FusedAdam(_params()).multi_tensor_adam is amp_C.multi_tensor_adam


# --- a learning rate given as a tensor is checked as a number is ---------------------------------

CONSTRUCTORS: list[Any] = [
    pytest.param(FusedAdam, id="FusedAdam"),
    pytest.param(FusedSGD, id="FusedSGD"),
    pytest.param(FusedLAMB, id="FusedLAMB"),
    pytest.param(FusedNovoGrad, id="FusedNovoGrad"),
    pytest.param(FusedAdagrad, id="FusedAdagrad"),
    pytest.param(FusedMixedPrecisionLamb, id="FusedMixedPrecisionLamb"),
]


@pytest.mark.parametrize("cls", CONSTRUCTORS)
@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
def test_a_bad_tensor_learning_rate_is_refused(cls: Any, bad: float) -> None:
    with pytest.raises(
        ValueError, match=r"invalid learning rate .*\(a tensor\).*finite number >= 0"
    ):
        cls(_params(), lr=torch.tensor(bad))


@pytest.mark.parametrize("cls", CONSTRUCTORS)
@pytest.mark.parametrize(
    "lr",
    [torch.tensor([1e-3, 2e-3]), torch.tensor([], dtype=torch.float32), torch.tensor(1)],
    ids=["two_elements", "empty", "integer"],
)
def test_a_tensor_learning_rate_must_be_one_float(cls: Any, lr: Tensor) -> None:
    with pytest.raises(ValueError, match="must hold one floating-point value"):
        cls(_params(), lr=lr)


@pytest.mark.parametrize("cls", CONSTRUCTORS)
def test_a_one_element_tensor_learning_rate_is_accepted(cls: Any) -> None:
    params = _params()
    opt = cls(params, lr=torch.tensor([1e-2]))
    _set_grads(params, 0)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


# --- FusedAdam state dicts and torch.optim.Adam state dicts ---------------------------------------


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        _set_grads(params, step)
        opt.step()


@pytest.mark.parametrize(
    ("torch_cls", "adam_w_mode"),
    [(torch.optim.AdamW, True), (torch.optim.Adam, False)],
    ids=["AdamW", "Adam"],
)
def test_fused_adam_state_dict_loads_into_torch_adam_and_back(
    torch_cls: Any, adam_w_mode: bool
) -> None:
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    # Reference: torch's optimizer for all five steps.
    ref_params = _params()
    ref = torch_cls(ref_params, **hyper)
    _train(ref, ref_params, range(5))

    # FusedAdam for three steps, then torch's optimizer from FusedAdam's state dict.
    params = _params()
    fused = FusedAdam(params, adam_w_mode=adam_w_mode, **hyper)  # type: ignore[arg-type]
    _train(fused, params, range(3))
    moved = torch_cls(params, **hyper)
    moved.load_state_dict(fused.state_dict())
    assert [float(s["step"]) for s in moved.state.values()] == [3.0] * 3
    _train(moved, params, range(3, 4))

    # And back: FusedAdam from torch's state dict, one more step.
    back = FusedAdam(params, adam_w_mode=adam_w_mode, **hyper)  # type: ignore[arg-type]
    back.load_state_dict(moved.state_dict())
    assert back.param_groups[0]["step"] == 4 and back.param_groups[0]["bias_correction"]
    _train(back, params, range(4, 5))

    # Two float32 implementations of the same update: a few ulps apart per step.
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    for p, r in zip(params, ref_params, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(back.state[p][key], ref.state[r][key], rtol=1e-5, atol=1e-7)


def test_fused_adam_state_dict_round_trip_through_torch_adam_is_bitwise() -> None:
    params = _params()
    fused = FusedAdam(params, lr=1e-2)
    _train(fused, params, range(2))
    moved = torch.optim.AdamW(params, lr=1e-2)
    moved.load_state_dict(fused.state_dict())
    back = FusedAdam(params, lr=1e-2)
    back.load_state_dict(moved.state_dict())
    assert_bitwise_equal(back.state_dict(), fused.state_dict())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_torch_adam_state_dict_of_half_params_continues_in_fused_adam(dtype) -> None:
    # torch keeps the moments of half params in half, FusedAdam in float32: the loaded
    # moments are the same values in float32, and the next step runs.
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
    ref = torch.optim.AdamW(params, lr=1e-2)
    _train(ref, params, range(2))
    fused = FusedAdam(params, lr=1e-2)
    fused.load_state_dict(ref.state_dict())
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert fused.state[p][key].dtype == torch.float32
            assert torch.equal(fused.state[p][key], ref.state[p][key].float())
    before = [p.detach().clone() for p in params]
    _train(fused, params, range(2, 3))
    assert fused.param_groups[0]["step"] == 3
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_a_torch_adam_state_dict_fused_adam_cannot_continue_is_refused() -> None:
    params = _params()
    amsgrad = torch.optim.Adam(params, amsgrad=True)
    _train(amsgrad, params, range(1))
    with pytest.raises(ValueError, match="amsgrad=True into FusedAdam"):
        FusedAdam(params).load_state_dict(amsgrad.state_dict())

    uneven = torch.optim.Adam(params)
    _train(uneven, params, range(1))
    params[0].grad = None
    uneven.step()  # the first param stays at step 1, the others reach 2
    with pytest.raises(ValueError, match=r"different steps \[1.0, 2.0\].*group of their own"):
        FusedAdam(params).load_state_dict(uneven.state_dict())
