"""The CUDA multi-tensor launcher: one launch per batch of tensors (GPU, or emulated).

The launcher (``csrc/cuda/multi_tensor_apply.cuh``) packs, per launch, the addresses and sizes
of up to ``MaxTensors<Depth>`` consecutive tensors and the block where each tensor's chunks
begin, and launches one block per chunk of the batch. These tests hold it to that minimum
(launches and blocks counted by the emulator) and check the results of lists that cross its
batch boundaries: more tensors than a batch holds, zero-size tensors in the middle and at a
batch's start, a tensor of more than 320 chunks, and the per-chunk reductions (L2 norms, LAMB's
trust ratios) that span several launches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE, EMULATED, SMALL_SIZES, extension
from _op_cases import TWO_ROUNDINGS, noop_flag
from amp_fused_ops.reference import _ops as _reference

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emulation]

# The kernel-argument bytes TensorListMetadata may take, and what it holds: per tensor, one
# address per list (8 bytes each), its size (int64) and its first block (int32); per launch,
# two int32 counts and the int64 index of its first chunk.
METADATA_BYTES = 3584
CHUNK = 4  # small chunks: many blocks from few elements
BIG_CHUNKS = 330  # one tensor of more chunks than the 320 blocks of Apex's per-block table
# The tests whose threads run take a smaller big tensor at the small emulated sizes (the
# AddressSanitizer build, where each block costs most); the launch counts keep BIG_CHUNKS.
RUN_BIG_CHUNKS = 12 if SMALL_SIZES else BIG_CHUNKS
# Segments of one reduction launch (as many as CUDA's 4 KiB of kernel parameters hold).
MAX_SEGMENTS = 1000


def max_tensors(depth: int) -> int:
    """The most tensors of ``depth`` lists whose metadata fits :data:`METADATA_BYTES`."""
    return (METADATA_BYTES - 16) // (8 * depth + 8 + 4)


def _sizes(count: int, depth: int, big_chunks: int = BIG_CHUNKS) -> list[int]:
    """``count`` tensor sizes that cross the batch boundaries of ``depth`` lists.

    Zero-size tensors in the middle of the first batch and as the first tensor of the second;
    the last tensor of the first batch has ``big_chunks`` chunks; the others 1 to 9 elements (one
    to three chunks, some with a partial last chunk).
    """
    batch = max_tensors(depth)
    sizes = [1 + (7 * i) % 9 for i in range(count)]
    sizes[3] = sizes[batch // 2] = 0
    sizes[batch - 1] = big_chunks * CHUNK - 1
    if count > batch:
        sizes[batch] = 0
    return sizes


def _blocks(sizes: list[int]) -> int:
    return sum(math.ceil(n / CHUNK) for n in sizes)


def _launches(count: int, depth: int) -> int:
    """Launches of one pass over ``count`` tensors of ``depth`` lists: one per batch."""
    return math.ceil(count / max_tensors(depth))


def _randn(sizes: list[int], seed: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(n, generator=g, device=DEVICE).to(dtype) for n in sizes]


def _adam_state(sizes: list[int], seed: int) -> list[list[Tensor]]:
    params = _randn(sizes, seed)
    exp_avgs = [0.01 * t for t in _randn(sizes, seed + 1)]
    exp_avg_sqs = [
        1e-4 * t.abs() + m.square() for t, m in zip(_randn(sizes, seed + 2), exp_avgs, strict=True)
    ]
    return [params, exp_avgs, exp_avg_sqs]


# One op per list depth: (depth, call on a list of `sizes`, launches beyond the multi-tensor
# passes). Each call takes `impl` (the extension or the reference) and returns the lists it
# wrote and the values it returned.
Call = Callable[[Any, list[int], Tensor], list[Any]]


def _l2norm(impl: Any, sizes: list[int], flag: Tensor) -> list[Any]:
    total, per_tensor = impl.multi_tensor_l2norm(CHUNK, flag, [_randn(sizes, 1)], True)
    return [[total], [per_tensor]]


def _scale(impl: Any, sizes: list[int], flag: Tensor) -> list[Any]:
    xs = _randn(sizes, 2, torch.float16)
    outs = [torch.full((n,), float("nan"), device=DEVICE) for n in sizes]
    impl.multi_tensor_scale(CHUNK, flag, [xs, outs], 0.5)
    return [outs]


def _axpby(impl: Any, sizes: list[int], flag: Tensor) -> list[Any]:
    outs = [torch.full((n,), float("nan"), device=DEVICE) for n in sizes]
    impl.multi_tensor_axpby(CHUNK, flag, [_randn(sizes, 3), _randn(sizes, 4), outs], 2.0, -0.5, -1)
    return [outs]


def _adam(impl: Any, sizes: list[int], flag: Tensor) -> list[Any]:
    state = _adam_state(sizes, 5)
    impl.multi_tensor_adam(CHUNK, flag, [_randn(sizes, 8), *state], 1e-2, 0.9, 0.999, 1e-8, 3,
                           1, 1, 0.01)  # fmt: skip
    return state


def _lamb(impl: Any, sizes: list[int], flag: Tensor) -> list[Any]:
    state = _adam_state(sizes, 9)
    norm = torch.full((1,), 3.0, device=DEVICE)
    impl.multi_tensor_lamb(CHUNK, flag, [_randn(sizes, 12), *state], 1e-3, 0.9, 0.999, 1e-6, 4,
                           1, 0.01, 1, 1, norm, 1.0, True)  # fmt: skip
    return state


# (depth of the multi-tensor passes, call, launches of one call on `count` tensors)
OPS: dict[str, tuple[int, Call, Callable[[int], int]]] = {
    # The sum of squares per chunk, then one reduction launch for the per-tensor norms (up to
    # MAX_SEGMENTS tensors) and one for the total.
    "l2norm": (1, _l2norm, lambda n: _launches(n, 1) + math.ceil(n / MAX_SEGMENTS) + 1),
    "scale": (2, _scale, lambda n: _launches(n, 2)),
    "axpby": (3, _axpby, lambda n: _launches(n, 3)),
    "adam": (4, _adam, lambda n: _launches(n, 4)),
    # Stage 1 on five lists, the parameter and update norms per tensor (one reduction launch
    # each), stage 2 on [params, updates].
    "lamb": (
        5,
        _lamb,
        lambda n: _launches(n, 5) + 2 * math.ceil(n / MAX_SEGMENTS) + _launches(n, 2),
    ),
}


def _flatten(lists: list[Any]) -> list[Tensor]:
    return [t for tensors in lists for t in tensors]


@pytest.mark.skipif(not EMULATED, reason="counts launches with the emulator")
@pytest.mark.parametrize("name", list(OPS))
def test_one_launch_per_batch_of_tensors_and_one_block_per_chunk(name: str) -> None:
    from amp_fused_ops.emulation import _kernels as _emulation

    depth, call, launches = OPS[name]
    sizes = _sizes(2 * max_tensors(depth) + 3, depth)
    assert _blocks(sizes) > 320  # more blocks than a launch of Apex's layout holds
    ext = extension()
    with _emulation.count_launches_only():
        _emulation.reset_counters()
        call(ext, sizes, noop_flag(0, DEVICE))
        counts = _emulation.counters()
    assert counts.launches == launches(len(sizes))
    passes = 2 if name == "lamb" else 1  # LAMB's two passes over every chunk
    reduction_blocks = counts.blocks - passes * _blocks(sizes)
    # The reductions' blocks: one per tensor (per-tensor norms), one for a total.
    per_tensor_reductions = {"l2norm": 1, "lamb": 2}.get(name, 0)
    assert reduction_blocks == per_tensor_reductions * len(sizes) + (name == "l2norm")


@pytest.mark.parametrize("name", list(OPS))
def test_lists_across_batch_boundaries_match_the_reference(name: str) -> None:
    depth, call, _ = OPS[name]
    sizes = _sizes(max_tensors(depth) + 4, depth, RUN_BIG_CHUNKS)
    flags = [noop_flag(0, DEVICE), noop_flag(0, DEVICE)]
    got = _flatten(call(extension(), sizes, flags[0]))
    want = _flatten(call(_reference, sizes, flags[1]))
    assert flags[0].item() == flags[1].item() == 0
    # scale is one fp32 multiply, as the reference's: bitwise. nvcc may contract axpby into a
    # fused multiply-add; the norms and the optimizers sum in another order.
    exact = name == "scale"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, i
        tol = {"rtol": 0.0, "atol": 0.0} if exact else TWO_ROUNDINGS[torch.float32]
        torch.testing.assert_close(a, b, msg=f"tensor {i}", **tol)


def test_a_nonfinite_value_in_a_later_launch_raises_the_flag() -> None:
    sizes = _sizes(max_tensors(2) + 4, 2, RUN_BIG_CHUNKS)
    xs = _randn(sizes, 13, torch.float16)
    xs[-1][0] = float("inf")  # the last tensor: in the second launch
    outs = [torch.empty(n, device=DEVICE) for n in sizes]
    flag = noop_flag(0, DEVICE)
    extension().multi_tensor_scale(CHUNK, flag, [xs, outs], 0.5)
    assert flag.item() == 1
    torch.testing.assert_close(outs[0], xs[0].float() * 0.5, rtol=0.0, atol=0.0)


@pytest.mark.skipif(SMALL_SIZES, reason="1003 blocks: run at the full emulated sizes, and on a GPU")
def test_per_tensor_norms_of_more_tensors_than_one_reduction_launch_holds() -> None:
    # MAX_SEGMENTS + 3 one-chunk tensors: the per-tensor norms take two reduction launches.
    xs = [torch.full((3,), float(i % 17), device=DEVICE) for i in range(MAX_SEGMENTS + 3)]
    total, per_tensor = extension().multi_tensor_l2norm(3, noop_flag(0, DEVICE), [xs], True)
    want = torch.stack([torch.linalg.vector_norm(x) for x in xs])
    torch.testing.assert_close(per_tensor, want, rtol=0.0, atol=0.0)
    torch.testing.assert_close(total.reshape(()), torch.linalg.vector_norm(torch.cat(xs)))


# --- the block size (AMP_FUSED_OPS_MULTI_TENSOR_BLOCK) -------------------------------------------

BLOCK_SIZES_CHUNK = 2048  # every thread of a block of 256 or 512 takes several elements
BLOCK_SIZES = [5000, 4097, 3, 2048]


@pytest.mark.parametrize("name", ["l2norm", "adam", "lamb"])
def test_blocks_of_256_threads_give_the_results_of_blocks_of_512(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels read blockDim: with 256 threads per block each thread takes twice the
    elements, and the per-chunk sums add in another order. Elementwise results are the same bit
    for bit (Adam); sums within float32 rounding (the norms, LAMB's trust ratios)."""
    calls = {
        "l2norm": lambda ext, flag: ext.multi_tensor_l2norm(
            BLOCK_SIZES_CHUNK, flag, [_randn(BLOCK_SIZES, 1)], True
        ),
        "adam": lambda ext, flag: _adam_chunked(ext, flag),
        "lamb": lambda ext, flag: _lamb_chunked(ext, flag),
    }
    results = {}
    launched = {}
    for threads in ("512", "256"):
        monkeypatch.setenv("AMP_FUSED_OPS_MULTI_TENSOR_BLOCK", threads)
        flag = noop_flag(0, DEVICE)
        if EMULATED:
            from amp_fused_ops.emulation import _kernels as _emulation

            extension()
            _emulation.reset_counters()
        out = calls[name](extension(), flag)
        if EMULATED:
            counts = _emulation.counters()
            launched[threads] = (counts.blocks, counts.threads)
        assert flag.item() == 0
        results[threads] = _flatten([list(o) if isinstance(o, (list, tuple)) else [o] for o in out])
    if EMULATED:  # the same blocks, of half the threads (the reductions' own launches keep theirs)
        chunks = sum(math.ceil(n / BLOCK_SIZES_CHUNK) for n in BLOCK_SIZES)
        passes = 2 if name == "lamb" else 1
        assert launched["256"][0] == launched["512"][0]
        assert launched["512"][1] - launched["256"][1] == passes * chunks * 256
    for i, (a, b) in enumerate(zip(results["256"], results["512"], strict=True)):
        tol = {"rtol": 0.0, "atol": 0.0} if name == "adam" else TWO_ROUNDINGS[torch.float32]
        torch.testing.assert_close(a, b, msg=f"tensor {i}", **tol)


