"""Every op of Apex's ``amp_C`` exists with Apex's signature; the newer ops against formulas.

Apex's last release with amp (``csrc/amp_C_frontend.cpp``) defines 17 ops. The ones beside the
classic optimizer ops (tested in ``test_reference_ops.py`` and the kernel tests) are checked
here against Apex's kernel math written out element by element in float64, on the reference
path and on the compiled CPU path where the extension has a kernel of that name, including how
each reads and raises the noop flag. Expected values are never taken from the implementation.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import amp_fused_ops
from _cpu_extension_helpers import load_from, session_cache
from _op_cases import TWO_ROUNDINGS as TOL
from _op_cases import noop_flag as flag
from amp_fused_ops import amp_C
from amp_fused_ops.reference import _ops as _reference

# Apex's amp_C ops (csrc/amp_C_frontend.cpp at its last release with amp) and their
# arguments, in order (Apex's C++ parameter names).
APEX_OPS: dict[str, list[str]] = {
    "multi_tensor_scale": ["chunk_size", "noop_flag", "tensor_lists", "scale"],
    "multi_tensor_sgd": ["chunk_size", "noop_flag", "tensor_lists", "wd", "momentum",
                         "dampening", "lr", "nesterov", "first_run", "wd_after_momentum",
                         "scale"],
    "multi_tensor_axpby": ["chunk_size", "noop_flag", "tensor_lists", "a", "b", "arg_to_check"],
    "multi_tensor_l2norm": ["chunk_size", "noop_flag", "tensor_lists", "per_tensor_python"],
    "multi_tensor_l2norm_mp": ["chunk_size", "noop_flag", "tensor_lists", "per_tensor_python"],
    "multi_tensor_l2norm_scale": ["chunk_size", "noop_flag", "tensor_lists", "scale",
                                  "per_tensor_python"],
    "multi_tensor_unscale_l2norm": ["chunk_size", "noop_flag", "tensor_lists", "inv_scale",
                                    "per_tensor_python"],
    "multi_tensor_lamb_stage1_cuda": ["chunk_size", "noop_flag", "tensor_lists",
                                      "per_tensor_decay", "step", "beta1", "beta2", "epsilon",
                                      "global_grad_norm", "max_global_grad_norm"],
    "multi_tensor_lamb_stage2_cuda": ["chunk_size", "noop_flag", "tensor_lists",
                                      "per_tensor_param_norm", "per_tensor_update_norm", "lr",
                                      "weight_decay", "use_nvlamb_python"],
    "multi_tensor_adam": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1", "beta2",
                          "epsilon", "step", "mode", "bias_correction", "weight_decay"],
    "multi_tensor_adam_capturable": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1",
                                     "beta2", "epsilon", "step", "mode", "bias_correction",
                                     "weight_decay", "inv_scale"],
    "multi_tensor_adam_capturable_master": ["chunk_size", "noop_flag", "tensor_lists", "lr",
                                            "beta1", "beta2", "epsilon", "step", "mode",
                                            "bias_correction", "weight_decay", "inv_scale"],
    "multi_tensor_adagrad": ["chunk_size", "noop_flag", "tensor_lists", "lr", "epsilon", "mode",
                             "weight_decay"],
    "multi_tensor_novograd": ["chunk_size", "noop_flag", "tensor_lists", "grad_norms", "lr",
                              "beta1", "beta2", "epsilon", "step", "bias_correction",
                              "weight_decay", "grad_averaging", "mode", "norm_type"],
    "multi_tensor_lamb": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1", "beta2",
                          "epsilon", "step", "bias_correction", "weight_decay",
                          "grad_averaging", "mode", "global_grad_norm", "max_grad_norm",
                          "use_nvlamb_python"],
    "multi_tensor_lamb_mp": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1", "beta2",
                             "epsilon", "step", "bias_correction", "weight_decay",
                             "grad_averaging", "mode", "global_grad_norm", "max_grad_norm",
                             "use_nvlamb_python", "found_inf", "inv_scale"],
    "update_scale_hysteresis": ["current_scale", "growth_tracker", "hysteresis_tracker",
                                "found_inf", "growth_factor", "backoff_factor",
                                "growth_interval", "hysteresis"],
}  # fmt: skip

SIZES = (1, 7, 555, 4099)
PATHS = ("reference", "compiled")
INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


def op_of(path: str, name: str, request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Op ``name`` of the reference, or of the compiled CPU extension (skip if it has none)."""
    if path == "reference":
        return getattr(_reference, name)  # type: ignore[no-any-return]
    ext = request.getfixturevalue("ext")
    if not hasattr(ext, name):
        pytest.skip(f"{name} has no compiled CPU kernel (amp_C runs the reference)")
    return getattr(ext, name)  # type: ignore[no-any-return]


