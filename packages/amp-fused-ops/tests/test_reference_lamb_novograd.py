"""multi_tensor_lamb and multi_tensor_novograd on the reference path, against float64 formulas.

The expected values are Apex's kernel math written out here element by element in float64,
never taken from the implementation. Each step is checked from the values stored before it, so
the tolerance is that of one rounding to the storage dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from _op_cases import noop_flag as _flag
from amp_fused_ops import amp_C, extensions
from amp_fused_ops.reference import _adam as _reference_adam
from amp_fused_ops.reference import _layerwise as _reference_layerwise
from amp_fused_ops.reference import _ops as _reference
from amp_fused_ops.reference import _optim as _reference_optim

# The last tensor of params is all zeros: its trust ratio falls back to 1 (LAMB).
SIZES = [1, 7, 555, 4096, 33]
DTYPES = [torch.float32, torch.bfloat16]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
STEPS = 3


@pytest.fixture(autouse=True)
def _reference_path() -> Iterator[None]:
    """Run amp_C's ops through the reference, whatever extensions are loaded."""
    with extensions.use_reference():
        yield


def _randn(dtype: torch.dtype, seed: int, scale: float = 1.0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for n in SIZES]


def _params(dtype: torch.dtype) -> list[Tensor]:
    params = _randn(dtype, seed=1)
    params[-1].zero_()
    return params


def _close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=RTOL[dtype], atol=ATOL[dtype]
    )


def _doubles(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().double().clone() for t in tensors]


def test_reference_reexports_the_moved_ops() -> None:
    assert _reference.multi_tensor_adam is _reference_adam.multi_tensor_adam
    assert _reference.multi_tensor_adam_capturable is _reference_adam.multi_tensor_adam_capturable
    assert _reference.multi_tensor_adagrad is _reference_optim.multi_tensor_adagrad
    assert _reference.multi_tensor_sgd is _reference_optim.multi_tensor_sgd
    assert _reference.multi_tensor_lamb is _reference_layerwise.multi_tensor_lamb
    assert _reference.multi_tensor_novograd is _reference_layerwise.multi_tensor_novograd
    assert {"multi_tensor_lamb", "multi_tensor_novograd"} <= set(amp_C.__all__)


# --- LAMB ------------------------------------------------------------------------------------


def _lamb_expected(
    grads: list[Tensor],
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
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
    use_nvlamb: bool,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Apex's LAMB stages 1 and 2 in float64; returns (param, exp_avg, exp_avg_sq) per tensor."""
    clip = global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1.0
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    out = []
    for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs, strict=True):
        s = g / clip
        if mode == 0:
            s = s + weight_decay * p
        m = beta1 * m + beta3 * s
        v = beta2 * v + (1.0 - beta2) * s * s
        update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
        if mode == 1:
            update = update + weight_decay * p
        p_norm = math.sqrt(float((p * p).sum()))
        u_norm = math.sqrt(float((update * update).sum()))
        ratio = 1.0
        if (use_nvlamb or weight_decay != 0.0) and p_norm != 0.0 and u_norm != 0.0:
            ratio = p_norm / u_norm
        out.append((p - lr * ratio * update, m, v))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("grad_averaging", [0, 1])
@pytest.mark.parametrize(
    ("weight_decay", "use_nvlamb"), [(0.0, False), (0.0, True), (0.01, False), (0.01, None)]
)
@pytest.mark.parametrize("max_grad_norm", [1.0, 1e9])  # clipping active / inactive
@pytest.mark.parametrize("bias_correction", [0, 1])
def test_lamb_three_steps_match_float64_formula(
    dtype: torch.dtype,
    mode: int,
    grad_averaging: int,
    weight_decay: float,
    use_nvlamb: bool | None,
    max_grad_norm: float,
    bias_correction: int,
) -> None:
    params = _params(dtype)
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
    }
    for step in range(1, STEPS + 1):
        grads = _randn(dtype, seed=10 + step)
        grads_before = [g.clone() for g in grads]
        global_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        expected = _lamb_expected(
            _doubles(grads),
            _doubles(params),
            _doubles(exp_avgs),
            _doubles(exp_avg_sqs),
            step=step,
            global_grad_norm=global_norm,
            use_nvlamb=bool(use_nvlamb),
            **hp,
        )
        flag = _flag()
        amp_C.multi_tensor_lamb(
            2048,
            flag,
            [grads, params, exp_avgs, exp_avg_sqs],
            hp["lr"],
            hp["beta1"],
            hp["beta2"],
            hp["eps"],
            step,
            bias_correction,
            weight_decay,
            grad_averaging,
            mode,
            torch.tensor([global_norm], dtype=torch.float32),
            max_grad_norm,
            use_nvlamb,
        )
        assert flag.item() == 0
        for i, (p_want, m_want, v_want) in enumerate(expected):
            assert params[i].dtype == dtype
            _close(params[i], p_want, dtype)
            _close(exp_avgs[i], m_want, dtype)
            _close(exp_avg_sqs[i], v_want, dtype)
            torch.testing.assert_close(grads[i], grads_before[i], rtol=0, atol=0)


