"""One error type per mistake, whatever the path: reference, C++ CPU kernel, CUDA kernel.

Each mistake of the table goes through the pure-PyTorch reference and the compiled CPU
extension (and, under ``nox -s cuda_emulation``, the CUDA kernels compiled for the CPU): all
raise the same exception class, with the same words in the message. A wrong value (a dtype
included, as the reference has always done) is a ValueError, a tensor on the wrong device a
RuntimeError (as torch's own ops).
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


def _l(n: int = 8, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    return [torch.randn(n).to(dtype)]


def _adam(lists: list[list[Tensor]], step: int = 1, mode: int = 1,
          chunk: int = 64) -> Callable[[Any], None]:  # fmt: skip
    return lambda impl: impl.multi_tensor_adam(chunk, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8,
                                               step, mode, 1, 0.0)  # fmt: skip


def _shared() -> list[list[Tensor]]:
    p = torch.randn(8)
    return [_l(), [p], [p], _l()]  # params and exp_avgs are one tensor


def _half_overlap() -> list[list[Tensor]]:
    buf = torch.randn(12)
    return [[buf[:8]], [buf[4:]]]  # the second list overlaps the first by half


def _master_overlap() -> list[list[Tensor]]:
    params, masters = _half_overlap()  # a float32 param overlapping its master by half
    return [_l(), params, _l(), _l(), masters]


def _two_views() -> list[Tensor]:
    buf = torch.randn(12)
    return [buf[:8], buf[4:]]


MISTAKES: dict[str, tuple[Callable[[Any], None], type[Exception], str]] = {
    "chunk_size 0": (lambda impl: impl.multi_tensor_scale(0, _flag(), [_l(), _l()], 1.0),
                     ValueError, "chunk_size must be"),
    "chunk_size over 2**30": (
        lambda impl: impl.multi_tensor_scale(2**30 + 1, _flag(), [_l(), _l()], 1.0),
        ValueError, "chunk_size must be"),
    "noop flag of the wrong dtype": (
        lambda impl: impl.multi_tensor_scale(64, torch.zeros(1), [_l(), _l()], 1.0),
        ValueError, "noop_flag must be"),
    "wrong number of lists": (lambda impl: impl.multi_tensor_scale(64, _flag(), [_l()], 1.0),
                              ValueError, "expected 2 tensor lists"),
    "lists of different lengths": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), [_l(), _l() * 2], 1.0),
        ValueError, "has 1"),
    "sizes differ at one position": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), [_l(8), _l(9)], 1.0),
        ValueError, "elements"),
    "float64 tensors": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), [_l(8, torch.float64), _l()], 1.0),
        ValueError, "float64|Double"),
    "axpby arg_to_check 2": (
        lambda impl: impl.multi_tensor_axpby(64, _flag(), [_l(), _l(), _l()], 1.0, 1.0, 2),
        ValueError, "arg_to_check must be"),
    "adam mode 2": (_adam([_l(), _l(), _l(), _l()], mode=2), ValueError, "mode must be"),
    "adam step 0 with bias correction": (_adam([_l(), _l(), _l(), _l()], step=0), ValueError,
                                         "step must be >= 1"),
    "adam lists that share memory": (_adam(_shared()), ValueError, "share memory"),
    "adam float16 moments": (
        _adam([_l(), _l(), _l(8, torch.float16), _l(8, torch.float16)]), ValueError, "float32"),
    "adam bfloat16 moments with bfloat16 params": (
        _adam([_l(8, torch.bfloat16) for _ in range(4)]),
        ValueError, "float32"),
    "capturable adam lists that share memory": (
        lambda impl: impl.multi_tensor_adam_capturable(
            64, _flag(), _shared(), torch.ones(1), 0.9, 0.999, 1e-8, torch.ones(1), 1, 1, 0.0,
            torch.ones(1)),
        ValueError, "share memory"),
    "scale output overlapping its input": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), _half_overlap(), 2.0),
        ValueError, "share memory; only the very same tensor"),
    "sgd with one param twice": (
        lambda impl: impl.multi_tensor_sgd(64, _flag(), [_l() * 2, _l() * 2, _l() + _l()], 0.0,
                                           0.9, 0.0, 0.1, False, False, False, 1.0),
        ValueError, "share memory; a tensor the op writes"),
    "capturable master adam: moments share memory": (
        lambda impl: impl.multi_tensor_adam_capturable_master(
            64, _flag(), [_l(), _l(), *_shared()[1:3], _l()], torch.ones(1), 0.9, 0.999, 1e-8,
            torch.ones(1), 1, 1, 0.0, torch.ones(1)),
        ValueError, "share memory"),
}  # fmt: skip


@pytest.fixture(scope="module")
def cpu_ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_reference_and_cpu_kernel_raise_the_same_error(cpu_ext: Any, mistake: str) -> None:
    call, error, match = MISTAKES[mistake]
    for impl in (_reference, cpu_ext):
        with pytest.raises(error, match=match) as info:
            call(impl)
        assert type(info.value) is error, (impl, type(info.value))


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.skipif(not EMULATED, reason="runs the emulated kernels (nox -s cuda_emulation)")
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_cuda_kernel_raises_the_same_error(mistake: str) -> None:
    call, error, match = MISTAKES[mistake]
    with pytest.raises(error, match=match) as info:
        call(extension())
    assert type(info.value) is error, type(info.value)


# --- One message per mistake: the words too are the same on every path ---------------------


def _sgd(params: list[Tensor], bufs: list[Tensor], lists: int = 3) -> Callable[[Any], None]:
    grads = [torch.randn_like(p) for p in params]
    tensor_lists = [grads, params, bufs, [p.clone() for p in params]][:lists]
    return lambda impl: impl.multi_tensor_sgd(64, _flag(), tensor_lists, 0.0, 0.9, 0.0, 0.1,
                                              False, False, False, 1.0)  # fmt: skip


def _lamb(dtypes: tuple[torch.dtype, ...]) -> Callable[[Any], None]:
    lists = [_l(8, dtype) for dtype in dtypes]
    return lambda impl: impl.multi_tensor_lamb(64, _flag(), lists, 1e-3, 0.9, 0.999, 1e-6, 1, 1,
                                               0.0, 1, 1, torch.ones(1), 1.0, False)  # fmt: skip


def _novograd(dtypes: tuple[torch.dtype, ...]) -> Callable[[Any], None]:
    lists = [_l(8, dtype) for dtype in dtypes]
    return lambda impl: impl.multi_tensor_novograd(64, _flag(), lists, torch.ones(1), 1e-3, 0.9,
                                                   0.98, 1e-8, 1, 1, 0.0, 1, 0, 2)  # fmt: skip


def _lamb_stage1(dtypes: tuple[torch.dtype, ...]) -> Callable[[Any], None]:
    lists = [_l(8, dtype) for dtype in dtypes]
    return lambda impl: impl.multi_tensor_lamb_stage1_cuda(64, _flag(), lists, torch.zeros(1), 0,
                                                           0.9, 0.999, 1e-6, torch.ones(1),
                                                           1.0)  # fmt: skip


def _lamb_stage2(dtypes: tuple[torch.dtype, ...]) -> Callable[[Any], None]:
    lists = [_l(8, dtype) for dtype in dtypes]
    return lambda impl: impl.multi_tensor_lamb_stage2_cuda(64, _flag(), lists, torch.ones(1),
                                                           torch.ones(1), 0.1, 0.0,
                                                           False)  # fmt: skip


_H, _B, _F = torch.float16, torch.bfloat16, torch.float32


def _adagrad(params: list[Tensor], sums: list[Tensor]) -> Callable[[Any], None]:
    grads = [torch.randn_like(p) for p in params]
    return lambda impl: impl.multi_tensor_adagrad(64, _flag(), [grads, params, sums], 1e-2,
                                                  1e-10, 0, 0.0)  # fmt: skip


# mistake -> (call, exception type); the message is compared word for word.
SAME_MESSAGE: dict[str, tuple[Callable[[Any], None], type[Exception]]] = {
    "chunk_size 0": (lambda impl: impl.multi_tensor_scale(0, _flag(), [_l(), _l()], 1.0),
                     ValueError),
    "noop flag of the wrong dtype": (
        lambda impl: impl.multi_tensor_scale(64, torch.zeros(1), [_l(), _l()], 1.0), ValueError),
    "noop flag of two elements": (
        lambda impl: impl.multi_tensor_scale(64, torch.zeros(2, dtype=torch.int32),
                                             [_l(), _l()], 1.0),
        ValueError),
    "wrong number of lists": (lambda impl: impl.multi_tensor_scale(64, _flag(), [_l()], 1.0),
                              ValueError),
    "sgd with two lists": (_sgd([torch.randn(8)], [torch.zeros(8)], lists=2), ValueError),
    "lists of different lengths": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), [_l(), _l() * 2], 1.0), ValueError),
    "sizes differ at one position": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), [_l(8) * 2, [*_l(8), *_l(9)]], 1.0),
        ValueError),
    "float64 tensor": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), [_l(), _l(8, torch.float64)], 1.0),
        ValueError),
    "int32 tensor": (
        lambda impl: impl.multi_tensor_axpby(64, _flag(), [_l(), _l(), _l(8, torch.int32)],
                                             1.0, 1.0, -1),
        ValueError),
    "a tensor on another device": (
        lambda impl: impl.multi_tensor_scale(64, _flag(),
                                             [_l(), [torch.empty(8, device="meta")]], 1.0),
        RuntimeError),
    "adam float16 moments": (
        _adam([_l(), _l(), _l(8, torch.float16), _l(8, torch.float16)]), ValueError),
    "master adam float16 masters": (
        lambda impl: impl.multi_tensor_adam_capturable_master(
            64, _flag(), [_l(8, torch.float16), _l(8, torch.float16), _l(), _l(),
                          _l(8, torch.float16)],
            torch.ones(1), 0.9, 0.999, 1e-8, torch.ones(1), 1, 1, 0.0, torch.ones(1)),
        ValueError),
    "adam lists that share memory": (_adam(_shared()), ValueError),
    "capturable adam lists that share memory": (
        lambda impl: impl.multi_tensor_adam_capturable(
            64, _flag(), _shared(), torch.ones(1), 0.9, 0.999, 1e-8, torch.ones(1), 1, 1, 0.0,
            torch.ones(1)),
        ValueError),
    # A written tensor shares memory with another tensor of the call.
    "scale output overlapping its input by half": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), _half_overlap(), 2.0), ValueError),
    "axpby outputs sharing memory": (
        lambda impl: impl.multi_tensor_axpby(64, _flag(), [_l() * 2, _l() * 2, _two_views()],
                                             1.0, 1.0, -1),
        ValueError),
    "sgd with one param twice": (_sgd([torch.randn(8)] * 2, [torch.zeros(8), torch.zeros(8)]),
                                 ValueError),
    "master adam param overlapping its master": (
        lambda impl: impl.multi_tensor_adam_capturable_master(
            64, _flag(), _master_overlap(),
            torch.ones(1), 0.9, 0.999, 1e-8, torch.ones(1), 1, 1, 0.0, torch.ones(1)),
        ValueError),
    "sgd bfloat16 momentum for float16 params": (
        _sgd([torch.randn(8).half()], [torch.zeros(8, dtype=torch.bfloat16)]), ValueError),
    "sgd float16 momentum for float32 params": (
        _sgd([torch.randn(8)], [torch.zeros(8, dtype=torch.float16)]), ValueError),
    "adagrad float16 sums for bfloat16 params": (
        _adagrad([torch.randn(8).bfloat16()], [torch.zeros(8, dtype=torch.float16)]),
        ValueError),
    "adagrad bfloat16 sums for float32 params": (
        _adagrad([torch.randn(8)], [torch.zeros(8, dtype=torch.bfloat16)]), ValueError),
    # The kernels read each list as the dtype of its first tensor.
    "two dtypes in one list": (
        lambda impl: impl.multi_tensor_scale(64, _flag(), [_l() + _l(8, torch.float16),
                                                           _l() * 2], 1.0),
        ValueError),
    "lamb moments of two dtypes": (_lamb((_H, _H, _F, _H)), ValueError),
    "lamb bfloat16 moments for float16 params": (_lamb((_H, _H, _B, _B)), ValueError),
    "novograd float16 exp_avgs for float32 params": (_novograd((_F, _F, _H)), ValueError),
    "lamb stage 1 moments of two dtypes": (_lamb_stage1((_H, _H, _F, _H, _F)), ValueError),
    "lamb stage 1 bfloat16 moments for float16 params": (
        _lamb_stage1((_H, _H, _B, _B, _F)), ValueError),
    "lamb stage 1 bfloat16 updates for float16 params": (
        _lamb_stage1((_H, _H, _F, _F, _B)), ValueError),
    "lamb stage 2 float16 updates for bfloat16 params": (_lamb_stage2((_B, _H)), ValueError),
}  # fmt: skip


def _raised(call: Callable[[Any], None], impl: Any, error: type[Exception]) -> str:
    with pytest.raises(error) as info:
        call(impl)
    assert type(info.value) is error, (impl, type(info.value), info.value)
    return str(info.value)


@pytest.mark.parametrize("mistake", list(SAME_MESSAGE))
def test_reference_and_cpu_kernel_give_the_same_message(cpu_ext: Any, mistake: str) -> None:
    call, error = SAME_MESSAGE[mistake]
    assert _raised(call, cpu_ext, error) == _raised(call, _reference, error)


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.skipif(not EMULATED, reason="runs the emulated kernels (nox -s cuda_emulation)")
@pytest.mark.parametrize("mistake", list(SAME_MESSAGE))
def test_cuda_kernel_gives_the_reference_message(mistake: str) -> None:
    call, error = SAME_MESSAGE[mistake]
    assert _raised(call, extension(), error) == _raised(call, _reference, error)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_STATE_CASES = [(p, s) for p in _FLOATS for s in _FLOATS]


def _state_step(
    op: str, param_dtype: torch.dtype, state_dtype: torch.dtype
) -> Callable[[Any], None]:
    params = [torch.randn(8).to(param_dtype)]
    state = [torch.rand(8).to(state_dtype)]
    return _sgd(params, state) if op == "sgd" else _adagrad(params, state)


def _check_state_dtypes(impl: Any, op: str, param_dtype: torch.dtype,
                        state_dtype: torch.dtype) -> None:  # fmt: skip
    call = _state_step(op, param_dtype, state_dtype)
    if state_dtype in (torch.float32, param_dtype):
        call(impl)
    else:
        message = "optimizer state must be float32 or the params' dtype"
        with pytest.raises(ValueError, match=message):
            call(impl)


@pytest.mark.parametrize("op", ["sgd", "adagrad"])
@pytest.mark.parametrize(("param_dtype", "state_dtype"), _STATE_CASES)
def test_sgd_and_adagrad_state_is_float32_or_the_params_dtype(
    cpu_ext: Any, op: str, param_dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    """Apex keeps the state in the params' dtype; float32 state is accepted as well."""
    for impl in (_reference, cpu_ext):
        _check_state_dtypes(impl, op, param_dtype, state_dtype)


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.skipif(not EMULATED, reason="runs the emulated kernels (nox -s cuda_emulation)")
@pytest.mark.parametrize("op", ["sgd", "adagrad"])
@pytest.mark.parametrize(("param_dtype", "state_dtype"), _STATE_CASES)
def test_cuda_sgd_and_adagrad_state_dtypes(
    op: str, param_dtype: torch.dtype, state_dtype: torch.dtype
) -> None:
    _check_state_dtypes(extension(), op, param_dtype, state_dtype)


