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


def max_err(a: Tensor, b: Tensor) -> float:
    """Largest absolute difference (0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()
