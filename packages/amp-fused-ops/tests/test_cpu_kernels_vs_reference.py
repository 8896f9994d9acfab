"""The compiled CPU kernels agree with the pure-PyTorch reference, op by op.

The reference is the oracle (docs/design.rst, decision 5): same inputs, same flags, results
within the rounding of the output dtype, for every op the extension implements.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from _op_cases import ONE_ROUNDING
from _op_cases import noop_flag as _flag
from amp_fused_ops.reference import _ops as _reference

SIZES = (1, 7, 555, 33333, 2048 * 32 + 1)
CHUNKS = (333, 2048 * 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One rounding of the output dtype; fp32 closer still (the same fp32 math on both sides).
TOL = {**ONE_ROUNDING, torch.float32: {"rtol": 1e-6, "atol": 1e-6}}


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


def _tensors(dtype: torch.dtype, seed: int, inject: float | None = None) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
    if inject is not None:
        out[3][1234] = inject
    return out


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("inject", [None, float("inf"), float("nan")])
def test_scale(ext: Any, chunk: int, in_dtype: torch.dtype, out_dtype: torch.dtype,
               inject: float | None) -> None:  # fmt: skip
    xs = _tensors(in_dtype, 1, inject)
    outs = [[torch.empty_like(x, dtype=out_dtype) for x in xs] for _ in range(2)]
    flags = [_flag(), _flag()]
    ext.multi_tensor_scale(chunk, flags[0], [xs, outs[0]], 0.25)
    _reference.multi_tensor_scale(chunk, flags[1], [xs, outs[1]], 0.25)
    assert flags[0].item() == flags[1].item() == (0 if inject is None else 1)
    if inject is None:
        for a, b in zip(outs[0], outs[1], strict=True):
            torch.testing.assert_close(a, b, **TOL[out_dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arg_to_check", [-1, 0, 1])
def test_axpby(ext: Any, dtype: torch.dtype, arg_to_check: int) -> None:
    xs, ys = _tensors(dtype, 2, float("inf")), _tensors(dtype, 3)
    outs = [[torch.empty_like(x) for x in xs] for _ in range(2)]
    flags = [_flag(), _flag()]
    ext.multi_tensor_axpby(333, flags[0], [xs, ys, outs[0]], 2.0, -0.5, arg_to_check)
    _reference.multi_tensor_axpby(333, flags[1], [xs, ys, outs[1]], 2.0, -0.5, arg_to_check)
    assert flags[0].item() == flags[1].item()
    for a, b in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm(ext: Any, chunk: int, dtype: torch.dtype) -> None:
    xs = _tensors(dtype, 4)
    got = ext.multi_tensor_l2norm(chunk, _flag(), [xs], True)
    want = _reference.multi_tensor_l2norm(chunk, _flag(), [xs], True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
def test_adam_steps(ext: Any, dtype: torch.dtype, mode: int) -> None:
    # fp32: five steps. Half params: one step, since a rounding tie decided the other way
    # in one element (both are correct roundings) is carried on by later steps.
    steps = 5 if dtype == torch.float32 else 1
    runs = []
    for impl in (ext, _reference):
        params = _tensors(dtype, 5)
        m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for step in range(1, steps + 1):
            grads = _tensors(dtype, 100 + step)
            impl.multi_tensor_adam(333, _flag(), [grads, params, m, v], 1e-2, 0.9, 0.999, 1e-8,
                                   step, mode, 1, 0.01)  # fmt: skip
        runs.append((params, m, v))
    for got, want in zip(runs[0], runs[1], strict=True):
        for a, b in zip(got, want, strict=True):
            if a.dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:  # within two roundings of the param dtype (2 ulps: 2 * 2**-10 for fp16)
                rtol = 2 * 2.0**-10 if dtype == torch.float16 else TOL[dtype]["rtol"]
                torch.testing.assert_close(a, b, rtol=rtol, atol=1e-5)
