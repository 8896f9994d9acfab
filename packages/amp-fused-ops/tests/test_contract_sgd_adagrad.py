"""multi_tensor_sgd, multi_tensor_adagrad and update_scale_hysteresis on every path.

Each test runs on the paths that implement the op (``_op_paths.py``): the pure-PyTorch
reference, the C++ CPU kernel and the CUDA kernel (on a GPU, or its emulated build). The
expected values never come from an implementation: several steps are checked against
``torch.optim`` (single-tensor, ``foreach=False``), and one step on every mix of dtypes and
layouts against Apex's kernel math written out here in float64 from the values stored before
the step. The loss-scale update is checked against Apex's kernel written out in Python.

The mixed lists (:func:`mixed_lists`) hold, at each position, their own combination of list
dtypes, their own size (cycling through the path's sizes) and, at every third position, a
channels-last 4-D tensor; the ops take one dtype per list, so each op runs once per dtype
combination (:func:`call_grouped`), in place.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from _op_cases import ONE_ROUNDING
from _op_paths import OpPath, call_grouped, mixed_lists, paths

Lists = list[list[Tensor]]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INF, NAN = math.inf, math.nan


# --- mixed lists ------------------------------------------------------------------------------


def state_dtypes(combo: tuple[torch.dtype, ...]) -> bool:
    """The state (list 2) is float32 or its param's dtype (list 1), as SGD and Adagrad take."""
    return combo[2] in (torch.float32, combo[1])


def clone(lists: Lists) -> Lists:
    return [[t.clone() for t in ts] for ts in lists]


def doubles(lists: Lists) -> Lists:
    return [[t.double() for t in ts] for ts in lists]


def identity(x: Tensor) -> Tensor:
    return x


def small(x: Tensor) -> Tensor:
    return x * 0.1


def positive(x: Tensor) -> Tensor:
    return x.square() + 0.1


def assert_close(got: Tensor, want: Tensor, before: Tensor, equal_nan: bool = False) -> None:
    """``got`` (written in place over ``before``) keeps its dtype and layout and is within one
    rounding of its dtype of the float64 ``want``."""
    assert got.dtype == before.dtype and got.stride() == before.stride()
    tolerance = ONE_ROUNDING[got.dtype]
    torch.testing.assert_close(
        got.double(), want, equal_nan=equal_nan, rtol=tolerance["rtol"], atol=tolerance["atol"]
    )


# --- SGD --------------------------------------------------------------------------------------


