"""The LAMB ops (multi_tensor_lamb, its two stages, _mp) and multi_tensor_novograd on every path.

Each test runs on the paths that implement the op (``_op_paths.py``): the pure-PyTorch
reference, the C++ CPU kernel and the CUDA kernel (on a GPU, or its emulated build). The
expected values are Apex's kernel math written out here element by element in float64, never
taken from an implementation. Each step is checked from the values stored before it, so the
tolerance is that of one rounding to the storage dtype. The grids of hyperparameters of the
three-step tests run whole on the reference path and, on the kernel paths, as a subset in which
every pair of values of two hyperparameters still meets.

The mixed lists (:func:`mixed_lists`) hold, at each position, their own combination of list
dtypes, their own size (cycling through the path's sizes) and, at every third position, a
channels-last 4-D tensor; the ops take one dtype per list, so each op runs once per dtype
combination (:func:`call_grouped`), in place.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from _op_cases import ONE_ROUNDING
from _op_paths import OpPath, call_grouped, mixed_lists, paths

Lists = list[list[Tensor]]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INF, NAN = math.inf, math.nan
# The last tensor of params is all zeros: its trust ratio falls back to 1 (LAMB).
LAYER_SIZES = (1, 7, 555, 4096, 33)
STEPS = 3
# One rounding of each storage dtype (bfloat16's atol covers params that cross zero).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


# --- helpers ----------------------------------------------------------------------------------


def lamb_dtypes(combo: tuple[torch.dtype, ...]) -> bool:
    """The moments (lists 2 and 3) share one dtype, float32 or the param's (list 1)."""
    return combo[2] == combo[3] and combo[2] in (torch.float32, combo[1])


def novograd_dtypes(combo: tuple[torch.dtype, ...]) -> bool:
    """The first moment (list 2) is float32 or the param's dtype (list 1)."""
    return combo[2] in (torch.float32, combo[1])


def clone(lists: Lists) -> Lists:
    return [[t.clone() for t in ts] for ts in lists]


def doubles(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.detach().double().clone() for t in tensors]


def identity(x: Tensor) -> Tensor:
    return x


def small(x: Tensor) -> Tensor:
    return x * 0.1


def positive(x: Tensor) -> Tensor:
    return x.square() + 0.1


def poke(t: Tensor, value: float) -> None:
    """Set the last element of ``t`` (in logical order, any layout) to ``value``."""
    t[(-1,) * t.dim()] = value


def close(got: Tensor, want: Tensor, before: Tensor | None = None, equal_nan: bool = False) -> None:
    """``got`` is within one rounding of its dtype of the float64 ``want`` (and, written in
    place over ``before``, keeps its dtype and layout)."""
    if before is not None:
        assert got.dtype == before.dtype and got.stride() == before.stride()
    tolerance = ONE_ROUNDING[got.dtype]
    torch.testing.assert_close(
        got.double(), want, rtol=tolerance["rtol"], atol=tolerance["atol"], equal_nan=equal_nan
    )


def close_layers(
    got: Tensor, want: Tensor, dtype: torch.dtype, atol: dict[torch.dtype, float] = ATOL
) -> None:
    torch.testing.assert_close(got.double(), want, rtol=RTOL[dtype], atol=atol[dtype])


def layer_params(path: OpPath, dtype: torch.dtype) -> list[Tensor]:
    params = path.randn(dtype, seed=1, sizes=LAYER_SIZES)
    params[-1].zero_()
    return params


# --- LAMB -------------------------------------------------------------------------------------


