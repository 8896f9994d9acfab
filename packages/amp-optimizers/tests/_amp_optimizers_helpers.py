"""The optimizer registry every generic test runs through, and the helpers they share.

One :class:`OptimizerSpec` per configuration: the fused optimizer, the optimizer it must match
(``torch.optim`` where torch has the same algorithm, else a written-out reference from
:mod:`_reference_optimizers`), the tolerance, and the hyperparameters of a second param group.
A new optimizer or option gets every generic test by adding one entry to :data:`SPECS`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from _reference_optimizers import RefAdagrad, RefAdam, RefLAMB, RefNovoGrad, RefSGD
from amp_optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]

# max |fused - reference| of float32 params after ten steps.
FP32_ATOL = 1e-5
# Low-precision params against a float32-master reference, relative to the param scale.
HALF_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer configuration for the generic tests.

    Attributes:
        name: Test id.
        fused: The fused optimizer class (for class-level checks).
        factory: Builds the fused optimizer over params or param groups.
        reference: Builds the optimizer it must match over the same kind of argument.
        atol: Largest allowed ``|fused - reference|`` for float32 params.
        second_group: Hyperparameters of the second param group (same keys for both).
        group_step: The reference counts steps per group as Apex does (or the algorithm has no
            step count), so a param whose first gradient comes late must match it too.
            ``torch.optim.Adam`` counts per param.
    """

    name: str
    fused: type[torch.optim.Optimizer]
    factory: OptimizerFactory
    reference: OptimizerFactory
    atol: float = FP32_ATOL
    second_group: dict[str, Any] = field(default_factory=dict)
    group_step: bool = True

    def __str__(self) -> str:
        return self.name


def _spec(
    name: str,
    fused: type[torch.optim.Optimizer],
    reference: Callable[..., torch.optim.Optimizer],
    kwargs: dict[str, Any],
    ref_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> OptimizerSpec:
    """A spec whose fused optimizer takes ``kwargs`` and its reference ``ref_kwargs`` (the
    same unless given)."""
    ref_kwargs = kwargs if ref_kwargs is None else ref_kwargs
    return OptimizerSpec(
        name,
        fused,
        lambda params: fused(params, **kwargs),
        lambda params: reference(params, **ref_kwargs),
        **options,
    )


_ADAM = dict(lr=2e-2, betas=(0.8, 0.99), eps=1e-8)
_ADAM_2 = dict(lr=5e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.05)
_SGD_2 = dict(lr=3e-2, momentum=0.5, weight_decay=0.02)
_LAMB = dict(lr=2e-2, betas=(0.85, 0.99), eps=1e-6)
_LAMB_2 = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
_NOVO = dict(lr=2e-2, betas=(0.9, 0.95), eps=1e-8)
_NOVO_2 = dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.02)

