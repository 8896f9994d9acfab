"""FusedLayerNorm / FusedRMSNorm (and Mixed*) against PyTorch's LayerNorm / RMSNorm, on CPU.

Tolerances: fp32 results match PyTorch's module run in float64 to 1e-5 (atol and rtol);
fp16 / bf16 results and gradients stay within twice the error of PyTorch's own fp16 / bf16 op
against a float64 reference (plus 1e-6 for exact cases). With ``memory_efficient`` the input is
recomputed from the saved, rounded output, which adds up to one rounding of the dtype at the
gradient's scale to that bound. These are the modules and functions users call; the norm ops
beneath them are held to float64 formulas on every path (reference, CPU kernel, CUDA kernel)
by test_contract_norm_ops.py.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import amp_fused_ops
from _norm_helpers import (
    NORM_IDS,
    NORMS,
    NormSpec,
    max_err,
    random_params,
    run_with_grads,
)
from _profiled import profiled
from amp_fused_ops import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)
from amp_fused_ops.extensions import _api as ext_api
from amp_fused_ops.extensions import _loader
from amp_fused_ops.normalization import _ops as _norm_ops

SHAPES = [  # (input shape, normalized_shape): rows of 1, 7, 64, 555 and 1025 elements
    ((4, 7), (7,)),
    ((3, 5, 64), (64,)),
    ((1, 555), (555,)),
    ((2, 1025), (1025,)),
    ((6, 1), (1,)),
    ((2, 3, 4, 12), (4, 12)),
]
HALF = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize(("shape", "normalized"), SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_fp32_forward_backward_match_torch(spec: NormSpec, shape, normalized, affine):
    # Against PyTorch's module run in float64 (its fp32 backward is noisier than ours for a
    # hidden size of 1, where the exact input gradient is 0).
    torch.manual_seed(0)
    ours = spec.ours(normalized, eps=1e-5, elementwise_affine=affine)
    theirs = spec.torch_module(normalized, eps=1e-5, elementwise_affine=affine)
    random_params(ours)
    theirs.load_state_dict(ours.state_dict())
    theirs.double()
    x, dy = torch.randn(shape), torch.randn(shape)
    y1, g1 = run_with_grads(ours, x, list(ours.parameters()), dy)
    y2, g2 = run_with_grads(theirs, x.double(), list(theirs.parameters()), dy.double())
    assert y1.dtype == torch.float32
    torch.testing.assert_close(y1, y2.float(), atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize(("shape", "affine"), [((16, 3, 200), True), ((5, 1025), False)])
def test_low_precision_error_within_twice_torch(
    spec: NormSpec, dtype, memory_efficient, shape, affine
):
    torch.manual_seed(1)
    normalized = shape[-1:]
    ours = spec.ours(normalized, elementwise_affine=affine, memory_efficient=memory_efficient)
    ours.to(dtype)
    random_params(ours)
    params = list(ours.parameters())
    x = torch.randn(shape, dtype=dtype) * 3 + 1
    dy = torch.randn(shape, dtype=dtype)
    eps = ours.eps

    def oracle(inp):
        return spec.oracle(inp, normalized, ours.weight, ours.bias, eps)

    def oracle64(inp):
        w = ours.weight.double() if ours.weight is not None else None
        b = ours.bias.double() if ours.bias is not None else None
        return spec.oracle(inp.double(), normalized, w, b, eps)

    y, grads = run_with_grads(ours, x, params, dy)
    y_lp, grads_lp = run_with_grads(oracle, x, params, dy)
    y_64, grads_64 = run_with_grads(oracle64, x, params, dy)
    assert y.dtype == dtype
    assert max_err(y, y_64) <= 2 * max_err(y_lp, y_64) + 1e-6
    names = ["input", "weight", "bias"]
    for name, g, g_lp, g_64 in zip(names, grads, grads_lp, grads_64, strict=False):
        assert g.dtype == dtype
        bound = 2 * max_err(g_lp, g_64) + 1e-6
        if memory_efficient:  # the saved output was rounded to the dtype
            bound += torch.finfo(dtype).eps * g_64.abs().max().item()
        assert max_err(g, g_64) <= bound, f"grad of {name}: {max_err(g, g_64)} > {bound}"


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("affine", [True, False])
def test_memory_efficient_gives_the_same_gradients(spec: NormSpec, affine):
    torch.manual_seed(2)
    plain = spec.ours((7, 48), elementwise_affine=affine)
    saving = spec.ours((7, 48), elementwise_affine=affine, memory_efficient=True)
    random_params(plain)
    saving.load_state_dict(plain.state_dict())
    x, dy = torch.randn(5, 7, 48), torch.randn(5, 7, 48)
    y1, g1 = run_with_grads(plain, x, list(plain.parameters()), dy)
    y2, g2 = run_with_grads(saving, x, list(saving.parameters()), dy)
    torch.testing.assert_close(y1, y2, atol=0, rtol=0)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_memory_efficient_saves_the_output_not_the_input(spec: NormSpec, memory_efficient):
    norm = spec.ours(32, memory_efficient=memory_efficient)
    x = torch.randn(4, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    big = [t for t in saved if t.numel() == x.numel()]  # the (rows, hidden) activations
    assert len(big) == 1
    assert big[0].data_ptr() == (y.data_ptr() if memory_efficient else x.data_ptr())


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
def test_state_dicts_interchange_with_torch(spec: NormSpec):
    ours = spec.ours((3, 8))
    random_params(ours)
    theirs = spec.torch_module((3, 8))
    theirs.load_state_dict(ours.state_dict())  # strict: same keys and shapes
    back = spec.ours((3, 8))
    back.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, value in ours.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(back(x), theirs(x), atol=1e-5, rtol=1e-5)
    mixed = spec.mixed((3, 8))
    mixed.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(mixed(x), theirs(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_mixed_variants_output_in_the_parameters_dtype(spec: NormSpec, dtype, memory_efficient):
    torch.manual_seed(3)
    norm = spec.mixed(40, memory_efficient=memory_efficient)
    random_params(norm)
    x = torch.randn(6, 40).to(dtype)
    dy = torch.randn(6, 40)
    params = list(norm.parameters())
    y, grads = run_with_grads(norm, x, params, dy)
    assert y.dtype == torch.float32
    assert grads[0].dtype == dtype and all(g.dtype == torch.float32 for g in grads[1:])
    # Same math as the fp32 norm on the (exactly representable) fp32 copy of the input.
    fp32 = spec.ours(40)
    fp32.load_state_dict(norm.state_dict())
    y32, grads32 = run_with_grads(fp32, x.float(), list(fp32.parameters()), dy)
    torch.testing.assert_close(y, y32, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[0], grads32[0].to(dtype))
    for g, g32 in zip(grads[1:], grads32[1:], strict=True):
        torch.testing.assert_close(g, g32, atol=1e-5, rtol=1e-5)
    if spec.rms:
        functional = mixed_dtype_fused_rms_norm_affine(x, norm.weight, 40, norm.eps)
    else:
        functional = mixed_dtype_fused_layer_norm_affine(x, norm.weight, norm.bias, 40, norm.eps)
    torch.testing.assert_close(functional, y)


def test_functional_forms_match_torch():
    torch.manual_seed(4)
    x, w, b = torch.randn(3, 5, 16), torch.rand(5, 16) + 0.5, torch.randn(5, 16)
    shape = (5, 16)
    ref = F.layer_norm(x, shape, w, b, 1e-6)  # Apex's functional default eps is 1e-6
    torch.testing.assert_close(fused_layer_norm_affine(x, w, b, shape), ref)
    torch.testing.assert_close(fused_layer_norm_affine(x, w, b, list(shape), 1e-6, True), ref)
    torch.testing.assert_close(fused_layer_norm(x, shape), F.layer_norm(x, shape, eps=1e-6))
    torch.testing.assert_close(fused_rms_norm_affine(x, w, shape), F.rms_norm(x, shape, w, 1e-6))
    torch.testing.assert_close(fused_rms_norm(x, torch.Size(shape)), F.rms_norm(x, shape, eps=1e-6))


def test_empty_batch_and_non_contiguous_input():
    norm = FusedLayerNorm(16)
    random_params(norm)
    empty = torch.randn(0, 16, requires_grad=True)
    out = norm(empty)
    out.sum().backward()
    assert out.shape == (0, 16) and empty.grad is not None and empty.grad.shape == (0, 16)
    assert torch.equal(norm.weight.grad, torch.zeros(16))
    transposed = torch.randn(16, 6).t()  # (6, 16), not contiguous
    expected = F.layer_norm(transposed, (16,), norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(norm(transposed), expected)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("autocast_dtype", HALF)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mixed", [False, True])
def test_autocast_casts_input_and_params_to_its_dtype_like_apex(
    spec: NormSpec, autocast_dtype, input_dtype, mixed
):
    # Apex's fused norms cast the input and the parameters to the autocast dtype and return
    # that dtype; the statistics stay fp32 inside. So the result equals the norm run outside
    # autocast on half copies, and the fp32 parameters get those gradients in fp32.
    torch.manual_seed(5)
    norm = (spec.mixed if mixed else spec.ours)(24)
    random_params(norm)
    half_norm = (spec.mixed if mixed else spec.ours)(24).to(autocast_dtype)
    half_norm.load_state_dict(norm.state_dict())
    x, dy = torch.randn(4, 24).to(input_dtype), torch.randn(4, 24)
    params = list(norm.parameters())
    with torch.autocast("cpu", dtype=autocast_dtype):
        y, grads = run_with_grads(norm, x, params, dy)
    assert y.dtype == autocast_dtype
    y_ref, grads_ref = run_with_grads(
        half_norm, x.to(autocast_dtype), list(half_norm.parameters()), dy
    )
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    assert grads[0].dtype == input_dtype
    torch.testing.assert_close(grads[0], grads_ref[0].to(input_dtype), atol=0, rtol=0)
    for g, g_ref in zip(grads[1:], grads_ref[1:], strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, g_ref.float(), atol=0, rtol=0)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
def test_autocast_functional_forms_cast_like_the_modules(spec: NormSpec):
    x, w = torch.randn(3, 16), torch.rand(16) + 0.5
    b = torch.randn(16)
    with torch.autocast("cpu", dtype=torch.float16):
        if spec.rms:
            outs = [fused_rms_norm(x, 16), fused_rms_norm_affine(x, w, 16)]
            outs.append(mixed_dtype_fused_rms_norm_affine(x, w, 16))
        else:
            outs = [fused_layer_norm(x, 16), fused_layer_norm_affine(x, w, b, 16)]
            outs.append(mixed_dtype_fused_layer_norm_affine(x, w, b, 16))
        float64 = (fused_rms_norm if spec.rms else fused_layer_norm)(x.double(), 16)
    assert [o.dtype for o in outs] == [torch.float16] * 3
    assert float64.dtype == torch.float64  # float64 is left alone, as by autocast


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_torch_compile_matches_eager(spec: NormSpec, memory_efficient, affine):
    torch.manual_seed(7)
    norm = spec.ours((3, 32), elementwise_affine=affine, memory_efficient=memory_efficient)
    random_params(norm)
    compiled = torch.compile(norm, fullgraph=True)  # inductor: the norm decomposed on the CPU
    x, dy = torch.randn(4, 3, 32), torch.randn(4, 3, 32)
    params = list(norm.parameters())
    y1, g1 = run_with_grads(norm, x, params, dy)
    y2, g2 = run_with_grads(compiled, x, params, dy)
    torch.testing.assert_close(y1, y2)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inductor_decomposes_the_norm_ops_on_the_cpu(rms: bool, dtype: torch.dtype) -> None:
    """Without a CUDA kernel the ops compute with ATen ops; Inductor gets them as
    decompositions (to fuse with the neighbours, as nn.LayerNorm's), so no norm op runs."""
    from torch.profiler import profile

    torch.manual_seed(3)
    make = FusedRMSNorm if rms else FusedLayerNorm
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), make(32), torch.nn.GELU()).to(dtype)
    random_params(model[1])
    compiled = torch.compile(model, fullgraph=True)
    x, dy = torch.randn(8, 16, dtype=dtype), torch.randn(8, 32, dtype=dtype)
    params = list(model.parameters())
    y1, g1 = run_with_grads(model, x, params, dy)
    # Compiled afresh: a cached graph would not show what this process lowers.
    with torch._inductor.config.patch(force_disable_caches=True):
        y2, g2 = run_with_grads(compiled, x, params, dy)
    with profile() as prof:
        run_with_grads(compiled, x, params, dy)
    ran = {e.key for e in prof.key_averages()}
    assert not {"amp_fused_ops::norm_forward", "amp_fused_ops::norm_backward"} & ran, ran
    # bfloat16: Inductor keeps in fp32 some intermediates that eager rounds to bfloat16, so
    # the two differ by a few bfloat16 roundings of the largest values.
    for a, b in zip([y2, *g2], [y1, *g1], strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b)
        else:
            scale = float(b.abs().max())
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * scale)