def _adam_chunked(ext: Any, flag: Tensor) -> list[list[Tensor]]:
    state = _adam_state(BLOCK_SIZES, 5)
    ext.multi_tensor_adam(BLOCK_SIZES_CHUNK, flag, [_randn(BLOCK_SIZES, 8), *state], 1e-2, 0.9,
                          0.999, 1e-8, 3, 1, 1, 0.01)  # fmt: skip
    return state


def _lamb_chunked(ext: Any, flag: Tensor) -> list[list[Tensor]]:
    state = _adam_state(BLOCK_SIZES, 9)
    norm = torch.full((1,), 3.0, device=DEVICE)
    ext.multi_tensor_lamb(BLOCK_SIZES_CHUNK, flag, [_randn(BLOCK_SIZES, 12), *state], 1e-3, 0.9,
                          0.999, 1e-6, 4, 1, 0.01, 1, 1, norm, 1.0, True)  # fmt: skip
    return state


def test_an_unknown_block_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMP_FUSED_OPS_MULTI_TENSOR_BLOCK", "1024")
    message = "AMP_FUSED_OPS_MULTI_TENSOR_BLOCK=1024 is not one of '512', '256'"
    with pytest.raises(RuntimeError, match=message):
        extension().multi_tensor_scale(
            CHUNK, noop_flag(0, DEVICE), [_randn([5], 2), _randn([5], 3)], 0.5
        )