def lamb64(
    grads: Sequence[Tensor],
    params: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: float,
    max_grad_norm: float,
    use_nvlamb: bool | None,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Apex's LAMB stages 1 and 2 in float64; (param, exp_avg, exp_avg_sq) per tensor.

    A zero weight decay adds no term; a max_grad_norm of 0 clips every gradient to 0."""
    clip = 1.0
    if global_grad_norm > max_grad_norm:
        clip = global_grad_norm / max_grad_norm if max_grad_norm else math.inf
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    out = []
    for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs, strict=True):
        g, p, m, v = (t.double() for t in (g, p, m, v))
        s = g / clip
        if mode == 0 and weight_decay != 0.0:
            s = s + weight_decay * p
        m = beta1 * m + beta3 * s
        v = beta2 * v + (1.0 - beta2) * s * s
        update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
        if mode == 1 and weight_decay != 0.0:
            update = update + weight_decay * p
        p_norm = math.sqrt(float((p * p).sum()))
        u_norm = math.sqrt(float((update * update).sum()))
        ratio = 1.0
        if (use_nvlamb or weight_decay != 0.0) and p_norm != 0.0 and u_norm != 0.0:
            ratio = p_norm / u_norm
        out.append((p - lr * ratio * update, m, v))
    return out


def grid(op: str, factors: Sequence[Sequence[Any]], kernels: Callable[..., bool]) -> list[Any]:
    """``(path, *case)`` parameters (``path`` indirect) for the cases of the product of
    ``factors`` (a tuple value is spread over several arguments): every case on the reference
    path, and on the kernel paths the cases for which ``kernels`` (given the index of each
    value in its factor) is true."""
    out = []
    for path in paths(op):
        for indices in itertools.product(*(range(len(f)) for f in factors)):
            if path.values[0] != "reference" and not kernels(*indices):
                continue
            values: list[Any] = []
            for f, i in zip(factors, indices, strict=True):
                values.extend(f[i] if isinstance(f[i], tuple) else (f[i],))
            words = [str(v).removeprefix("torch.") for v in values]
            out.append(
                pytest.param(
                    *path.values, *values, marks=path.marks, id="-".join([*words, path.values[0]])
                )
            )
    return out


# On the kernel paths, 8 of the 128 cases: every pair of values of two factors still meets
# (each binary column is the dtype's bit plus a function of the decay case, no two alike).
LAMB_GRID = grid(
    "multi_tensor_lamb",
    [
        [torch.float32, torch.bfloat16],
        [0, 1],  # mode
        [0, 1],  # grad_averaging
        [(0.0, False), (0.0, True), (0.01, False), (0.01, None)],  # weight_decay, use_nvlamb
        [1.0, 1e9],  # max_grad_norm: clipping active / inactive
        [0, 1],  # bias_correction
    ],
    lambda d, m, ga, wd, mx, bc: (
        (m, ga, mx, bc)
        == (d ^ (wd >> 1), d ^ (wd & 1), d ^ (wd & 1) ^ (wd >> 1), d ^ (wd & 1 & (wd >> 1)))
    ),
)


@pytest.mark.parametrize(
    ("path", "dtype", "mode", "grad_averaging", "weight_decay", "use_nvlamb", "max_grad_norm",
     "bias_correction"),
    LAMB_GRID,
    indirect=["path"],
)  # fmt: skip
def test_lamb_three_steps_match_the_float64_formula(
    path: OpPath,
    dtype: torch.dtype,
    mode: int,
    grad_averaging: int,
    weight_decay: float,
    use_nvlamb: bool | None,
    max_grad_norm: float,
    bias_correction: int,
) -> None:
    lamb = path.op("multi_tensor_lamb")
    atol = ATOL
    params = layer_params(path, dtype)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    hp: dict[str, Any] = {
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-6,
        "bias_correction": bias_correction,
        "weight_decay": weight_decay,
        "grad_averaging": grad_averaging,
        "mode": mode,
        "max_grad_norm": max_grad_norm,
        "use_nvlamb": use_nvlamb,
    }
    for step in range(1, STEPS + 1):
        grads = path.randn(dtype, seed=10 + step, sizes=LAYER_SIZES)
        grads_before = [g.clone() for g in grads]
        global_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        want = lamb64(
            grads, params, exp_avgs, exp_avg_sqs, step=step, global_grad_norm=global_norm, **hp
        )
        flag = path.flag()
        lamb(2048, flag, [grads, params, exp_avgs, exp_avg_sqs], 1e-2, 0.9, 0.999, 1e-6, step,
             bias_correction, weight_decay, grad_averaging, mode, path.tensor([global_norm]),
             max_grad_norm, use_nvlamb)  # fmt: skip
        assert flag.item() == 0
        for i, (p_want, m_want, v_want) in enumerate(want):
            assert params[i].dtype == dtype
            close_layers(params[i], p_want, dtype, atol)
            close_layers(exp_avgs[i], m_want, dtype)
            close_layers(exp_avg_sqs[i], v_want, dtype)
            assert torch.equal(grads[i], grads_before[i])


LAMB_CASES: dict[str, dict[str, Any]] = {
    "decoupled-clipped": {"mode": 1, "weight_decay": 0.01, "use_nvlamb": False,
                          "global_grad_norm": 5.0, "tensor_norm": True},
    "l2-not-clipped": {"mode": 0, "weight_decay": 0.01, "use_nvlamb": None,
                       "global_grad_norm": 0.5, "tensor_norm": True, "grad_averaging": 0},
    "nvlamb-no-decay": {"mode": 1, "weight_decay": 0.0, "use_nvlamb": True,
                        "global_grad_norm": 2.0, "tensor_norm": False},
    "no-ratio": {"mode": 0, "weight_decay": 0.0, "use_nvlamb": False, "global_grad_norm": 0.5,
                 "tensor_norm": False},
    "max-norm-zero": {"mode": 1, "weight_decay": 0.01, "use_nvlamb": False,
                      "global_grad_norm": 3.0, "tensor_norm": True, "max_grad_norm": 0.0},
}  # fmt: skip


def lamb_case(path: OpPath, case: str) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The float64 formula's hyperparameters of ``case`` and the op's arguments after the lists
    (the global norm as a one-element tensor on the path's device, or a Python number)."""
    c = LAMB_CASES[case]
    hp: dict[str, Any] = {
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-6,
        "step": 4,
        "bias_correction": 1,
        "weight_decay": c["weight_decay"],
        "grad_averaging": c.get("grad_averaging", 1),
        "mode": c["mode"],
        "global_grad_norm": c["global_grad_norm"],
        "max_grad_norm": c.get("max_grad_norm", 1.0),
        "use_nvlamb": c["use_nvlamb"],
    }
    norm = path.tensor([hp["global_grad_norm"]]) if c["tensor_norm"] else hp["global_grad_norm"]
    args = (hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["step"], hp["bias_correction"],
            hp["weight_decay"], hp["grad_averaging"], hp["mode"], norm, hp["max_grad_norm"],
            hp["use_nvlamb"])  # fmt: skip
    return hp, args


@pytest.mark.parametrize("path", paths("multi_tensor_lamb"), indirect=True)
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_step_matches_the_formula_for_every_dtype_mix(path: OpPath, case: str) -> None:
    lamb = path.op("multi_tensor_lamb")
    start = mixed_lists(path, [DTYPES] * 4, 11, [identity, identity, small, positive], lamb_dtypes)
    hp, args = lamb_case(path, case)
    want = lamb64(*start, **hp)
    for chunk in path.chunks:
        lists = clone(start)
        flag = path.flag()
        call_grouped(lamb, chunk, flag, lists, *args)
        assert flag.item() == 0
        for k, (p_want, m_want, v_want) in enumerate(want):
            assert torch.equal(lists[0][k], start[0][k])
            close(lists[1][k], p_want, start[1][k])
            close(lists[2][k], m_want, start[2][k])
            close(lists[3][k], v_want, start[3][k])


@pytest.mark.parametrize("path", paths("multi_tensor_lamb"), indirect=True)
@pytest.mark.parametrize("bad", [INF, NAN])
def test_lamb_flags_a_nonfinite_update_norm_and_still_writes(path: OpPath, bad: float) -> None:
    lamb = path.op("multi_tensor_lamb")
    lists = mixed_lists(path, [DTYPES] * 4, 12, [identity, identity, small, positive], lamb_dtypes)
    lists[1][1].zero_()  # ||p|| = 0: ratio 1
    poke(lists[0][4], bad)  # a nonfinite update norm: the flag is set, inf/nan propagate
    hp, args = lamb_case(path, "decoupled-clipped")
    want = lamb64(*lists, **hp)
    before = clone(lists)
    flag = path.flag()
    call_grouped(lamb, path.chunks[0], flag, lists, *args)
    assert flag.item() == 1
    for k, (p_want, m_want, v_want) in enumerate(want):
        close(lists[1][k], p_want, before[1][k], equal_nan=True)
        close(lists[2][k], m_want, before[2][k], equal_nan=True)
        close(lists[3][k], v_want, before[3][k], equal_nan=True)
    assert lists[1][4].isnan().all() and lists[1][1].isfinite().all()


@pytest.mark.parametrize("path", paths("multi_tensor_lamb"), indirect=True)
def test_lamb_flags_a_nan_param_norm_and_still_writes(path: OpPath) -> None:
    params = [path.tensor([1.0, NAN])]
    exp_avgs = [path.tensor([0.0, 0.0])]
    flag = path.flag()
    lists = [[path.tensor([1.0, 1.0])], params, exp_avgs, [path.tensor([0.0, 0.0])]]
    path.op("multi_tensor_lamb")(64, flag, lists, 0.1, 0.9, 0.999, 1e-6, 1, 1, 0.0, 1, 0,
                                 path.tensor([1.0]), 1.0, False)  # fmt: skip
    assert flag.item() == 1
    assert exp_avgs[0].tolist() == pytest.approx([0.1, 0.1])
    assert params[0][0].item() == pytest.approx(1.0 - 0.1, rel=1e-5) and params[0][1].isnan()


@pytest.mark.parametrize("path", paths("multi_tensor_lamb"), indirect=True)
def test_lamb_trust_ratio_scales_the_step(path: OpPath) -> None:
    # One element, bias correction on, step 1: update = g / (|g| + eps) ~ sign(g), so with the
    # trust ratio ||p|| / ||update|| the step is lr * |p|.
    lamb = path.op("multi_tensor_lamb")
    args = (0.1, 0.9, 0.999, 0.0, 1, 1, 0.0, 1, 0, path.tensor([0.5]), 1.0)
    for use_nvlamb, want in ((True, 4.0 - 0.1 * 4.0), (False, 4.0 - 0.1)):
        p = path.tensor([4.0])
        lists = [[path.tensor([0.5])], [p], [path.tensor([0.0])], [path.tensor([0.0])]]
        lamb(64, path.flag(), lists, *args, use_nvlamb)  # no decay, no nvlamb: ratio 1
        torch.testing.assert_close(p, path.tensor([want]))


@pytest.mark.parametrize("path", paths("multi_tensor_lamb"), indirect=True)
def test_lamb_accepts_a_python_global_norm_and_clips(path: OpPath) -> None:
    # grad 3 with global norm 3 > max 1: the gradient is divided by 3 before the moments.
    m, v = path.tensor([0.0]), path.tensor([0.0])
    lists = [[path.tensor([3.0])], [path.tensor([0.0])], [m], [v]]
    path.op("multi_tensor_lamb")(64, path.flag(), lists, 0.1, 0.9, 0.99, 1e-8, 1, 0, 0.0, 1, 0,
                                 3.0, 1.0)  # fmt: skip
    torch.testing.assert_close(m, path.tensor([0.1]))
    torch.testing.assert_close(v, path.tensor([0.01]))


@pytest.mark.parametrize("path", paths("multi_tensor_lamb", "multi_tensor_novograd"), indirect=True)
def test_lamb_and_novograd_of_empty_lists_do_nothing(path: OpPath) -> None:
    flag = path.flag()
    lamb, novograd = (path.op(f"multi_tensor_{op}") for op in ("lamb", "novograd"))
    lamb(64, flag, [[], [], [], []], 0.1, 0.9, 0.999, 1e-6, 1, 1, 0.0,
                                 1, 0, path.tensor([1.0]), 1.0, False)  # fmt: skip
    grad_norms = torch.ones(0, device=path.device)
    novograd(64, flag, [[], [], []], grad_norms, 0.1, 0.9, 0.98, 1e-8,
                                     1, 1, 0.0, 1, 0, 2)  # fmt: skip
    assert flag.item() == 0 and grad_norms.numel() == 0


# --- LAMB in two stages -----------------------------------------------------------------------


@pytest.mark.parametrize("path", paths("multi_tensor_lamb_stage1_cuda"), indirect=True)
@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype", "state_dtype", "update_dtype"),
    [
        (torch.float32,) * 4,
        (torch.float16, torch.float32, torch.float32, torch.float32),
        (torch.float16,) * 4,
        (torch.bfloat16,) * 4,
        (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16),
    ],
)
# Clipping inactive / active; the flag is neither read nor written.
@pytest.mark.parametrize(("global_norm", "entry_flag"), [(0.5, 0), (8.0, 1)])
def test_lamb_stage1_writes_moments_and_update(
    path: OpPath,
    grad_dtype: torch.dtype,
    param_dtype: torch.dtype,
    state_dtype: torch.dtype,
    update_dtype: torch.dtype,
    global_norm: float,
    entry_flag: int,
) -> None:
    stage1 = path.op("multi_tensor_lamb_stage1_cuda")
    grads, params = path.randn(grad_dtype, 7), path.randn(param_dtype, 8)
    ms = path.randn(state_dtype, 9, scale=0.1)
    vs = path.randn(state_dtype, 10, scale=0.01, positive=True)
    decay = torch.linspace(0.0, 0.5, len(path.sizes), device=path.device)
    b1, b2, eps, step, max_norm = 0.9, 0.999, 1e-6, 4, 2.0
    clip = global_norm / max_norm if global_norm > max_norm else 1.0
    want_m, want_v, want_u = [], [], []
    for i, (g, p, m, v) in enumerate(zip(*map(doubles, (grads, params, ms, vs)), strict=True)):
        g = g / clip
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        # Apex counts steps from 0 here: the bias corrections use step + 1.
        u = (m / (1 - b1 ** (step + 1))) / ((v / (1 - b2 ** (step + 1))).sqrt() + eps)
        want_m.append(m)
        want_v.append(v)
        want_u.append(u + float(decay[i]) * p)
    for chunk in path.chunks:
        lists = [grads, params, [m.clone() for m in ms], [v.clone() for v in vs]]
        lists.append([torch.full_like(g, 123.0, dtype=update_dtype) for g in grads])
        flag = path.flag(entry_flag)
        stage1(chunk, flag, lists, decay, step, b1, b2, eps, path.tensor([global_norm]),
               max_norm)  # fmt: skip
        assert flag.item() == entry_flag
        assert lists[0] is grads and lists[1] is params
        for i in range(len(grads)):
            close(lists[2][i], want_m[i])
            close(lists[3][i], want_v[i])
            close(lists[4][i], want_u[i])
            assert lists[4][i].dtype == update_dtype and lists[2][i].dtype == state_dtype
    assert all(torch.equal(a, b) for a, b in zip(grads, path.randn(grad_dtype, 7), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, path.randn(param_dtype, 8), strict=True))