# A fresh process that compiles a model without a norm first (Inductor then has made and
# cached its decomposition table) and a model with both norms after it.
_NORMS_COMPILED_SECOND = """
import torch
from torch.profiler import profile
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm

torch.compile(torch.nn.Linear(4, 4))(torch.randn(2, 4)).sum().backward()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), FusedLayerNorm(16), FusedRMSNorm(16))
compiled = torch.compile(model)
x = torch.randn(4, 8)
compiled(x).sum().backward()
with profile() as prof:
    compiled(x).sum().backward()
print(sorted(e.key for e in prof.key_averages() if e.key.startswith("amp_fused_ops::")))
"""


def test_inductor_decomposes_the_norms_compiled_after_another_model() -> None:
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _NORMS_COMPILED_SECOND],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_torch_compile_under_autocast_matches_eager():
    norm = FusedLayerNorm(32)
    random_params(norm)
    compiled = torch.compile(norm, backend="aot_eager")
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager, traced = norm(x), compiled(x)
    assert traced.dtype == eager.dtype
    torch.testing.assert_close(traced, eager, atol=0, rtol=0)


OPCHECK_CASES = [  # (rms, weight, bias, mixed, memory_efficient, input dtype)
    (False, True, True, False, False, torch.float32),
    (False, True, True, False, True, torch.float32),
    (False, False, False, False, False, torch.float32),
    (True, True, False, False, True, torch.float32),
    (True, False, False, False, False, torch.bfloat16),
    (False, True, True, True, False, torch.bfloat16),
    (True, True, False, True, True, torch.float16),
]


