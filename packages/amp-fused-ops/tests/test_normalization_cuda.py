"""The CUDA LayerNorm / RMSNorm kernels (csrc/cuda/layer_norm.cu), GPU only.

Two oracles:

* PyTorch's own CUDA ``layer_norm`` / ``rms_norm``: our outputs and gradients stay within twice
  its error against a float64 reference (plus two roundings of the dtype at the result's scale
  for fp32, whose errors are all summation order; plus one rounding with ``memory_efficient``,
  whose input is recomputed from the rounded output);
* the fp32 PyTorch reference path (``amp_fused_ops.normalization._reference``) on the same
  CUDA tensors, for the statistics and the dtype combinations PyTorch has no op for (mixed dtypes).

Row lengths run from 1 to 65536 and include sizes that are not multiples of the vector width
(7, 555, 1025, 4099) and a misaligned buffer, so both the vector and the scalar paths run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from _norm_helpers import (
    NORM_IDS,
    NORMS,
    STATS_TOL,
    NormSpec,
    max_err,
    random_params,
    run_with_grads,
)
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm, extensions
from amp_fused_ops.extensions import _loader
from amp_fused_ops.reference import _norm as _norm_reference

_OPS = torch.ops.amp_fused_ops

pytestmark = pytest.mark.gpu

HIDDEN = (1, 7, 127, 555, 1024, 1025, 4099, 8192, 65536)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {  # two roundings of the output dtype, as in test_cuda_kernels.py
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2 * 2.0**-10, "atol": 1e-4},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    _loader.get_extension("cuda")
    for name in ("norm_forward", "norm_backward"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"amp_fused_ops::{name}", "CUDA"):
            pytest.fail(f"the CUDA kernel of {name} is unavailable: "
                        f"{_loader.unavailable_reason('cuda')}")  # fmt: skip


def _rows_for(hidden: int) -> int:
    return 3 if hidden >= 8192 else 37


def _bound(dtype: torch.dtype, torch_err: float, scale: float, *, memory_efficient: bool) -> float:
    """How far from the float64 result ours may be: twice PyTorch's error, plus roundings.

    ``scale`` is the magnitude of the terms the result is made of. The float64 reference of a
    low-precision gradient is itself rounded to the dtype (autograd casts it to the leaf's
    dtype), so a result one rounding away from it is still correct: PyTorch's kernel may round
    every element the same way as the reference by chance, ours in another summation order
    need not. The memory-efficient backward recomputes x-hat from the rounded output, one more
    rounding of the dtype.
    """
    eps = torch.finfo(dtype).eps
    bound = 2 * torch_err + 1e-6 + (2 if dtype == torch.float32 else 1) * eps * scale
    if memory_efficient:
        bound += eps * scale
    return bound


def _scale(t: Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _input_grad_scale(
    spec: NormSpec, x: Tensor, dy: Tensor, weight: Tensor | None, eps: float
) -> float:
    """The size of the terms of the input gradient: max |dy * weight| * max rstd.

    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = dy * weight cancels to
    nearly nothing when a row's g is nearly constant (hidden = 1, say), so its rounding error
    is relative to the terms, not to the result.
    """
    x64 = x.double()
    spread = x64.pow(2).mean(-1) if spec.rms else x64.var(-1, unbiased=False)
    rstd = torch.rsqrt(spread + eps).max().item()
    g = dy.double() if weight is None else dy.double() * weight.double()
    return g.abs().max().item() * rstd


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_kernels_within_twice_torch_error(spec: NormSpec, hidden, dtype, memory_efficient):
    torch.manual_seed(hidden)
    ours = spec.ours(hidden, memory_efficient=memory_efficient).to("cuda", dtype)
    random_params(ours)
    params = list(ours.parameters())
    shape = (_rows_for(hidden), hidden)
    x = (torch.randn(shape, device="cuda") * 3 + 1).to(dtype)
    dy = torch.randn(shape, device="cuda").to(dtype)

    def theirs(inp: Tensor) -> Tensor:
        return spec.oracle(inp, (hidden,), ours.weight, ours.bias, ours.eps)

    def theirs64(inp: Tensor) -> Tensor:
        w = ours.weight.double()
        b = ours.bias.double() if ours.bias is not None else None
        return spec.oracle(inp.double(), (hidden,), w, b, ours.eps)

    y, grads = run_with_grads(ours, x, params, dy)
    y_t, grads_t = run_with_grads(theirs, x, params, dy)
    y_64, grads_64 = run_with_grads(theirs64, x, params, dy)
    assert y.dtype == dtype
    bound = _bound(dtype, max_err(y_t, y_64), _scale(y_64), memory_efficient=False)
    assert max_err(y, y_64) <= bound, f"output: {max_err(y, y_64)} > {bound}"
    names = ["input", "weight", "bias"]
    for name, g, g_t, g_64 in zip(names, grads, grads_t, grads_64, strict=False):
        assert g.dtype == dtype
        scale = _scale(g_64)
        if name == "input":
            scale = max(scale, _input_grad_scale(spec, x, dy, ours.weight, ours.eps))
        bound = _bound(dtype, max_err(g_t, g_64), scale, memory_efficient=memory_efficient)
        assert max_err(g, g_64) <= bound, f"grad of {name}: {max_err(g, g_64)} > {bound}"


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("hidden", (1, 7, 555, 1024, 65536))
@pytest.mark.parametrize(
    ("x_dtype", "p_dtype", "mixed"),
    [
        (torch.bfloat16, torch.float32, False),
        (torch.bfloat16, torch.float32, True),
        (torch.float16, torch.float32, False),
        (torch.float16, torch.float32, True),
        (torch.float16, None, False),
        (torch.float32, torch.float32, True),
    ],
)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_kernels_match_the_reference(rms, hidden, x_dtype, p_dtype, mixed, memory_efficient):
    torch.manual_seed(3)
    rows = _rows_for(hidden)
    x = torch.randn(rows, hidden, device="cuda").to(x_dtype)
    w = b = None
    if p_dtype is not None:
        w = (torch.rand(hidden, device="cuda") + 0.5).to(p_dtype)
        b = None if rms else torch.randn(hidden, device="cuda").to(p_dtype)
    kernel = _OPS.norm_forward(x, w, b, 1e-5, rms, mixed, memory_efficient)
    reference = _norm_reference.norm_forward_reference(x, w, b, 1e-5, rms, mixed)
    out_dtype = reference[0].dtype
    assert kernel[0].dtype == out_dtype
    torch.testing.assert_close(kernel[0], reference[0], **TOL[out_dtype])
    torch.testing.assert_close(kernel[1], reference[1], **STATS_TOL)  # mean
    torch.testing.assert_close(kernel[2], reference[2], **STATS_TOL)  # invvar

    dy = torch.randn(rows, hidden, device="cuda").to(out_dtype)
    saved = reference[0] if memory_efficient else x
    args = (dy, saved, reference[1], reference[2], w, b, rms, memory_efficient, x_dtype)
    got = _OPS.norm_backward(*args)
    want = _norm_reference.norm_backward_reference(*args)
    assert got[0].dtype == x_dtype
    torch.testing.assert_close(got[0], want[0], **TOL[x_dtype])
    for g, r in zip(got[1:], want[1:], strict=True):  # parameter grads: sums over rows
        assert g.dtype == r.dtype and g.shape == r.shape
        if r.numel():
            scale = max(r.abs().max().item(), 1.0)
            torch.testing.assert_close(g, r, rtol=TOL[r.dtype]["rtol"], atol=1e-5 * scale * rows)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_buffers_take_the_scalar_path(rms, dtype):
    # One element into a buffer: every row starts off the 16-byte grid, so the kernels cannot
    # use vector loads; the results must not change beyond rounding.
    torch.manual_seed(4)
    rows, hidden = 29, 1024
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    buf = torch.empty(rows * hidden + 1, device="cuda", dtype=dtype)
    shifted = buf[1:].view(rows, hidden)
    shifted.copy_(x)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    b = None if rms else torch.randn(hidden, device="cuda").to(dtype)
    aligned = _OPS.norm_forward(x, w, b, 1e-5, rms, False, False)
    scalar = _OPS.norm_forward(shifted, w, b, 1e-5, rms, False, False)
    for a, s in zip(aligned, scalar, strict=True):
        torch.testing.assert_close(s, a, **TOL[s.dtype])
    dy = torch.randn(rows, hidden, device="cuda").to(dtype)
    dy_buf = torch.empty(rows * hidden + 1, device="cuda", dtype=dtype)
    dy_shifted = dy_buf[1:].view(rows, hidden)
    dy_shifted.copy_(dy)
    rest = (aligned[1], aligned[2], w, b, rms, False, dtype)
    grads = _OPS.norm_backward(dy, x, *rest)
    grads_scalar = _OPS.norm_backward(dy_shifted, shifted, *rest)
    for g, s in zip(grads, grads_scalar, strict=True):
        torch.testing.assert_close(s, g, rtol=TOL[dtype]["rtol"], atol=1e-3)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("rows", [1, 16384, 70001])
def test_many_rows_reduce_the_parameter_gradients(spec: NormSpec, rows):
    torch.manual_seed(5)
    hidden = 256
    ours = spec.ours(hidden).cuda()
    random_params(ours)
    theirs = spec.torch_module(hidden).cuda().double()
    theirs.load_state_dict(ours.state_dict())
    x, dy = torch.randn(rows, hidden, device="cuda"), torch.randn(rows, hidden, device="cuda")
    _, grads = run_with_grads(ours, x, list(ours.parameters()), dy)
    _, grads_64 = run_with_grads(theirs, x.double(), list(theirs.parameters()), dy.double())
    for g, g64 in zip(grads[1:], grads_64[1:], strict=True):
        # fp32 sums of `rows` terms of size ~1: relative error ~ 1e-7 * sqrt(rows).
        torch.testing.assert_close(g, g64.float(), rtol=1e-4, atol=1e-6 * rows)


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


def test_rows_longer_than_the_kernels_take_the_reference():
    norm = FusedRMSNorm(65537).cuda()
    x = torch.randn(2, 65537, device="cuda")
    torch.testing.assert_close(norm(x), F.rms_norm(x, (65537,), norm.weight, norm.eps))


def test_inputs_the_kernels_do_not_take_run_the_reference():
    x = torch.randn(8, 16, device="cuda")
    want = _norm_reference.norm_forward_reference(
        x.t().contiguous(), None, None, 1e-5, False, False
    )
    for got, ref in zip(_OPS.norm_forward(x.t(), None, None, 1e-5, False, False, False), want,
                        strict=True):  # fmt: skip
        torch.testing.assert_close(got, ref, **TOL[torch.float32])
    half, weight = x.half(), torch.rand(16, device="cuda", dtype=torch.bfloat16) + 0.5
    got = _OPS.norm_forward(half, weight, None, 1e-5, False, False, False)
    want = _norm_reference.norm_forward_reference(half, weight, None, 1e-5, False, False)
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float16])


def test_kernel_checks_name_the_problem():
    x = torch.randn(8, 16, device="cuda")
    with pytest.raises(RuntimeError, match=r"parameters must be contiguous of shape \(16\)"):
        _OPS.norm_forward(x, torch.ones(15, device="cuda"), None, 1e-5, False, False, False)
    with pytest.raises(RuntimeError, match="mixed-dtype variant needs a weight"):
        _OPS.norm_forward(x, None, None, 1e-5, False, True, False)
    with pytest.raises(RuntimeError, match="parameters must be on the input's device"):
        _OPS.norm_forward(x, torch.ones(16), None, 1e-5, False, False, False)