@pytest.mark.parametrize("path", paths("multi_tensor_lamb_stage2_cuda"), indirect=True)
@pytest.mark.parametrize(
    ("param_dtype", "update_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
# The flag is neither read nor written.
@pytest.mark.parametrize(
    ("weight_decay", "use_nvlamb", "entry_flag"), [(0.0, None, 0), (0.0, True, 1), (0.01, False, 0)]
)
def test_lamb_stage2_applies_the_trust_ratio(
    path: OpPath,
    param_dtype: torch.dtype,
    update_dtype: torch.dtype,
    weight_decay: float,
    use_nvlamb: bool | None,
    entry_flag: int,
) -> None:
    stage2 = path.op("multi_tensor_lamb_stage2_cuda")
    start, updates = path.randn(param_dtype, 11), path.randn(update_dtype, 12)
    param_norms = path.tensor([float(p.double().norm()) for p in start])
    param_norms[1] = 0.0  # a zero norm falls back to the plain learning rate
    update_norms = path.tensor([float(u.double().norm()) for u in updates])
    lr = 0.1
    apply_ratio = bool(use_nvlamb) or weight_decay != 0.0
    want = []
    for i, (p, u) in enumerate(zip(doubles(start), doubles(updates), strict=True)):
        pn, un = float(param_norms[i]), float(update_norms[i])
        ratio = lr * (pn / un) if apply_ratio and pn != 0 and un != 0 else lr
        want.append(p - ratio * u)
    for chunk in path.chunks:
        params = [p.clone() for p in start]
        flag = path.flag(entry_flag)
        stage2(chunk, flag, [params, updates], param_norms, update_norms, lr, weight_decay,
               use_nvlamb)  # fmt: skip
        assert flag.item() == entry_flag
        for p, w in zip(params, want, strict=True):
            assert p.dtype == param_dtype
            close(p, w)
    assert all(
        torch.equal(a, b) for a, b in zip(updates, path.randn(update_dtype, 12), strict=True)
    )


# --- LAMB with device-side scalars and master weights -----------------------------------------


def lamb_mp_args(path: OpPath, step: int, global_norm: float, found_inf: float = 0.0) -> Any:
    return (path.tensor([0.01]), 0.9, 0.999, 1e-6, path.tensor([step], torch.int32), 1, 0.01, 1,
            1, path.tensor([global_norm]), path.tensor([4.0 * 512]), False,
            path.tensor([found_inf]), path.tensor([1.0 / 512]))  # fmt: skip


@pytest.mark.parametrize("path", paths("multi_tensor_lamb_mp"), indirect=True)
@pytest.mark.parametrize("masters", [False, True])
@pytest.mark.parametrize("global_norm", [512.0, 8192.0])  # clipping inactive / active
def test_lamb_mp_steps_params_or_masters_and_model_copies(
    path: OpPath, masters: bool, global_norm: float
) -> None:
    model_dtype = torch.bfloat16 if masters else torch.float32
    grads = path.randn(model_dtype, 13, scale=512.0)
    params = path.randn(torch.float32, 14)
    ms = path.randn(torch.float32, 15, scale=0.1)
    vs = path.randn(torch.float32, 16, scale=0.01, positive=True)
    # Both norms are of the scaled gradients: the clip is that of the unscaled ones.
    want = lamb64([g.double() / 512 for g in grads], params, ms, vs, lr=0.01, beta1=0.9,
                  beta2=0.999, eps=1e-6, step=2, bias_correction=1, weight_decay=0.01,
                  grad_averaging=1, mode=1, global_grad_norm=global_norm, max_grad_norm=4.0 * 512,
                  use_nvlamb=False)  # fmt: skip
    lists = [grads, params, ms, vs]
    if masters:
        lists.append([p.to(torch.bfloat16) for p in params])
    grads_before = [g.clone() for g in grads]
    flag = path.flag()
    path.op("multi_tensor_lamb_mp")(2048, flag, lists, *lamb_mp_args(path, 2, global_norm))
    assert flag.item() == 0
    for i, (p_want, m_want, v_want) in enumerate(want):
        close(params[i], p_want)
        close(ms[i], m_want)
        close(vs[i], v_want)
        if masters:
            close(lists[4][i], p_want)
    # Gradients keep their values (Apex stored the update in them).
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_before, strict=True))