def test_lamb_trust_ratio_scales_the_step() -> None:
    # One element, bias correction on, step 1: update = g / (|g| + eps) ~ sign(g), so with the
    # trust ratio ||p|| / ||update|| the step is lr * |p|.
    p, g = torch.tensor([4.0]), torch.tensor([0.5])
    lists = [[g], [p], [torch.zeros(1)], [torch.zeros(1)]]
    args = (0.1, 0.9, 0.999, 0.0, 1, 1, 0.0, 1, 0, torch.tensor([0.5]), 1.0)
    amp_C.multi_tensor_lamb(64, _flag(), lists, *args, True)
    torch.testing.assert_close(p, torch.tensor([4.0 - 0.1 * 4.0]))
    p.fill_(4.0)
    lists = [[g], [p], [torch.zeros(1)], [torch.zeros(1)]]
    amp_C.multi_tensor_lamb(64, _flag(), lists, *args, False)  # no decay, no nvlamb: ratio 1
    torch.testing.assert_close(p, torch.tensor([4.0 - 0.1]))


def test_lamb_accepts_a_python_global_norm_and_clips() -> None:
    # grad 3 with global norm 3 > max 1: the gradient is divided by 3 before the moments.
    p, m, v = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    amp_C.multi_tensor_lamb(
        64, _flag(), [[torch.tensor([3.0])], [p], [m], [v]], 0.1, 0.9, 0.99, 1e-8, 1, 0, 0.0, 1,
        0, 3.0, 1.0,
    )  # fmt: skip
    torch.testing.assert_close(m, torch.tensor([0.1]))
    torch.testing.assert_close(v, torch.tensor([0.01]))


def test_lamb_flags_nonfinite_norms_and_still_writes() -> None:
    params = [torch.tensor([1.0, float("nan")])]
    exp_avgs = [torch.zeros(2)]
    flag = _flag()
    amp_C.multi_tensor_lamb(
        64, flag, [[torch.ones(2)], params, exp_avgs, [torch.zeros(2)]], 0.1, 0.9, 0.999, 1e-6,
        1, 1, 0.0, 1, 0, torch.tensor([1.0]), 1.0, False,
    )  # fmt: skip
    assert flag.item() == 1
    assert exp_avgs[0].tolist() == pytest.approx([0.1, 0.1])


# --- NovoGrad --------------------------------------------------------------------------------


def _norm(g: Tensor, norm_type: int) -> float:
    return float(g.abs().max()) if norm_type == 0 else math.sqrt(float((g * g).sum()))


