"""Apex's ``apex.normalization.fused_layer_norm`` at ``amp_fused_ops.normalization``: every
public name, and the autograd Functions called as Apex code calls them (``.apply`` with Apex's
positional arguments), against PyTorch's ``layer_norm`` / a float32 RMSNorm."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from amp_fused_ops.normalization import fused_layer_norm as fln

# Every public name of Apex's module (24.04), written out.
APEX_NAMES = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedLayerNormFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "FusedRMSNormFunction",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
    "manual_rms_norm",
]

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def test_every_apex_name_is_there() -> None:
    missing = [n for n in APEX_NAMES if not hasattr(fln, n)]
    assert missing == []
    from amp_fused_ops import normalization

    for name in ("FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"):
        assert getattr(normalization, name) is getattr(fln, name)
    assert normalization.fused_layer_norm is fln


@pytest.mark.parametrize(
    "function",
    [
        "FusedLayerNormAffineFunction",
        "FusedLayerNormAffineMixedDtypesFunction",
        "FusedLayerNormFunction",
        "FusedRMSNormAffineFunction",
        "FusedRMSNormAffineMixedDtypesFunction",
        "FusedRMSNormFunction",
    ],
)
def test_forward_takes_apex_arguments(function: str) -> None:
    # megatron-core looks for "memory_efficient" in the argument names before passing it.
    args = inspect.getfullargspec(getattr(fln, function).forward).args
    affine = "Affine" in function
    rms = "RMS" in function
    expected = ["ctx", "input"]
    expected += (["weight"] if affine else []) + (["bias"] if affine and not rms else [])
    expected += ["normalized_shape", "eps", "memory_efficient"]
    assert args == expected


def _rms_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.double()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.double()


def _inputs(dtype: torch.dtype, affine_dtype: torch.dtype | None = None) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=gen) * 2 + 0.5).to(dtype).requires_grad_()
    pdtype = affine_dtype or dtype
    w = (torch.rand(16, generator=gen) + 0.5).to(pdtype).requires_grad_()
    b = torch.randn(16, generator=gen).to(pdtype).requires_grad_()
    g = torch.randn(3, 5, 16, generator=gen)
    return x, w, b, g


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_norm_affine_function_matches_torch(
    dtype: torch.dtype, memory_efficient: bool
) -> None:
    x, w, b, g = _inputs(dtype)
    out = fln.FusedLayerNormAffineFunction.apply(x, w, b, torch.Size([16]), 1e-5, memory_efficient)
    assert out.dtype == dtype and out.shape == x.shape
    (out.float() * g).sum().backward()
    grads = [t.grad.clone() for t in (x, w, b)]

    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.layer_norm(xr, (16,), wr, br, 1e-5)
    (ref * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), **TOL[dtype])
    for got, want in zip(grads, (xr.grad, wr.grad, br.grad), strict=True):
        assert got.dtype == dtype
        scale = want.abs().max().item()
        torch.testing.assert_close(
            got.double(), want, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale
        )


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_rms_norm_affine_function_matches_reference(memory_efficient: bool) -> None:
    x, w, _, g = _inputs(torch.float32)
    out = fln.FusedRMSNormAffineFunction.apply(x, w, 16, 1e-6, memory_efficient)
    (out * g).sum().backward()
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))
    ref = _rms_reference(xr, wr, 1e-6)
    (ref * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), **TOL[torch.float32])
    torch.testing.assert_close(x.grad.double(), xr.grad, **TOL[torch.float32])
    torch.testing.assert_close(w.grad.double(), wr.grad, **TOL[torch.float32])


def test_functions_without_parameters() -> None:
    x, _, _, g = _inputs(torch.float32)
    out = fln.FusedLayerNormFunction.apply(x, (16,), 1e-5)
    (out * g).sum().backward()
    xr = x.detach().double().requires_grad_()
    ref = F.layer_norm(xr, (16,), None, None, 1e-5)
    (ref * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), **TOL[torch.float32])
    torch.testing.assert_close(x.grad.double(), xr.grad, **TOL[torch.float32])

    x.grad = None
    out = fln.FusedRMSNormFunction.apply(x, [16], 1e-6, True)
    (out * g).sum().backward()
    xr = x.detach().double().requires_grad_()
    ref = _rms_reference(xr, None, 1e-6)
    (ref * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), **TOL[torch.float32])
    torch.testing.assert_close(x.grad.double(), xr.grad, **TOL[torch.float32])


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_mixed_dtype_functions_return_the_weights_dtype(half: torch.dtype) -> None:
    x, w, b, g = _inputs(half, affine_dtype=torch.float32)
    out = fln.FusedLayerNormAffineMixedDtypesFunction.apply(x, w, b, (16,), 1e-5)
    assert out.dtype == torch.float32
    (out * g).sum().backward()
    assert x.grad.dtype == half and w.grad.dtype == torch.float32
    ref = F.layer_norm(x.detach().float(), (16,), w.detach(), b.detach(), 1e-5)
    torch.testing.assert_close(out, ref, **TOL[half])

    out = fln.FusedRMSNormAffineMixedDtypesFunction.apply(x, w, (16,), 1e-6)
    assert out.dtype == torch.float32
    ref = _rms_reference(x.detach(), w.detach(), 1e-6).float()
    torch.testing.assert_close(out, ref, **TOL[half])


def test_functions_ignore_autocast_as_apex_did() -> None:
    # Apex's Functions ran the extension on what they were given; the functional forms cast.
    x, w, b, _ = _inputs(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fln.FusedLayerNormAffineFunction.apply(x, w, b, (16,), 1e-5)
    assert out.dtype == torch.bfloat16


def test_a_shape_mismatch_says_what_to_pass() -> None:
    x, w, b, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"does not end with normalized_shape \(8,\)"):
        fln.FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-5)


def test_manual_rms_norm_is_apex_formula() -> None:
    x, w, _, _ = _inputs(torch.float32)
    out = fln.manual_rms_norm(x.detach(), (16,), w.detach(), 1e-6)
    ref = _rms_reference(x.detach(), w.detach(), 1e-6)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    half_w = w.detach().to(torch.bfloat16)
    assert fln.manual_rms_norm(x.detach(), (16,), half_w, 1e-6).dtype == torch.bfloat16
    assert fln.manual_rms_norm(x.detach(), (16,), None, 1e-6).dtype == torch.float32


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("module", [fln.FusedLayerNorm, fln.FusedRMSNorm], ids=["ln", "rms"])
def test_a_forward_without_grad_gives_the_same_output_and_no_graph(module, memory_efficient):
    torch.manual_seed(0)
    norm = module(32, memory_efficient=memory_efficient)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 32, requires_grad=True)
    trained = norm(x)
    assert trained.grad_fn is not None
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            out = norm(x)
        assert out.grad_fn is None and not out.requires_grad
        torch.testing.assert_close(out, trained.detach(), rtol=0, atol=0)
    for param in norm.parameters():
        param.requires_grad_(False)
    out = norm(x.detach())  # grad mode on, nothing requires grad
    assert out.grad_fn is None
    torch.testing.assert_close(out, trained.detach(), rtol=0, atol=0)