@pytest.mark.parametrize("path", paths("multi_tensor_lamb_mp"), indirect=True)
@pytest.mark.parametrize("case", ["flag", "found_inf", "inf_grad", "nan_param"])
def test_lamb_mp_writes_nothing_when_skipped(path: OpPath, case: str) -> None:
    grads, params = path.randn(torch.float32, 13), path.randn(torch.float32, 14)
    if case == "inf_grad":
        grads[2][3] = INF
    if case == "nan_param":
        params[1][2] = NAN
    lists = [grads, params, path.randn(seed=15), path.randn(seed=16, positive=True)]
    before = clone(lists)
    flag = path.flag(1 if case == "flag" else 0)
    found_inf = 1.0 if case == "found_inf" else 0.0
    path.op("multi_tensor_lamb_mp")(2048, flag, lists, *lamb_mp_args(path, 1, 1.0, found_inf))
    assert flag.item() == (0 if case == "found_inf" else 1)
    for got, want in zip(lists, before, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# --- NovoGrad ---------------------------------------------------------------------------------


# The op's arguments after the grad norms, as novograd64 names them.
NOVOGRAD_ARGS = ("lr", "beta1", "beta2", "eps", "step", "bias_correction", "weight_decay",
                 "grad_averaging", "mode", "norm_type")  # fmt: skip


def norm64(g: Tensor, norm_type: int) -> float:
    g = g.double()
    return float(g.abs().max()) if norm_type == 0 else math.sqrt(float((g * g).sum()))


def novograd64(
    grads: Sequence[Tensor],
    params: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    grad_norms: Sequence[float],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    norm_type: int,
) -> list[tuple[Tensor, Tensor, float]]:
    """Apex's norm blend and NovoGradFunctor in float64; (param, exp_avg, grad_norm) each."""
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = math.sqrt(1.0 - beta2**step) if bias_correction else 1.0
    out = []
    for g, p, m, old in zip(grads, params, exp_avgs, grad_norms, strict=True):
        g, p, m = g.double(), p.double(), m.double()
        n = norm64(g, norm_type)
        if norm_type == 2:
            gn = math.sqrt(beta2 * old * old + (1.0 - beta2) * n * n)
        else:
            gn = beta2 * old + (1.0 - beta2) * n
        denom = gn / bc2 + eps
        if mode == 0:
            s = g / denom
            if weight_decay != 0.0:
                s = s + weight_decay * p
            m = beta1 * m + beta3 * s
            p = p - lr * (m / bc1)
        else:
            m = beta1 * m + beta3 * g
            update = (m / bc1) / denom
            if weight_decay != 0.0:
                update = update + weight_decay * p
            p = p - lr * update
        out.append((p, m, gn))
    return out


# On the kernel paths, 8 of the 128 cases: every pair of values of two factors still meets
# (the columns are independent sums of the bits of dtype, mode and norm_type).
NOVOGRAD_GRID = grid(
    "multi_tensor_novograd",
    [
        [torch.float32, torch.bfloat16],
        [0, 1],  # mode
        [0, 1],  # grad_averaging
        [0, 2],  # norm_type
        [0.0, 0.01],  # weight_decay
        [0, 1],  # bias_correction
        [False, True],  # init_zero
    ],
    lambda d, m, ga, n, wd, bc, z: ga == d ^ m and wd == d ^ n and bc == m ^ n and z == d ^ m ^ n,
)


@pytest.mark.parametrize(
    ("path", "dtype", "mode", "grad_averaging", "norm_type", "weight_decay", "bias_correction",
     "init_zero"),
    NOVOGRAD_GRID,
    indirect=["path"],
)  # fmt: skip
def test_novograd_three_steps_match_the_float64_formula(
    path: OpPath,
    dtype: torch.dtype,
    mode: int,
    grad_averaging: int,
    norm_type: int,
    weight_decay: float,
    bias_correction: int,
    init_zero: bool,
) -> None:
    novograd = path.op("multi_tensor_novograd")
    params = layer_params(path, dtype)
    exp_avgs = [torch.zeros_like(p) for p in params]
    first = path.randn(dtype, seed=11, sizes=LAYER_SIZES)
    # FusedNovoGrad's two initialisations: zeros, or the first gradients' norms.
    init = [0.0 if init_zero else norm64(g, norm_type) for g in first]
    grad_norms = path.tensor(init, torch.float32)
    hp: dict[str, Any] = {
        "lr": 1e-2,
        "beta1": 0.95,
        "beta2": 0.98,
        "eps": 1e-8,
        "bias_correction": bias_correction,
        "weight_decay": weight_decay,
        "grad_averaging": grad_averaging,
        "mode": mode,
        "norm_type": norm_type,
    }
    for step in range(1, STEPS + 1):
        grads = first if step == 1 else path.randn(dtype, seed=10 + step, sizes=LAYER_SIZES)
        grads_before = [g.clone() for g in grads]
        want = novograd64(grads, params, exp_avgs, grad_norms.tolist(), step=step, **hp)
        flag = path.flag()
        novograd(2048, flag, [grads, params, exp_avgs], grad_norms, 1e-2, 0.95, 0.98, 1e-8, step,
                 bias_correction, weight_decay, grad_averaging, mode, norm_type)  # fmt: skip
        assert flag.item() == 0
        for i, (p_want, m_want, gn_want) in enumerate(want):
            assert params[i].dtype == dtype
            close_layers(params[i], p_want, dtype)
            close_layers(exp_avgs[i], m_want, dtype)
            assert grad_norms[i].item() == pytest.approx(gn_want, rel=1e-5, abs=1e-6)
            assert torch.equal(grads[i], grads_before[i])


@pytest.mark.parametrize("path", paths("multi_tensor_novograd"), indirect=True)
@pytest.mark.parametrize(("mode", "norm_type"), [(0, 2), (1, 2), (0, 0), (1, 0)])
def test_novograd_two_steps_match_the_formula_for_every_dtype_mix(
    path: OpPath, mode: int, norm_type: int
) -> None:
    novograd = path.op("multi_tensor_novograd")
    start = mixed_lists(path, [DTYPES] * 3, 13, [identity, identity, small], novograd_dtypes)
    generator = torch.Generator().manual_seed(0)
    start_norms = (torch.rand(len(start[0]), generator=generator) + 0.5).to(path.device)
    for chunk in path.chunks:
        lists, grad_norms = clone(start), start_norms.clone()
        for step in (1, 2):
            if step == 2:
                lists[0] = mixed_lists(path, [DTYPES] * 3, 14, [identity] * 3, novograd_dtypes)[0]
            before = clone(lists)
            args = (1e-2, 0.95, 0.98, 1e-8, step, 1, 0.001, 1, mode, norm_type)
            hp: dict[str, Any] = dict(zip(NOVOGRAD_ARGS, args, strict=True))
            want = novograd64(before[0], before[1], before[2], grad_norms.tolist(), **hp)
            flag = path.flag()
            call_grouped(novograd, chunk, flag, lists, grad_norms, *args, per_tensor=0)
            assert flag.item() == 0
            for k, (p_want, m_want, gn_want) in enumerate(want):
                assert torch.equal(lists[0][k], before[0][k])
                close(lists[1][k], p_want, before[1][k])
                close(lists[2][k], m_want, before[2][k])
                assert grad_norms[k].item() == pytest.approx(gn_want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("path", paths("multi_tensor_novograd"), indirect=True)
def test_novograd_first_step_with_first_norm_init_keeps_the_norm(path: OpPath) -> None:
    grad_norms = path.tensor([5.0])
    lists = [[path.tensor([3.0, 4.0])], [path.tensor([0.0, 0.0])], [path.tensor([0.0, 0.0])]]
    path.op("multi_tensor_novograd")(64, path.flag(), lists, grad_norms, 0.1, 0.9, 0.5, 0.0, 1,
                                     0, 0.0, 1, 0, 2)  # fmt: skip
    torch.testing.assert_close(grad_norms, path.tensor([5.0]))


@pytest.mark.parametrize("path", paths("multi_tensor_novograd"), indirect=True)
@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("bad", [INF, NAN])
def test_novograd_flags_a_nonfinite_gradient_and_still_writes(
    path: OpPath, norm_type: int, bad: float
) -> None:
    novograd = path.op("multi_tensor_novograd")
    lists = mixed_lists(path, [DTYPES] * 3, 14, [identity, identity, small], novograd_dtypes)
    poke(lists[0][5], bad)
    grad_norms = torch.ones(len(lists[0]), device=path.device)
    args = (1e-2, 0.95, 0.98, 1e-8, 1, 0, 0.0, 0, 1, norm_type)
    hp: dict[str, Any] = dict(zip(NOVOGRAD_ARGS, args, strict=True))
    want = novograd64(lists[0], lists[1], lists[2], grad_norms.tolist(), **hp)
    before = clone(lists)
    flag = path.flag()
    call_grouped(novograd, path.chunks[0], flag, lists, grad_norms, *args, per_tensor=0)
    assert flag.item() == 1
    for k, (p_want, m_want, gn_want) in enumerate(want):
        close(lists[1][k], p_want, before[1][k], equal_nan=True)
        close(lists[2][k], m_want, before[2][k], equal_nan=True)
        torch.testing.assert_close(
            grad_norms[k].double(), torch.tensor(gn_want, dtype=torch.float64, device=path.device),
            rtol=1e-5, atol=1e-6, equal_nan=True,
        )  # fmt: skip
    assert not math.isfinite(grad_norms[5].item())
