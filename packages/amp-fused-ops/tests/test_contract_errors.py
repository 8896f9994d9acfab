"""One error per mistake, whatever the path: every op's error inputs on every path of the op.

Each error input of an op (``OpCase.errors``, from ``_op_errors.py``) is one call with one
mistake. On each path (``_op_paths.py``: the reference, the C++ CPU kernel, the CUDA kernel or
its emulated build) it raises exactly the declared exception class with a message that
matches, and, unless the kernel words it its own way, the reference's message word for word
(the reference, called directly with the same arguments, is the oracle). A scalar mistake is
caught by ``amp_C`` before any kernel runs, so through ``amp_C`` every path gives the
reference's words. The optimizer state may be float32 or the params' dtype, on every path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

from _kernel_target import EMULATED
from _op_cases import OP_CASES, PATHS
from _op_errors import ErrorInput, device_words
from _op_paths import OpPath, apex_arguments, paths
from amp_fused_ops import amp_C, extensions
from amp_fused_ops.ops import _preconditions
from amp_fused_ops.ops._registry import REGISTRY
from amp_fused_ops.reference import _ops as _reference


def _error_params(select: Callable[[ErrorInput], bool] = lambda e: True,
                  on: tuple[str, ...] = PATHS) -> list[Any]:  # fmt: skip
    """(op, mistake, path) for every error input ``select`` keeps, on the paths of its op."""
    params = []
    for name, case in sorted(OP_CASES.items()):
        for error_input in case.errors:
            if not select(error_input):
                continue
            for param in paths(name):
                path = param.values[0]
                if path not in on or (error_input.cuda_only and (path != "cuda" or EMULATED)):
                    continue
                params.append(
                    pytest.param(name, error_input.mistake, path, marks=param.marks,
                                 id=f"{name}-{error_input.mistake}-{path}")
                )  # fmt: skip
    return params


def _error_input(name: str, mistake: str) -> ErrorInput:
    (error_input,) = [e for e in OP_CASES[name].errors if e.mistake == mistake]
    return error_input


def _raised(error_input: ErrorInput, op: Callable[..., Any], device: str) -> str:
    match = error_input.match.replace("{device}", device_words(device))
    with pytest.raises(error_input.error, match=match) as info:
        error_input.call(op, device)
    assert type(info.value) is error_input.error, (type(info.value), info.value)
    return str(info.value)


def _reference_message(error_input: ErrorInput, name: str, device: str) -> str:
    """What the reference path says: ``amp_C`` on the reference, tensors on ``device``."""
    with extensions.use_reference():
        return _raised(error_input, getattr(amp_C, name), device)


@pytest.mark.parametrize(("name", "mistake", "path"), _error_params(), indirect=["path"])
def test_every_path_raises_the_declared_error(name: str, mistake: str, path: OpPath) -> None:
    error_input = _error_input(name, mistake)
    op = path.op(name)
    if path.name == "reference" and error_input.kernels_only:
        error_input.call(op, path.device)  # the reference computes it
        return
    if path.name != "reference" and error_input.dispatcher_error is not None:
        with pytest.raises(error_input.dispatcher_error):
            error_input.call(op, path.device)
        return
    message = _raised(error_input, op, path.device)
    if error_input.same_words and not error_input.kernels_only and path.name != "reference":
        assert message == _reference_message(error_input, name, path.device)


@pytest.mark.parametrize(
    ("name", "mistake", "path"),
    _error_params(lambda e: e.before_kernel, on=("cpu",) if EMULATED else ("cpu", "cuda")),
    indirect=["path"],
)
def test_amp_C_checks_the_scalars_before_the_kernel(name: str, mistake: str, path: OpPath) -> None:
    """Through ``amp_C`` a kernel never sees a scalar mistake (or an argument of the wrong
    type): on every path the reference's words, though the kernel, called past ``amp_C``,
    words some of them its own way. (``amp_C`` sends the emulated build's CPU tensors to the
    CPU kernels: only a GPU runs the CUDA case.)"""
    error_input = _error_input(name, mistake)  # the path's kernels serve amp_C on its device
    message = _raised(error_input, getattr(amp_C, name), path.device)
    assert message == _reference_message(error_input, name, path.device)


def _switch_params() -> list[Any]:
    return [
        pytest.param(name, argument, allowed, id=f"{name}-{argument}")
        for name in sorted(OP_CASES)
        for argument, allowed in REGISTRY[name].choices
    ]


@pytest.mark.parametrize(("name", "argument", "allowed"), _switch_params())
def test_amp_C_names_the_choices_of_a_switch_given_another_value(
    name: str, argument: str, allowed: tuple[int, ...]
) -> None:
    """Every switch of an entry (``OpSpec.choices``) is checked, in the words of the entry."""
    schema = getattr(torch.ops.amp_fused_ops, name).default._schema
    names = [a.name for a in schema.arguments]
    args = list(OP_CASES[name].sample())
    wrong = max(allowed) + 1
    args[names.index("decay_mode" if argument == "mode" else argument)] = wrong
    message = (
        rf"^{name}: {argument} must be one of \[{', '.join(map(str, allowed))}\], got {wrong}$"
    )
    with extensions.use_reference(), pytest.raises(ValueError, match=message):
        getattr(amp_C, name)(*apex_arguments(name, tuple(args)))


def test_every_op_of_apex_convention_has_error_inputs() -> None:
    for name, case in OP_CASES.items():
        if REGISTRY[name].list_counts:
            assert case.errors, name
            mistakes = [e.mistake for e in case.errors]
            assert len(set(mistakes)) == len(mistakes), name


# --- The optimizer state: float32 or the params' dtype ---------------------------------------

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_STATE_RULE = "optimizer state must be float32 or the params' dtype"


# op -> (the lists' dtypes for a param dtype and a state dtype, the call, the list it writes)
_STATE_STEPS: dict[
    str, tuple[Callable[[Any, Any], tuple[Any, ...]], Callable[..., Any], int]
] = {
    "multi_tensor_sgd": (
        lambda p, s: (p, p, s),
        lambda op, f, lists: op(64, f, lists, 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0),
        2,
    ),
    "multi_tensor_adagrad": (
        lambda p, s: (p, p, s),
        lambda op, f, lists: op(64, f, lists, 1e-2, 1e-10, 0, 0.0),
        2,
    ),
    "multi_tensor_lamb": (
        lambda p, s: (p, p, s, s),
        lambda op, f, lists: op(64, f, lists, 1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.0, 1, 1,
                                torch.ones(1, device=f.device), 1.0, False),
        2,
    ),
    "multi_tensor_novograd": (
        lambda p, s: (p, p, s),
        lambda op, f, lists: op(64, f, lists, torch.ones(1, device=f.device), 1e-3, 0.9, 0.98,
                                1e-8, 1, 1, 0.0, 1, 0, 2),
        2,
    ),
    # The moments (lists 2 and 3) are the state, and the updates (list 4) follow its rule.
    "multi_tensor_lamb_stage1_cuda": (
        lambda p, s: (p, p, s, s, s),
        lambda op, f, lists: op(64, f, lists, torch.zeros(1, device=f.device), 0, 0.9, 0.999,
                                1e-6, torch.ones(1, device=f.device), 1.0),
        4,
    ),
    # The updates (list 1) follow the state's rule; the op writes the params.
    "multi_tensor_lamb_stage2_cuda": (
        lambda p, s: (p, s),
        lambda op, f, lists: op(64, f, lists, torch.ones(1, device=f.device),
                                torch.ones(1, device=f.device), 0.1, 0.0, False),
        0,
    ),
}  # fmt: skip


def _state_params() -> list[Any]:
    params = []
    for name in sorted(_STATE_STEPS):
        for param in paths(name):
            for p in _FLOATS:
                for s in _FLOATS:
                    params.append(
                        pytest.param(name, p, s, param.values[0], marks=param.marks,
                                     id=f"{name}-{p}-{s}-{param.values[0]}".replace("torch.", ""))
                    )  # fmt: skip
    return params


@pytest.mark.parametrize(("name", "param_dtype", "state_dtype", "path"), _state_params(),
                         indirect=["path"])  # fmt: skip
def test_the_state_is_float32_or_the_params_dtype(
    name: str, param_dtype: torch.dtype, state_dtype: torch.dtype, path: OpPath
) -> None:
    """Apex keeps the state in the params' dtype; float32 state is accepted as well, and the
    op then steps (what it writes changes)."""
    dtypes, step, written = _STATE_STEPS[name]
    lists = [
        [torch.rand(8, device=path.device).to(dtype) + 0.5]
        for dtype in dtypes(param_dtype, state_dtype)
    ]
    if state_dtype in (torch.float32, param_dtype):
        before = lists[written][0].clone()
        step(path.op(name), path.flag(), lists)
        assert [t[0].dtype for t in lists] == list(dtypes(param_dtype, state_dtype))
        assert not torch.equal(lists[written][0], before), "the op wrote nothing"
    else:
        with pytest.raises(ValueError, match=_STATE_RULE):
            step(path.op(name), path.flag(), lists)


# --- The preconditions' argument lists ------------------------------------------------------


def test_the_preconditions_name_the_arguments_of_every_op() -> None:
    """The scalar arguments an entry's preconditions take from its schema are the reference's
    (Apex's order), so a positional call is checked argument by argument."""
    for op in _reference.__all__:
        if op == "update_scale_hysteresis":
            continue
        parameters = list(inspect.signature(getattr(_reference, op)).parameters)
        assert parameters[:3] == ["chunk_size", "noop_flag", "tensor_lists"], op
        assert tuple(parameters[3:]) == _preconditions.rules()[op].arguments, op