def sgd64(
    g: Tensor,
    p: Tensor,
    buf: Tensor,
    weight_decay: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Apex's SGDFunctor in float64: (param, momentum buffer). A zero decay adds no term."""
    g = g * scale
    if weight_decay != 0.0 and not wd_after_momentum:
        g = g + weight_decay * p
    if momentum != 0.0:
        buf = g if first_run else momentum * buf + (1.0 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    if weight_decay != 0.0 and wd_after_momentum:
        g = g + weight_decay * p
    return p - lr * g, buf


@pytest.mark.parametrize("path", paths("multi_tensor_sgd"), indirect=True)
@pytest.mark.parametrize(
    ("momentum", "dampening", "nesterov", "weight_decay"),
    [
        (0.0, 0.0, False, 0.0),
        (0.9, 0.0, False, 1e-2),
        (0.9, 0.1, False, 0.0),
        (0.9, 0.0, True, 1e-2),
    ],
)
def test_sgd_three_steps_match_torch_optim(
    path: OpPath, momentum: float, dampening: float, nesterov: bool, weight_decay: float
) -> None:
    sgd = path.op("multi_tensor_sgd")
    for chunk in path.chunks:
        params = path.randn(seed=40)
        bufs = [torch.zeros_like(p) for p in params]
        ref_params = [p.clone().requires_grad_() for p in params]
        ref = torch.optim.SGD(
            ref_params,
            lr=0.1,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            foreach=False,
        )
        for step in range(3):
            grads = path.randn(seed=400 + step)
            for p, g in zip(ref_params, grads, strict=True):
                p.grad = g.clone()
            ref.step()
            flag = path.flag()
            sgd(chunk, flag, [grads, params, bufs], weight_decay, momentum, dampening, 0.1,
                nesterov, step == 0, False, 1.0)  # fmt: skip
            assert flag.item() == 0
        for p, r in zip(params, ref_params, strict=True):
            assert (p - r.detach()).abs().max() <= 1e-5, chunk
        if momentum == 0.0:
            assert all(not b.any() for b in bufs)  # buffers untouched


SGD_CASES = {
    # weight_decay, momentum, dampening, lr, nesterov, first_run, wd_after_momentum, scale
    "momentum": (1e-2, 0.9, 0.1, 0.05, False, False, False, 0.5),
    "nesterov-first-run": (1e-2, 0.9, 0.0, 0.05, True, True, False, 1.0),
    "nesterov-wd-after": (1e-2, 0.9, 0.0, 0.05, True, False, True, 0.25),
    "first-run-wd-after": (1e-2, 0.8, 0.2, 0.05, False, True, True, 1.0),
    "dampened-wd-after": (1e-2, 0.9, 0.2, 0.05, False, False, True, 1 / 128),
    "no-momentum": (1e-2, 0.0, 0.0, 0.1, False, False, False, 2.0),
    "no-decay": (0.0, 0.9, 0.0, 0.1, False, False, False, 1.0),
}


@pytest.mark.parametrize("path", paths("multi_tensor_sgd"), indirect=True)
@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_step_with_model_copies_matches_the_formula_for_every_dtype_mix(
    path: OpPath, case: str
) -> None:
    sgd = path.op("multi_tensor_sgd")
    args = SGD_CASES[case]
    momentum = args[1]
    start = mixed_lists(
        path, [DTYPES] * 4, seed=6, init=[identity, identity, small, identity], keep=state_dtypes
    )
    grads, params, bufs = doubles(start[:3])
    want = [sgd64(g, p, b, *args) for g, p, b in zip(grads, params, bufs, strict=True)]
    for chunk in path.chunks:
        lists = clone(start)
        flag = path.flag()
        call_grouped(sgd, chunk, flag, lists, *args)
        assert flag.item() == 0
        grads, params, bufs, copies = lists
        for k, (p_want, buf_want) in enumerate(want):
            assert torch.equal(grads[k], start[0][k])
            assert_close(params[k], p_want, start[1][k])
            if momentum == 0.0:
                assert torch.equal(bufs[k], start[2][k])  # buffers untouched
            else:
                assert_close(bufs[k], buf_want, start[2][k])
            # The copy is the new float32 param, rounded once to the copy's dtype.
            assert_close(copies[k], p_want, start[3][k])
            if params[k].dtype in (torch.float32, copies[k].dtype):
                assert torch.equal(copies[k], params[k].to(copies[k].dtype)), (chunk, k)


@pytest.mark.parametrize("path", paths("multi_tensor_sgd"), indirect=True)
@pytest.mark.parametrize("case", ["momentum", "no-decay"])
def test_sgd_without_model_copies_propagates_nonfinite_and_never_sets_the_flag(
    path: OpPath, case: str
) -> None:
    sgd = path.op("multi_tensor_sgd")
    lists = mixed_lists(
        path, [DTYPES] * 3, seed=7, init=[identity, identity, small], keep=state_dtypes
    )
    lists[0][3][100 % lists[0][3].numel()] = NAN
    lists[1][3][7 % lists[1][3].numel()] = INF  # with no decay, 0 * inf must not make a nan
    grads, params, bufs = doubles(lists)
    want = [sgd64(g, p, b, *SGD_CASES[case]) for g, p, b in zip(grads, params, bufs, strict=True)]
    before = clone(lists)
    flag = path.flag()
    call_grouped(sgd, path.chunks[0], flag, lists, *SGD_CASES[case])
    assert flag.item() == 0
    for k, (p_want, buf_want) in enumerate(want):
        assert_close(lists[1][k], p_want, before[1][k], equal_nan=True)
        assert_close(lists[2][k], buf_want, before[2][k], equal_nan=True)
    assert lists[1][3].isinf().any() if case == "no-decay" else lists[1][3].isnan().any()


@pytest.mark.parametrize("path", paths("multi_tensor_sgd"), indirect=True)
@pytest.mark.parametrize("first_run", [False, True])
def test_sgd_writes_nothing_when_the_flag_is_set(path: OpPath, first_run: bool) -> None:
    sgd = path.op("multi_tensor_sgd")
    lists = mixed_lists(
        path, [DTYPES] * 4, seed=8, init=[identity, identity, small, identity], keep=state_dtypes
    )
    before = clone(lists)
    flag = path.flag(1)
    args = (0.1, 0.9, 0.0, 0.1, True, first_run, False, 1.0)
    call_grouped(sgd, path.chunks[0], flag, lists, *args)
    assert flag.item() == 1
    for ts, bs in zip(lists, before, strict=True):
        assert all(torch.equal(t, b) for t, b in zip(ts, bs, strict=True))


@pytest.mark.parametrize("path", paths("multi_tensor_sgd"), indirect=True)
def test_sgd_first_run_copies_the_gradient_into_a_channels_last_buffer(path: OpPath) -> None:
    generator = torch.Generator().manual_seed(62)
    p, g = (
        torch.randn(4, 6, 5, 7, generator=generator)
        .to(path.device)
        .contiguous(memory_format=torch.channels_last)
        for _ in range(2)
    )
    want = p.double() - 0.1 * g.double()
    buf = torch.zeros_like(p)
    path.op("multi_tensor_sgd")(333, path.flag(), [[g], [p], [buf]], 0.0, 0.9, 0.0, 0.1, False,
                                True, False, 1.0)  # fmt: skip
    for t in (p, buf):
        assert t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    assert torch.equal(buf, g)
    assert_close(p, want, p)


# --- Adagrad ----------------------------------------------------------------------------------


def adagrad64(
    g: Tensor, p: Tensor, h: Tensor, lr: float, eps: float, mode: int, weight_decay: float
) -> tuple[Tensor, Tensor]:
    """Apex's AdagradFunctor in float64: (param, state sum). A zero decay adds no term."""
    if mode == 0 and weight_decay != 0.0:
        g = g + weight_decay * p
    h = h + g * g
    update = g / (h.sqrt() + eps)
    if mode == 1 and weight_decay != 0.0:
        update = update + weight_decay * p
    return p - lr * update, h


@pytest.mark.parametrize("path", paths("multi_tensor_adagrad"), indirect=True)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adagrad_three_steps_match_torch_optim(path: OpPath, weight_decay: float) -> None:
    adagrad = path.op("multi_tensor_adagrad")
    for chunk in path.chunks:
        params = path.randn(seed=50)
        sums = [torch.zeros_like(p) for p in params]
        ref_params = [p.clone().requires_grad_() for p in params]
        ref = torch.optim.Adagrad(
            ref_params, lr=0.05, eps=1e-10, weight_decay=weight_decay, foreach=False
        )
        for step in range(3):
            grads = path.randn(seed=500 + step)
            for p, g in zip(ref_params, grads, strict=True):
                p.grad = g.clone()
            ref.step()
            adagrad(chunk, path.flag(), [grads, params, sums], 0.05, 1e-10, 0, weight_decay)
        for p, r in zip(params, ref_params, strict=True):
            assert (p - r.detach()).abs().max() <= 1e-5, chunk


@pytest.mark.parametrize("path", paths("multi_tensor_adagrad"), indirect=True)
@pytest.mark.parametrize(("mode", "weight_decay"), [(0, 0.01), (1, 0.01), (1, 0.1), (0, 0.0)])
def test_adagrad_step_matches_the_formula_for_every_dtype_mix(
    path: OpPath, mode: int, weight_decay: float
) -> None:
    adagrad = path.op("multi_tensor_adagrad")
    start = mixed_lists(
        path, [DTYPES] * 3, seed=9, init=[identity, identity, positive], keep=state_dtypes
    )
    args = (0.05, 1e-8, mode, weight_decay)
    grads, params, sums = doubles(start)
    want = [adagrad64(g, p, h, *args) for g, p, h in zip(grads, params, sums, strict=True)]
    for chunk in path.chunks:
        lists = clone(start)
        flag = path.flag()
        call_grouped(adagrad, chunk, flag, lists, *args)
        assert flag.item() == 0
        for k, (p_want, h_want) in enumerate(want):
            assert torch.equal(lists[0][k], start[0][k])
            assert_close(lists[1][k], p_want, start[1][k])
            assert_close(lists[2][k], h_want, start[2][k])


@pytest.mark.parametrize("path", paths("multi_tensor_adagrad"), indirect=True)
def test_adagrad_steps_with_the_flag_set_and_keeps_it(path: OpPath) -> None:
    adagrad = path.op("multi_tensor_adagrad")
    lists = mixed_lists(
        path, [DTYPES] * 3, seed=10, init=[identity, identity, positive], keep=state_dtypes
    )
    lists[0][4][0] = INF  # propagates: Apex's Adagrad neither reads nor sets the flag
    args = (0.1, 1e-10, 1, 0.01)
    grads, params, sums = doubles(lists)
    want = [adagrad64(g, p, h, *args) for g, p, h in zip(grads, params, sums, strict=True)]
    before = clone(lists)
    flag = path.flag(1)
    call_grouped(adagrad, path.chunks[0], flag, lists, *args)
    assert flag.item() == 1
    for k, (p_want, h_want) in enumerate(want):
        assert_close(lists[1][k], p_want, before[1][k], equal_nan=True)
        assert_close(lists[2][k], h_want, before[2][k], equal_nan=True)
    assert lists[2][4][0].isinf()


# --- update_scale_hysteresis ------------------------------------------------------------------


def hysteresis_expected(
    state: tuple[float, int, int],
    found: float,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
) -> tuple[float, int, int]:
    """Apex's update_scale_hysteresis kernel, step by step, in Python floats."""
    scale, tracker, hyst = state
    if found > 0:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
    if found != 0:
        scale, tracker = float(torch.tensor(scale * backoff, dtype=torch.float32)), 0
    elif tracker + 1 == interval:
        grown = float(torch.tensor(scale * growth, dtype=torch.float32))
        scale, tracker = (grown if math.isfinite(grown) else scale), 0
    else:
        tracker += 1
    if found <= 0:
        hyst = hysteresis
    return scale, tracker, hyst


@pytest.mark.parametrize("path", paths("update_scale_hysteresis"), indirect=True)
def test_update_scale_hysteresis_follows_apex_over_a_sequence(path: OpPath) -> None:
    op = path.op("update_scale_hysteresis")
    scale = path.tensor([2.0**16])
    tracker = path.tensor([0], torch.int32)
    hyst = path.tensor([3], torch.int32)
    found_inf = path.tensor([0.0])
    state = (2.0**16, 0, 3)
    # Overflows fewer than the hysteresis keep the scale; more back it off every step; clean
    # runs grow it every 4 steps; a negative found_inf backs off without using the hysteresis.
    pattern = [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, -1, 0]
    for found in pattern:
        found_inf.fill_(found)
        result = op(scale, tracker, hyst, found_inf, 2.0, 0.5, 4, 3)
        state = hysteresis_expected(state, found, 2.0, 0.5, 4, 3)
        assert result is scale
        assert (scale.item(), tracker.item(), hyst.item()) == state, found
    # A huge scale never grows to inf.
    scale.fill_(3.0e38)
    tracker.fill_(3)
    found_inf.zero_()
    op(scale, tracker, hyst, found_inf, 2.0, 0.5, 4, 3)
    assert scale.item() == float(torch.tensor(3.0e38)) and tracker.item() == 0
