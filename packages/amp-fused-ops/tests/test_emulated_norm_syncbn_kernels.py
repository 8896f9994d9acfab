"""The LayerNorm / RMSNorm and SyncBN CUDA kernels, run on the emulated kernels.

Only under ``nox -s cuda_emulation`` (``AMP_FUSED_OPS_EMULATION`` set): the ops of
``csrc/cuda/layer_norm.cu`` and ``csrc/cuda/syncbn.cu`` compiled for the CPU are compared
with the PyTorch references (``amp_fused_ops.reference._norm`` and ``_syncbn``), which are the
oracle on every device. Sizes cross the vector width and the block sizes (1, 7, 555, 1024,
4099 columns); a misaligned buffer takes the scalar path; SyncBN runs channels-first and
channels-last. Tolerances as in test_cuda_kernels.py (two roundings of the output dtype).
With ``AMP_EMULATION_SIZES=small`` (the AddressSanitizer build in CI) the widest row is 1031
columns instead of 4099: an odd width, so one element per chunk and a full block of 512
threads looping over the row, the launch 4099 gets, at a quarter of the emulated work.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from _kernel_target import EMULATED, SMALL_SIZES, OnKernelsOf, norm_ops
from _norm_helpers import (
    NORM_IDS,
    NORMS,
    STATS_TOL,
    ZERO_WEIGHT_CASES,
    NormSpec,
    check_zero_weight_gradients,
)
from amp_fused_ops.reference import _norm as _norm_reference
from amp_fused_ops.syncbn import _kernels as _syncbn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.cuda_emulation,
    pytest.mark.skipif(not EMULATED, reason="runs the emulated kernels (nox -s cuda_emulation)"),
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2 * 2.0**-10, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}


@pytest.fixture(scope="module")
def ops():
    return norm_ops()


def _close(got: Tensor, want: Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[got.dtype])


# The widest row: 512 threads per row (threads_for in csrc/cuda/layer_norm.cu) either way.
WIDEST = 1031 if SMALL_SIZES else 4099


@pytest.mark.parametrize("hidden", [1, 7, 555, 1024, WIDEST])
@pytest.mark.parametrize(
    ("x_dtype", "p_dtype", "mixed"),
    [(d, d, False) for d in DTYPES]
    + [(torch.float16, torch.float32, False), (torch.bfloat16, torch.float32, True)],
)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("misaligned", [False, True])
def test_norm_forward_and_backward(ops, hidden, x_dtype, p_dtype, mixed, rms, memory_efficient,
                                   misaligned):  # fmt: skip
    torch.manual_seed(hidden)
    rows = 5
    buffer = (torch.randn(rows * hidden + 1) * 3 + 1).to(x_dtype)
    x = (buffer[1:] if misaligned else buffer[:-1]).view(rows, hidden)
    weight = (torch.rand(hidden) + 0.5).to(p_dtype)
    bias = None if rms else torch.randn(hidden).to(p_dtype)
    y, mean, invvar = ops.norm_forward(x, weight, bias, 1e-5, rms, mixed, memory_efficient)
    y_ref, mean_ref, invvar_ref = _norm_reference.norm_forward_reference(
        x, weight, bias, 1e-5, rms, mixed
    )
    _close(y, y_ref)
    torch.testing.assert_close(mean, mean_ref, **STATS_TOL)
    torch.testing.assert_close(invvar, invvar_ref, **STATS_TOL)

    dy = torch.randn(rows, hidden).to(y.dtype)
    saved = y_ref if memory_efficient else x
    got = ops.norm_backward(dy, saved, mean_ref, invvar_ref, weight, bias, rms,
                             memory_efficient, x_dtype)  # fmt: skip
    want = _norm_reference.norm_backward_reference(
        dy, saved, mean_ref, invvar_ref, weight, bias, rms, memory_efficient, x_dtype
    )
    _close(got[0], want[0])
    # Column sums over the rows: accumulated in another order, compared at the sum's scale.
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2e-2, atol=2e-2)
    if bias is not None:
        torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("hidden", "x_dtype", "weight_dtype", "bias_dtype"),
    [
        (65537, torch.float32, torch.float32, torch.float32),  # longer rows than the kernels'
        (33, torch.float64, torch.float64, torch.float64),  # a dtype the kernels do not take
        (33, torch.bfloat16, torch.float32, torch.bfloat16),  # parameters of two dtypes
        (33, torch.float32, torch.bfloat16, torch.bfloat16),  # half parameters, float32 input
    ],
)
@pytest.mark.parametrize("rms", [False, True])
def test_inputs_the_kernels_do_not_take_run_the_reference_in_cpp(
    ops, hidden, x_dtype, weight_dtype, bias_dtype, rms
):
    """The op hands such inputs to its C++ reference (csrc/common/norm_reference.h) instead of
    raising: the same values as the Python reference, forward and backward."""
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, hidden, generator=gen) * 2 + 0.5).to(x_dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(weight_dtype)
    bias = torch.randn(hidden, generator=gen).to(bias_dtype)
    got = ops.norm_forward(x, weight, bias, 1e-5, rms, False, False)
    want = _norm_reference.norm_forward_reference(x, weight, bias, 1e-5, rms, False)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **TOL.get(g.dtype, TOL[torch.float32]))
    dy = torch.randn(3, hidden, generator=gen).to(got[0].dtype)
    args = (dy, x, want[1], want[2], weight, bias, rms, False, x_dtype)
    for g, w in zip(ops.norm_backward(*args), _norm_reference.norm_backward_reference(*args),
                    strict=True):  # fmt: skip
        assert g.dtype == w.dtype and g.shape == w.shape
        tol = TOL.get(g.dtype, TOL[torch.float32])
        torch.testing.assert_close(g.float(), w.float(), rtol=max(tol["rtol"], 1e-4), atol=1e-2)


def _batch(shape: tuple[int, ...], dtype: torch.dtype, seed: int, channel_last: bool) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    # Channels-last is a contiguous (..., C) tensor for the kernels.
    return x.movedim(1, -1).contiguous() if channel_last else x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (4, 33, 9, 9), (2, 5, 555)])
@pytest.mark.parametrize("channel_last", [False, True])
def test_syncbn_kernels_match_the_cpu_path(ops, dtype, shape, channel_last):
    x = _batch(shape, dtype, 1, channel_last)
    dy = _batch(shape, dtype, 2, channel_last)
    channels = shape[1]
    weight = torch.rand(channels) + 0.5
    bias = torch.randn(channels)

    mean, var = ops.syncbn_welford_mean_var(x, channel_last)
    mean_ref, var_ref = _syncbn.welford_mean_var(x, channel_last=channel_last)
    torch.testing.assert_close(mean, mean_ref, **STATS_TOL)
    torch.testing.assert_close(var, var_ref, rtol=1e-4, atol=1e-5)

    counts = torch.tensor([float(x.numel() // channels), 3.0])
    means = torch.stack([mean_ref, mean_ref + 1])
    variances = torch.stack([var_ref, var_ref * 2])
    merged = ops.syncbn_welford_parallel(means, variances, counts, 1e-5)
    merged_ref = _syncbn.welford_parallel(means, variances, counts, 1e-5)
    for got, want in zip(merged, merged_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, _, invstd = merged_ref

    z = _batch(shape, dtype, 3, channel_last)
    y = ops.syncbn_forward(x, mean_ref, invstd, weight, bias, z, True, channel_last)
    y_ref = _syncbn.batchnorm_forward(
        x, mean_ref, invstd, weight, bias, z=z, fuse_relu=True, channel_last=channel_last
    )
    _close(y, y_ref)

    sum_dy, sum_dy_xmu = ops.syncbn_reduce(dy, x, mean_ref, channel_last)
    sums_ref = _syncbn.reduce_bn(dy, x, mean_ref, invstd, weight, channel_last=channel_last)
    torch.testing.assert_close(sum_dy, sums_ref[0], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(sum_dy_xmu, sums_ref[1], rtol=1e-4, atol=1e-3)

    count = x.numel() // channels
    dx = ops.syncbn_backward(dy, x, mean_ref, invstd, weight, sums_ref[0], sums_ref[1], count,
                             channel_last)  # fmt: skip
    dx_ref = _syncbn.batchnorm_backward(dy, x, mean_ref, invstd, weight, sums_ref[0],
                                        sums_ref[1], count, channel_last=channel_last)  # fmt: skip
    _close(dx, dx_ref)


@pytest.mark.parametrize("spec", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize(("variant", "dtype"), ZERO_WEIGHT_CASES)
def test_memory_efficient_with_a_zero_weight_on_the_kernels(
    ops, spec: NormSpec, variant: str, dtype: torch.dtype
):
    """The modules and Apex's Functions on the emulated kernels (sent there for CPU tensors):
    a zero weight makes the forward save the input, and the kernels' gradients are exact."""
    with OnKernelsOf("amp_fused_ops_emu") as routed:
        check_zero_weight_gradients(spec, variant, dtype)
    assert routed.calls["norm_forward"] >= 1 and routed.calls["norm_backward"] >= 1