@pytest.mark.parametrize(("rms", "has_w", "has_b", "mixed", "me", "dtype"), OPCHECK_CASES)
def test_custom_ops_pass_opcheck(rms, has_w, has_b, mixed, me, dtype):
    torch.manual_seed(8)
    param_dtype = torch.float32 if mixed else dtype
    x = torch.randn(5, 12, dtype=dtype, requires_grad=True)
    w = (torch.rand(12, dtype=param_dtype) + 0.5).requires_grad_() if has_w else None
    b = torch.randn(12, dtype=param_dtype, requires_grad=True) if has_b else None
    args = (x, w, b, 1e-5, rms, mixed, me)
    torch.library.opcheck(torch.ops.amp_fused_ops.norm_forward.default, args)
    y, mean, invvar = torch.ops.amp_fused_ops.norm_forward(*args)
    saved = y.detach() if me else x.detach()
    detached = [t.detach() if t is not None else None for t in (w, b)]
    back = (torch.randn_like(y), saved, mean, invvar, *detached, rms, me, dtype)
    torch.library.opcheck(torch.ops.amp_fused_ops.norm_backward.default, back)


def test_cpu_path_needs_no_extension(monkeypatch):
    # CPU tensors take the PyTorch path without asking the loader for any extension, so the
    # norms work where nothing can be compiled (and with AMP_FUSED_OPS_DISABLE set).
    monkeypatch.setenv(_loader.DISABLE_ENV, "1")

    def refuse(kind: str) -> None:
        raise AssertionError(f"the CPU path asked for the {kind} extension")

    monkeypatch.setattr(ext_api, "get_extension", refuse)
    torch.manual_seed(9)
    x = torch.randn(3, 40, requires_grad=True)
    for spec in NORMS:
        norm = spec.ours(40)
        random_params(norm)
        out = norm(x)
        out.sum().backward()
        torch.testing.assert_close(out, spec.oracle(x, (40,), norm.weight, norm.bias, norm.eps))


