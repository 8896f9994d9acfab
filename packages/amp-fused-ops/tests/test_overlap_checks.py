"""Tensors that share memory: what each multi-tensor op refuses and what it honours.

The kernels read and write the lists as independent arrays, chunk by chunk, so a written tensor
that partially overlaps another one (an input, or another output) would be read after it was
written, or written twice, and give wrong values without a word. Every path (the reference, the
C++ CPU kernel and, under ``nox -s cuda_emulation``, the CUDA kernels compiled for the CPU)
refuses such calls with the same ``ValueError``, and honours the sharing the ops are made for:
an output that is its own input (``multi_tensor_scale`` / ``axpby`` in place, a float32 param
that is its own master), and inputs read twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from _kernel_target import EMULATED, extension
from _op_cases import noop_flag as _flag
from amp_fused_ops.reference import _ops as _reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_F = torch.float32


def _t(n: int, dtype: torch.dtype, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) + 0.5).to(dtype)


Call = Callable[[Any], Any]


def _scale(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_scale(64, _flag(), lists, 2.0)


def _axpby(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_axpby(64, _flag(), lists, 2.0, 3.0, -1)


def _adam(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_adam(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1,
                                               1, 0.0)  # fmt: skip


def _capturable(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_adam_capturable(
        64, _flag(), lists, torch.ones(1), 0.9, 0.999, 1e-8, torch.ones(1), 1, 1, 0.0,
        torch.ones(1))  # fmt: skip


def _master(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_adam_capturable_master(
        64, _flag(), lists, torch.full((1,), 1e-3), 0.9, 0.999, 1e-8, torch.ones(1), 1, 1, 0.0,
        torch.ones(1))  # fmt: skip


def _sgd(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_sgd(64, _flag(), lists, 0.0, 0.9, 0.0, 0.1, False,
                                              False, False, 1.0)  # fmt: skip


def _adagrad(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_adagrad(64, _flag(), lists, 1e-2, 1e-10, 0, 0.0)


def _lamb(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_lamb(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-6, 1, 1,
                                               0.0, 1, 1, torch.ones(1), 1.0, False)  # fmt: skip


def _novograd(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_novograd(64, _flag(), lists, torch.ones(len(lists[0])),
                                                   1e-3, 0.9, 0.98, 1e-8, 1, 1, 0.0, 1, 0,
                                                   2)  # fmt: skip


def _stage1(lists: list[list[Tensor]]) -> Call:
    return lambda impl: impl.multi_tensor_lamb_stage1_cuda(
        64, _flag(), lists, torch.zeros(len(lists[0])), 0, 0.9, 0.999, 1e-6, torch.ones(1), 1.0
    )


def _stage2(lists: list[list[Tensor]]) -> Call:
    n = len(lists[0])
    return lambda impl: impl.multi_tensor_lamb_stage2_cuda(64, _flag(), lists, torch.ones(n),
                                                           torch.ones(n), 0.1, 0.0,
                                                           False)  # fmt: skip


def _view(fp32: Tensor, start: int, dtype: torch.dtype) -> Tensor:
    """Eight elements of ``dtype`` in the memory of ``fp32``, from its element ``start``."""
    if dtype == _F:
        return fp32[start : start + 8]
    return fp32[start : start + 4].view(dtype)


_IN_PLACE = "only the very same tensor may be updated in place"
_OWN_LIST = "every list needs tensors of its own"
_OTHER = "a tensor the op writes may not overlap any other tensor of the call"


def _refused(dtype: torch.dtype) -> dict[str, tuple[Call, str]]:
    """Each mistake -> (call, the words of the message that name the pair and the fix)."""
    buf = _t(24, dtype, 0)
    other = _t(8, dtype, 1)
    fp32 = _t(32, _F, 2)
    m, v = _t(8, _F, 3), _t(8, _F, 4)
    return {
        "scale: output overlaps its input by half": (
            _scale([[buf[:8]], [buf[4:12]]]),
            f"tensor_lists[0][0] and tensor_lists[1][0] share memory; {_IN_PLACE}"),
        "scale: two outputs share memory": (
            _scale([[other, other.clone()], [buf[:8], buf[4:12]]]),
            f"tensor_lists[1][0] and tensor_lists[1][1] share memory; {_OTHER}"),
        "scale: an output is the input of another position": (
            _scale([[other, buf[:8]], [buf[:8], buf[8:16]]]),
            f"tensor_lists[0][1] and tensor_lists[1][0] share memory; {_OTHER}"),
        "scale: output and input start together, of another dtype": (
            _scale([[fp32[:8]], [fp32[:4].view(torch.bfloat16)]]),
            f"tensor_lists[0][0] and tensor_lists[1][0] share memory; {_IN_PLACE}"),
        "axpby: output overlaps y by one element": (
            _axpby([[other], [buf[:8]], [buf[7:15]]]),
            f"tensor_lists[1][0] and tensor_lists[2][0] share memory; {_IN_PLACE}"),
        "axpby: output is y of another position": (
            _axpby([[other, other], [buf[:8], buf[8:16]], [buf[8:16], buf[16:24]]]),
            f"tensor_lists[1][1] and tensor_lists[2][0] share memory; {_OTHER}"),
        "adam: params overlap the grads of another position": (
            _adam([[buf[:8], buf[8:16]], [buf[12:20], other], [m, m.clone()],
                   [v, v.clone()]]),
            f"tensor_lists[0][1] and tensor_lists[1][0] share memory; {_OTHER}"),
        "adam: one param twice": (
            _adam([[other, other.clone()], [buf[:8], buf[:8]], [m, m.clone()], [v, v.clone()]]),
            f"tensor_lists[1][0] and tensor_lists[1][1] share memory; {_OTHER}"),
        "capturable adam: grads overlap the params of another position": (
            _capturable([[buf[:8], other], [_t(8, dtype, 9), buf[4:12]], [m, m.clone()],
                         [v, v.clone()]]),
            f"tensor_lists[0][0] and tensor_lists[1][1] share memory; {_OTHER}"),
        "master adam: a param overlaps its master by half": (
            _master([[other], [_view(fp32, 0, dtype)], [m], [v], [fp32[2:10]]]),
            f"tensor_lists[1][0] and tensor_lists[4][0] share memory; {_IN_PLACE}"),
        "sgd: two params share memory": (
            _sgd([[other, other.clone()], [buf[:8], buf[4:12]], [m, m.clone()]]),
            f"tensor_lists[1][0] and tensor_lists[1][1] share memory; {_OTHER}"),
        "sgd: momentum overlaps the model copies": (
            _sgd([[other], [_t(8, dtype, 5)], [fp32[:8]], [_view(fp32, 6, dtype)]]),
            f"tensor_lists[2][0] and tensor_lists[3][0] share memory; {_OWN_LIST}"),
        "adagrad: sums overlap the params": (
            _adagrad([[other], [buf[:8]], [buf[2:10]]]),
            f"tensor_lists[1][0] and tensor_lists[2][0] share memory; {_OWN_LIST}"),
        "lamb: exp_avgs overlap exp_avg_sqs": (
            _lamb([[other], [_t(8, dtype, 6)], [fp32[:8]], [fp32[4:12]]]),
            f"tensor_lists[2][0] and tensor_lists[3][0] share memory; {_OWN_LIST}"),
        "novograd: params overlap the grads of another position": (
            _novograd([[other, buf[:8]], [buf[:8], _t(8, dtype, 7)], [m, m.clone()]]),
            f"tensor_lists[0][1] and tensor_lists[1][0] share memory; {_OTHER}"),
        "lamb stage 1: updates overlap the grads": (
            _stage1([[buf[:8]], [_t(8, dtype, 8)], [m], [v], [buf[4:12]]]),
            f"tensor_lists[0][0] and tensor_lists[4][0] share memory; {_OWN_LIST}"),
        "lamb stage 2: params overlap the updates": (
            _stage2([[buf[:8]], [buf[1:9]]]),
            f"tensor_lists[0][0] and tensor_lists[1][0] share memory; {_OWN_LIST}"),
    }  # fmt: skip


MISTAKES = list(_refused(torch.float32))


@pytest.fixture(scope="module")
def cpu_ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


def _refusal(impl: Any, dtype: torch.dtype, mistake: str) -> str:
    """The message ``impl`` refuses the call with (checked to name the pair and the fix)."""
    call, words = _refused(dtype)[mistake]
    with pytest.raises(ValueError) as info:
        call(impl)
    assert type(info.value) is ValueError
    assert words in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mistake", MISTAKES)
def test_reference_and_cpu_kernel_refuse_shared_memory(
    cpu_ext: Any, dtype: torch.dtype, mistake: str
) -> None:
    assert _refusal(cpu_ext, dtype, mistake) == _refusal(_reference, dtype, mistake)


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.skipif(not EMULATED, reason="runs the emulated kernels (nox -s cuda_emulation)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mistake", MISTAKES)
def test_cuda_kernel_refuses_shared_memory(dtype: torch.dtype, mistake: str) -> None:
    assert _refusal(extension(), dtype, mistake) == _refusal(_reference, dtype, mistake)


# --- What the ops honour: in place updates and inputs read twice ------------------------------

TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _honoured(impl: Any, dtype: torch.dtype) -> None:
    x, y = _t(8, dtype, 10), _t(8, dtype, 11)
    x32, y32 = x.float(), y.float()
    tol = {"rtol": TOL[dtype], "atol": TOL[dtype]}

    # scale in place, as amp unscales gradients that are their own masters
    t = x.clone()
    impl.multi_tensor_scale(64, _flag(), [[t], [t]], 2.0)
    torch.testing.assert_close(t.float(), x32 * 2, **tol)
    # ... through a contiguous view of another shape
    t = x.clone()
    impl.multi_tensor_scale(64, _flag(), [[t], [t.view(2, 4)]], 2.0)
    torch.testing.assert_close(t.float(), x32 * 2, **tol)
    # axpby into x, into y, and with x and y one tensor
    for into in (0, 1):
        a, b = x.clone(), y.clone()
        impl.multi_tensor_axpby(64, _flag(), [[a], [b], [(a, b)[into]]], 2.0, 3.0, -1)
        torch.testing.assert_close((a, b)[into].float(), 2 * x32 + 3 * y32, **tol)
    out = torch.empty(8, dtype=dtype)
    impl.multi_tensor_axpby(64, _flag(), [[x], [x], [out]], 2.0, 3.0, -1)
    torch.testing.assert_close(out.float(), 5 * x32, **tol)
    # an input read at two positions, and two inputs that partially overlap
    buf = _t(12, dtype, 12)
    outs = [torch.empty(8, dtype=dtype) for _ in range(2)]
    impl.multi_tensor_scale(64, _flag(), [[buf[:8], buf[4:12]], outs], 0.5)
    torch.testing.assert_close(outs[0].float(), buf[:8].float() * 0.5, **tol)
    torch.testing.assert_close(outs[1].float(), buf[4:12].float() * 0.5, **tol)
    # the same gradient for two params (tied weights stepped as two tensors)
    g = _t(8, dtype, 13)
    params = [_t(8, dtype, 14), _t(8, dtype, 15)]
    expected = [p.float() - 0.1 * g.float() for p in params]
    bufs = [torch.zeros(8), torch.zeros(8)]
    impl.multi_tensor_sgd(64, _flag(), [[g, g], params, bufs], 0.0, 0.0, 0.0, 0.1, False,
                          True, False, 1.0)  # fmt: skip
    for p, want in zip(params, expected, strict=True):
        torch.testing.assert_close(p.float(), want, **tol)


def _master_param_is_its_own_master(impl: Any) -> None:
    p, g = _t(8, _F, 16), _t(8, _F, 17)
    separate = [g.clone(), p.clone(), torch.zeros(8), torch.zeros(8), p.clone()]
    shared = p.clone()
    aliased = [g.clone(), shared, torch.zeros(8), torch.zeros(8), shared]
    for lists in (separate, aliased):
        _master([[t] for t in lists])(impl)
    torch.testing.assert_close(shared, separate[4], rtol=0, atol=0)
    torch.testing.assert_close(aliased[2], separate[2], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_and_cpu_kernel_honour_in_place_and_shared_inputs(
    cpu_ext: Any, dtype: torch.dtype
) -> None:
    for impl in (_reference, cpu_ext):
        _honoured(impl, dtype)


def test_reference_and_cpu_kernel_take_a_param_that_is_its_own_master(cpu_ext: Any) -> None:
    for impl in (_reference, cpu_ext):
        _master_param_is_its_own_master(impl)


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.skipif(not EMULATED, reason="runs the emulated kernels (nox -s cuda_emulation)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_kernel_honours_in_place_and_shared_inputs(dtype: torch.dtype) -> None:
    _honoured(extension(), dtype)
    _master_param_is_its_own_master(extension())
