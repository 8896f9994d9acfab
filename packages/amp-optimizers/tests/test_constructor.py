"""Constructor validation (Apex's errors, clearer messages) and Apex's ``zero_grad``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _amp_optimizers_helpers import SPECS, OptimizerSpec, loss_of, make_params, two_groups
from amp_optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

ALL = [FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad]
WITH_BETAS = [FusedAdam, FusedLAMB, FusedNovoGrad]
WITH_EPS = [FusedAdam, FusedAdagrad, FusedLAMB, FusedNovoGrad]


def _build(cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
    kwargs.setdefault("lr", 0.1)
    return cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad], ids=lambda c: c.__name__)
def test_amsgrad_is_refused(cls: type[torch.optim.Optimizer]) -> None:
    with pytest.raises(RuntimeError, match=rf"{cls.__name__} does not support the AMSGrad"):
        _build(cls, amsgrad=True)


@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf")])
@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_bad_learning_rate(cls: type[torch.optim.Optimizer], value: float) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}: invalid learning rate {value!r}"):
        _build(cls, lr=value)


@pytest.mark.parametrize("cls", WITH_EPS, ids=lambda c: c.__name__)
def test_negative_eps(cls: type[torch.optim.Optimizer]) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}: invalid epsilon value -1e-08"):
        _build(cls, eps=-1e-8)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_negative_weight_decay(cls: type[torch.optim.Optimizer]) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}: invalid weight_decay value -0.1"):
        _build(cls, weight_decay=-0.1)


@pytest.mark.parametrize(
    ("betas", "match"),
    [
        ((1.0, 0.999), r"invalid beta parameter at index 0: 1\.0"),
        ((0.9, -0.1), r"invalid beta parameter at index 1: -0\.1"),
        ((0.9, 1.5), r"invalid beta parameter at index 1: 1\.5"),
        ((0.9,), r"betas must be a pair \(beta1, beta2\), got \(0\.9,\)"),
    ],
)
@pytest.mark.parametrize("cls", WITH_BETAS, ids=lambda c: c.__name__)
def test_bad_betas(cls: type[torch.optim.Optimizer], betas: tuple[float, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _build(cls, betas=betas)


def test_sgd_needs_a_learning_rate() -> None:
    with pytest.raises(
        ValueError, match=r"FusedSGD: lr is required, e\.g\. FusedSGD\(params, lr=0\.1\)"
    ):
        FusedSGD([torch.nn.Parameter(torch.zeros(2))])
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1}]
    groups.append({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(
        ValueError, match=r"unless every param group .*; param groups \[1\] have none"
    ):
        FusedSGD(groups, momentum=0.5)
    groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"invalid learning rate of param group 1 -1\.0"):
        FusedSGD(groups)


def _per_group_run(cls: type[torch.optim.Optimizer], **kwargs: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    groups = [{"params": [params[0]], "lr": 0.25}, {"params": [params[1]], "lr": 0.5}]
    opt = cls(groups, **kwargs)
    for step in range(2):
        opt.zero_grad()
        sum((p * p).sum() * (step + 1) for p in params).backward()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("cls", [*ALL, FusedMixedPrecisionLamb], ids=lambda c: c.__name__)
def test_lr_given_per_param_group_only(cls: type[torch.optim.Optimizer]) -> None:
    # Apex's multi-model tests build FusedSGD([{'params': ..., 'lr': 0.25}, ...], momentum=...).
    momentum = {"momentum": 0.125} if cls is FusedSGD else {}
    only_groups = _per_group_run(cls, **momentum)
    # The groups' own lr is what steps: a default lr changes nothing.
    with_default = _per_group_run(cls, lr=0.125, **momentum)
    for actual, expected in zip(only_groups, with_default, strict=True):
        assert torch.equal(actual, expected)
    if cls is FusedSGD:  # the same steps as torch's SGD with these groups
        reference = _per_group_run(torch.optim.SGD, **momentum)
        for actual, expected in zip(only_groups, reference, strict=True):
            torch.testing.assert_close(actual, expected)


def test_sgd_negative_momentum() -> None:
    with pytest.raises(ValueError, match=r"FusedSGD: invalid momentum value -0\.5"):
        _build(FusedSGD, momentum=-0.5)


@pytest.mark.parametrize(
    "kwargs", [dict(momentum=0.0), dict(momentum=0.9, dampening=0.1)], ids=["no_momentum", "damp"]
)
def test_sgd_nesterov_needs_momentum_without_dampening(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"Nesterov momentum requires a momentum and zero"):
        _build(FusedSGD, nesterov=True, **kwargs)


def test_lamb_negative_max_grad_norm() -> None:
    with pytest.raises(ValueError, match=r"FusedLAMB: invalid max_grad_norm -1\.0"):
        _build(FusedLAMB, max_grad_norm=-1.0)


def test_novograd_norm_type() -> None:
    with pytest.raises(ValueError, match=r"norm_type=1"):
        _build(FusedNovoGrad, norm_type=1)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_unsupported_param_dtype(cls: type[torch.optim.Optimizer]) -> None:
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = cls([p], lr=0.1)
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"supports float32, float16 and bfloat16 params"):
        opt.step()


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_sparse_gradients_are_refused(cls: type[torch.optim.Optimizer]) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = cls([p], lr=0.1)
    p.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match=r"does not support sparse gradients"):
        opt.step()


# --- add_param_group ----------------------------------------------------------------------

BF16 = torch.bfloat16


def _param(dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(3, dtype=dtype))


# (optimizer over its first params, the group it must refuse, the error) for every optimizer:
# its own checks where it has some, torch's (a param in two groups) where it has none.
REFUSED_GROUPS = [
    pytest.param(
        lambda ps: FusedAdam(ps, lr=0.1, bf16_stochastic_round=True), BF16,
        lambda: {"params": [_param()]}, r"FusedAdam: bf16_stochastic_round=True needs bfloat16",
        id="FusedAdam-rounding-float32",
    ),
    pytest.param(
        lambda ps: FusedAdam(ps, lr=0.1, master_weights=True), BF16,
        lambda: {"params": [_param(BF16)], "bf16_stochastic_round": True},
        r"cannot be combined with float32 master weights", id="FusedAdam-rounding-masters",
    ),
    pytest.param(
        lambda ps: FusedSGD(ps, lr=0.1, bf16_stochastic_round=True), BF16,
        (lambda: {"params": (p for p in [_param(), _param(BF16)])}),  # an iterator, read once
        r"FusedSGD: bf16_stochastic_round=True needs bfloat16 params, got \['torch.float32'\]",
        id="FusedSGD-rounding-float32",
    ),
    pytest.param(
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-3), torch.float32,
        lambda: {"params": [_param()], "lr": -1.0},
        r"FusedMixedPrecisionLamb: invalid learning rate -1.0", id="FusedMixedPrecisionLamb-lr",
    ),
    pytest.param(
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-3), torch.float32,
        lambda: {"params": [_param()], "step": 1.5},
        r"FusedMixedPrecisionLamb: invalid step 1.5", id="FusedMixedPrecisionLamb-step",
    ),
    *(
        pytest.param(
            build, torch.float32, None, "appear in more than one parameter group", id=name
        )
        for name, build in [
            ("FusedLAMB", lambda ps: FusedLAMB(ps, lr=1e-3)),
            ("FusedNovoGrad", lambda ps: FusedNovoGrad(ps, lr=1e-3)),
            ("FusedAdagrad", lambda ps: FusedAdagrad(ps, lr=1e-2)),
        ]
    ),
]  # fmt: skip


@pytest.mark.parametrize(("build", "dtype", "bad_group", "match"), REFUSED_GROUPS)
def test_a_refused_param_group_is_not_added(
    build: Any, dtype: torch.dtype, bad_group: Any, match: str
) -> None:
    """As torch.optim: a group that add_param_group refuses is not appended, and the optimizer
    goes on stepping its groups and accepts a valid one afterwards."""
    first = _param(dtype)
    opt = build([first])
    group = {"params": [first]} if bad_group is None else bad_group()
    with pytest.raises(ValueError, match=match):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1
    assert opt.param_groups[0]["params"] == [first]
    second = _param(dtype)
    opt.add_param_group({"params": [second]})
    for p in (first, second):
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    assert len(opt.param_groups) == 2
    assert all((p != 1).all() for p in (first, second))


# --- zero_grad ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "default"),
    [
        (FusedAdam, True),
        (FusedSGD, False),
        (FusedAdagrad, True),
        (FusedLAMB, True),
        (FusedNovoGrad, True),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else str(v),
)
def test_set_grad_none_defaults_follow_apex(
    cls: type[torch.optim.Optimizer], default: bool
) -> None:
    assert _build(cls).set_grad_none is default  # type: ignore[attr-defined]


def _with_grads(spec: OptimizerSpec, set_grad_none: bool) -> tuple[Any, list[torch.Tensor]]:
    params = make_params()
    opt = spec.factory(two_groups(params, spec.second_group))
    opt.set_grad_none = set_grad_none  # type: ignore[attr-defined]
    loss_of(params, 0).backward()
    opt.step()
    return opt, [p for p in params if p.grad is not None]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_zero_grad_honours_set_grad_none(spec: OptimizerSpec) -> None:
    opt, with_grads = _with_grads(spec, set_grad_none=True)
    opt.zero_grad()
    assert all(p.grad is None for p in with_grads)

    opt, with_grads = _with_grads(spec, set_grad_none=False)
    grads = [p.grad for p in with_grads]
    opt.zero_grad()
    for p, g in zip(with_grads, grads, strict=True):
        assert p.grad is g, "zero_grad replaced the gradient tensor instead of zeroing it"
        assert p.grad is not None and not p.grad.any()


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_zero_grad_argument_overrides_set_grad_none(spec: OptimizerSpec) -> None:
    opt, with_grads = _with_grads(spec, set_grad_none=False)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in with_grads)

    opt, with_grads = _with_grads(spec, set_grad_none=True)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in with_grads)


def test_set_grad_none_constructor_argument() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    for cls in ALL:
        opt = cls([p], lr=0.1, set_grad_none=False)
        p.grad = torch.ones(2)
        opt.zero_grad()
        assert p.grad is not None and not p.grad.any(), cls.__name__
        opt = cls([p], lr=0.1, set_grad_none=True)
        opt.zero_grad()
        assert p.grad is None, cls.__name__
