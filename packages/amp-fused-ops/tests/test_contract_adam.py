"""The Adam ops of ``amp_C`` on every path: plain, capturable, capturable with master weights.

The ops are ``multi_tensor_adam``, ``multi_tensor_adam_capturable`` and
``multi_tensor_adam_capturable_master``.

Each test runs on the paths that implement the op (``_op_paths.py``): the pure-PyTorch
reference, the C++ CPU kernel and the CUDA kernel (on a GPU, or its emulated build). The
expected values never come from an implementation: several steps of float32 Adam and AdamW are
checked against ``torch.optim`` (single-tensor, ``foreach=False``), and every step of the other
tests against Apex's kernel math written out here in float64 (:func:`adam64`) from the values
stored before that step, so each step is held to one rounding of each output's dtype however
many steps came before. Conversions between the float32 math and the 16-bit storage dtypes are
checked bit for bit against ``Tensor.to``.

What the ops share: the moments are float32 and the math is float32 whatever the grads' and
params' dtypes. ``multi_tensor_adam`` neither reads nor sets the noop flag (a non-finite
gradient reaches the params, as in Apex). The capturable ops take ``lr``, ``step`` and
``inv_scale`` as tensors (or numbers), unscale the gradients, and write nothing when the flag
is set on entry or an unscaled gradient is not finite (then they raise the flag);
``..._capturable`` writes the unscaled gradients back, ``..._capturable_master`` steps float32
masters and writes the params as the new masters rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import EMULATED, Graph
from _op_cases import ONE_ROUNDING
from _op_paths import OpPath, paths

Lists = list[list[Tensor]]

ADAM = "multi_tensor_adam"
CAPTURABLE = "multi_tensor_adam_capturable"
MASTER = "multi_tensor_adam_capturable_master"
ADAM_OPS = (ADAM, CAPTURABLE, MASTER)
CAPTURABLE_OPS = (CAPTURABLE, MASTER)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF = (torch.float16, torch.bfloat16)
FP32 = torch.float32
# (grad dtype, param dtype): each dtype alone and the mixes of Apex's fp16 and bf16 recipes.
DTYPE_MIXES = [
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float32, torch.bfloat16),
]
ALL_DTYPE_MIXES = [(g, p) for g in DTYPES for p in DTYPES]
CHANNELS_LAST_SHAPES = [(2, 3, 5, 7), (4, 16, 9, 9), (1, 8, 1, 1)]
# The first sizes of every path, for a test that runs on many inputs. An inf or a nan goes
# past the first chunk of 333 of the 555-element tensor (INJECT_AT).
SMALL = (1, 7, 555)
INJECT_AT = (2, 444)
INF, NAN = math.inf, math.nan


def cuda_path(*ops: str) -> list[Any]:
    """The ``path`` parameter of the CUDA kernels alone (for what only they do)."""
    return [param for param in paths(*ops) if param.id == "cuda"]


def chunk_of(path: OpPath, k: int) -> int:
    """The chunk size of a path's k-th call: its chunk sizes in turn, the largest first."""
    return path.chunks[-1 - k % len(path.chunks)]


def mix_id(mix: tuple[torch.dtype, torch.dtype]) -> str:
    return "-".join(str(dtype).removeprefix("torch.") for dtype in mix)


# --- Apex's Adam in float64 -----------------------------------------------------------------


@dataclass(frozen=True)
class Hyper:
    """The scalar arguments of one step (``inv_scale`` only for the capturable ops)."""

    lr: float = 1e-2
    beta1: float = 0.8
    beta2: float = 0.9
    eps: float = 1e-6
    step: int = 3
    mode: int = 1
    bias_correction: int = 1
    weight_decay: float = 0.05
    inv_scale: float = 1.0