def _novograd_expected(
    grads: list[Tensor],
    params: list[Tensor],
    exp_avgs: list[Tensor],
    grad_norms: list[float],
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
        n = _norm(g, norm_type)
        if norm_type == 2:
            gn = math.sqrt(beta2 * old * old + (1.0 - beta2) * n * n)
        else:
            gn = beta2 * old + (1.0 - beta2) * n
        denom = gn / bc2 + eps
        if mode == 0:
            s = g / denom + weight_decay * p
            m = beta1 * m + beta3 * s
            p = p - lr * (m / bc1)
        else:
            m = beta1 * m + beta3 * g
            p = p - lr * ((m / bc1) / denom + weight_decay * p)
        out.append((p, m, gn))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("grad_averaging", [0, 1])
@pytest.mark.parametrize("norm_type", [0, 2])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("bias_correction", [0, 1])
@pytest.mark.parametrize("init_zero", [False, True])
def test_novograd_three_steps_match_float64_formula(
    dtype: torch.dtype,
    mode: int,
    grad_averaging: int,
    norm_type: int,
    weight_decay: float,
    bias_correction: int,
    init_zero: bool,
) -> None:
    params = _params(dtype)
    exp_avgs = [torch.zeros_like(p) for p in params]
    first = _randn(dtype, seed=11)
    # FusedNovoGrad's two initialisations: zeros, or the first gradients' norms.
    init = [0.0 if init_zero else _norm(g.double(), norm_type) for g in first]
    grad_norms = torch.tensor(init, dtype=torch.float32)
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
        grads = first if step == 1 else _randn(dtype, seed=10 + step)
        grads_before = [g.clone() for g in grads]
        expected = _novograd_expected(
            _doubles(grads),
            _doubles(params),
            _doubles(exp_avgs),
            [float(x) for x in grad_norms],
            step=step,
            **hp,
        )
        flag = _flag()
        amp_C.multi_tensor_novograd(
            2048,
            flag,
            [grads, params, exp_avgs],
            grad_norms,
            hp["lr"],
            hp["beta1"],
            hp["beta2"],
            hp["eps"],
            step,
            bias_correction,
            weight_decay,
            grad_averaging,
            mode,
            norm_type,
        )
        assert flag.item() == 0
        for i, (p_want, m_want, gn_want) in enumerate(expected):
            assert params[i].dtype == dtype
            _close(params[i], p_want, dtype)
            _close(exp_avgs[i], m_want, dtype)
            torch.testing.assert_close(
                grad_norms[i].double(), torch.tensor(gn_want, dtype=torch.float64), rtol=1e-5,
                atol=1e-6,
            )  # fmt: skip
            torch.testing.assert_close(grads[i], grads_before[i], rtol=0, atol=0)


def test_novograd_first_step_with_first_norm_init_keeps_the_norm() -> None:
    g = [torch.tensor([3.0, 4.0])]
    grad_norms = torch.tensor([5.0])
    amp_C.multi_tensor_novograd(
        64, _flag(), [g, [torch.zeros(2)], [torch.zeros(2)]], grad_norms, 0.1, 0.9, 0.5, 0.0, 1,
        0, 0.0, 1, 0, 2,
    )  # fmt: skip
    torch.testing.assert_close(grad_norms, torch.tensor([5.0]))


def test_novograd_flags_nonfinite_grad_norm() -> None:
    flag = _flag()
    grads = [torch.tensor([1.0, float("inf")])]
    amp_C.multi_tensor_novograd(
        64, flag, [grads, [torch.zeros(2)], [torch.zeros(2)]], torch.zeros(1), 0.1, 0.9, 0.98,
        1e-8, 1, 1, 0.0, 1, 0, 2,
    )  # fmt: skip
    assert flag.item() == 1


# --- preconditions ---------------------------------------------------------------------------


def _lamb(lists: Any, **overrides: Any) -> None:
    kw: dict[str, Any] = {"bias_correction": 1, "grad_averaging": 1, "mode": 0}
    kw.update(overrides)
    amp_C.multi_tensor_lamb(
        64, _flag(), lists, 0.1, 0.9, 0.999, 1e-6, 1, kw["bias_correction"], 0.0,
        kw["grad_averaging"], kw["mode"], torch.tensor([1.0]), 1.0, False,
    )  # fmt: skip


def _novograd(lists: Any, grad_norms: Any = None, **overrides: Any) -> None:
    kw: dict[str, Any] = {"bias_correction": 1, "grad_averaging": 1, "mode": 0, "norm_type": 2}
    kw.update(overrides)
    if grad_norms is None:
        grad_norms = torch.zeros(len(lists[0]) if lists else 0)
    amp_C.multi_tensor_novograd(
        64, _flag(), lists, grad_norms, 0.1, 0.9, 0.98, 1e-8, 1, kw["bias_correction"], 0.0,
        kw["grad_averaging"], kw["mode"], kw["norm_type"],
    )  # fmt: skip


def _lists(count: int, n: int = 3) -> list[list[Tensor]]:
    return [[torch.zeros(n)] for _ in range(count)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": 2}, "mode must be one of"),
        ({"grad_averaging": 2}, "grad_averaging must be one of"),
        ({"bias_correction": -1}, "bias_correction must be one of"),
    ],
)
def test_lamb_rejects_bad_choices(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"multi_tensor_lamb: {message}"):
        _lamb(_lists(4), **overrides)