@pytest.mark.parametrize("channel_last", [False, True])
def test_syncbn_float64_runs_the_reference_in_cpp(ops, channel_last):
    """float64, a dtype the SyncBN kernels do not take: each op hands it to its C++ reference
    (csrc/common/syncbn_reference.h) instead of raising, with the Python reference's values
    (fp32 math, the result in the input's dtype)."""
    from amp_fused_ops.reference import _syncbn as _syncbn_reference

    shape = (6, 5) if channel_last else (4, 5, 7)
    x = _batch(shape, torch.float64, 3, channel_last)
    dy = _batch(shape, torch.float64, 4, channel_last)
    z = _batch(shape, torch.float64, 5, channel_last)
    gen = torch.Generator().manual_seed(6)
    weight = torch.rand(5, generator=gen, dtype=torch.float64) + 0.5
    bias = torch.randn(5, generator=gen, dtype=torch.float64)
    f32 = {"rtol": 1e-5, "atol": 1e-5}

    got = ops.syncbn_welford_mean_var(x, channel_last)
    want = _syncbn_reference.syncbn_welford_mean_var(x, channel_last)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, **f32)
    mean, var = want
    invstd = torch.rsqrt(var + 1e-5)
    y = ops.syncbn_forward(x, mean, invstd, weight, bias, z, True, channel_last)
    y_ref = _syncbn_reference.syncbn_forward(x, mean, invstd, weight, bias, z, True, channel_last)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, **f32)
    sums = ops.syncbn_reduce(dy, x, mean, channel_last)
    sums_ref = _syncbn_reference.syncbn_reduce(dy, x, mean, channel_last)
    for g, w in zip(sums, sums_ref, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
    count = x.numel() // 5
    dx = ops.syncbn_backward(dy, x, mean, invstd, weight, *sums_ref, count, channel_last)
    dx_ref = _syncbn_reference.syncbn_backward(
        dy, x, mean, invstd, weight, *sums_ref, count, channel_last
    )
    assert dx.dtype == torch.float64
    torch.testing.assert_close(dx, dx_ref, **f32)