def test_with_the_cpu_extension_a_step_runs_no_python_between_call_and_kernel(
    cpu_extension: object,
) -> None:
    """Forward and backward of a fused norm on the CPU: the C++ autograd node, the C++ CPU
    kernels; none of the Python fallbacks (the ATen path, the reference, the Python formula)."""
    from amp_fused_ops.reference import _norm

    python_paths = (_norm.norm_forward_aten, _norm.norm_backward_aten,
                    _norm.norm_forward_reference, _norm.norm_backward_reference,
                    _norm_ops._NormForward.forward, _norm_ops._autograd_kernel)  # fmt: skip
    for spec in NORMS:
        norm = spec.ours(8)
        x = torch.randn(3, 8, requires_grad=True)
        with profiled(*python_paths) as runs:
            out = norm(x)
            out.sum().backward()
        assert not any(runs.values()), runs
        node = out.grad_fn
        assert type(node).__name__ == "CppFunction", node  # the C++ autograd node
        assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("path", ["cpp", "python"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_double_backward_raises_instead_of_giving_a_partial_gradient(
    path: str, rms: bool, cpu_extension: object
) -> None:
    """A gradient penalty (create_graph=True) through a fused norm: the first-order gradient is
    right, and differentiating it raises, on the C++ formula and on the Python one alike."""
    from amp_fused_ops.normalization import _ops as _norm_ops

    torch.manual_seed(4)
    x = torch.randn(4, 8, requires_grad=True)
    w = (torch.rand(8) + 0.5).requires_grad_()
    b = None if rms else torch.randn(8, requires_grad=True)
    call = _norm_ops.NORM_FORWARD if path == "cpp" else _norm_ops._autograd_kernel
    out, _, _ = call(x, w, b, 1e-5, rms, False, False)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    xr = x.detach().clone().requires_grad_()
    ref = (
        F.rms_norm(xr, (8,), w.detach(), 1e-5)
        if rms
        else F.layer_norm(xr, (8,), w.detach(), b.detach() if b is not None else None, 1e-5)
    )
    (want,) = torch.autograd.grad(ref.pow(2).sum(), xr)
    torch.testing.assert_close(grad.detach(), want)
    penalty = out.sum() + grad.pow(2).sum()
    # The Python formula is once_differentiable itself; the C++ one says the same in its words.
    with pytest.raises(RuntimeError, match=r"differentiable once|differentiate twice"):
        penalty.backward()


def test_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"does not end with normalized_shape \(8,\)"):
        FusedLayerNorm(8)(torch.randn(2, 9))
    with pytest.raises(ValueError, match=r"does not end with normalized_shape \(2, 8\)"):
        FusedRMSNorm((2, 8))(torch.randn(8))
    with pytest.raises(ValueError, match=r"weight has shape \(7,\)"):
        fused_layer_norm_affine(torch.randn(2, 8), torch.ones(7), torch.zeros(8), 8)
    with pytest.raises(ValueError, match=r"bias has shape \(2, 4\)"):
        fused_layer_norm_affine(torch.randn(2, 8), torch.ones(8), torch.zeros(2, 4), 8)
    with pytest.raises(ValueError, match="positive sizes"):
        FusedRMSNorm((4, 0))
    with pytest.raises(ValueError, match="positive sizes"):
        FusedLayerNorm([])


def test_mixed_norms_refuse_what_apex_refuses():
    with pytest.raises(ValueError, match="elementwise_affine=False"):
        MixedFusedLayerNorm(8, elementwise_affine=False)
    with pytest.raises(ValueError, match="elementwise_affine=False"):
        MixedFusedRMSNorm(8, elementwise_affine=False)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bias'\]"):
        MixedFusedLayerNorm(8, bias=False)
    assert MixedFusedRMSNorm(8, elementwise_affine=True).weight is not None
    with pytest.raises(TypeError):
        MixedFusedLayerNorm(8, 1e-5, True)  # type: ignore[misc]  # memory_efficient: keyword


def test_repr_defaults_and_class_tree_follow_apex():
    norm = FusedLayerNorm([4, 5])
    assert norm.normalized_shape == torch.Size([4, 5]) and norm.eps == 1e-5
    assert isinstance(norm.normalized_shape, torch.Size)
    assert torch.equal(norm.weight, torch.ones(4, 5)) and torch.equal(norm.bias, torch.zeros(4, 5))
    assert repr(norm) == (
        "FusedLayerNorm((4, 5), eps=1e-05, elementwise_affine=True, memory_efficient=False)"
    )
    assert FusedRMSNorm(4).bias is None and FusedRMSNorm(4).eps == 1e-5
    assert FusedLayerNorm(4, elementwise_affine=False).weight is None
    assert isinstance(MixedFusedLayerNorm(4), FusedLayerNorm)
    assert isinstance(MixedFusedRMSNorm(4), FusedRMSNorm)
    assert not isinstance(FusedRMSNorm(4), FusedLayerNorm)  # siblings, as in Apex


# Apex's signatures (apex/normalization/fused_layer_norm.py), as (name, default) pairs.
APEX_SIGNATURES = {
    "fused_layer_norm_affine": [
        ("input", None), ("weight", None), ("bias", None), ("normalized_shape", None),
        ("eps", 1e-6), ("memory_efficient", False),
    ],
    "fused_layer_norm": [
        ("input", None), ("normalized_shape", None), ("eps", 1e-6), ("memory_efficient", False),
    ],
    "mixed_dtype_fused_layer_norm_affine": [
        ("input", None), ("weight", None), ("bias", None), ("normalized_shape", None),
        ("eps", 1e-6), ("memory_efficient", False),
    ],
    "fused_rms_norm_affine": [
        ("input", None), ("weight", None), ("normalized_shape", None), ("eps", 1e-6),
        ("memory_efficient", False),
    ],
    "fused_rms_norm": [
        ("input", None), ("normalized_shape", None), ("eps", 1e-6), ("memory_efficient", False),
    ],
    "mixed_dtype_fused_rms_norm_affine": [
        ("input", None), ("weight", None), ("normalized_shape", None), ("eps", 1e-6),
        ("memory_efficient", False),
    ],
    "FusedLayerNorm": [
        ("normalized_shape", None), ("eps", 1e-5), ("elementwise_affine", True),
        ("memory_efficient", False),
    ],
    "FusedRMSNorm": [
        ("normalized_shape", None), ("eps", 1e-5), ("elementwise_affine", True),
        ("memory_efficient", False),
    ],
    "MixedFusedLayerNorm": [
        ("normalized_shape", None), ("eps", 1e-5), ("memory_efficient", False), ("kwargs", None),
    ],
    "MixedFusedRMSNorm": [
        ("normalized_shape", None), ("eps", 1e-5), ("memory_efficient", False), ("kwargs", None),
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(APEX_SIGNATURES))
def test_signatures_follow_apex(name):
    signature = inspect.signature(getattr(amp_fused_ops, name))
    found = [
        (p.name, None if p.default is inspect.Parameter.empty else p.default)
        for p in signature.parameters.values()
    ]
    assert found == APEX_SIGNATURES[name]


# --- integer inputs -----------------------------------------------------------------------------

INTEGER_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_integer_input_refused_like_torch(spec: NormSpec, dtype):
    x = torch.ones(2, 8, dtype=dtype)
    with pytest.raises(RuntimeError):
        spec.torch_module(8)(x)  # PyTorch refuses it too
    calls = {
        "module": lambda: spec.ours(8)(x),
        "module without affine": lambda: spec.ours(8, elementwise_affine=False)(x),
        "mixed module": lambda: spec.mixed(8)(x),
        "functional": lambda: (fused_rms_norm if spec.rms else fused_layer_norm)(x, 8),
        "op": lambda: torch.ops.amp_fused_ops.norm_forward(
            x, None, None, 1e-5, spec.rms, False, False
        ),
    }
    for call in calls.values():
        with pytest.raises(TypeError, match=rf"floating-point.*input of dtype {dtype}"):
            call()
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError):
            call()
    with pytest.raises(TypeError, match=r"weight of dtype torch\.int64"):
        fused_layer_norm_affine(torch.randn(2, 8), torch.ones(8, dtype=torch.int64), None, 8)


def test_integer_input_refused_under_torch_compile():
    compiled = torch.compile(FusedLayerNorm(8), backend="aot_eager")
    with pytest.raises(Exception, match="floating-point"):
        compiled(torch.ones(2, 8, dtype=torch.int64))


# --- tracing and export: plain PyTorch ops, as Apex's modules ---------------------------------


def _net(rms_affine: bool = True) -> torch.nn.Module:
    torch.manual_seed(9)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        FusedLayerNorm(16),
        torch.nn.Linear(16, 16),
        FusedRMSNorm(16, elementwise_affine=rms_affine),
        MixedFusedLayerNorm(16),
    )
    for m in net:
        if isinstance(m, (FusedLayerNorm, FusedRMSNorm)):
            random_params(m)
    return net