def test_lamb_rejects_bad_lists() -> None:
    with pytest.raises(ValueError, match=r"expected 4 tensor lists, got 3"):
        _lamb(_lists(3))
    lists = _lists(4)
    lists[2] = [torch.zeros(5)]
    with pytest.raises(ValueError, match=r"tensor_lists\[2\]\[0\] has 5 elements"):
        _lamb(lists)
    lists = _lists(4)
    lists[1] = [torch.zeros(3, dtype=torch.int64)]
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[0\] has dtype torch.int64"):
        _lamb(lists)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": 2}, "mode must be one of"),
        ({"grad_averaging": 3}, "grad_averaging must be one of"),
        ({"bias_correction": 2}, "bias_correction must be one of"),
        ({"norm_type": 1}, r"norm_type must be one of \[0, 2\]"),
    ],
)
def test_novograd_rejects_bad_choices(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"multi_tensor_novograd: {message}"):
        _novograd(_lists(3), **overrides)


def test_novograd_rejects_bad_lists_and_grad_norms() -> None:
    with pytest.raises(ValueError, match=r"expected 3 tensor lists, got 4"):
        _novograd(_lists(4))
    with pytest.raises(TypeError, match="grad_norms must be a tensor, got list"):
        _novograd(_lists(3), grad_norms=[0.0])
    with pytest.raises(ValueError, match="grad_norms must be a float32 tensor of 1 elements"):
        _novograd(_lists(3), grad_norms=torch.zeros(2))
    with pytest.raises(ValueError, match=r"got dtype torch\.float16 with 1 elements"):
        _novograd(_lists(3), grad_norms=torch.zeros(1, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="grad_norms is on meta"):
        _novograd(_lists(3), grad_norms=torch.zeros(1, device="meta"))


def _typed(*dtypes: torch.dtype, n: int = 3) -> list[list[Tensor]]:
    return [[torch.rand(n).to(dtype)] for dtype in dtypes]


HALF, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def test_lamb_and_novograd_reject_two_dtypes_in_one_list() -> None:
    """The compiled kernels read each list as the dtype of its first tensor (as Apex's do)."""
    lists = _typed(FP32, FP32, FP32, FP32)
    lists[0].append(torch.rand(3, dtype=HALF))
    lists[1:] = [[*tensors, torch.rand(3)] for tensors in lists[1:]]
    message = (
        r"^multi_tensor_lamb: tensor_lists\[0\]\[1\] has dtype torch.float16 but "
        r"tensor_lists\[0\]\[0\] has dtype torch.float32; the tensors of one list must share "
        r"one dtype \(group them by dtype\)$"
    )
    with pytest.raises(ValueError, match=message):
        _lamb(lists)
    lists = _typed(BF16, BF16, FP32)
    lists[0].append(torch.rand(3, dtype=BF16))
    lists[1].append(torch.rand(3, dtype=BF16))
    lists[2].append(torch.rand(3, dtype=BF16))
    with pytest.raises(ValueError, match=r"tensor_lists\[2\]\[1\] has dtype torch.bfloat16 but"):
        _novograd(lists)


def test_lamb_state_lists_share_one_dtype() -> None:
    message = (
        r"^multi_tensor_lamb: tensor_lists\[3\]\[0\] has dtype torch.float16 but "
        r"tensor_lists\[2\]\[0\] has dtype torch.float32; the optimizer state lists must "
        r"share one dtype$"
    )
    with pytest.raises(ValueError, match=message):
        _lamb(_typed(HALF, HALF, FP32, HALF))


@pytest.mark.parametrize(
    ("op", "dtypes", "state", "param"),
    [
        ("lamb", (HALF, HALF, BF16, BF16), 2, 1),
        ("lamb", (FP32, FP32, HALF, HALF), 2, 1),
        ("novograd", (BF16, BF16, HALF), 2, 1),
        ("novograd", (FP32, FP32, BF16), 2, 1),
    ],
)
def test_lamb_and_novograd_state_is_float32_or_the_params_dtype(
    op: str, dtypes: tuple[torch.dtype, ...], state: int, param: int
) -> None:
    name = f"multi_tensor_{op}"
    message = (
        rf"^{name}: tensor_lists\[{state}\]\[0\] has dtype {dtypes[state]} but "
        rf"tensor_lists\[{param}\]\[0\] has dtype {dtypes[param]}; optimizer state must be "
        r"float32 or the params' dtype$"
    )
    call = _lamb if op == "lamb" else _novograd
    with pytest.raises(ValueError, match=message):
        call(_typed(*dtypes))


@pytest.mark.parametrize("param_dtype", [HALF, BF16])
@pytest.mark.parametrize("state_is_fp32", [True, False])
def test_lamb_and_novograd_take_float32_or_param_dtype_state(
    param_dtype: torch.dtype, state_is_fp32: bool
) -> None:
    state = FP32 if state_is_fp32 else param_dtype
    lamb_lists = _typed(param_dtype, param_dtype, state, state)
    _lamb(lamb_lists)
    assert lamb_lists[2][0].dtype == state and lamb_lists[2][0].abs().sum() > 0
    novograd_lists = _typed(param_dtype, param_dtype, state)
    _novograd(novograd_lists, grad_norms=torch.ones(1))
    assert novograd_lists[2][0].dtype == state


def test_novograd_checks_the_state_before_grad_norms() -> None:
    """The order of the compiled kernels: lists, then state, then grad_norms."""
    with pytest.raises(ValueError, match="optimizer state must be float32 or the params' dtype"):
        _novograd(_typed(HALF, HALF, BF16), grad_norms=torch.zeros(2))


def _lamb_stage1(lists: list[list[Tensor]]) -> None:
    amp_C.multi_tensor_lamb_stage1_cuda(
        64, _flag(), lists, torch.zeros(len(lists[0])), 0, 0.9, 0.999, 1e-6, torch.ones(1), 1.0
    )


def _lamb_stage2(lists: list[list[Tensor]], norms: Tensor | None = None) -> None:
    n = len(lists[0])
    norms = torch.ones(n) if norms is None else norms
    amp_C.multi_tensor_lamb_stage2_cuda(64, _flag(), lists, norms, torch.ones(n), 0.1, 0.0, False)


@pytest.mark.parametrize(
    ("dtypes", "message"),
    [
        (
            (HALF, HALF, FP32, HALF, FP32),
            r"^multi_tensor_lamb_stage1_cuda: tensor_lists\[3\]\[0\] has dtype torch.float16 "
            r"but tensor_lists\[2\]\[0\] has dtype torch.float32; the optimizer state lists "
            r"must share one dtype$",
        ),
        (
            (HALF, HALF, BF16, BF16, FP32),
            r"^multi_tensor_lamb_stage1_cuda: tensor_lists\[2\]\[0\] has dtype torch.bfloat16 "
            r"but tensor_lists\[1\]\[0\] has dtype torch.float16; optimizer state must be "
            r"float32 or the params' dtype$",
        ),
        (
            (HALF, HALF, FP32, FP32, BF16),
            r"^multi_tensor_lamb_stage1_cuda: tensor_lists\[4\]\[0\] has dtype torch.bfloat16 "
            r"but tensor_lists\[1\]\[0\] has dtype torch.float16; optimizer state must be "
            r"float32 or the params' dtype$",
        ),
    ],
)
def test_lamb_stage1_moments_and_updates_are_float32_or_the_params_dtype(
    dtypes: tuple[torch.dtype, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _lamb_stage1(_typed(*dtypes))


def test_lamb_stage1_takes_float32_moments_and_param_dtype_updates() -> None:
    lists = _typed(HALF, BF16, FP32, FP32, BF16)
    _lamb_stage1(lists)
    assert lists[4][0].dtype == BF16 and lists[4][0].abs().sum() > 0


def test_lamb_stage2_updates_are_float32_or_the_params_dtype() -> None:
    message = (
        r"^multi_tensor_lamb_stage2_cuda: tensor_lists\[1\]\[0\] has dtype torch.float16 but "
        r"tensor_lists\[0\]\[0\] has dtype torch.bfloat16; optimizer state must be float32 "
        r"or the params' dtype$"
    )
    with pytest.raises(ValueError, match=message):
        _lamb_stage2(_typed(BF16, HALF))
    # Checked before the norms, as the compiled kernels do.
    with pytest.raises(ValueError, match="optimizer state must be float32"):
        _lamb_stage2(_typed(BF16, HALF), norms=torch.ones(5))
    for updates in (FP32, BF16):
        lists = _typed(BF16, updates)
        before = lists[0][0].clone()
        _lamb_stage2(lists)
        assert not torch.equal(lists[0][0], before)


def test_empty_lists_do_nothing() -> None:
    _lamb([[], [], [], []])
    grad_norms = torch.ones(0)
    _novograd([[], [], []], grad_norms=grad_norms)
