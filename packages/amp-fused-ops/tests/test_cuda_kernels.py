"""The CUDA kernels agree with the pure-PyTorch reference, op by op (GPU only).

The reference (``amp_fused_ops.reference``) is the oracle (docs/design.rst, decision 5): the same
inputs go through the compiled kernel and the reference, both on the GPU, and the results
must agree within the rounding of the output dtype:

* float32 outputs: rtol 1e-5 / atol 1e-6 (both compute in float32; the kernels may fuse a
  multiply-add or sum in another order);
* float16 / bfloat16 outputs: within two roundings of the dtype (fp16 rtol 2 * 2**-10,
  bf16 rtol 1.6e-2), since a tie rounded the other way is a correct result too;
* norms: rtol 1e-5 (float32 sums of squares accumulated in another order).

Noop-flag behaviour must match exactly. Sizes cross the vector width (1, 7), the chunk sizes
(333 and 2048 * 32, so chunks start misaligned and aligned) and the launch batches.

The same tests run on the emulated kernels (``nox -s cuda_emulation``, see
``_kernel_target.py``) at the sizes 1, 7, 555 and 33333, or with ``AMP_EMULATION_SIZES=small``
at 1, 7 and 555 with the chunk size 333 only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE, EMULATED, SMALL_SIZES, Graph, extension
from _op_cases import TWO_ROUNDINGS as TOL
from _op_cases import noop_flag
from amp_fused_ops.reference import _ops as _reference

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emulation]

if SMALL_SIZES:
    SIZES: tuple[int, ...] = (1, 7, 555)
elif EMULATED:
    SIZES = (1, 7, 555, 33333)
else:
    SIZES = (1, 7, 555, 33333, 2048 * 32 + 1, 2 * 2048 * 32)
CHUNKS = (333,) if SMALL_SIZES else (333, 2048 * 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF = (torch.float16, torch.bfloat16)
NORM_TOL = {"rtol": 1e-5, "atol": 1e-6}
INF, NAN = float("inf"), float("nan")
# Where inf/nan goes: past the first chunk of 333, in tensor 3 (33333 elements) or, with the
# small sizes, tensor 2 (555 elements).
INJECT_AT = (2, 444) if SMALL_SIZES else (3, 1234)


@pytest.fixture(scope="module")
def ext() -> Any:
    return extension()


def _flag(value: int = 0) -> Tensor:
    return noop_flag(value, DEVICE)


def _tensors(
    dtype: torch.dtype,
    seed: int,
    *,
    scale: float = 1.0,
    inject: float | None = None,
    positive: bool = False,
) -> list[Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = []
    for n in SIZES:
        t = torch.randn(n, generator=g, device=DEVICE) * scale
        out.append((t.abs() if positive else t).to(dtype))
    if inject is not None:
        out[INJECT_AT[0]][INJECT_AT[1]] = inject
    return out


def _clone(tensors: list[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


def _assert_lists_close(got: list[Tensor], want: list[Tensor], *, equal_nan: bool = False) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), i
        torch.testing.assert_close(a, b, equal_nan=equal_nan, msg=f"tensor {i}", **TOL[a.dtype])


def _both(
    ext: Any, name: str, make_args: Callable[[], tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]]
) -> tuple[tuple[Any, Tensor, list[list[Tensor]]], tuple[Any, Tensor, list[list[Tensor]]]]:
    """Run op ``name`` of the kernel and of the reference on identical fresh inputs."""
    runs = []
    for impl in (getattr(ext, name), getattr(_reference, name)):
        flag, lists, args = make_args()
        result = impl(2048 * 32, flag, lists, *args)
        runs.append((result, flag, lists))
    return runs[0], runs[1]


# --- dispatch -------------------------------------------------------------------------------


# amp_C ops without a CUDA kernel: amp_C runs the reference for them.
REFERENCE_ONLY = {"multi_tensor_l2norm_scale", "multi_tensor_lamb_mp"}


@pytest.mark.skipif(EMULATED, reason="dispatch by device needs CUDA tensors")
def test_amp_C_dispatches_cuda_tensors_to_the_kernel(ext: Any) -> None:
    assert {name for name in _reference.__all__ if not hasattr(ext, name)} == REFERENCE_ONLY
    for name in _reference.__all__:
        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(
            f"amp_fused_ops::{name}", "CUDA"
        )
        assert has_kernel == (name not in REFERENCE_ONLY), name


# --- scale, axpby ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("inject", [None, INF, NAN])
def test_scale(
    ext: Any, chunk: int, in_dtype: torch.dtype, out_dtype: torch.dtype, inject: float | None
) -> None:
    xs = _tensors(in_dtype, 1, inject=inject)
    outs = [[torch.empty_like(x, dtype=out_dtype) for x in xs] for _ in range(2)]
    flags = [_flag(), _flag()]
    ext.multi_tensor_scale(chunk, flags[0], [xs, outs[0]], 0.25)
    _reference.multi_tensor_scale(chunk, flags[1], [xs, outs[1]], 0.25)
    assert flags[0].item() == flags[1].item() == (0 if inject is None else 1)
    _assert_lists_close(outs[0], outs[1], equal_nan=True)


def _at_offset(tensors: list[Tensor], offset: int) -> list[Tensor]:
    """Copies of ``tensors`` that start ``offset`` elements into a buffer of their own."""
    out = []
    for t in tensors:
        buffer = torch.full((t.numel() + offset,), NAN, dtype=t.dtype, device=DEVICE)
        view = buffer[offset:]
        view.copy_(t)
        out.append(view)
    return out


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize(("in_offset", "out_offset"), [(1, 0), (0, 1), (3, 5)])
def test_scale_of_tensors_at_a_misaligned_storage_offset(
    ext: Any, in_dtype: torch.dtype, out_dtype: torch.dtype, in_offset: int, out_offset: int
) -> None:
    # Views whose data pointer is not 16-byte aligned (storage offset 1, 3 or 5 elements): the
    # kernel must not use 16-byte vector accesses on them (a GPU faults; the emulator raises).
    xs = _at_offset(_tensors(in_dtype, 3), in_offset)
    outs = [_at_offset([torch.zeros_like(x, dtype=out_dtype) for x in xs], out_offset)]
    outs.append([torch.empty_like(x, dtype=out_dtype) for x in xs])
    assert all(x.data_ptr() % 16 != 0 for x in (xs if in_offset else outs[0]))
    for impl, out in ((ext, outs[0]), (_reference, outs[1])):
        impl.multi_tensor_scale(2048 * 32, _flag(), [xs, out], 0.25)
    _assert_lists_close(outs[0], outs[1])


@pytest.mark.parametrize("param_dtype", DTYPES)
def test_adam_of_tensors_at_a_misaligned_storage_offset(ext: Any, param_dtype: torch.dtype) -> None:
    runs = []
    for impl, offset in ((ext, 1), (_reference, 0)):
        state = [_at_offset(ts, offset) for ts in _adam_state(param_dtype, torch.float32, 13)]
        grads = _at_offset(_tensors(param_dtype, 14), offset)
        impl.multi_tensor_adam(2048 * 32, _flag(), [grads, *state], 1e-2, 0.9, 0.999, 1e-8, 1,
                               1, 1, 0.01)  # fmt: skip
        runs.append(state)
    for got, want in zip(runs[0], runs[1], strict=True):
        _assert_lists_close([t.contiguous() for t in got], want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_in_place_keeps_the_flag_already_raised(ext: Any, dtype: torch.dtype) -> None:
    xs = _tensors(dtype, 2)
    want = [x.float().mul(1 / 1024).to(dtype) for x in xs]
    flag = _flag(1)  # raised earlier: the op never clears it
    ext.multi_tensor_scale(333, flag, [xs, xs], 1 / 1024)
    assert flag.item() == 1
    _assert_lists_close(xs, want)


@pytest.mark.parametrize(
    ("x_dtype", "y_dtype", "out_dtype"),
    [(d, d, d) for d in DTYPES] + [(torch.float16, torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("arg_to_check", [-1, 0, 1])
@pytest.mark.parametrize("inject_into", ["x", "y"])
def test_axpby(
    ext: Any,
    x_dtype: torch.dtype,
    y_dtype: torch.dtype,
    out_dtype: torch.dtype,
    arg_to_check: int,
    inject_into: str,
) -> None:
    xs = _tensors(x_dtype, 3, inject=INF if inject_into == "x" else None)
    ys = _tensors(y_dtype, 4, inject=NAN if inject_into == "y" else None)
    outs = [[torch.empty_like(x, dtype=out_dtype) for x in xs] for _ in range(2)]
    flags = [_flag(), _flag()]
    ext.multi_tensor_axpby(333, flags[0], [xs, ys, outs[0]], 2.0, -0.5, arg_to_check)
    _reference.multi_tensor_axpby(333, flags[1], [xs, ys, outs[1]], 2.0, -0.5, arg_to_check)
    checked = arg_to_check == -1 or (arg_to_check == 0) == (inject_into == "x")
    assert flags[0].item() == flags[1].item() == int(checked)
    _assert_lists_close(outs[0], outs[1], equal_nan=True)


# --- norms ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [True, False, None])
def test_l2norm(ext: Any, chunk: int, dtype: torch.dtype, per_tensor: bool | None) -> None:
    xs = _tensors(dtype, 5)
    flags = [_flag(), _flag()]
    got = ext.multi_tensor_l2norm(chunk, flags[0], [xs], per_tensor)
    want = _reference.multi_tensor_l2norm(chunk, flags[1], [xs], per_tensor)
    assert flags[0].item() == flags[1].item() == 0
    assert got[0].shape == (1,) and got[1].shape == want[1].shape
    torch.testing.assert_close(got[0], want[0], **NORM_TOL)
    torch.testing.assert_close(got[1], want[1], **NORM_TOL)


@pytest.mark.parametrize("inject", [INF, NAN])
def test_l2norm_flags_a_nonfinite_norm(ext: Any, inject: float) -> None:
    xs = _tensors(torch.float16, 6, inject=inject)
    flag = _flag()
    total, per = ext.multi_tensor_l2norm(333, flag, [xs], True)
    assert flag.item() == 1
    assert not torch.isfinite(total).any()
    assert not torch.isfinite(per[INJECT_AT[0]]) and torch.isfinite(per[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv_scale_kind", ["tensor", "float"])
def test_unscale_l2norm(ext: Any, dtype: torch.dtype, inv_scale_kind: str) -> None:
    xs = _tensors(dtype, 7, scale=1024.0)
    inv_scale: Tensor | float = 1 / 1024
    if inv_scale_kind == "tensor":
        inv_scale = torch.full((1,), 1 / 1024, device=DEVICE)
    originals = _clone(xs)
    flags = [_flag(), _flag()]
    got = ext.multi_tensor_unscale_l2norm(333, flags[0], [xs], inv_scale, True)
    want = _reference.multi_tensor_unscale_l2norm(333, flags[1], [xs], inv_scale, True)
    assert flags[0].item() == flags[1].item() == 0
    torch.testing.assert_close(got[0], want[0], **NORM_TOL)
    torch.testing.assert_close(got[1], want[1], **NORM_TOL)
    _assert_lists_close(xs, originals)  # inputs not modified


# --- Adam -----------------------------------------------------------------------------------


def _adam_state(dtype: torch.dtype, state_dtype: torch.dtype, seed: int) -> list[list[Tensor]]:
    params = _tensors(dtype, seed)
    # From a generator of their own: every implementation compared starts from the same moments.
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    exp_avgs = [
        (0.01 * torch.randn(p.shape, generator=g, device=DEVICE)).to(state_dtype) for p in params
    ]
    exp_avg_sqs = [
        (1e-4 * torch.rand(p.shape, generator=g, device=DEVICE) + m.float().square()).to(
            state_dtype
        )
        for p, m in zip(params, exp_avgs, strict=True)
    ]
    return [params, exp_avgs, exp_avg_sqs]


@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype", "state_dtype"),
    [(d, d, torch.float32) for d in DTYPES]
    + [
        (torch.float16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
def test_adam(
    ext: Any,
    grad_dtype: torch.dtype,
    param_dtype: torch.dtype,
    state_dtype: torch.dtype,
    mode: int,
    bias_correction: int,
) -> None:
    # fp32: five steps; low-precision params or state: one step (a tie rounded the other way
    # is carried on by later steps).
    exact = param_dtype == torch.float32 and state_dtype == torch.float32
    steps = 5 if exact else 1
    runs = []
    for impl in (ext, _reference):
        state = _adam_state(param_dtype, state_dtype, 10)
        for step in range(1, steps + 1):
            grads = _tensors(grad_dtype, 100 + step)
            impl.multi_tensor_adam(333, _flag(), [grads, *state], 1e-2, 0.9, 0.999, 1e-8, step,
                                   mode, bias_correction, 0.01)  # fmt: skip
        runs.append(state)
    for got, want in zip(runs[0], runs[1], strict=True):
        _assert_lists_close(got, want)


def test_adam_propagates_nonfinite_without_touching_the_flag(ext: Any) -> None:
    grads = _tensors(torch.float32, 11, inject=NAN)
    state = _adam_state(torch.float32, torch.float32, 12)
    flag = _flag()
    ext.multi_tensor_adam(2048 * 32, flag, [grads, *state], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert flag.item() == 0
    assert state[0][INJECT_AT[0]][INJECT_AT[1]].isnan()
    assert torch.isfinite(state[0][0]).all()


def _master_inputs(
    grad_dtype: torch.dtype, param_dtype: torch.dtype, inject: float | None, flag_value: int
) -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
    masters = _tensors(torch.float32, 20)
    params = [m.to(param_dtype) for m in masters]
    _, exp_avgs, exp_avg_sqs = _adam_state(torch.float32, torch.float32, 21)
    grads = _tensors(grad_dtype, 22, scale=512.0, inject=inject)
    lr = torch.full((1,), 1e-2, device=DEVICE)
    step = torch.full((1,), 3, dtype=torch.int32, device=DEVICE)
    inv_scale = torch.full((1,), 1 / 512, device=DEVICE)
    lists = [grads, params, exp_avgs, exp_avg_sqs, masters]
    return _flag(flag_value), lists, (lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.01, inv_scale)


@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype"),
    [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.float32), (torch.float32, torch.float16),
     (torch.float16, torch.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize("mode", [0, 1])
def test_adam_capturable_master(
    ext: Any, grad_dtype: torch.dtype, param_dtype: torch.dtype, mode: int
) -> None:
    def make() -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
        flag, lists, args = _master_inputs(grad_dtype, param_dtype, None, 0)
        return flag, lists, (*args[:5], mode, *args[6:])

    (_, flag_k, lists_k), (_, flag_r, lists_r) = _both(
        ext, "multi_tensor_adam_capturable_master", make
    )
    assert flag_k.item() == flag_r.item() == 0
    for got, want in zip(lists_k, lists_r, strict=True):
        _assert_lists_close(got, want)
    # The half params are the new masters, rounded once.
    for p, m in zip(lists_k[1], lists_k[4], strict=True):
        torch.testing.assert_close(p, m.to(param_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("inject", [INF, NAN])
def test_adam_capturable_master_skips_on_nonfinite_grads(ext: Any, inject: float) -> None:
    flag, lists, args = _master_inputs(torch.float16, torch.float16, inject, 0)
    before = [_clone(tensors) for tensors in lists]
    ext.multi_tensor_adam_capturable_master(333, flag, lists, *args)
    assert flag.item() == 1
    for got, want in zip(lists, before, strict=True):
        _assert_lists_close(got, want, equal_nan=True)  # nothing written, grads included


def test_adam_capturable_master_skips_when_flag_set_on_entry(ext: Any) -> None:
    flag, lists, args = _master_inputs(torch.bfloat16, torch.bfloat16, None, 0)
    flag.fill_(7)  # GradScaler's found_inf, as any nonzero value
    before = [_clone(tensors) for tensors in lists]
    ext.multi_tensor_adam_capturable_master(2048 * 32, flag, lists, *args)
    assert flag.item() == 7
    for got, want in zip(lists, before, strict=True):
        _assert_lists_close(got, want)


def test_adam_capturable_master_flags_overflow_of_the_unscaled_grad(ext: Any) -> None:
    # Finite fp16 grads whose product with inv_scale overflows float32 count as inf.
    flag, lists, args = _master_inputs(torch.float16, torch.float16, None, 0)
    huge = torch.full((1,), 1e36, device=DEVICE)
    ext.multi_tensor_adam_capturable_master(333, flag, lists, *args[:-1], huge)
    want = _flag()
    _reference.multi_tensor_adam_capturable_master(333, want, lists, *args[:-1], huge)
    assert flag.item() == want.item() == 1


def test_adam_capturable_master_runs_in_a_cuda_graph(ext: Any) -> None:
    flag, lists, args = _master_inputs(torch.float16, torch.float16, None, 0)
    ref_flag, ref_lists, _ = _master_inputs(torch.float16, torch.float16, None, 0)
    lr, step = args[0], args[4]
    if not EMULATED:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (lazy inits)
            ext.multi_tensor_adam_capturable_master(
                2048 * 32, _flag(), [_clone(t) for t in lists], *args
            )
        torch.cuda.current_stream().wait_stream(stream)
    assert not step.is_floating_point()  # the launcher's float copy of it is captured too
    captured = (*args[:4], step, *args[5:])
    graph = Graph()
    with graph:
        ext.multi_tensor_adam_capturable_master(2048 * 32, flag, lists, *captured)
    # Nothing ran during the capture; each replay reads lr and step from their tensors.
    for new_lr, new_step in ((1e-2, 3), (5e-3, 4)):
        lr.fill_(new_lr)
        step.fill_(new_step)
        graph.replay()
        _reference.multi_tensor_adam_capturable_master(2048 * 32, ref_flag, ref_lists, *captured)
    if not EMULATED:
        torch.cuda.synchronize()
    for got, want in zip(lists, ref_lists, strict=True):
        _assert_lists_close(got, want)


# --- SGD, Adagrad ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype", "copy_dtype"),
    [(torch.float32, torch.float32, None), (torch.float16, torch.float16, None),
     (torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float32, torch.float16),
     (torch.float32, torch.float32, torch.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize(
    ("momentum", "nesterov", "first_run", "wd_after_momentum"),
    [(0.0, False, False, False), (0.9, False, True, False), (0.9, True, False, False),
     (0.9, False, False, True)],
)  # fmt: skip
def test_sgd(
    ext: Any,
    grad_dtype: torch.dtype,
    param_dtype: torch.dtype,
    copy_dtype: torch.dtype | None,
    momentum: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
) -> None:
    def make() -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
        grads = _tensors(grad_dtype, 30, scale=8.0)
        params = _tensors(param_dtype, 31)
        bufs = _tensors(param_dtype, 32)
        lists = [grads, params, bufs]
        if copy_dtype is not None:
            lists.append([p.to(copy_dtype) for p in params])
        args = (1e-4, momentum, 0.1, 0.05, nesterov, first_run, wd_after_momentum, 1 / 8)
        return _flag(), lists, args

    (_, flag_k, lists_k), (_, flag_r, lists_r) = _both(ext, "multi_tensor_sgd", make)
    assert flag_k.item() == flag_r.item() == 0
    for got, want in zip(lists_k, lists_r, strict=True):
        _assert_lists_close(got, want)
    if momentum == 0.0:  # buffers untouched
        _assert_lists_close(lists_k[2], _tensors(param_dtype, 32))


def test_sgd_skips_when_flag_set(ext: Any) -> None:
    params = _tensors(torch.float32, 33)
    before = _clone(params)
    flag = _flag(1)
    grads, bufs = _tensors(torch.float32, 34), _tensors(torch.float32, 35)
    ext.multi_tensor_sgd(333, flag, [grads, params, bufs], 0.0, 0.9, 0.0, 0.1, False, False,
                         False, 1.0)  # fmt: skip
    assert flag.item() == 1
    _assert_lists_close(params, before)


@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16),
     (torch.bfloat16, torch.float32)],
)  # fmt: skip
@pytest.mark.parametrize("mode", [0, 1])
def test_adagrad(ext: Any, grad_dtype: torch.dtype, param_dtype: torch.dtype, mode: int) -> None:
    def make() -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
        lists = [
            _tensors(grad_dtype, 40),
            _tensors(param_dtype, 41),
            [s.float() for s in _tensors(torch.float32, 42, positive=True)],
        ]
        return _flag(), lists, (1e-2, 1e-10, mode, 0.01)

    (_, flag_k, lists_k), (_, flag_r, lists_r) = _both(ext, "multi_tensor_adagrad", make)
    assert flag_k.item() == flag_r.item() == 0
    for got, want in zip(lists_k, lists_r, strict=True):
        _assert_lists_close(got, want)


# --- LAMB, NovoGrad -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("mode", "weight_decay", "use_nvlamb", "grad_averaging"),
    [(0, 0.01, False, 1), (1, 0.01, None, 1), (1, 0.0, False, 0), (1, 0.0, True, 1)],
)
@pytest.mark.parametrize("global_norm", [0.5, 4.0, "tensor"])
def test_lamb(
    ext: Any,
    dtype: torch.dtype,
    mode: int,
    weight_decay: float,
    use_nvlamb: bool | None,
    grad_averaging: int,
    global_norm: float | str,
) -> None:
    def make() -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
        params, exp_avgs, exp_avg_sqs = _adam_state(dtype, torch.float32, 50)
        lists = [_tensors(dtype, 51), params, exp_avgs, exp_avg_sqs]
        norm: Tensor | float = global_norm if isinstance(global_norm, float) else 0.0
        if global_norm == "tensor":
            norm = torch.full((1,), 3.0, device=DEVICE)
        args = (1e-3, 0.9, 0.999, 1e-6, 4, 1, weight_decay, grad_averaging, mode, norm, 1.0,
                use_nvlamb)  # fmt: skip
        return _flag(), lists, args

    (_, flag_k, lists_k), (_, flag_r, lists_r) = _both(ext, "multi_tensor_lamb", make)
    assert flag_k.item() == flag_r.item() == 0
    for got, want in zip(lists_k, lists_r, strict=True):
        _assert_lists_close(got, want)


def test_lamb_flags_a_nonfinite_update_norm(ext: Any) -> None:
    flags = [_flag(), _flag()]
    for flag, impl in zip(flags, (ext, _reference), strict=True):
        params, exp_avgs, exp_avg_sqs = _adam_state(torch.float32, torch.float32, 52)
        grads = _tensors(torch.float32, 53, inject=INF)
        impl.multi_tensor_lamb(333, flag, [grads, params, exp_avgs, exp_avg_sqs], 1e-3, 0.9,
                               0.999, 1e-6, 1, 1, 0.01, 1, 1, 1.0, 1.0, False)  # fmt: skip
    assert flags[0].item() == flags[1].item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("norm_type", [0, 2])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_novograd(ext: Any, dtype: torch.dtype, mode: int, norm_type: int, chunk: int) -> None:
    runs = []
    for impl in (ext, _reference):
        params = _tensors(dtype, 60)
        exp_avgs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        grad_norms = torch.linspace(0.5, 1.5, len(params), device=DEVICE)
        flag = _flag()
        for step in (1, 2):
            grads = _tensors(dtype, 60 + step)
            args = (1e-2, 0.95, 0.98, 1e-8, step, 1, 0.001, 1, mode, norm_type)
            impl.multi_tensor_novograd(chunk, flag, [grads, params, exp_avgs], grad_norms, *args)
        runs.append((flag, params, exp_avgs, grad_norms))
    (flag_k, *got), (flag_r, *want) = runs
    assert flag_k.item() == flag_r.item() == 0
    _assert_lists_close(got[0], want[0])
    _assert_lists_close(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], **NORM_TOL)


@pytest.mark.parametrize("norm_type", [0, 2])
def test_novograd_flags_a_nonfinite_grad_norm(ext: Any, norm_type: int) -> None:
    flags = [_flag(), _flag()]
    for flag, impl in zip(flags, (ext, _reference), strict=True):
        params = _tensors(torch.float32, 61)
        exp_avgs = [torch.zeros_like(p) for p in params]
        grads = _tensors(torch.float32, 62, inject=NAN)
        grad_norms = torch.ones(len(params), device=DEVICE)
        impl.multi_tensor_novograd(333, flag, [grads, params, exp_avgs], grad_norms, 1e-2, 0.95,
                                   0.98, 1e-8, 1, 1, 0.0, 1, 0, norm_type)  # fmt: skip
    assert flags[0].item() == flags[1].item() == 1


# --- layouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_channels_last_tensors_keep_their_layout(ext: Any, dtype: torch.dtype) -> None:
    shapes = [(2, 3, 5, 7), (4, 16, 9, 9), (1, 8, 1, 1)]

    def cl(seed: int, tensor_dtype: torch.dtype) -> list[Tensor]:
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        return [
            torch.randn(s, generator=g, device=DEVICE)
            .to(tensor_dtype)
            .contiguous(memory_format=torch.channels_last)
            for s in shapes
        ]

    xs = cl(70, dtype)
    outs = [[torch.empty_like(x, dtype=torch.float32) for x in xs] for _ in range(2)]
    for out, impl in zip(outs, (ext, _reference), strict=True):
        impl.multi_tensor_scale(333, _flag(), [xs, out], 3.0)
    _assert_lists_close(outs[0], outs[1])
    assert all(o.is_contiguous(memory_format=torch.channels_last) for o in outs[0])

    runs = []
    for impl in (ext, _reference):
        params = cl(71, dtype)
        m = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        v = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        impl.multi_tensor_adam(333, _flag(), [cl(72, dtype), params, m, v], 1e-2, 0.9, 0.999,
                               1e-8, 1, 1, 1, 0.01)  # fmt: skip
        runs.append([params, m, v])
    for got, want in zip(runs[0], runs[1], strict=True):
        _assert_lists_close(got, want)


# --- preconditions --------------------------------------------------------------------------
# A wrong value is a ValueError and a tensor on the wrong device a RuntimeError, on every path
# (the reference, the CPU kernels and these).


def _scale_call(
    ext: Any, ins: list[Tensor], outs: list[Tensor], flag: Tensor | None = None
) -> None:
    ext.multi_tensor_scale(333, _flag() if flag is None else flag, [ins, outs], 2.0)


@pytest.mark.skipif(EMULATED, reason="the emulated kernels take CPU tensors")
def test_rejects_tensors_on_the_cpu(ext: Any) -> None:
    message = r"tensor_lists\[1\]\[0\] is on cpu but noop_flag is on cuda:0"
    with pytest.raises(RuntimeError, match=message):
        _scale_call(ext, [torch.ones(3, device=DEVICE)], [torch.ones(3)])


def test_rejects_a_noop_flag_on_the_cpu_or_of_the_wrong_dtype(ext: Any) -> None:
    x = [torch.ones(3, device=DEVICE)]
    if not EMULATED:
        with pytest.raises(RuntimeError, match="noop_flag must be a CUDA tensor"):
            _scale_call(ext, x, x, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="noop_flag must be a one-element int32 tensor"):
        _scale_call(ext, x, x, torch.zeros(1, device=DEVICE))


def test_rejects_mismatched_sizes_and_list_lengths(ext: Any) -> None:
    message = r"tensor_lists\[1\]\[0\] has 4 elements but tensor_lists\[0\]\[0\] has 3"
    with pytest.raises(ValueError, match=message):
        _scale_call(ext, [torch.ones(3, device=DEVICE)], [torch.ones(4, device=DEVICE)])
    message = r"tensor_lists\[1\] has 2 tensors but tensor_lists\[0\] has 1"
    with pytest.raises(ValueError, match=message):
        _scale_call(ext, [torch.ones(3, device=DEVICE)], [torch.ones(3, device=DEVICE)] * 2)


def test_rejects_unsupported_and_mixed_dtypes(ext: Any) -> None:
    with pytest.raises(ValueError, match="this list accepts float32, float16, bfloat16"):
        x = [torch.ones(3, device=DEVICE, dtype=torch.float64)]
        _scale_call(ext, x, x)
    with pytest.raises(ValueError, match="the tensors of one list must share one dtype"):
        ins = [torch.ones(3, device=DEVICE), torch.ones(3, device=DEVICE, dtype=torch.half)]
        _scale_call(ext, ins, [torch.ones(3, device=DEVICE)] * 2)


def test_rejects_non_dense_and_mismatched_layouts(ext: Any) -> None:
    strided = torch.ones(4, 6, device=DEVICE)[:, ::2]
    message = "is not dense in any memory format"
    with pytest.raises(ValueError, match=message):
        _scale_call(ext, [strided], [torch.ones(4, 3, device=DEVICE)])
    x = torch.ones(2, 3, 4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="have different memory layouts"):
        _scale_call(ext, [x], [x.contiguous(memory_format=torch.channels_last)])


def test_rejects_bad_choices_and_state_dtypes(ext: Any) -> None:
    g = [torch.ones(3, device=DEVICE)]
    with pytest.raises(ValueError, match="arg_to_check must be -1"):
        ext.multi_tensor_axpby(333, _flag(), [g, g, g], 1.0, 1.0, 2)
    with pytest.raises(ValueError, match=r"mode must be 0 \(Adam, L2 weight decay\) or 1"):
        ext.multi_tensor_adam(333, _flag(), [g, g, g, g], 1e-3, 0.9, 0.999, 1e-8, 1, 2, 1, 0.0)
    half = [torch.ones(3, device=DEVICE, dtype=torch.half)]
    # The moments are float32 (as Apex's kernel reads them), also for low-precision params.
    message = r"tensor_lists\[2\]\[0\] has dtype torch.bfloat16; this list accepts float32$"
    with pytest.raises(ValueError, match=message):
        bf16 = [torch.ones(3, device=DEVICE, dtype=torch.bfloat16)]
        ext.multi_tensor_adam(333, _flag(), [bf16, bf16, bf16, bf16], 1e-3, 0.9, 0.999, 1e-8, 1,
                              1, 1, 0.0)  # fmt: skip
    one = torch.ones(1, device=DEVICE)
    message = r"tensor_lists\[4\]\[0\] has dtype torch.float16; this list accepts float32$"
    with pytest.raises(ValueError, match=message):
        ext.multi_tensor_adam_capturable_master(333, _flag(), [half, half, g, g, half], one, 0.9,
                                                0.999, 1e-8, one, 1, 1, 0.0, one)  # fmt: skip
    with pytest.raises(ValueError, match="grad_norms must be a float32 tensor of 1 elements"):
        lists = [g, [torch.ones(3, device=DEVICE)], [torch.ones(3, device=DEVICE)]]
        ext.multi_tensor_novograd(333, _flag(), lists, torch.ones(2, device=DEVICE), 1e-3, 0.9,
                                  0.999, 1e-8, 1, 1, 0.0, 1, 0, 2)  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size must be an int in"):
        ext.multi_tensor_scale(0, _flag(), [g, g], 1.0)