def randn(
    dtype: torch.dtype, seed: int, scale: float = 1.0, positive: bool = False
) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g) * scale for n in SIZES]
    return [(t.abs() if positive else t).to(dtype) for t in out]


def f64(tensors: list[Tensor]) -> list[Tensor]:
    return [t.double() for t in tensors]


def close(got: list[Tensor], want: list[Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.double(), b.double(), msg=f"tensor {i}", **TOL[a.dtype])


# --- the op list ----------------------------------------------------------------------------


def test_amp_C_has_every_apex_op_in_apex_argument_order() -> None:
    assert sorted(amp_C.__all__) == sorted(APEX_OPS)
    for name, apex_args in APEX_OPS.items():
        op = getattr(amp_C, name)
        signature = inspect.signature(op).parameters
        params = list(signature)
        assert len(params) >= len(apex_args), name
        # Same positions; a few of our names are spelled out ("wd": "weight_decay", "eps").
        for ours, theirs in zip(params, apex_args, strict=False):
            assert ours[0] == theirs[0], (name, ours, theirs)
        # Ours may only add trailing optional arguments (step_tensor; bfloat16 stochastic
        # rounding's sr_seed and sr_step, sgd's step_tensor after them; lr_tensor last), which
        # Apex's calls omit.
        extra = params[len(apex_args) :]
        allowed = (
            [],
            ["lr_tensor"],
            ["step_tensor", "lr_tensor"],
            ["sr_seed", "sr_step"],
            ["step_tensor", "sr_seed", "sr_step", "lr_tensor"],
            ["sr_seed", "sr_step", "step_tensor", "lr_tensor"],
            ["step_tensor"],
        )
        assert extra in allowed, (name, extra)
        assert all(signature[p].default is None for p in extra), name
    assert amp_fused_ops.amp_C is amp_C


# --- multi_tensor_l2norm_mp -----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_mp_is_the_l2norm_when_the_flag_is_clear(
    path: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_l2norm_mp", request)
    xs = randn(dtype, 0)
    noop = flag()
    total, per = op(2048, noop, [xs], True)
    want_per = torch.tensor(
        [math.sqrt(float((x.double() ** 2).sum())) for x in xs], dtype=torch.float64
    )
    torch.testing.assert_close(per.double(), want_per, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        total.double(), want_per.square().sum().sqrt().reshape(1), rtol=1e-5, atol=0
    )
    assert noop.item() == 0


@pytest.mark.parametrize("path", PATHS)
def test_l2norm_mp_returns_zero_norms_when_the_flag_is_set(
    path: str, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_l2norm_mp", request)
    noop = flag(1)
    total, per = op(2048, noop, [randn(torch.float32, 0)], True)
    assert total.tolist() == [0.0] and per.tolist() == [0.0] * len(SIZES)
    assert noop.item() == 1


@pytest.mark.parametrize("path", PATHS)
def test_l2norm_mp_raises_the_flag_on_inf(path: str, request: pytest.FixtureRequest) -> None:
    op = op_of(path, "multi_tensor_l2norm_mp", request)
    xs = randn(torch.float32, 0)
    xs[2][5] = INF
    noop = flag()
    total, _ = op(2048, noop, [xs], None)
    assert noop.item() == 1 and math.isinf(total.item())


# --- multi_tensor_l2norm_scale --------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_l2norm_scale_scales_and_returns_the_norm_of_the_inputs(
    path: str, in_dtype: torch.dtype, out_dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_l2norm_scale", request)
    ins = randn(in_dtype, 1)
    outs = [torch.empty(x.shape, dtype=out_dtype) for x in ins]
    noop = flag()
    total, per = op(2048, noop, [ins, outs], 0.25, True)
    close(outs, [x.double() * 0.25 for x in ins])
    want_per = torch.tensor([float(x.double().norm()) for x in ins], dtype=torch.float64)
    torch.testing.assert_close(per.double(), want_per, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.double(), want_per.norm().reshape(1), rtol=1e-5, atol=0)
    assert noop.item() == 0


@pytest.mark.parametrize("path", PATHS)
def test_l2norm_scale_writes_even_with_the_flag_set_and_flags_nan(
    path: str, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_l2norm_scale", request)
    ins = randn(torch.float32, 2)
    ins[3][7] = NAN
    noop = flag(1)  # never read: Apex's kernel propagates infs and nans
    total, per = op(2048, noop, [ins, ins], 2.0, False)
    assert math.isnan(total.item()) and per.numel() == 0 and noop.item() == 1
    assert math.isnan(ins[3][7].item())
    noop = flag()
    op(2048, noop, [ins, ins], 2.0, False)
    assert noop.item() == 1


# --- multi_tensor_adam_capturable -----------------------------------------------------------


def adam_expected(
    g: Tensor,
    p: Tensor,
    m: Tensor,
    v: Tensor,
    *,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    step: int,
    mode: int,
    wd: float,
    inv_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Apex's AdamCapturableFunctor, in float64: (unscaled grad, param, m, v)."""
    g = g.double() * inv_scale
    p, m, v = p.double(), m.double(), v.double()
    grad = g + wd * p if mode == 0 else g
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    update = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    return g, p - lr * update, m, v


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", [0, 1])
def test_adam_capturable_steps_params_and_writes_back_unscaled_grads(
    path: str, dtype: torch.dtype, mode: int, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_adam_capturable", request)
    grads = randn(dtype, 3, scale=1024.0)
    params = randn(dtype, 4)
    ms = randn(torch.float32, 5, scale=0.1)
    vs = randn(torch.float32, 6, scale=0.01, positive=True)
    hyper = {
        "lr": 1e-2,
        "b1": 0.9,
        "b2": 0.999,
        "eps": 1e-8,
        "step": 3,
        "mode": mode,
        "wd": 0.01,
        "inv_scale": 1.0 / 1024,
    }
    want = [adam_expected(*row, **hyper) for row in zip(grads, params, ms, vs, strict=True)]
    noop = flag()
    lr = torch.tensor([1e-2])
    step = torch.tensor([3], dtype=torch.int32)  # Apex passes an int32 step
    op(
        2048,
        noop,
        [grads, params, ms, vs],
        lr,
        0.9,
        0.999,
        1e-8,
        step,
        mode,
        1,
        0.01,
        torch.tensor([1.0 / 1024]),
    )
    assert noop.item() == 0
    close(grads, [w[0] for w in want])
    close(params, [w[1] for w in want])
    close(ms, [w[2] for w in want])
    close(vs, [w[3] for w in want])
    assert ms[0].dtype == torch.float32  # moments keep float32 (Apex rounded them to bf16/fp16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("entry_flag", "inject"), [(1, None), (0, INF), (0, NAN)])
def test_adam_capturable_writes_nothing_on_a_set_flag_or_a_nonfinite_grad(
    path: str, entry_flag: int, inject: float | None, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_adam_capturable", request)
    grads = randn(torch.float16, 3)
    if inject is not None:
        grads[3][100] = inject
    lists = [
        grads,
        randn(torch.float16, 4),
        randn(torch.float32, 5),
        randn(torch.float32, 6, positive=True),
    ]
    before = [[t.clone() for t in tensors] for tensors in lists]
    noop = flag(entry_flag)
    one = torch.ones(1)
    op(2048, noop, lists, one * 1e-3, 0.9, 0.999, 1e-8, one, 1, 1, 0.0, one * 0.5)
    assert noop.item() == 1
    for got, want in zip(lists, before, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())


# --- multi_tensor_lamb_stage1_cuda / stage2_cuda ----------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype", "update_dtype"),
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.float16, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("global_norm", [0.5, 8.0])
def test_lamb_stage1_writes_moments_and_update(
    path: str,
    grad_dtype: torch.dtype,
    param_dtype: torch.dtype,
    update_dtype: torch.dtype,
    global_norm: float,
    request: pytest.FixtureRequest,
) -> None:
    op = op_of(path, "multi_tensor_lamb_stage1_cuda", request)
    grads, params = randn(grad_dtype, 7), randn(param_dtype, 8)
    state = torch.float32 if param_dtype == torch.float32 else param_dtype
    ms, vs = randn(state, 9, 0.1), randn(state, 10, 0.01, positive=True)
    updates = [torch.full(g.shape, 123.0, dtype=update_dtype) for g in grads]
    grads_before = [g.clone() for g in grads]
    decay = torch.tensor([0.0, 0.01, 0.1, 0.5])
    b1, b2, eps, step, max_norm = 0.9, 0.999, 1e-6, 4, 2.0
    clip = global_norm / max_norm if global_norm > max_norm else 1.0
    want_m, want_v, want_u = [], [], []
    for i, (g, p, m, v) in enumerate(zip(f64(grads), f64(params), f64(ms), f64(vs), strict=True)):
        g = g / clip
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        # Apex counts steps from 0 here: the bias corrections use step + 1.
        u = (m / (1 - b1 ** (step + 1))) / ((v / (1 - b2 ** (step + 1))).sqrt() + eps)
        want_m.append(m), want_v.append(v), want_u.append(u + float(decay[i]) * p)
    noop = flag(1)  # neither read nor written
    op(
        2048,
        noop,
        [grads, params, ms, vs, updates],
        decay,
        step,
        b1,
        b2,
        eps,
        torch.tensor([global_norm]),
        max_norm,
    )
    close(ms, want_m)
    close(vs, want_v)
    close(updates, want_u)
    assert noop.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_before, strict=True))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("weight_decay", "use_nvlamb"), [(0.0, None), (0.0, True), (0.01, False)])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16])
def test_lamb_stage2_applies_the_trust_ratio(
    path: str,
    weight_decay: float,
    use_nvlamb: bool | None,
    param_dtype: torch.dtype,
    request: pytest.FixtureRequest,
) -> None:
    op = op_of(path, "multi_tensor_lamb_stage2_cuda", request)
    params, updates = randn(param_dtype, 11), randn(torch.float32, 12)
    param_norms = torch.tensor([float(p.double().norm()) for p in params])
    param_norms[1] = 0.0  # a zero norm falls back to the plain learning rate
    update_norms = torch.tensor([float(u.double().norm()) for u in updates])
    lr = 0.1
    apply_ratio = bool(use_nvlamb) or weight_decay != 0.0
    want = []
    for i, (p, u) in enumerate(zip(f64(params), f64(updates), strict=True)):
        pn, un = float(param_norms[i]), float(update_norms[i])
        ratio = lr * (pn / un) if apply_ratio and pn != 0 and un != 0 else lr
        want.append(p - ratio * u)
    noop = flag()
    op(2048, noop, [params, updates], param_norms, update_norms, lr, weight_decay, use_nvlamb)
    close(params, want)
    assert noop.item() == 0


# --- multi_tensor_lamb_mp -------------------------------------------------------------------


def lamb_mp_expected(
    grads: list[Tensor],
    params: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    *,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    step: int,
    wd: float,
    mode: int,
    global_norm: float,
    max_norm: float,
    inv_scale: float,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Apex's multi_tensor_lamb_mp with grad_averaging and bias correction, in float64."""
    clip = global_norm / max_norm if global_norm > max_norm else 1.0
    new_p, new_m, new_v = [], [], []
    for g, p, m, v in zip(f64(grads), f64(params), f64(ms), f64(vs), strict=True):
        g = g * inv_scale / clip
        if mode == 0:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
        if mode == 1:
            u = u + wd * p
        pn, un = float(p.norm()), float(u.norm())
        ratio = lr * pn / un if pn != 0 and un != 0 else lr
        new_p.append(p - ratio * u), new_m.append(m), new_v.append(v)
    return new_p, new_m, new_v


def lamb_mp_args(step: int, global_norm: float, found_inf: float = 0.0) -> tuple[Any, ...]:
    return (
        torch.tensor([0.01]),
        0.9,
        0.999,
        1e-6,
        torch.tensor([step], dtype=torch.int32),
        1,
        0.01,
        1,
        1,
        torch.tensor([global_norm]),
        torch.tensor([4.0 * 512]),
        False,
        torch.tensor([found_inf]),
        torch.tensor([1.0 / 512]),
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("global_norm", [512.0, 8192.0])
def test_lamb_mp_steps_params_or_masters_and_model_copies(
    path: str, masters: bool, global_norm: float, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_lamb_mp", request)
    model_dtype = torch.bfloat16 if masters else torch.float32
    grads = randn(model_dtype, 13, scale=512.0)
    params = randn(torch.float32, 14)
    ms, vs = randn(torch.float32, 15, 0.1), randn(torch.float32, 16, 0.01, positive=True)
    want_p, want_m, want_v = lamb_mp_expected(
        grads,
        params,
        ms,
        vs,
        lr=0.01,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        step=2,
        wd=0.01,
        mode=1,
        global_norm=global_norm,
        max_norm=4.0 * 512,
        inv_scale=1.0 / 512,
    )
    lists = [grads, params, ms, vs]
    if masters:
        lists.append([p.to(torch.bfloat16) for p in params])
    grads_before = [g.clone() for g in grads]
    noop = flag()
    op(2048, noop, lists, *lamb_mp_args(2, global_norm))
    assert noop.item() == 0
    close(params, want_p)
    close(ms, want_m)
    close(vs, want_v)
    if masters:
        close(lists[4], want_p)
    # Gradients keep their values (Apex stored the update in them).
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_before, strict=True))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["flag", "found_inf", "inf_grad", "nan_param"])
def test_lamb_mp_writes_nothing_when_skipped(
    path: str, case: str, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "multi_tensor_lamb_mp", request)
    grads, params = randn(torch.float32, 13), randn(torch.float32, 14)
    if case == "inf_grad":
        grads[2][3] = INF
    if case == "nan_param":
        params[1][2] = NAN
    lists = [grads, params, randn(torch.float32, 15), randn(torch.float32, 16, positive=True)]
    before = [[t.clone() for t in tensors] for tensors in lists]
    noop = flag(1 if case == "flag" else 0)
    op(2048, noop, lists, *lamb_mp_args(1, 1.0, 1.0 if case == "found_inf" else 0.0))
    assert noop.item() == (0 if case == "found_inf" else 1)
    for got, want in zip(lists, before, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# --- update_scale_hysteresis ----------------------------------------------------------------


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


@pytest.mark.parametrize("path", PATHS)
def test_update_scale_hysteresis_follows_apex_over_a_sequence(
    path: str, request: pytest.FixtureRequest
) -> None:
    op = op_of(path, "update_scale_hysteresis", request)
    scale = torch.tensor([2.0**16])
    tracker = torch.zeros(1, dtype=torch.int32)
    hyst = torch.tensor([3], dtype=torch.int32)
    found_inf = torch.zeros(1)
    state = (2.0**16, 0, 3)
    # Overflows fewer than the hysteresis keep the scale; more back it off every step; clean
    # runs grow it every 4 steps; a huge scale never grows to inf.
    pattern = [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, -1, 0]
    for found in pattern:
        found_inf.fill_(found)
        result = op(scale, tracker, hyst, found_inf, 2.0, 0.5, 4, 3)
        state = hysteresis_expected(state, found, 2.0, 0.5, 4, 3)
        assert result is scale
        assert (scale.item(), tracker.item(), hyst.item()) == state, found
    scale.fill_(3.0e38)
    tracker.fill_(3)
    found_inf.zero_()
    op(scale, tracker, hyst, found_inf, 2.0, 0.5, 4, 3)
    assert scale.item() == float(torch.tensor(3.0e38)) and tracker.item() == 0


def test_update_scale_hysteresis_dispatches_on_current_scale() -> None:
    scale = torch.tensor([8.0])
    tracker = torch.zeros(1, dtype=torch.int32)
    hyst = torch.ones(1, dtype=torch.int32)
    amp_C.update_scale_hysteresis(scale, tracker, hyst, torch.ones(1), 2.0, 0.5, 10, 1)
    assert scale.item() == 4.0 and tracker.item() == 0 and hyst.item() == 0
    with pytest.raises(ValueError, match="growth_tracker must be a one-element int32 tensor"):
        amp_C.update_scale_hysteresis(scale, torch.zeros(1), hyst, torch.ones(1), 2.0, 0.5, 10, 1)


def test_dir_of_amp_C_lists_every_apex_op() -> None:
    # dir() is what help(), tab completion and `import amp_C; dir(amp_C)` scripts read.
    listed = dir(amp_C)
    assert set(APEX_OPS) <= set(listed), sorted(set(APEX_OPS) - set(listed))
    assert all(callable(getattr(amp_C, name)) for name in APEX_OPS)
    assert listed == sorted(listed)