def adam64(
    grad: Tensor, param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, h: Hyper
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Apex's Adam step in float64: ``(grad * inv_scale, param, exp_avg, exp_avg_sq)``.

    Mode 0 adds the weight decay to the gradient (Adam's L2), mode 1 to the update (AdamW,
    decoupled); a weight decay of 0 adds no term.
    """
    g = grad.double() * h.inv_scale
    p, m, v = param.double(), exp_avg.double(), exp_avg_sq.double()
    decay = h.weight_decay != 0.0
    grad_term = g + h.weight_decay * p if h.mode == 0 and decay else g
    m = h.beta1 * m + (1 - h.beta1) * grad_term
    v = h.beta2 * v + (1 - h.beta2) * grad_term * grad_term
    if h.bias_correction:
        bc1, bc2 = 1 - h.beta1**h.step, 1 - h.beta2**h.step
    else:
        bc1 = bc2 = 1.0
    update = (m / bc1) / ((v / bc2).sqrt() + h.eps)
    if h.mode == 1 and decay:
        update = update + h.weight_decay * p
    return g, p - h.lr * update, m, v


def expected(name: str, lists: Lists, h: Hyper) -> list[list[Tensor] | None]:
    """What op ``name`` leaves in each list: float64 values (held to one rounding of the list's
    dtype), a copy (held bit for bit), or None (a master op's params: the new masters rounded,
    checked against the masters the op wrote)."""
    if name == ADAM:  # no loss scale
        h = replace(h, inv_scale=1.0)
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    weights = lists[4] if name == MASTER else params
    rows = [adam64(*row, h) for row in zip(grads, weights, exp_avgs, exp_avg_sqs, strict=True)]
    new_grads = [r[0] for r in rows] if name == CAPTURABLE else [g.clone() for g in grads]
    new_weights, new_m, new_v = ([r[i] for r in rows] for i in (1, 2, 3))
    if name == MASTER:
        return [new_grads, None, new_m, new_v, new_weights]
    return [new_grads, new_weights, new_m, new_v]


def assert_lists(got: Lists, want: Sequence[Sequence[Tensor] | None], name: str) -> None:
    for i, (tensors, wanted) in enumerate(zip(got, want, strict=True)):
        if wanted is None:  # the master op's params: its new masters, rounded once
            for p, master in zip(tensors, got[4], strict=True):
                assert torch.equal(p, master.to(p.dtype)), f"{name}: params are not the masters"
            continue
        for j, (a, b) in enumerate(zip(tensors, wanted, strict=True)):
            msg = f"{name}: list {i} tensor {j} ({a.dtype})"
            if b.dtype == a.dtype:
                assert torch.equal(a, b), f"{msg} was written"
            else:
                torch.testing.assert_close(a.double(), b, msg=msg, **ONE_ROUNDING[a.dtype])


def scalars(path: OpPath, name: str, h: Hyper, *, numbers: bool = False) -> tuple[Any, ...]:
    """The arguments of op ``name`` after its tensor lists (the capturable ops' ``lr``, ``step``
    and ``inv_scale`` as one-element tensors on the path's device, or as ``numbers``)."""
    if name == ADAM:
        return (h.lr, h.beta1, h.beta2, h.eps, h.step, h.mode, h.bias_correction, h.weight_decay)
    if numbers:
        lr: Any = h.lr
        step: Any = h.step
        inv_scale: Any = h.inv_scale
    else:
        lr = path.tensor([h.lr])
        step = path.tensor([h.step], torch.int32)  # Apex passes an int32 step
        inv_scale = path.tensor([h.inv_scale])
    return (lr, h.beta1, h.beta2, h.eps, step, h.mode, h.bias_correction, h.weight_decay,
            inv_scale)  # fmt: skip


def adam_lists(
    path: OpPath,
    name: str,
    grad_dtype: torch.dtype,
    param_dtype: torch.dtype,
    seed: int,
    *,
    grad_scale: float = 1.0,
    sizes: tuple[int, ...] | None = None,
) -> Lists:
    """The tensor lists of op ``name``: ``[grads, params, exp_avgs, exp_avg_sqs]`` and, for the
    master op, the float32 masters (the params are the masters rounded); the moments float32,
    ``exp_avg_sq`` at least ``exp_avg ** 2`` as in training."""
    grads = path.randn(grad_dtype, seed, sizes, scale=grad_scale)
    weights = path.randn(FP32, seed + 1, sizes)
    exp_avgs = path.randn(FP32, seed + 2, sizes, scale=0.1)
    spread = path.randn(FP32, seed + 3, sizes, scale=1e-3, positive=True)
    exp_avg_sqs = [m * m + s for m, s in zip(exp_avgs, spread, strict=True)]
    params = [w.to(param_dtype) for w in weights]
    if name == MASTER:
        return [grads, params, exp_avgs, exp_avg_sqs, weights]
    return [grads, params, exp_avgs, exp_avg_sqs]


def step_and_check(
    path: OpPath, name: str, lists: Lists, steps: Sequence[Hyper], *, numbers: bool = False
) -> None:
    """Op ``name`` once per entry of ``steps`` on ``lists`` (in place), each call with the next
    of the path's chunk sizes (:func:`chunk_of`), each checked against :func:`adam64` of the
    values before it."""
    for k, h in enumerate(steps):
        want = expected(name, lists, h)
        flag = path.flag()
        chunk = chunk_of(path, k)
        path.op(name)(chunk, flag, lists, *scalars(path, name, h, numbers=numbers))
        assert flag.item() == 0, f"{name} raised the flag"
        assert_lists(lists, want, f"{name} at step {h.step}, chunk {chunk}")


# --- multi_tensor_adam ----------------------------------------------------------------------


@pytest.mark.parametrize("path", paths(ADAM), indirect=True)
@pytest.mark.parametrize("mode", [0, 1], ids=["adam", "adamw"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_adam_follows_torch_optim_over_several_steps(
    path: OpPath, mode: int, weight_decay: float
) -> None:
    params = path.randn(FP32, seed=10)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    ref_params = [torch.nn.Parameter(p.clone()) for p in params]
    optim_class = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    optim = optim_class(ref_params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                        weight_decay=weight_decay, foreach=False, fused=False)  # fmt: skip
    adam = path.op(ADAM)
    for step in range(1, 5):
        grads = path.randn(FP32, seed=100 + step)
        for ref, g in zip(ref_params, grads, strict=True):
            ref.grad = g.clone()
        optim.step()
        flag = path.flag()
        chunk = chunk_of(path, step - 1)
        adam(chunk, flag, [grads, params, exp_avgs, exp_avg_sqs], 1e-2, 0.9, 0.99, 1e-8, step,
             mode, 1, weight_decay)  # fmt: skip
        assert flag.item() == 0
    for p, m, v, ref in zip(params, exp_avgs, exp_avg_sqs, ref_params, strict=True):
        assert (p - ref.detach()).abs().max().item() <= 1e-5
        torch.testing.assert_close(m, optim.state[ref]["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, optim.state[ref]["exp_avg_sq"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", paths(ADAM), indirect=True)
@pytest.mark.parametrize("mix", DTYPE_MIXES, ids=mix_id)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
def test_adam_steps_every_dtype_mix_with_float32_moments(
    path: OpPath, mix: tuple[torch.dtype, torch.dtype], mode: int, bias_correction: int
) -> None:
    lists = adam_lists(path, ADAM, *mix, seed=11)
    h = Hyper(mode=mode, bias_correction=bias_correction)
    step_and_check(path, ADAM, lists, [replace(h, step=step) for step in (1, 2)])


@pytest.mark.parametrize("path", paths(ADAM), indirect=True)
@pytest.mark.parametrize("bad", [NAN, INF])
def test_adam_lets_a_nonfinite_gradient_reach_its_param_and_leaves_the_flag_alone(
    path: OpPath, bad: float
) -> None:
    for chunk in path.chunks:
        grads, params, exp_avgs, exp_avg_sqs = adam_lists(path, ADAM, FP32, FP32, seed=12)
        grads[INJECT_AT[0]][INJECT_AT[1]] = bad
        flag = path.flag()
        path.op(ADAM)(chunk, flag, [grads, params, exp_avgs, exp_avg_sqs], 1e-3, 0.9, 0.999,
                      1e-8, 1, 1, 1, 0.0)  # fmt: skip
        assert flag.item() == 0
        for k, p in enumerate(params):
            finite = torch.isfinite(p)
            if k == INJECT_AT[0]:
                assert not finite[INJECT_AT[1]], chunk
                finite[INJECT_AT[1]] = True
            assert finite.all(), (chunk, k)


@pytest.mark.parametrize("path", paths(ADAM), indirect=True)
def test_adam_steps_the_same_with_the_noop_flag_set(path: OpPath) -> None:
    def run(flag_value: int) -> tuple[Lists, Tensor]:
        lists = adam_lists(path, ADAM, torch.bfloat16, torch.bfloat16, seed=13)
        flag = path.flag(flag_value)
        path.op(ADAM)(path.chunks[0], flag, lists, *scalars(path, ADAM, Hyper()))
        return lists, flag

    with_flag, flag_after = run(1)
    without_flag, _ = run(0)
    assert flag_after.item() == 1
    before = adam_lists(path, ADAM, torch.bfloat16, torch.bfloat16, seed=13)
    assert not all(torch.equal(a, b) for a, b in zip(with_flag[1], before[1], strict=True))
    for tensors, reference in zip(with_flag, without_flag, strict=True):
        for a, b in zip(tensors, reference, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("path", paths(ADAM), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_of_tensors_at_a_misaligned_storage_offset(path: OpPath, dtype: torch.dtype) -> None:
    # Views whose data pointer is not 16-byte aligned (storage offset of one element): a kernel
    # must not use 16-byte vector accesses on them (a GPU faults; the emulator raises).
    lists = adam_lists(path, ADAM, dtype, dtype, seed=14)
    buffers = [[torch.full((t.numel() + 1,), NAN, dtype=t.dtype, device=t.device) for t in ts]
               for ts in lists]  # fmt: skip
    views = [[b[1:].copy_(t) for b, t in zip(bs, ts, strict=True)]
             for bs, ts in zip(buffers, lists, strict=True)]  # fmt: skip
    assert all(t.data_ptr() % 16 != 0 for ts in views for t in ts)
    step_and_check(path, ADAM, views, [Hyper(step=1), Hyper(step=2)])
    assert all(b[0].isnan() for bs in buffers for b in bs)  # nothing written before a view


# --- every Adam op --------------------------------------------------------------------------


@pytest.mark.parametrize("path", paths(*ADAM_OPS), indirect=True)
@pytest.mark.parametrize("name", ADAM_OPS)
def test_adam_ops_of_empty_lists_do_nothing(path: OpPath, name: str) -> None:
    flag = path.flag()
    depth = 5 if name == MASTER else 4
    path.op(name)(path.chunks[0], flag, [[] for _ in range(depth)], *scalars(path, name, Hyper()))
    assert flag.item() == 0


@pytest.mark.parametrize("path", paths(*ADAM_OPS), indirect=True)
@pytest.mark.parametrize("name", ADAM_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_ops_keep_the_channels_last_layout(
    path: OpPath, name: str, dtype: torch.dtype
) -> None:
    sizes = tuple(math.prod(shape) for shape in CHANNELS_LAST_SHAPES)
    flat = adam_lists(path, name, dtype, dtype, seed=15, grad_scale=4.0, sizes=sizes)
    lists = [
        [t.reshape(shape).contiguous(memory_format=torch.channels_last)
         for t, shape in zip(ts, CHANNELS_LAST_SHAPES, strict=True)]
        for ts in flat
    ]  # fmt: skip
    strides = [[t.stride() for t in ts] for ts in lists]
    step_and_check(path, name, lists, [Hyper(inv_scale=0.25), Hyper(step=4, inv_scale=0.25)])
    assert [[t.stride() for t in ts] for ts in lists] == strides


def every_value(dtype: torch.dtype, device: str) -> Tensor:
    """Every bit pattern of a 16-bit float dtype: zeros, subnormals, normals, infs, nans."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).to(device)


def same_bits(got: Tensor, want: Tensor) -> Tensor:
    """Elementwise: the same bits, or both nan (nan payloads are not kept, by torch either)."""
    return (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())


@pytest.mark.parametrize("path", paths(ADAM), indirect=True)
@pytest.mark.parametrize("dtype", HALF)
def test_adam_with_a_zero_learning_rate_keeps_every_half_value_bit_for_bit(
    path: OpPath, dtype: torch.dtype
) -> None:
    # With lr 0 and no decay nothing moves: the half params come back through the float32
    # math unchanged (infs and nans included).
    values = every_value(dtype, path.device)
    n = values.numel()
    params = values.clone()
    zeros = torch.zeros(n, device=path.device)
    lists = [[torch.zeros_like(values)], [params], [zeros.clone()], [zeros.clone()]]
    path.op(ADAM)(2048, path.flag(), lists, 0.0, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    same = same_bits(params, values)
    assert bool(same.all()), values[~same][:8]


@pytest.mark.parametrize("path", paths(MASTER), indirect=True)
@pytest.mark.parametrize("dtype", HALF)
def test_adam_capturable_master_rounds_masters_into_params_like_tensor_to(
    path: OpPath, dtype: torch.dtype
) -> None:
    # With lr 0 and no decay the masters keep their values; the params get them rounded as
    # Tensor.to rounds them (ties to even, overflow to inf, nan stays nan).
    values = every_value(dtype, "cpu")
    generator = torch.Generator().manual_seed(5)
    masters = torch.cat([
        torch.randn(4096, generator=generator) * 1e3,
        torch.randn(4096, generator=generator) * 1e-6,  # half subnormals and underflow
        values.float(),  # exactly representable: round trip
        values.float() * (1 + 2**-9),  # near ties of bfloat16
        values.float() * (1 + 2**-12),  # near ties of float16
        torch.tensor([70000.0, -70000.0, 3.0e38, INF, NAN, -0.0]),
    ]).to(path.device)  # fmt: skip
    half = torch.zeros_like(masters, dtype=dtype)
    lists = [[torch.zeros_like(half)], [half], [torch.zeros_like(masters)],
             [torch.zeros_like(masters)], [masters.clone()]]  # fmt: skip
    one = path.tensor([1.0])
    path.op(MASTER)(2048, path.flag(), lists, one * 0.0, 0.9, 0.999, 1e-8, one, 1, 1, 0.0, one)
    same = same_bits(half, masters.to(dtype))
    assert bool(same.all()), masters[~same][:8]


# --- the capturable ops ---------------------------------------------------------------------


@pytest.mark.parametrize("path", paths(CAPTURABLE), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
def test_adam_capturable_steps_params_and_writes_back_unscaled_grads(
    path: OpPath, dtype: torch.dtype, mode: int
) -> None:
    # Gradients scaled by 1024: the first step unscales by 1 (keeps them), the second by 2**-10.
    lists = adam_lists(path, CAPTURABLE, dtype, dtype, seed=16, grad_scale=1024.0)
    h = Hyper(mode=mode, weight_decay=0.01)
    step_and_check(path, CAPTURABLE, lists, [h, replace(h, step=4, inv_scale=2.0**-10)])
    assert all(t.dtype == FP32 for ts in lists[2:] for t in ts)  # the moments stay float32


@pytest.mark.parametrize("path", paths(MASTER), indirect=True)
@pytest.mark.parametrize("mix", ALL_DTYPE_MIXES, ids=mix_id)
def test_adam_capturable_master_steps_masters_and_rounds_them_into_params(
    path: OpPath, mix: tuple[torch.dtype, torch.dtype]
) -> None:
    lists = adam_lists(path, MASTER, *mix, seed=17, grad_scale=512.0)
    h = Hyper(mode=0, inv_scale=1 / 512, weight_decay=0.01)
    step_and_check(path, MASTER, lists, [h, replace(h, step=4, mode=1)])


@pytest.mark.parametrize("path", paths(MASTER), indirect=True)
def test_adam_capturable_master_takes_numbers_and_steps_without_bias_correction(
    path: OpPath,
) -> None:
    h = Hyper(lr=1e-3, beta2=0.99, step=2, bias_correction=0, weight_decay=0.0, inv_scale=0.25)
    for k, mix in enumerate(ALL_DTYPE_MIXES):
        lists = adam_lists(path, MASTER, *mix, seed=18 + k, grad_scale=4.0, sizes=SMALL)
        step_and_check(path, MASTER, lists, [h], numbers=True)


@pytest.mark.parametrize("path", paths(MASTER), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1], ids=["adam", "adamw"])
def test_adam_capturable_master_follows_torch_optim_over_several_steps(
    path: OpPath, dtype: torch.dtype, mode: int
) -> None:
    masters = path.randn(FP32, seed=20)
    params = [m.to(dtype) for m in masters]
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    ref_params = [torch.nn.Parameter(m.clone()) for m in masters]
    optim_class = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    optim = optim_class(ref_params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01,
                        foreach=False, fused=False)  # fmt: skip
    lr, step = path.tensor([1e-2]), path.tensor([0], torch.int32)
    inv_scale = path.tensor([1.0 / 256])
    for k in range(3):
        # Scaled by a power of two: torch.optim gets exactly the gradients the op unscales.
        grads = [(g * 256).to(dtype) for g in path.randn(FP32, seed=200 + k)]
        grads_before = [g.clone() for g in grads]
        for ref, g in zip(ref_params, grads, strict=True):
            ref.grad = g.float() / 256
        optim.step()
        step += 1
        flag = path.flag()
        lists = [grads, params, exp_avgs, exp_avg_sqs, masters]
        path.op(MASTER)(chunk_of(path, k), flag, lists, lr, 0.9, 0.99, 1e-8,
                        step, mode, 1, 0.01, inv_scale)  # fmt: skip
        assert flag.item() == 0
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_before, strict=True))
    for p, m, ref in zip(params, masters, ref_params, strict=True):
        assert (m - ref.detach()).abs().max().item() <= 1e-5
        assert torch.equal(p, m.to(dtype))


SKIP_CAUSES = {
    # cause: (value injected into a gradient, inv_scale, flag on entry, flag after)
    "flag-set-on-entry": (None, 1 / 512, 7, 7),  # GradScaler's found_inf: any nonzero value
    "inf-grad": (INF, 1 / 512, 0, 1),
    "nan-grad": (NAN, 1 / 512, 0, 1),
    "overflowing-unscale": (None, 1e36, 0, 1),  # finite grads whose unscaled value is inf
}


@pytest.mark.parametrize("path", paths(*CAPTURABLE_OPS), indirect=True)
@pytest.mark.parametrize("name", CAPTURABLE_OPS)
@pytest.mark.parametrize("cause", SKIP_CAUSES)
def test_capturable_adam_writes_nothing_when_it_skips_the_step(
    path: OpPath, name: str, cause: str
) -> None:
    # Every dtype mix on the first sizes; one mix on all of them, where the tensors after the
    # one that skips the step (and on a GPU, other launches) must be left alone too.
    inject, inv_scale, entry, after = SKIP_CAUSES[cause]
    for k, mix in enumerate(ALL_DTYPE_MIXES):
        sizes = path.sizes if mix == (torch.float16, torch.float16) else SMALL
        lists = adam_lists(path, name, *mix, seed=30 + k, grad_scale=512.0, sizes=sizes)
        if inject is not None:
            lists[0][INJECT_AT[0]][INJECT_AT[1]] = inject
        before = [[t.clone() for t in ts] for ts in lists]
        flag = path.flag(entry)
        chunk = chunk_of(path, k)
        path.op(name)(chunk, flag, lists, *scalars(path, name, Hyper(inv_scale=inv_scale)))
        assert flag.item() == after, mix
        for ts, bs in zip(lists, before, strict=True):
            for a, b in zip(ts, bs, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=str(mix))


@pytest.mark.parametrize("path", cuda_path(*CAPTURABLE_OPS), indirect=True)
@pytest.mark.parametrize("name", CAPTURABLE_OPS)
def test_capturable_adam_replays_in_a_cuda_graph_reading_its_tensors(
    path: OpPath, name: str
) -> None:
    grad_dtype, param_dtype = (torch.bfloat16, torch.bfloat16) if name == CAPTURABLE else HALF
    chunk = path.chunks[-1]
    lists = adam_lists(path, name, grad_dtype, param_dtype, seed=40, grad_scale=1024.0)
    h = Hyper(lr=1e-2, step=2, mode=0, weight_decay=0.01, inv_scale=1 / 1024)
    args = scalars(path, name, h)
    lr, step = args[0], args[4]
    assert not step.is_floating_point()  # the launcher's float copy of it is captured too
    if not EMULATED:
        spare = adam_lists(path, name, grad_dtype, param_dtype, seed=40, grad_scale=1024.0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (lazy inits)
            path.op(name)(chunk, path.flag(), spare, *args)
        torch.cuda.current_stream().wait_stream(stream)
    before = [[t.clone() for t in ts] for ts in lists]
    flag = path.flag()
    graph = Graph()
    with graph:
        path.op(name)(chunk, flag, lists, *args)
    if not EMULATED:
        torch.cuda.synchronize()
    assert_lists(lists, before, f"{name} while captured")  # nothing ran during the capture
    # Each replay reads lr and step from their tensors (and the grads as they are then).
    for new_lr, new_step in ((1e-2, 2), (5e-3, 3)):
        lr.fill_(new_lr)
        step.fill_(new_step)
        want = expected(name, lists, replace(h, lr=new_lr, step=new_step))
        graph.replay()
        if not EMULATED:
            torch.cuda.synchronize()
        assert flag.item() == 0
        assert_lists(lists, want, f"{name} replayed at step {new_step}")