# --- Apex's launches (AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT=apex) ------------------------------------

APEX_MAX_TENSORS = (110, 64, 48, 36, 30)  # Apex's tensors per launch, lists of depth 1 to 5
APEX_MAX_BLOCKS = 320  # and blocks per launch
# The multi-tensor passes of each op of OPS, by list depth.
PASSES = {"l2norm": (1,), "scale": (2,), "axpby": (3,), "adam": (4,), "lamb": (5, 2)}
LAYOUT_ENV = "AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT"


def _apex_launches(sizes: list[int], depth: int) -> int:
    """The launches of Apex's multi_tensor_apply over non-empty tensors of ``sizes``.

    Its host loop: each chunk takes the next block; a launch is made when the tensors are full
    at a tensor's last chunk, when the blocks are full, or at the last chunk of the last
    tensor; a tensor cut by a launch continues as the first tensor of the next.
    """
    launches = tensors = blocks = 0
    for t, numel in enumerate(sizes):
        tensors += 1
        chunks = math.ceil(numel / CHUNK)
        for chunk in range(chunks):
            blocks += 1
            ends_tensor = chunk == chunks - 1
            if (
                (tensors == APEX_MAX_TENSORS[depth - 1] and ends_tensor)
                or blocks == APEX_MAX_BLOCKS
                or (t == len(sizes) - 1 and ends_tensor)
            ):
                launches += 1
                blocks = 0
                tensors = 0 if ends_tensor else 1
    return launches


