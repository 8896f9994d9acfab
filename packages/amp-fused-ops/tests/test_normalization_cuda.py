"""The fused norms' modules on CUDA tensors, GPU only: autocast, ``torch.compile`` and
``use_reference`` there.

The kernels themselves (every row width, dtype mix, aligned or not, the inputs they hand to the
C++ reference, their checks) are held to float64 formulas on every path, the CUDA one included,
by ``test_contract_norm_ops.py``.
"""

from __future__ import annotations

import pytest
import torch

from _norm_helpers import (
    NORM_IDS,
    NORMS,
    NormSpec,
    random_params,
    run_with_grads,
)
from amp_fused_ops import FusedLayerNorm, extensions
from amp_fused_ops.extensions import _loader

pytestmark = pytest.mark.gpu

# fp32: two roundings (summation order)
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    _loader.get_extension("cuda")
    for name in ("norm_forward", "norm_backward"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"amp_fused_ops::{name}", "CUDA"):
            pytest.fail(f"the CUDA kernel of {name} is unavailable: "
                        f"{_loader.unavailable_reason('cuda')}")  # fmt: skip


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
def test_cuda_autocast_casts_the_norms_to_its_dtype_like_apex(spec: NormSpec):
    norm = spec.ours(64).cuda()
    random_params(norm)
    half = spec.ours(64).cuda().half()
    half.load_state_dict(norm.state_dict())
    x = torch.randn(8, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        y = norm(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, half(x.half()), atol=0, rtol=0)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_torch_compile_on_cuda_matches_eager(spec: NormSpec, memory_efficient):
    torch.manual_seed(6)
    norm = spec.ours(1000, memory_efficient=memory_efficient).cuda().to(torch.bfloat16)
    random_params(norm)
    compiled = torch.compile(norm, fullgraph=True)
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    params = list(norm.parameters())
    y1, g1 = run_with_grads(norm, x, params, dy)
    y2, g2 = run_with_grads(compiled, x, params, dy)
    torch.testing.assert_close(y2, y1)
    for a, b in zip(g1, g2, strict=True):
        if memory_efficient:
            # Compiled, the input is saved (the weight's values are unknown when tracing); eager
            # recomputes it from the bf16 output: one rounding of the dtype at the grad's scale.
            atol = torch.finfo(torch.bfloat16).eps * a.abs().max().item()
            torch.testing.assert_close(b, a, atol=atol, rtol=1.6e-2)
        else:
            torch.testing.assert_close(b, a)


def test_use_reference_sends_cuda_tensors_to_the_reference():
    torch.manual_seed(7)
    norm = FusedLayerNorm(300).cuda()
    random_params(norm)
    x = torch.randn(17, 300, device="cuda")
    with_kernel = norm(x)
    with extensions.use_reference() as calls:
        on_reference = norm(x)
    assert calls == {"amp_fused_ops::norm_forward": 1}
    torch.testing.assert_close(on_reference, with_kernel, **TOL[torch.float32])