def test_jit_trace_holds_standard_ops_and_matches_eager():
    net, x = _net(), torch.randn(5, 6)
    traced = torch.jit.trace(net, (x,))
    assert "amp_fused_ops::" not in str(traced.inlined_graph)
    torch.testing.assert_close(traced(x), net(x), atol=1e-5, rtol=1e-5)
    other = torch.randn(3, 6)  # the trace is not tied to the example's values
    torch.testing.assert_close(traced(other), net(other), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_export_runs_and_matches_eager(dynamo, tmp_path):
    onnx = pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    from onnx.reference import ReferenceEvaluator

    net, x = _net(), torch.randn(5, 6)
    path = tmp_path / "net.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(net, (x,), str(path), dynamo=dynamo, opset_version=18)
    model = onnx.load(str(path))
    ops = {node.op_type for node in model.graph.node}
    assert "LayerNormalization" in ops
    assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)
    [out] = ReferenceEvaluator(model).run(None, {model.graph.input[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), net(x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
def test_memory_efficient_with_a_zero_weight_saves_the_input(spec: NormSpec):
    norm = spec.ours(32, memory_efficient=True)
    with torch.no_grad():
        norm.weight[5] = 0.0
    x = torch.randn(4, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    big = [t for t in saved if t.numel() == x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_torch_export_names_the_norm_op_and_runs(memory_efficient: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        FusedLayerNorm(16, memory_efficient=memory_efficient),
        FusedRMSNorm(16, memory_efficient=memory_efficient),
    )
    x = torch.randn(4, 8)
    exported = torch.export.export(model, (x,))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert "amp_fused_ops.norm_forward.default" in targets
    torch.testing.assert_close(exported.module()(x), model(x), rtol=0, atol=0)