# --- One table of scalar preconditions, checked before dispatch ----------------------------

SCALAR_MISTAKES: dict[str, Callable[[Any], None]] = {
    "chunk_size 0": lambda ns: ns.multi_tensor_scale(0, _flag(), [_l(), _l()], 1.0),
    "axpby arg_to_check 2": lambda ns: ns.multi_tensor_axpby(
        64, _flag(), [_l(), _l(), _l()], 1.0, 1.0, 2
    ),
    "adam mode 2": _adam([_l(), _l(), _l(), _l()], mode=2),
    "adam step 0": _adam([_l(), _l(), _l(), _l()], step=0),
    "adam bias_correction given by keyword": lambda ns: ns.multi_tensor_adam(
        64, _flag(), [_l(), _l(), _l(), _l()], 1e-3, 0.9, 0.999, 1e-8, 1, 1, bias_correction=3,
        weight_decay=0.0,
    ),
    "adagrad mode -1": lambda ns: ns.multi_tensor_adagrad(
        64, _flag(), [_l(), _l(), _l()], 1e-2, 1e-10, -1, 0.0
    ),
    "lamb grad_averaging 2": lambda ns: ns.multi_tensor_lamb(
        64, _flag(), [_l(), _l(), _l(), _l()], 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.0, 2, 1,
        torch.ones(1), 1.0, False,
    ),
    "novograd norm_type 1": lambda ns: ns.multi_tensor_novograd(
        64, _flag(), [_l(), _l(), _l()], torch.zeros(1), 1e-3, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1,
        0, 1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("mistake", list(SCALAR_MISTAKES))
def test_amp_C_gives_the_reference_message_on_the_kernel_path(
    cpu_ext: Any, monkeypatch: pytest.MonkeyPatch, mistake: str
) -> None:
    """Through amp_C the compiled kernel never sees the mistake: one message on every path."""
    from amp_fused_ops import amp_C

    call = SCALAR_MISTAKES[mistake]
    with pytest.raises(ValueError) as reference:
        call(_reference)
    # The CPU extension is loaded (cpu_ext): its kernels serve amp_C's CPU calls.
    with pytest.raises(ValueError) as dispatched:
        call(amp_C)
    assert str(dispatched.value) == str(reference.value)
    # The kernel itself raises the same type (its own words).
    with pytest.raises(ValueError):
        call(cpu_ext)


def test_the_preconditions_name_the_arguments_of_every_op() -> None:
    """The scalar arguments an entry's preconditions take from its schema are the reference's
    (Apex's order), so a positional call is checked argument by argument."""
    import inspect

    from amp_fused_ops.ops import _preconditions

    for op in _reference.__all__:
        if op == "update_scale_hysteresis":
            continue
        parameters = list(inspect.signature(getattr(_reference, op)).parameters)
        assert parameters[:3] == ["chunk_size", "noop_flag", "tensor_lists"], op
        assert tuple(parameters[3:]) == _preconditions.rules()[op].arguments, op