SPECS: list[OptimizerSpec] = [
    # FusedAdam: torch.optim.Adam (L2 decay) and AdamW (decoupled decay, the default)
    _spec(
        "adam",
        FusedAdam,
        torch.optim.Adam,
        dict(_ADAM, adam_w_mode=False),
        ref_kwargs=_ADAM,
        second_group=dict(_ADAM_2, weight_decay=0.0),
        group_step=False,
    ),
    _spec(
        "adam_l2",
        FusedAdam,
        torch.optim.Adam,
        dict(_ADAM, adam_w_mode=False, weight_decay=0.1),
        ref_kwargs=dict(_ADAM, weight_decay=0.1),
        second_group=_ADAM_2,
        group_step=False,
    ),
    _spec(
        "adamw",
        FusedAdam,
        torch.optim.AdamW,
        dict(_ADAM, weight_decay=0.1),
        second_group=_ADAM_2,
        group_step=False,
    ),
    _spec(
        "adamw_no_decay",
        FusedAdam,
        torch.optim.AdamW,
        dict(_ADAM, weight_decay=0.0),
        second_group=_ADAM_2,
        group_step=False,
    ),
    _spec(
        "adamw_no_bias_correction",
        FusedAdam,
        RefAdam,
        dict(_ADAM, weight_decay=0.1, bias_correction=False),
        second_group=dict(_ADAM_2, bias_correction=True),
    ),
    _spec(
        "adam_l2_no_bias_correction",
        FusedAdam,
        RefAdam,
        dict(_ADAM, weight_decay=0.1, bias_correction=False, adam_w_mode=False),
        second_group=_ADAM_2,
    ),
    # FusedSGD: torch.optim.SGD, and Apex's wd_after_momentum against the reference
    _spec("sgd", FusedSGD, torch.optim.SGD, dict(lr=5e-2), second_group=_SGD_2),
    _spec(
        "sgd_momentum",
        FusedSGD,
        torch.optim.SGD,
        dict(lr=5e-2, momentum=0.9, weight_decay=0.01),
        second_group=_SGD_2,
    ),
    _spec(
        "sgd_dampening",
        FusedSGD,
        torch.optim.SGD,
        dict(lr=5e-2, momentum=0.9, dampening=0.3, weight_decay=0.01),
        second_group=dict(_SGD_2, dampening=0.1),
    ),
    _spec(
        "sgd_nesterov",
        FusedSGD,
        torch.optim.SGD,
        dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
        second_group=dict(_SGD_2, nesterov=False),
    ),
    _spec(
        "sgd_wd_after_momentum",
        FusedSGD,
        RefSGD,
        dict(lr=5e-2, momentum=0.9, weight_decay=0.05, wd_after_momentum=True),
        second_group=dict(_SGD_2, nesterov=True),
    ),
    # FusedAdagrad: torch.optim.Adagrad, and adagrad_w_mode against the reference
    _spec(
        "adagrad",
        FusedAdagrad,
        torch.optim.Adagrad,
        dict(lr=5e-2, eps=1e-10),
        second_group=dict(lr=2e-2, eps=1e-6),
    ),
    _spec(
        "adagrad_l2",
        FusedAdagrad,
        torch.optim.Adagrad,
        dict(lr=5e-2, eps=1e-10, weight_decay=0.1),
        second_group=dict(lr=2e-2, weight_decay=0.0),
    ),
    _spec(
        "adagrad_w_mode",
        FusedAdagrad,
        RefAdagrad,
        dict(lr=5e-2, eps=1e-10, weight_decay=0.1, adagrad_w_mode=True),
        second_group=dict(lr=2e-2, weight_decay=0.3),
    ),
    # FusedLAMB: the written-out reference of Apex's algorithm
    _spec("lamb", FusedLAMB, RefLAMB, dict(_LAMB, weight_decay=0.01), second_group=_LAMB_2),
    _spec(
        "lamb_l2",
        FusedLAMB,
        RefLAMB,
        dict(_LAMB, weight_decay=0.05, adam_w_mode=False),
        second_group=_LAMB_2,
    ),
    _spec(
        "lamb_no_decay",
        FusedLAMB,
        RefLAMB,
        dict(_LAMB, weight_decay=0.0),
        second_group=dict(_LAMB_2, weight_decay=0.0),
    ),
    _spec(
        "lamb_nvlamb",
        FusedLAMB,
        RefLAMB,
        dict(_LAMB, weight_decay=0.0, use_nvlamb=True),
        second_group=_LAMB_2,
    ),
    _spec(
        "lamb_clipped_no_averaging",
        FusedLAMB,
        RefLAMB,
        dict(_LAMB, max_grad_norm=0.5, grad_averaging=False, bias_correction=False),
        second_group=dict(_LAMB_2, grad_averaging=True),
    ),
    # FusedNovoGrad: the written-out reference of Apex's algorithm
    _spec("novograd", FusedNovoGrad, RefNovoGrad, dict(_NOVO), second_group=_NOVO_2),
    _spec(
        "novograd_reg_inside_moment",
        FusedNovoGrad,
        RefNovoGrad,
        dict(_NOVO, weight_decay=0.05, reg_inside_moment=True),
        second_group=_NOVO_2,
    ),
    _spec(
        "novograd_inf_norm_init_zero",
        FusedNovoGrad,
        RefNovoGrad,
        dict(_NOVO, weight_decay=0.01, norm_type=0, init_zero=True),
        second_group=_NOVO_2,
    ),
    _spec(
        "novograd_no_averaging_no_bias_correction",
        FusedNovoGrad,
        RefNovoGrad,
        dict(_NOVO, grad_averaging=False, bias_correction=False),
        second_group=dict(_NOVO_2, bias_correction=True),
    ),
]

