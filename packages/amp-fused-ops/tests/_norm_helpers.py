"""Shared pieces of the FusedLayerNorm / FusedRMSNorm tests: the norm registry and oracles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from amp_fused_ops import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """One norm under test: our module, PyTorch's module and a functional oracle."""

    name: str
    ours: type[FusedLayerNorm] | type[FusedRMSNorm]
    mixed: type[MixedFusedLayerNorm] | type[MixedFusedRMSNorm]
    torch_module: Callable[..., nn.Module]
    rms: bool

    def oracle(self, x: Tensor, shape: tuple[int, ...], w: Tensor | None, b: Tensor | None,
               eps: float) -> Tensor:  # fmt: skip
        """PyTorch's own op, run in ``x``'s dtype (parameters cast to it)."""
        w = w.to(x.dtype) if w is not None else None
        if self.rms:
            return F.rms_norm(x, shape, w, eps)
        b = b.to(x.dtype) if b is not None else None
        return F.layer_norm(x, shape, w, b, eps)


NORMS = [
    NormSpec("layer_norm", FusedLayerNorm, MixedFusedLayerNorm, nn.LayerNorm, rms=False),
    NormSpec("rms_norm", FusedRMSNorm, MixedFusedRMSNorm, nn.RMSNorm, rms=True),
]
NORM_IDS = [spec.name for spec in NORMS]


def random_params(norm: nn.Module, seed: int = 0) -> None:
    """Weights in [0.5, 1.5) (never zero: memory_efficient divides by them), random bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in norm.named_parameters():
            noise = torch.rand(p.shape, generator=gen)
            p.copy_(noise + 0.5 if name == "weight" else noise - 0.5)


def run_with_grads(
    fn: Callable[[Tensor], Tensor], x: Tensor, params: list[Tensor], dy: Tensor
) -> tuple[Tensor, list[Tensor]]:
    """``fn(x)`` and the gradients of ``(fn(x) * dy).sum()`` w.r.t. ``[x, *params]``."""
    x = x.detach().requires_grad_(True)
    y = fn(x)
    grads = torch.autograd.grad(y, [x, *params], dy.to(y.dtype))
    return y.detach(), [g.detach() for g in grads]


# The fp32 statistics a norm kernel saves (mean, invvar) against the reference's.
STATS_TOL = {"rtol": 1e-5, "atol": 1e-5}


def max_err(a: Tensor, b: Tensor) -> float:
    """Largest absolute difference (0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


# --- memory_efficient with a zero in the weight ----------------------------------------------

ZERO_WEIGHT_VARIANTS = ["module", "mixed module", "apex function"]
ZERO_WEIGHT_TOL = {  # grad_input is rounded once to its dtype; fp32 sums in other orders
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
}
ZERO_WEIGHT_CASES = [
    (variant, dtype)
    for variant in ZERO_WEIGHT_VARIANTS
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    if not (variant == "mixed module" and dtype == torch.float32)  # Mixed*: half inputs
]


def check_zero_weight_gradients(spec: NormSpec, variant: str, dtype: torch.dtype) -> None:
    """``memory_efficient=True`` with two zero columns in the weight: every gradient (input,
    weight, bias) matches PyTorch's own norm differentiated in fp32 on the same values."""
    from amp_fused_ops.normalization._functions import (
        FusedLayerNormAffineFunction,
        FusedRMSNormAffineFunction,
    )

    hidden, shape = 24, (24,)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, hidden, generator=gen) * 2 + 0.5).to(dtype)
    param_dtype = torch.float32 if variant == "mixed module" else dtype
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(param_dtype)
    weight[[3, 17]] = 0.0
    bias = None if spec.rms else (torch.rand(hidden, generator=gen) - 0.5).to(param_dtype)
    params = [weight] if bias is None else [weight, bias]
    params = [p.clone().requires_grad_(True) for p in params]

    if variant == "apex function":

        def norm(t: Tensor) -> Tensor:
            if spec.rms:
                return FusedRMSNormAffineFunction.apply(t, params[0], shape, 1e-5, True)
            return FusedLayerNormAffineFunction.apply(t, *params, shape, 1e-5, True)
    else:
        module = (spec.mixed if variant == "mixed module" else spec.ours)(
            shape, eps=1e-5, memory_efficient=True
        ).to(param_dtype)
        with torch.no_grad():
            for ours, value in zip(module.parameters(), params, strict=True):
                ours.copy_(value)
        params = list(module.parameters())
        norm = module

    y = norm(x.clone().requires_grad_(True))
    dy = torch.randn(y.shape, generator=gen).to(y.dtype)
    _, grads = run_with_grads(norm, x, params, dy)

    # The oracle: PyTorch's norm in fp32 on the same (exactly representable) values.
    x32 = x.float().requires_grad_(True)
    p32 = [p.detach().float().requires_grad_(True) for p in params]
    if spec.rms:
        y32 = F.rms_norm(x32, shape, p32[0], 1e-5)
    else:
        y32 = F.layer_norm(x32, shape, p32[0], p32[1], 1e-5)
    want = torch.autograd.grad(y32, [x32, *p32], dy.float())
    # grad_weight and grad_bias are column sums over the rows, rounded once to their dtype:
    # compared at the scale of the sum of the absolute terms (cancellation leaves the rounding).
    x_plain = x.float()
    xhat = (
        F.rms_norm(x_plain, shape, None, 1e-5)
        if spec.rms
        else F.layer_norm(x_plain, shape, None, None, 1e-5)
    )
    sums = [(dy.float().abs() * xhat.abs()).sum(0), dy.float().abs().sum(0)]
    column_scale = [s.max().item() for s in sums]
    for k, (name, got, expected, ref) in enumerate(
        zip(["input", "weight", "bias"], grads, want, [x, *params], strict=False)
    ):
        assert got.dtype == ref.dtype, name
        assert torch.isfinite(got).all(), f"grad of {name} is not finite"
        tol = dict(ZERO_WEIGHT_TOL[ref.dtype])
        if k > 0:
            tol["atol"] = max(tol["atol"], 2 * torch.finfo(ref.dtype).eps * column_scale[k - 1])
        torch.testing.assert_close(
            got.float(), expected.detach(), **tol, msg=lambda m, n=name: f"{n}: {m}"
        )