@pytest.mark.skipif(not EMULATED, reason="counts launches with the emulator")
@pytest.mark.parametrize("name", list(OPS))
def test_the_apex_layout_launches_as_apex_did(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from amp_fused_ops.emulation import _kernels as _emulation

    depth, call, launches = OPS[name]
    # Non-empty tensors (Apex's loop gives an empty tensor a slot that it may never launch).
    sizes = [max(n, 1) for n in _sizes(2 * max_tensors(depth) + 3, depth)]
    ext = extension()
    counted = {}
    for layout in ("batch", "apex"):
        monkeypatch.setenv(LAYOUT_ENV, layout)
        with _emulation.count_launches_only():
            _emulation.reset_counters()
            call(ext, sizes, noop_flag(0, DEVICE))
            counted[layout] = _emulation.counters()
    ours = sum(_launches(len(sizes), d) for d in PASSES[name])
    apex = sum(_apex_launches(sizes, d) for d in PASSES[name])
    assert apex > ours  # the big tensor crosses a 320-block launch; smaller batches of tensors
    assert counted["batch"].launches == launches(len(sizes))
    assert counted["apex"].launches == launches(len(sizes)) - ours + apex
    assert counted["apex"].blocks == counted["batch"].blocks  # one block per chunk either way


def _sgd_stochastic(impl: Any, sizes: list[int], flag: Tensor) -> list[Any]:
    """bfloat16 SGD with stochastic rounding: its random bits are keyed by each element's
    index in its tensor, which a tensor continued in the next launch must keep."""
    params = [p.to(torch.bfloat16) for p in _randn(sizes, 14)]
    grads = _randn(sizes, 15)
    bufs = [torch.zeros_like(g) for g in grads]
    impl.multi_tensor_sgd(CHUNK, flag, [grads, params, bufs], 0.0, 0.0, 0.0, 2.0**-6,
                          False, False, False, 1.0, -0x1234_5678, 7)  # fmt: skip
    return [params]


@pytest.mark.parametrize("name", [*OPS, "sgd_stochastic"])
def test_the_apex_layout_gives_the_same_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk is computed by one block in either layout, and the per-chunk partials are
    reduced in chunk order: every result is the same bit for bit."""
    if name == "sgd_stochastic":
        depth, call = 3, _sgd_stochastic
    else:
        depth, call = OPS[name][0], OPS[name][1]
    sizes = _sizes(max_tensors(depth) + 4, depth, RUN_BIG_CHUNKS)
    results = {}
    for layout in ("batch", "apex"):
        monkeypatch.setenv(LAYOUT_ENV, layout)
        flag = noop_flag(0, DEVICE)
        results[layout] = _flatten(call(extension(), sizes, flag))
        assert flag.item() == 0
    for i, (a, b) in enumerate(zip(results["apex"], results["batch"], strict=True)):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), i


def test_an_unknown_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAYOUT_ENV, "per_tensor")
    message = f"{LAYOUT_ENV}=per_tensor is not one of 'batch', 'apex'"
    with pytest.raises(RuntimeError, match=message):
        extension().multi_tensor_scale(
            CHUNK, noop_flag(0, DEVICE), [_randn([5], 2), _randn([5], 3)], 0.5
        )