# One configuration per optimizer class, for the slower model-level tests.
CLASS_SPECS: list[OptimizerSpec] = [
    s for s in SPECS if s.name in ("adamw", "sgd_momentum", "adagrad", "lamb", "novograd")
]


# --- params, losses and steps -----------------------------------------------------------------

# Two groups of params; the last of each group never gets a gradient.
GROUP_SHAPES: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((6, 5), (5,), (), (2, 2)),
    ((3, 2, 4), (4, 3), (3,), (2,)),
)
NO_GRAD = (3, 7)  # flat indices of the params without gradients
ACTIVE = tuple(i for i in range(8) if i not in NO_GRAD)


def make_params(
    device: str | torch.device = "cpu",
    dtype: torch.dtype | Sequence[torch.dtype] = torch.float32,
    seed: int = 0,
) -> list[Tensor]:
    """The eight params of :data:`GROUP_SHAPES`, flat; ``dtype`` may be one per param."""
    shapes = [s for group in GROUP_SHAPES for s in group]
    dtypes = [dtype] * len(shapes) if isinstance(dtype, torch.dtype) else list(dtype)
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=d))
        for s, d in zip(shapes, dtypes, strict=True)
    ]


def float_copies(params: Sequence[Tensor]) -> list[Tensor]:
    """Independent float32 params with the same values (the float32-master reference)."""
    return [torch.nn.Parameter(p.detach().float().clone()) for p in params]


def two_groups(params: Sequence[Tensor], second: dict[str, Any]) -> list[dict[str, Any]]:
    """The flat params split into the two groups of :data:`GROUP_SHAPES`."""
    n = len(GROUP_SHAPES[0])
    return [{"params": list(params[:n])}, {"params": list(params[n:]), **second}]


def loss_of(params: Sequence[Tensor], step: int, active: Sequence[int] = ACTIVE) -> Tensor:
    """A loss whose gradient is ``target + 0.5 * p`` for every active param.

    The targets depend on the step only, so two runs over equal params get equal gradients.
    """
    total = torch.zeros((), device=params[0].device)
    for i in active:
        p = params[i]
        gen = torch.Generator().manual_seed(1000 * step + i)
        target = torch.randn(p.shape, generator=gen).to(p.device)
        pf = p.float()
        total = total + (pf * target).sum() + 0.25 * pf.square().sum()
    return total


def run_steps(
    optimizer: torch.optim.Optimizer,
    params: Sequence[Tensor],
    steps: range,
    active: Sequence[int] = ACTIVE,
) -> None:
    """``zero_grad``, backward of :func:`loss_of` and ``step``, once per step number."""
    for step in steps:
        optimizer.zero_grad()
        loss_of(params, step, active).backward()
        optimizer.step()


def snapshot(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> dict[str, Any]:
    """Deep copies of the params and the optimizer's state, for bitwise comparisons."""
    return {
        "params": [p.detach().clone() for p in params],
        "state": copy.deepcopy(optimizer.state_dict()["state"]),
        "groups": copy.deepcopy(optimizer.state_dict()["param_groups"]),
    }


def assert_bitwise_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Tensors equal bitwise (and in dtype), recursively through dicts, lists and tuples."""
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{path}: {actual!r} is not a tensor"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual.cpu(), expected.cpu()), f"{path}: tensors differ"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{path}: keys {set(actual)} != {set(expected)}"
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise_equal(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def max_abs_diff(actual: Sequence[Tensor], expected: Sequence[Tensor]) -> float:
    """Largest ``|a - e|`` over all elements of all pairs, in float32."""
    return max(
        (a.detach().float() - e.detach().float()).abs().max().item()
        for a, e in zip(actual, expected, strict=True)
    )
