"""The error inputs of the ``amp_C`` ops: one call with one mistake, and what it must raise.

Each op's case in ``_op_cases.py`` carries its error inputs from here (``OpCase.errors``), as
PyTorch's ``OpInfo`` carries ``error_inputs``. ``test_contract_errors.py`` runs every one on
every path of its op (``_op_paths.py``): each path raises the same exception class, with a
message that matches, in the same words as the reference unless ``same_words`` says
otherwise. A wrong value (a dtype included) is a ``ValueError``, a wrong type a ``TypeError``,
a tensor on the wrong device a ``RuntimeError``, as torch's own ops.

Each call takes the op (Apex's calling convention) and the device of the path's tensors, and
builds fresh tensors there, so a call that writes cannot leak into the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ERRORS", "ErrorInput", "device_words"]

Op = Callable[..., Any]
_H, _B, _F = torch.float16, torch.bfloat16, torch.float32


@dataclass(frozen=True)
class ErrorInput:
    """One mistake in a call of an op, and what every path raises for it.

    Attributes:
        mistake: The mistake, in words (the test's id).
        call: Makes the call: ``call(op, device)`` with tensors on ``device``.
        error: The exception class every path raises (exactly that class).
        match: A regular expression the message matches on every path; ``{device}`` stands for
            the words naming the path's device (``cpu``, ``cuda:0``).
        same_words: Whether every path gives the reference's message word for word; else the
            compiled kernel words it its own way and only ``match`` is common.
        before_kernel: A mistake in a scalar argument, which ``amp_C`` checks before any
            kernel runs: through ``amp_C`` every path gives the reference's words.
        cuda_only: A mistake only a CUDA device can make (a CPU tensor given to it).
        kernels_only: A mistake only the compiled kernels refuse (a layout they cannot walk,
            see the package README): the reference computes the call.
        dispatcher_error: A wrong Python type, which ``amp_C`` checks before any kernel; a
            kernel path called past ``amp_C`` gets the dispatcher's own error of this class.
    """

    mistake: str
    call: Callable[[Op, str], object]
    error: type[Exception]
    match: str
    same_words: bool = True
    before_kernel: bool = False
    cuda_only: bool = False
    kernels_only: bool = False
    dispatcher_error: type[Exception] | None = None


def _choice(op: str, argument: str, value: int) -> str:
    """The message of a switch outside its choices: the reference lists the choices, each
    kernel says what they mean; both name the op, the argument and the value given."""
    return rf"^{op}: {argument} must be .*, got {value}$"


def device_words(device: str) -> str:
    """How a message names ``device``: torch's ``str`` of the device of a tensor made there."""
    return str(torch.empty(0, device=device).device)


def _l(device: str, n: int = 8, dtype: torch.dtype = _F) -> list[Tensor]:
    return [torch.randn(n).to(device=device, dtype=dtype)]


def _flag(device: str, value: int = 0) -> Tensor:
    return torch.full((1,), value, dtype=torch.int32, device=device)


def _one(device: str, value: float = 1.0) -> Tensor:
    return torch.tensor([value], device=device)


def _typed(device: str, *dtypes: torch.dtype) -> list[list[Tensor]]:
    return [_l(device, 8, dtype) for dtype in dtypes]


def _shared(d: str) -> list[list[Tensor]]:
    p = torch.randn(8, device=d)
    return [_l(d), [p], [p], _l(d)]  # params and exp_avgs are one tensor


def _half_overlap(d: str) -> list[list[Tensor]]:
    buf = torch.randn(12, device=d)
    return [[buf[:8]], [buf[4:]]]  # the second list overlaps the first by half


# --- multi_tensor_scale ---------------------------------------------------------------------


def _scale(op: Op, d: str, lists: list[list[Any]], chunk: int = 64, flag: Any = None) -> object:
    return op(chunk, _flag(d) if flag is None else flag, lists, 2.0)


_SCALE = (
    ErrorInput("chunk_size 0", lambda op, d: _scale(op, d, [_l(d), _l(d)], chunk=0), ValueError,
               r"^multi_tensor_scale: chunk_size must be an int in \[1, 2\*\*30\], got 0;",
               before_kernel=True),
    ErrorInput("chunk_size over 2**30",
               lambda op, d: _scale(op, d, [_l(d), _l(d)], chunk=2**30 + 1), ValueError,
               "chunk_size must be an int in", before_kernel=True),
    ErrorInput("noop flag of the wrong dtype",
               lambda op, d: _scale(op, d, [_l(d), _l(d)], flag=torch.zeros(1, device=d)),
               ValueError,
               "noop_flag must be a one-element int32 tensor, got dtype torch.float32"),
    ErrorInput("noop flag of two elements",
               lambda op, d: _scale(op, d, [_l(d), _l(d)],
                                    flag=torch.zeros(2, dtype=torch.int32, device=d)),
               ValueError, "with 2 elements"),
    ErrorInput("noop flag not a tensor", lambda op, d: _scale(op, d, [_l(d), _l(d)], flag=0),
               TypeError, "noop_flag must be a tensor, got int", before_kernel=True,
               dispatcher_error=RuntimeError),
    ErrorInput("noop flag on another device",
               lambda op, d: _scale(op, d, [_l(d), _l(d)],
                                    flag=torch.zeros(1, dtype=torch.int32, device="meta")),
               RuntimeError, r"tensor_lists\[0\]\[0\] is on {device} but noop_flag is on meta"),
    ErrorInput("one list", lambda op, d: _scale(op, d, [_l(d)]), ValueError,
               r"^multi_tensor_scale: expected 2 tensor lists, got 1$"),
    ErrorInput("lists of different lengths", lambda op, d: _scale(op, d, [_l(d), _l(d) * 2]),
               ValueError, r"tensor_lists\[1\] has 2 tensors but tensor_lists\[0\] has 1"),
    ErrorInput("an empty list beside a full one", lambda op, d: _scale(op, d, [_l(d), []]),
               ValueError, r"tensor_lists\[1\] has 0 tensors but tensor_lists\[0\] has 1"),
    ErrorInput("sizes differ at the first position",
               lambda op, d: _scale(op, d, [_l(d, 8), _l(d, 9)]), ValueError,
               r"tensor_lists\[1\]\[0\] has 9 elements but tensor_lists\[0\]\[0\] has 8"),
    ErrorInput("sizes differ at the second position",
               lambda op, d: _scale(op, d, [_l(d) * 2, [*_l(d, 8), *_l(d, 9)]]), ValueError,
               r"tensor_lists\[1\]\[1\] has 9 elements but tensor_lists\[0\]\[1\] has 8"),
    ErrorInput("float64 input", lambda op, d: _scale(op, d, [_l(d, 8, torch.float64), _l(d)]),
               ValueError,
               r"tensor_lists\[0\]\[0\] has dtype torch.float64; "
               r"this list accepts float32, float16, bfloat16"),
    ErrorInput("float64 output", lambda op, d: _scale(op, d, [_l(d), _l(d, 8, torch.float64)]),
               ValueError, r"tensor_lists\[1\]\[0\] has dtype torch.float64"),
    ErrorInput("int64 input", lambda op, d: _scale(op, d, [_l(d, 8, torch.int64), _l(d)]),
               ValueError,
               r"tensor_lists\[0\]\[0\] has dtype torch.int64; "
               r"this list accepts float32, float16, bfloat16"),
    ErrorInput("a number in a tensor list", lambda op, d: _scale(op, d, [_l(d), [3.0]]),
               TypeError, r"tensor_lists\[1\]\[0\] must be a tensor, got float",
               before_kernel=True, dispatcher_error=RuntimeError),
    ErrorInput("a tensor on another device",
               lambda op, d: _scale(op, d, [_l(d), [torch.empty(8, device="meta")]]),
               RuntimeError, r"tensor_lists\[1\]\[0\] is on meta but noop_flag is on {device}"),
    ErrorInput("two dtypes in one list",
               lambda op, d: _scale(op, d, [_l(d) + _l(d, 8, _H), _l(d) * 2]), ValueError,
               r"^multi_tensor_scale: tensor_lists\[0\]\[1\] has dtype torch.float16 but "
               r"tensor_lists\[0\]\[0\] has dtype torch.float32; the tensors of one list must "
               r"share one dtype \(group them by dtype\)$"),
    ErrorInput("a tensor dense in no memory format",
               lambda op, d: _scale(op, d, [[torch.randn(4, 6, device=d)[:, ::2]],
                                            [torch.empty(4, 3, device=d)]]),
               ValueError, "is not dense in any memory format", kernels_only=True),
    ErrorInput("input and output in different memory layouts",
               lambda op, d: _scale(op, d, [
                   [torch.randn(2, 3, 4, 5, device=d).to(memory_format=torch.channels_last)],
                   [torch.empty(2, 3, 4, 5, device=d)]]),
               ValueError, "have different memory layouts", kernels_only=True),
    ErrorInput("output overlapping its input by half",
               lambda op, d: _scale(op, d, _half_overlap(d)), ValueError,
               "share memory; only the very same tensor"),
    ErrorInput("an output on the CPU",
               lambda op, d: _scale(op, d, [_l(d), _l("cpu")]), RuntimeError,
               r"tensor_lists\[1\]\[0\] is on cpu but noop_flag is on cuda:0", cuda_only=True),
    ErrorInput("noop flag on the CPU",
               lambda op, d: _scale(op, d, [_l(d), _l(d)], flag=_flag("cpu")), RuntimeError,
               "noop_flag must be a CUDA tensor|is on cuda:0 but noop_flag is on cpu",
               same_words=False, cuda_only=True),
)  # fmt: skip


# --- multi_tensor_axpby, the norms --------------------------------------------------------


def _axpby(op: Op, lists: list[list[Tensor]], arg_to_check: int = -1) -> object:
    return op(64, _flag(str(lists[0][0].device)), lists, 1.0, 1.0, arg_to_check)


_AXPBY = (
    ErrorInput("arg_to_check 2", lambda op, d: _axpby(op, [_l(d), _l(d), _l(d)], 2), ValueError,
               _choice("multi_tensor_axpby", "arg_to_check", 2), same_words=False,
               before_kernel=True),
    ErrorInput("an int32 output", lambda op, d: _axpby(op, [_l(d), _l(d), _l(d, 8, torch.int32)]),
               ValueError, r"tensor_lists\[2\]\[0\] has dtype torch.int32"),
    ErrorInput("two outputs sharing memory",
               lambda op, d: _axpby(op, [_l(d) * 2, _l(d) * 2,
                                         list(torch.randn(12, device=d).unfold(0, 8, 4))]),
               ValueError, "share memory"),
)  # fmt: skip

_L2NORM = (
    ErrorInput("two lists", lambda op, d: op(64, _flag(d), [_l(d), _l(d)], False), ValueError,
               r"^multi_tensor_l2norm: expected 1 tensor list, got 2$"),
    ErrorInput("a float64 tensor", lambda op, d: op(64, _flag(d), [_l(d, 8, torch.float64)]),
               ValueError, r"tensor_lists\[0\]\[0\] has dtype torch.float64"),
)  # fmt: skip

_L2NORM_MP = (
    ErrorInput("two lists", lambda op, d: op(64, _flag(d), [_l(d), _l(d)], False), ValueError,
               r"^multi_tensor_l2norm_mp: expected 1 tensor list, got 2$"),
)  # fmt: skip

_L2NORM_SCALE = (
    ErrorInput("one list", lambda op, d: op(64, _flag(d), [_l(d)], 0.5, False), ValueError,
               r"^multi_tensor_l2norm_scale: expected 2 tensor lists, got 1$"),
)  # fmt: skip

_UNSCALE_L2NORM = (
    ErrorInput("inv_scale of two elements",
               lambda op, d: op(64, _flag(d), [_l(d)], torch.ones(2, device=d), False),
               ValueError, "inv_scale must have one element, got 2"),
    ErrorInput("inv_scale a string", lambda op, d: op(64, _flag(d), [_l(d)], "x", False),
               TypeError, "inv_scale must be a tensor or a number, got str", before_kernel=True),
)  # fmt: skip


# --- the Adam ops ---------------------------------------------------------------------------


def _adam(op: Op, lists: list[list[Tensor]], step: int = 1, mode: int = 1) -> object:
    return op(64, _flag(str(lists[0][0].device)), lists, 1e-3, 0.9, 0.999, 1e-8, step, mode, 1,
              0.0)  # fmt: skip


def _capturable(op: Op, lists: list[list[Tensor]], lr: Tensor | None = None, mode: int = 1,
                bias_correction: int = 1) -> object:  # fmt: skip
    d = str(lists[0][0].device)
    lr = _one(d, 1e-3) if lr is None else lr
    return op(64, _flag(d), lists, lr, 0.9, 0.999, 1e-8, _one(d), mode, bias_correction, 0.0,
              _one(d))  # fmt: skip


_ADAM = (
    ErrorInput("mode 2", lambda op, d: _adam(op, _typed(d, _F, _F, _F, _F), mode=2), ValueError,
               _choice("multi_tensor_adam", "mode", 2), same_words=False, before_kernel=True),
    ErrorInput("step 0 with bias correction",
               lambda op, d: _adam(op, _typed(d, _F, _F, _F, _F), step=0), ValueError,
               "step must be >= 1", before_kernel=True),
    ErrorInput("bias_correction 3, given by keyword",
               lambda op, d: op(64, _flag(d), _typed(d, _F, _F, _F, _F), 1e-3, 0.9, 0.999, 1e-8,
                                1, 1, bias_correction=3, weight_decay=0.0),
               ValueError, _choice("multi_tensor_adam", "bias_correction", 3), same_words=False,
               before_kernel=True),
    ErrorInput("params and exp_avgs one tensor", lambda op, d: _adam(op, _shared(d)), ValueError,
               r"tensor_lists\[1\]\[0\] and tensor_lists\[2\]\[0\] share memory"),
    ErrorInput("float16 moments", lambda op, d: _adam(op, _typed(d, _F, _F, _H, _H)), ValueError,
               r"tensor_lists\[2\]\[0\] has dtype torch.float16; this list accepts float32$"),
    ErrorInput("bfloat16 moments with bfloat16 params",
               lambda op, d: _adam(op, _typed(d, _B, _B, _B, _B)), ValueError,
               r"tensor_lists\[2\]\[0\] has dtype torch.bfloat16; this list accepts float32$"),
)  # fmt: skip

_ADAM_CAPTURABLE = (
    ErrorInput("params and exp_avgs one tensor", lambda op, d: _capturable(op, _shared(d)),
               ValueError, "share memory"),
)  # fmt: skip


def _master_overlap(d: str) -> list[list[Tensor]]:
    params, masters = _half_overlap(d)  # a float32 param overlapping its master by half
    return [_l(d), params, _l(d), _l(d), masters]


_ADAM_CAPTURABLE_MASTER = (
    ErrorInput("four lists", lambda op, d: _capturable(op, _typed(d, _F, _F, _F, _F)),
               ValueError, "expected 5 tensor lists, got 4"),
    ErrorInput("float16 masters", lambda op, d: _capturable(op, _typed(d, _H, _H, _F, _F, _H)),
               ValueError,
               r"tensor_lists\[4\]\[0\] has dtype torch.float16; this list accepts float32$"),
    ErrorInput("mode 2", lambda op, d: _capturable(op, _typed(d, *[_F] * 5), mode=2),
               ValueError, _choice("multi_tensor_adam_capturable_master", "mode", 2),
               same_words=False),
    ErrorInput("bias_correction 2",
               lambda op, d: _capturable(op, _typed(d, *[_F] * 5), bias_correction=2),
               ValueError, _choice("multi_tensor_adam_capturable_master", "bias_correction", 2),
               same_words=False),
    ErrorInput("lr of three elements",
               lambda op, d: _capturable(op, _typed(d, *[_F] * 5), lr=torch.ones(3, device=d)),
               ValueError, "lr must have one element"),
    ErrorInput("exp_avgs and exp_avg_sqs one tensor",
               lambda op, d: _capturable(op, [_l(d), _l(d), *_shared(d)[1:3], _l(d)]),
               ValueError, "share memory"),
    ErrorInput("a param overlapping its master",
               lambda op, d: _capturable(op, _master_overlap(d)), ValueError, "share memory"),
)  # fmt: skip


# --- SGD, Adagrad -----------------------------------------------------------------------------


def _sgd(op: Op, lists: list[list[Tensor]]) -> object:
    d = str(lists[0][0].device)
    return op(64, _flag(d), lists, 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)


def _sgd_state(d: str, param: torch.dtype, state: torch.dtype) -> list[list[Tensor]]:
    return [_l(d, 8, param), _l(d, 8, param), [torch.zeros(8, dtype=state, device=d)]]


_SGD = (
    ErrorInput("two lists", lambda op, d: _sgd(op, _typed(d, _F, _F)), ValueError,
               r"^multi_tensor_sgd: expected 3 or 4 tensor lists, got 2$"),
    ErrorInput("five lists", lambda op, d: _sgd(op, _typed(d, *[_F] * 5)), ValueError,
               "expected 3 or 4 tensor lists, got 5"),
    ErrorInput("sizes differ at one position",
               lambda op, d: _sgd(op, [_l(d, 8), _l(d, 9), _l(d, 8)]), ValueError,
               "same number of elements"),
    ErrorInput("one param twice",
               lambda op, d: _sgd(op, [_l(d) * 2, _l(d) * 2, _l(d) + _l(d)]),
               ValueError, "share memory; a tensor the op writes"),
    ErrorInput("bfloat16 momentum for float16 params",
               lambda op, d: _sgd(op, _sgd_state(d, _H, _B)), ValueError,
               "optimizer state must be float32 or the params' dtype"),
    ErrorInput("float16 momentum for float32 params",
               lambda op, d: _sgd(op, _sgd_state(d, _F, _H)), ValueError,
               "optimizer state must be float32 or the params' dtype"),
)  # fmt: skip


def _adagrad(op: Op, lists: list[list[Tensor]], mode: int = 0) -> object:
    d = str(lists[0][0].device)
    return op(64, _flag(d), lists, 1e-2, 1e-10, mode, 0.0)


_ADAGRAD = (
    ErrorInput("mode 3", lambda op, d: _adagrad(op, _typed(d, _F, _F, _F), mode=3), ValueError,
               _choice("multi_tensor_adagrad", "mode", 3),
               same_words=False, before_kernel=True),
    ErrorInput("mode -1", lambda op, d: _adagrad(op, _typed(d, _F, _F, _F), mode=-1),
               ValueError, _choice("multi_tensor_adagrad", "mode", -1), same_words=False,
               before_kernel=True),
    ErrorInput("float64 grads", lambda op, d: _adagrad(op, _typed(d, torch.float64, _F, _F)),
               ValueError, "this list accepts float32, float16, bfloat16"),
    ErrorInput("float16 sums for bfloat16 params",
               lambda op, d: _adagrad(op, _sgd_state(d, _B, _H)), ValueError,
               "optimizer state must be float32 or the params' dtype"),
    ErrorInput("bfloat16 sums for float32 params",
               lambda op, d: _adagrad(op, _sgd_state(d, _F, _B)), ValueError,
               "optimizer state must be float32 or the params' dtype"),
)  # fmt: skip


# --- LAMB, NovoGrad -----------------------------------------------------------------------------


def _lamb(op: Op, lists: list[list[Tensor]], mode: int = 0, grad_averaging: int = 1,
          bias_correction: int = 1) -> object:  # fmt: skip
    d = str(lists[0][0].device) if lists and lists[0] else "cpu"
    return op(64, _flag(d), lists, 0.1, 0.9, 0.999, 1e-6, 1, bias_correction, 0.0,
              grad_averaging, mode, _one(d), 1.0, False)  # fmt: skip


def _state_rule(name: str, state: int, param: int, dtypes: tuple[torch.dtype, ...]) -> str:
    return (
        rf"^{name}: tensor_lists\[{state}\]\[0\] has dtype {dtypes[state]} but "
        rf"tensor_lists\[{param}\]\[0\] has dtype {dtypes[param]}; optimizer state must be "
        r"float32 or the params' dtype$"
    )


def _lists_of_two_dtypes(d: str) -> list[list[Tensor]]:
    lists = _typed(d, _F, _F, _F, _F)
    lists[0].append(torch.rand(8, dtype=_H, device=d))
    return [lists[0], *([*tensors, torch.rand(8, device=d)] for tensors in lists[1:])]


_LAMB = (
    ErrorInput("mode 2", lambda op, d: _lamb(op, _typed(d, *[_F] * 4), mode=2), ValueError,
               _choice("multi_tensor_lamb", "mode", 2), same_words=False, before_kernel=True),
    ErrorInput("grad_averaging 2",
               lambda op, d: _lamb(op, _typed(d, *[_F] * 4), grad_averaging=2), ValueError,
               _choice("multi_tensor_lamb", "grad_averaging", 2),
               same_words=False, before_kernel=True),
    ErrorInput("bias_correction -1",
               lambda op, d: _lamb(op, _typed(d, *[_F] * 4), bias_correction=-1), ValueError,
               _choice("multi_tensor_lamb", "bias_correction", -1),
               same_words=False, before_kernel=True),
    ErrorInput("three lists", lambda op, d: _lamb(op, _typed(d, _F, _F, _F)), ValueError,
               "expected 4 tensor lists, got 3"),
    ErrorInput("sizes differ at one position",
               lambda op, d: _lamb(op, [_l(d), _l(d), _l(d, 5), _l(d)]), ValueError,
               r"tensor_lists\[2\]\[0\] has 5 elements"),
    ErrorInput("int64 params",
               lambda op, d: _lamb(op, _typed(d, _F, torch.int64, _F, _F)), ValueError,
               r"tensor_lists\[1\]\[0\] has dtype torch.int64"),
    ErrorInput("two dtypes in one list", lambda op, d: _lamb(op, _lists_of_two_dtypes(d)),
               ValueError,
               r"^multi_tensor_lamb: tensor_lists\[0\]\[1\] has dtype torch.float16 but "
               r"tensor_lists\[0\]\[0\] has dtype torch.float32; the tensors of one list must "
               r"share one dtype \(group them by dtype\)$"),
    ErrorInput("moments of two dtypes", lambda op, d: _lamb(op, _typed(d, _H, _H, _F, _H)),
               ValueError,
               r"^multi_tensor_lamb: tensor_lists\[3\]\[0\] has dtype torch.float16 but "
               r"tensor_lists\[2\]\[0\] has dtype torch.float32; the optimizer state lists "
               r"must share one dtype$"),
    ErrorInput("bfloat16 moments for float16 params",
               lambda op, d: _lamb(op, _typed(d, _H, _H, _B, _B)), ValueError,
               _state_rule("multi_tensor_lamb", 2, 1, (_H, _H, _B, _B))),
    ErrorInput("float16 moments for float32 params",
               lambda op, d: _lamb(op, _typed(d, _F, _F, _H, _H)), ValueError,
               _state_rule("multi_tensor_lamb", 2, 1, (_F, _F, _H, _H))),
)  # fmt: skip


def _lamb_mp(op: Op, lists: list[list[Tensor]]) -> object:
    d = str(lists[0][0].device)
    return op(64, _flag(d), lists, _one(d, 1e-3), 0.9, 0.999, 1e-6, _one(d), 1, 0.01, 1, 1,
              _one(d), _one(d), False, _one(d, 0.0), _one(d))  # fmt: skip


_LAMB_MP = (
    ErrorInput("three lists", lambda op, d: _lamb_mp(op, _typed(d, _F, _F, _F)), ValueError,
               "expected 4 or 5 tensor lists, got 3"),
)  # fmt: skip


def _novograd(op: Op, lists: list[list[Tensor]], grad_norms: Any = None, mode: int = 0,
              grad_averaging: int = 1, bias_correction: int = 1,
              norm_type: int = 2) -> object:  # fmt: skip
    d = str(lists[0][0].device)
    if grad_norms is None:
        grad_norms = torch.zeros(len(lists[0]), device=d)
    return op(64, _flag(d), lists, grad_norms, 0.1, 0.9, 0.98, 1e-8, 1, bias_correction, 0.0,
              grad_averaging, mode, norm_type)  # fmt: skip


def _three(d: str) -> list[list[Tensor]]:
    return _typed(d, _F, _F, _F)


_NOVOGRAD = (
    ErrorInput("mode 2", lambda op, d: _novograd(op, _three(d), mode=2), ValueError,
               _choice("multi_tensor_novograd", "mode", 2), same_words=False, before_kernel=True),
    ErrorInput("grad_averaging 3", lambda op, d: _novograd(op, _three(d), grad_averaging=3),
               ValueError, _choice("multi_tensor_novograd", "grad_averaging", 3),
               same_words=False, before_kernel=True),
    ErrorInput("bias_correction 2", lambda op, d: _novograd(op, _three(d), bias_correction=2),
               ValueError, _choice("multi_tensor_novograd", "bias_correction", 2),
               same_words=False, before_kernel=True),
    ErrorInput("norm_type 1", lambda op, d: _novograd(op, _three(d), norm_type=1), ValueError,
               _choice("multi_tensor_novograd", "norm_type", 1),
               same_words=False, before_kernel=True),
    ErrorInput("four lists", lambda op, d: _novograd(op, _typed(d, *[_F] * 4)), ValueError,
               "expected 3 tensor lists, got 4"),
    ErrorInput("grad_norms a list", lambda op, d: _novograd(op, _three(d), grad_norms=[0.0]),
               TypeError, "grad_norms must be a tensor, got list"),
    ErrorInput("grad_norms of two elements",
               lambda op, d: _novograd(op, _three(d), grad_norms=torch.zeros(2, device=d)),
               ValueError, "grad_norms must be a float32 tensor of 1 elements"),
    ErrorInput("float16 grad_norms",
               lambda op, d: _novograd(op, _three(d),
                                       grad_norms=torch.zeros(1, dtype=_H, device=d)),
               ValueError, r"got dtype torch\.float16 with 1 elements"),
    ErrorInput("grad_norms on another device",
               lambda op, d: _novograd(op, _three(d),
                                       grad_norms=torch.zeros(1, device="meta")),
               RuntimeError, "grad_norms is on meta"),
    ErrorInput("grads dense in no memory format",
               lambda op, d: _novograd(op, [[torch.randn(4, 4, device=d)[:, ::2]],
                                            *_typed(d, _F, _F)]),
               ValueError, "is not dense in any memory format", kernels_only=True),
    ErrorInput("two dtypes in one list",
               lambda op, d: _novograd(op, [[*t, torch.rand(8, dtype=_B, device=d)]
                                            for t in _typed(d, _B, _B, _F)]),
               ValueError, r"tensor_lists\[2\]\[1\] has dtype torch.bfloat16 but"),
    ErrorInput("float16 exp_avgs for bfloat16 params",
               lambda op, d: _novograd(op, _typed(d, _B, _B, _H)), ValueError,
               _state_rule("multi_tensor_novograd", 2, 1, (_B, _B, _H))),
    ErrorInput("bfloat16 exp_avgs for float32 params",
               lambda op, d: _novograd(op, _typed(d, _F, _F, _B)), ValueError,
               _state_rule("multi_tensor_novograd", 2, 1, (_F, _F, _B))),
    ErrorInput("the state checked before grad_norms",
               lambda op, d: _novograd(op, _typed(d, _H, _H, _B),
                                       grad_norms=torch.zeros(2, device=d)),
               ValueError, "optimizer state must be float32 or the params' dtype"),
)  # fmt: skip


def _stage1(op: Op, lists: list[list[Tensor]]) -> object:
    d = str(lists[0][0].device)
    return op(64, _flag(d), lists, torch.zeros(1, device=d), 0, 0.9, 0.999, 1e-6, _one(d), 1.0)


def _stage2(op: Op, lists: list[list[Tensor]], norms: int = 1) -> object:
    d = str(lists[0][0].device)
    return op(64, _flag(d), lists, torch.ones(norms, device=d), torch.ones(1, device=d), 0.1,
              0.0, False)  # fmt: skip


_STAGE1 = "multi_tensor_lamb_stage1_cuda"
_LAMB_STAGE1 = (
    ErrorInput("moments of two dtypes", lambda op, d: _stage1(op, _typed(d, _H, _H, _F, _H, _F)),
               ValueError,
               rf"^{_STAGE1}: tensor_lists\[3\]\[0\] has dtype torch.float16 but "
               r"tensor_lists\[2\]\[0\] has dtype torch.float32; the optimizer state lists "
               r"must share one dtype$"),
    ErrorInput("bfloat16 moments for float16 params",
               lambda op, d: _stage1(op, _typed(d, _H, _H, _B, _B, _F)), ValueError,
               _state_rule(_STAGE1, 2, 1, (_H, _H, _B, _B, _F))),
    ErrorInput("bfloat16 updates for float16 params",
               lambda op, d: _stage1(op, _typed(d, _H, _H, _F, _F, _B)), ValueError,
               _state_rule(_STAGE1, 4, 1, (_H, _H, _F, _F, _B))),
)  # fmt: skip

_LAMB_STAGE2 = (
    ErrorInput("float16 updates for bfloat16 params",
               lambda op, d: _stage2(op, _typed(d, _B, _H)), ValueError,
               _state_rule("multi_tensor_lamb_stage2_cuda", 1, 0, (_B, _H))),
    ErrorInput("the updates checked before the norms",
               lambda op, d: _stage2(op, _typed(d, _B, _H), norms=5), ValueError,
               "optimizer state must be float32 or the params' dtype"),
)  # fmt: skip


ERRORS: dict[str, tuple[ErrorInput, ...]] = {
    "multi_tensor_scale": _SCALE,
    "multi_tensor_axpby": _AXPBY,
    "multi_tensor_l2norm": _L2NORM,
    "multi_tensor_l2norm_mp": _L2NORM_MP,
    "multi_tensor_l2norm_scale": _L2NORM_SCALE,
    "multi_tensor_unscale_l2norm": _UNSCALE_L2NORM,
    "multi_tensor_adam": _ADAM,
    "multi_tensor_adam_capturable": _ADAM_CAPTURABLE,
    "multi_tensor_adam_capturable_master": _ADAM_CAPTURABLE_MASTER,
    "multi_tensor_sgd": _SGD,
    "multi_tensor_adagrad": _ADAGRAD,
    "multi_tensor_lamb": _LAMB,
    "multi_tensor_lamb_mp": _LAMB_MP,
    "multi_tensor_novograd": _NOVOGRAD,
    "multi_tensor_lamb_stage1_cuda": _LAMB_STAGE1,
    "multi_tensor_lamb_stage2_cuda": _LAMB_STAGE2,
}
