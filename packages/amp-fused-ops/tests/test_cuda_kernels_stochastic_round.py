"""bfloat16 stochastic rounding (``sr_seed``) of the CUDA kernels against the reference (GPU only).

Also run on the emulated kernels (``nox -s cuda_emulation``, see ``_kernel_target.py``). The
random bits are a pure function of (seed, step, tensor index, element offset): the kernel must
give the reference's bits whatever the chunk size, the vector path or the launch batching
(more tensors than one launch's metadata holds).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE, EMULATED, SMALL_SIZES, extension
from amp_fused_ops.reference import _ops as _reference
from amp_fused_ops.reference._stochastic_round import stochastic_round_bf16

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emulation]

if SMALL_SIZES:
    SIZES: tuple[int, ...] = (1, 7, 17, 555)
elif EMULATED:
    SIZES = (1, 7, 17, 555, 4099, 33333)
else:
    SIZES = (1, 7, 17, 555, 4099, 33333, 2048 * 32 + 1)
CHUNKS = (333,) if SMALL_SIZES else (333, 2048 * 32)
BF16 = torch.bfloat16
SEED, STEP = -0x1234_5678_9ABC, 7  # a negative int64 seed: its 64 bits are the key


@pytest.fixture(scope="module")
def ext() -> Any:
    return extension()


def _flag() -> Tensor:
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


def _randn(seed: int, sizes: tuple[int, ...] = SIZES, scale: float = 1.0) -> list[Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(n, generator=g, device=DEVICE) * scale for n in sizes]


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.int16).cpu()


def _sgd(impl: Any, chunk: int, sizes: tuple[int, ...] = SIZES) -> list[Tensor]:
    # lr a power of two, no momentum or decay: p - lr * g is one float32 rounding on every path
    # (fused multiply-add or not), so the bits are the stochastic rounding's alone.
    params = [p.to(BF16) for p in _randn(1, sizes)]
    grads = _randn(2, sizes)
    bufs = [torch.zeros_like(g) for g in grads]
    impl.multi_tensor_sgd(chunk, _flag(), [grads, params, bufs], 0.0, 0.0, 0.0, 2.0**-6,
                          False, False, False, 1.0, SEED, STEP)  # fmt: skip
    return params


@pytest.mark.parametrize("chunk", CHUNKS)
def test_sgd_equals_reference_bitwise(ext: Any, chunk: int) -> None:
    got = _sgd(ext, chunk)
    want = _sgd(_reference, chunk)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"tensor {i} ({a.numel()} elements)"


def test_sgd_bits_survive_launch_batching(ext: Any) -> None:
    """More tensors than one launch holds: tensor indices continue across launches."""
    sizes = tuple(5 + (i % 7) * 40 for i in range(70))
    got = _sgd(ext, 64, sizes)
    want = _sgd(_reference, 64, sizes)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"tensor {i}"


def _adam(impl: Any, chunk: int, params: list[Tensor], seed: int | None) -> list[Tensor]:
    grads = _randn(3)
    exp_avgs = _randn(4, scale=0.1)
    exp_avg_sqs = [v.square() + 0.1 for v in _randn(5)]
    kwargs = {} if seed is None else {"sr_seed": seed, "sr_step": STEP}
    impl.multi_tensor_adam(chunk, _flag(), [grads, params, exp_avgs, exp_avg_sqs], 1e-3, 0.9,
                           0.999, 1e-8, 3, 1, 1, 0.01, **kwargs)  # fmt: skip
    return params


@pytest.mark.parametrize("chunk", CHUNKS)
def test_adam_rounds_its_own_float32_result_with_reference_bits(ext: Any, chunk: int) -> None:
    start = [p.to(BF16) for p in _randn(1)]
    fp32 = _adam(ext, chunk, [p.float() for p in start], None)
    got = _adam(ext, chunk, [p.clone() for p in start], SEED)
    for i, (a, value) in enumerate(zip(got, fp32, strict=True)):
        want = stochastic_round_bf16(value, a, SEED, STEP, i)
        assert torch.equal(_bits(a), _bits(want)), f"tensor {i}"


def test_non_bfloat16_params_are_refused(ext: Any) -> None:
    lists = [[torch.zeros(4, device=DEVICE)] for _ in range(3)]
    with pytest.raises(ValueError, match=r"stochastic rounding \(sr_seed\) needs bfloat16"):
        ext.multi_tensor_sgd(333, _flag(), lists, 0.0, 0.0, 0.0, 0.1, False, False, False, 1.0,
                             SEED, STEP)  # fmt: skip
