"""amp-fused-ops' fused norms under amp-core's O1 casting: float32, like ``layer_norm``.

amp-fused-ops does not require amp-core; where amp-core is installed, a fused norm asks it
whether O1 casting is on and then runs in float32, as ``layer_norm`` does in Apex's O1 policy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from amp_core import amp
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm, fused_layer_norm, fused_rms_norm


def _layer_norm(x: Tensor, shape, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    w = w.to(x.dtype) if w is not None else None
    b = b.to(x.dtype) if b is not None else None
    return F.layer_norm(x, shape, w, b, eps)


def _rms_norm(x: Tensor, shape, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
    w = w.to(x.dtype) if w is not None else None
    return F.rms_norm(x, shape, w, eps)


# (our module, PyTorch's op run in the input's dtype as the oracle, our functional form)
NORMS = {
    "layer_norm": (FusedLayerNorm, _layer_norm, fused_layer_norm),
    "rms_norm": (FusedRMSNorm, _rms_norm, fused_rms_norm),
}


def _random_params(norm: nn.Module, seed: int = 0) -> None:
    """Weights in [0.5, 1.5) (never zero: memory_efficient divides by them), random bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in norm.named_parameters():
            noise = torch.rand(p.shape, generator=gen)
            p.copy_(noise + 0.5 if name == "weight" else noise - 0.5)


@pytest.fixture
def amp_o1() -> Iterator[None]:
    yield
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)  # casting off again


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_amp_o1_runs_the_norms_in_fp32_like_layer_norm(amp_o1, name: str, memory_efficient):
    module, oracle, functional = NORMS[name]
    torch.manual_seed(6)
    norm = module(16, memory_efficient=memory_efficient)
    _random_params(norm)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0
    )
    x = torch.randn(3, 8)
    hidden = model[0](x)
    assert hidden.dtype == torch.bfloat16  # O1 casts the linear layer
    out = model[1](hidden)
    # layer_norm is an fp32 op in Apex's O1 policy; the fused norms follow it.
    assert out.dtype == F.layer_norm(hidden, (16,)).dtype == torch.float32
    with torch.autocast("cpu", enabled=False):
        expected = oracle(hidden.float(), (16,), norm.weight, norm.bias, norm.eps)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    loss = model(x).square().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32
    assert torch.isfinite(norm.weight.grad).all()
    # The functional forms too.
    assert functional(torch.randn(2, 8, dtype=torch.bfloat16), 8).dtype == torch.float32
