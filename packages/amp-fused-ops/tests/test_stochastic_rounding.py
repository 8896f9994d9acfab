"""bfloat16 stochastic rounding of multi_tensor_adam / multi_tensor_sgd (``sr_seed``), on the CPU.

The C++ CPU kernels against the pure-PyTorch reference (bit for bit), the random bits against
Philox4x32-10's published answers, the rounding's bias against round-to-nearest's and
truncation's, and the independence of the results from the chunk size and the thread count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from amp_fused_ops import amp_C
from amp_fused_ops.reference import _ops as _reference
from amp_fused_ops.reference._stochastic_round import (
    _philox_first,
    stochastic_round_bf16,
    stochastic_round_bits,
)

# Non-multiples of the vector widths (8, 16) and of the chunk sizes, and a tensor of several
# chunks and tiles.
SIZES = (1, 7, 17, 555, 4099, 33333)
CHUNKS = (333, 2048 * 32)
BF16 = torch.bfloat16
SEED, STEP = 0x1234_5678_9ABC, 7


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _flag() -> Tensor:
    return torch.zeros(1, dtype=torch.int32)


def _randn(seed: int, scale: float = 1.0, sizes: tuple[int, ...] = SIZES) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * scale for n in sizes]


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.int16)


# --- the random bits ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("counter", "key", "first_word"),
    [
        # Random123's known-answer tests for philox4x32_10 (kat_vectors), first output word.
        ((0, 0, 0, 0), (0, 0), 0x6627E8D5),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, 0x408F276D),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), 0xD16CFE09),
    ],
)
def test_reference_bits_are_philox4x32_10(
    counter: tuple[int, ...], key: tuple[int, int], first_word: int
) -> None:
    c0 = torch.tensor([counter[0]], dtype=torch.int64)
    c1 = torch.tensor([counter[1]], dtype=torch.int64)
    assert _philox_first(c0, c1, counter[2], counter[3], *key).item() == first_word


def test_bits_differ_per_element_step_tensor_and_seed() -> None:
    offsets = torch.arange(1 << 16, dtype=torch.int64)
    base = stochastic_round_bits(SEED, STEP, 0, offsets)
    # Close to uniform over [0, 65536): mean 32767.5, about one element per value.
    assert abs(base.float().mean().item() - 32767.5) < 300
    assert base.unique().numel() > 0.6 * (1 << 16)
    for other in (
        stochastic_round_bits(SEED, STEP + 1, 0, offsets),
        stochastic_round_bits(SEED, STEP, 1, offsets),
        stochastic_round_bits(SEED + 1, STEP, 0, offsets),
    ):
        assert (other == base).float().mean().item() < 0.01


# --- unbiased ------------------------------------------------------------------------------


def _sgd_rounding_errors(impl: Any, fraction: float, n: int = 1 << 18) -> dict[str, float]:
    """Mean error, in bfloat16 ulps at 1.0, of 1.0 + fraction * ulp stored by a SGD step from 1.0.

    Returns the stochastic kernel's error and, for comparison, round-to-nearest's and
    truncation's errors on the same float32 result.
    """
    ulp = 2.0**-7  # bfloat16 spacing in [1, 2)
    params = [torch.ones(n, dtype=BF16)]
    grads = [torch.full((n,), -fraction * ulp, dtype=torch.float32)]
    bufs = [torch.zeros(n, dtype=torch.float32)]
    impl.multi_tensor_sgd(2048 * 32, _flag(), [grads, params, bufs], 0.0, 0.0, 0.0, 1.0,
                          False, False, False, 1.0, SEED, STEP)  # fmt: skip
    exact = 1.0 + fraction * ulp  # representable in float32: the kernel's float32 result
    fp32 = torch.full((n,), exact, dtype=torch.float32)
    truncated = (fp32.view(torch.int32) & ~0xFFFF).view(torch.float32)
    return {
        "stochastic": (params[0].double().mean().item() - exact) / ulp,
        "nearest": (fp32.to(BF16).double().mean().item() - exact) / ulp,
        "truncation": (truncated.double().mean().item() - exact) / ulp,
    }


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.7])
@pytest.mark.parametrize("path", ["cpu", "reference"])
def test_rounding_is_unbiased_where_nearest_and_truncation_are_not(
    ext: Any, path: str, fraction: float
) -> None:
    errors = _sgd_rounding_errors(ext if path == "cpu" else _reference, fraction)
    # Each rounded value is off by up to one ulp, with standard deviation
    # sqrt(f (1 - f)) <= 0.5 ulp: the mean of 2**18 of them is within 6 standard errors of the
    # exact value 1e-9 of the time.
    bound = 6 * 0.5 / (1 << 9)  # 0.0059 ulp
    assert abs(errors["stochastic"]) < bound, errors
    assert abs(errors["nearest"]) > 10 * bound, errors
    assert abs(errors["truncation"]) > 10 * bound, errors


def test_inf_nan_and_overflow(ext: Any) -> None:
    largest = torch.finfo(BF16).max
    values = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.0, -2.0])
    for impl in (ext, _reference):
        params = [values.to(BF16)]
        grads, bufs = [torch.zeros(values.numel())], [torch.zeros(values.numel())]
        impl.multi_tensor_sgd(333, _flag(), [grads, params, bufs], 0.0, 0.0, 0.0, 0.5,
                              False, False, False, 1.0, SEED, STEP)  # fmt: skip
        torch.testing.assert_close(params[0], values.to(BF16), equal_nan=True, rtol=0, atol=0)
    # Above the largest bfloat16 by a fraction f of an ulp: inf with probability f.
    n = 1 << 14
    above = torch.full((n,), largest, dtype=torch.float32)
    above = (above.view(torch.int32) + (1 << 14)).view(torch.float32)  # f = 1/4
    rounded = stochastic_round_bf16(above, above, SEED, STEP, 0)
    assert torch.isinf(rounded).float().mean().item() == pytest.approx(0.25, abs=0.03)
    assert torch.isfinite(rounded[~torch.isinf(rounded)]).all()
    assert (rounded[torch.isfinite(rounded)].float() == largest).all()


# --- bit for bit ---------------------------------------------------------------------------


def _sgd_case(impl: Any, chunk: int, seed: int) -> list[Tensor]:
    # lr a power of two, no momentum or decay: the float32 result p - lr * g is the same
    # rounding on every path (contracted into a fused multiply-add or not), so the
    # stochastic rounding alone decides the bits.
    params = [p.to(BF16) for p in _randn(1)]
    grads = _randn(2)
    bufs = [torch.zeros_like(g) for g in grads]
    impl.multi_tensor_sgd(chunk, _flag(), [grads, params, bufs], 0.0, 0.0, 0.0, 2.0**-6,
                          False, False, False, 1.0, seed, STEP)  # fmt: skip
    return params


@pytest.mark.parametrize("chunk", CHUNKS)
def test_sgd_cpu_kernel_equals_reference_bitwise(ext: Any, chunk: int) -> None:
    got = _sgd_case(ext, chunk, SEED)
    want = _sgd_case(_reference, chunk, SEED)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    # And the rounding did something: another seed gives other bits.
    other = _sgd_case(ext, chunk, SEED + 1)
    assert any(not torch.equal(_bits(a), _bits(b)) for a, b in zip(got, other, strict=True))


def _adam(impl: Any, chunk: int, params: list[Tensor], seed: int | None) -> list[Tensor]:
    grads = _randn(3)
    exp_avgs = _randn(4, 0.1)
    exp_avg_sqs = [v.square() + 0.1 for v in _randn(5)]
    kwargs = {} if seed is None else {"sr_seed": seed, "sr_step": STEP}
    impl.multi_tensor_adam(chunk, _flag(), [grads, params, exp_avgs, exp_avg_sqs], 1e-3, 0.9,
                           0.999, 1e-8, 3, 1, 1, 0.01, **kwargs)  # fmt: skip
    return params


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("path", ["cpu", "reference"])
def test_adam_rounds_its_own_float32_result(ext: Any, path: str, chunk: int) -> None:
    """The bfloat16 result is the float32 step (the same path on float32 copies of the params)
    rounded with the reference's bits: the kernels and the reference agree bit for bit given
    the same float32 value (Adam's float32 math itself may differ by fused multiply-adds)."""
    impl = ext if path == "cpu" else _reference
    start = [p.to(BF16) for p in _randn(1)]
    fp32 = _adam(impl, chunk, [p.float() for p in start], None)
    got = _adam(impl, chunk, [p.clone() for p in start], SEED)
    for i, (a, value) in enumerate(zip(got, fp32, strict=True)):
        want = stochastic_round_bf16(value, a, SEED, STEP, i)
        assert torch.equal(_bits(a), _bits(want)), f"tensor {i}"
    nearest = _adam(impl, chunk, [p.clone() for p in start], None)
    assert any(not torch.equal(_bits(a), _bits(b)) for a, b in zip(got, nearest, strict=True))


def test_offsets_follow_storage_order(ext: Any) -> None:
    """A channels-last param: the random bits are keyed by storage offsets on every path."""
    shape = (2, 3, 5, 7)
    p0 = torch.randn(shape).to(BF16).contiguous(memory_format=torch.channels_last)
    g0 = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    results = []
    for impl in (ext, _reference):
        p, g = p0.clone(), g0.clone()
        buf = torch.zeros_like(g)
        impl.multi_tensor_sgd(333, _flag(), [[g], [p], [buf]], 0.0, 0.0, 0.0, 2.0**-6,
                              False, False, False, 1.0, SEED, STEP)  # fmt: skip
        results.append(p)
    assert torch.equal(_bits(results[0]), _bits(results[1]))


@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_same_bits_for_any_chunk_size_and_thread_count(ext: Any, op: str) -> None:
    def run(chunk: int) -> list[Tensor]:
        if op == "sgd":
            return _sgd_case(ext, chunk, SEED)
        return _adam(ext, chunk, [p.to(BF16) for p in _randn(1)], SEED)

    with _threads(1):
        want = run(2048 * 32)
    for chunk in (7, 333, 2048 * 32):
        for n in (1, 2, 4):
            with _threads(n):
                got = run(chunk)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(_bits(a), _bits(b)), f"chunk {chunk}, {n} threads"


# --- preconditions -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["cpu", "reference", "amp_C"])
def test_non_bfloat16_params_are_refused(ext: Any, path: str) -> None:
    impl = {"cpu": ext, "reference": _reference, "amp_C": amp_C}[path]
    params, grads = [torch.zeros(4)], [torch.zeros(4)]
    with pytest.raises(ValueError, match=r"stochastic rounding \(sr_seed\) needs bfloat16 params"):
        impl.multi_tensor_sgd(333, _flag(), [grads, params, [torch.zeros(4)]], 0.0, 0.0, 0.0,
                              0.1, False, False, False, 1.0, SEED, STEP)  # fmt: skip
    with pytest.raises(ValueError, match=r"needs bfloat16 params, got (torch\.)?[Ff]loat"):
        lists = [grads, params, [torch.zeros(4)], [torch.zeros(4)]]
        impl.multi_tensor_adam(333, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0,
                               sr_seed=SEED, sr_step=STEP)  # fmt: skip


@pytest.mark.parametrize("path", ["cpu", "reference"])
def test_model_copies_are_refused(ext: Any, path: str) -> None:
    impl = ext if path == "cpu" else _reference
    lists = [[torch.zeros(4)], [torch.zeros(4, dtype=BF16)], [torch.zeros(4)],
             [torch.zeros(4, dtype=BF16)]]  # fmt: skip
    with pytest.raises(ValueError, match="pass 3 tensor lists \\(no model copies\\), got 4"):
        impl.multi_tensor_sgd(333, _flag(), lists, 0.0, 0.0, 0.0, 0.1, False, False, False,
                              1.0, SEED, STEP)  # fmt: skip


def test_apex_calling_convention_unchanged() -> None:
    """Without the new arguments the ops round to nearest, as before (Apex's call)."""
    params = [torch.ones(64, dtype=BF16)]
    grads = [torch.full((64,), -0.3 * 2.0**-7)]
    amp_C.multi_tensor_sgd(2048 * 32, _flag(), [grads, params, [torch.zeros(64)]], 0.0, 0.0,
                           0.0, 1.0, False, False, False, 1.0)  # fmt: skip
    assert torch.equal(params[0], torch.ones(64, dtype=BF16))
