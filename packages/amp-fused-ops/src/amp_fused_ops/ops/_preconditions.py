"""The preconditions on the scalar arguments of every ``amp_C`` op, in one table.

The reference ops check them with :func:`check_arguments`; the compiled kernels keep their own
``TORCH_CHECK`` guards (a ``ValueError`` too, in other words). A call that succeeds is checked
once, by the kernel that runs it. When an :mod:`amp_fused_ops.amp_C` call fails, ``amp_C``
checks the call against this table (:func:`check`) before the error leaves it, so that a bad
``chunk_size``, ``mode``, ``bias_correction``, ``step`` ... gives the same ``ValueError``, with
the same message, on every path; the kernels' own words reach only a direct call of the
extension. Under ``torch.compile`` ``amp_C`` checks the table before the call.

The per-tensor preconditions (list count and lengths, sizes, dtypes, layouts, devices,
overlap) stay with each path, which walks the tensors anyway; they raise the same exception
type on every path (``tests/test_error_types.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_CHUNK_SIZE", "PRECONDITIONS", "OpPreconditions", "check", "check_arguments"]

# Largest chunk_size every path accepts (the CUDA launcher indexes chunks with int).
MAX_CHUNK_SIZE = 1 << 30

# The arguments of an op before its own: (chunk_size, noop_flag, tensor_lists).
_LEADING = ("chunk_size", "noop_flag", "tensor_lists")


@dataclass(frozen=True)
class OpPreconditions:
    """What the scalar arguments of one op must satisfy.

    Attributes:
        arguments: The op's arguments after ``(chunk_size, noop_flag, tensor_lists)``, in order
            (Apex's signature), so that positional and keyword calls are checked alike.
        choices: ``(name, allowed values)`` of the integer switches.
        step_at_least_one: The op has an integer ``step`` that must be >= 1 when
            ``bias_correction`` is 1 (checked here unless a ``step_tensor`` replaces it: the
            kernels check that one, as reading it here would trace a host read under
            ``torch.compile``).
    """

    arguments: tuple[str, ...]
    choices: tuple[tuple[str, tuple[int, ...]], ...] = ()
    step_at_least_one: bool = False

    def __post_init__(self) -> None:
        for name, _ in self.choices:
            if name not in self.arguments:
                raise ValueError(f"choice {name!r} is not an argument of the op")


_FLAG = (0, 1)
_ADAM_ARGS = (
    "lr",
    "beta1",
    "beta2",
    "eps",
    "step",
    "mode",
    "bias_correction",
    "weight_decay",
)
_ADAM_CHOICES = (("mode", _FLAG), ("bias_correction", _FLAG))
_LAMB_ARGS = (
    "lr",
    "beta1",
    "beta2",
    "epsilon",
    "step",
    "bias_correction",
    "weight_decay",
    "grad_averaging",
    "mode",
    "global_grad_norm",
    "max_grad_norm",
    "use_nvlamb",
)
_LAMB_CHOICES = (("bias_correction", _FLAG), ("grad_averaging", _FLAG), ("mode", _FLAG))

# Every op of Apex's amp_C (csrc/amp_C_frontend.cpp) that takes a chunk_size.
PRECONDITIONS: Mapping[str, OpPreconditions] = {
    "multi_tensor_scale": OpPreconditions(("scale",)),
    "multi_tensor_sgd": OpPreconditions(
        (
            "weight_decay",
            "momentum",
            "dampening",
            "lr",
            "nesterov",
            "first_run",
            "wd_after_momentum",
            "scale",
            "sr_seed",
            "sr_step",
            "step_tensor",
            "lr_tensor",
        )
    ),
    "multi_tensor_axpby": OpPreconditions(
        ("a", "b", "arg_to_check"), choices=(("arg_to_check", (-1, 0, 1)),)
    ),
    "multi_tensor_l2norm": OpPreconditions(("per_tensor",)),
    "multi_tensor_l2norm_mp": OpPreconditions(("per_tensor",)),
    "multi_tensor_l2norm_scale": OpPreconditions(("scale", "per_tensor")),
    "multi_tensor_unscale_l2norm": OpPreconditions(("inv_scale", "per_tensor")),
    "multi_tensor_lamb_stage1_cuda": OpPreconditions(
        (
            "per_tensor_decay",
            "step",
            "beta1",
            "beta2",
            "epsilon",
            "global_grad_norm",
            "max_global_grad_norm",
            "step_tensor",
        )
    ),
    "multi_tensor_lamb_stage2_cuda": OpPreconditions(
        ("per_tensor_param_norm", "per_tensor_update_norm", "lr", "weight_decay", "use_nvlamb")
    ),
    "multi_tensor_adam": OpPreconditions(
        (*_ADAM_ARGS, "step_tensor", "sr_seed", "sr_step", "lr_tensor"),
        choices=_ADAM_CHOICES,
        step_at_least_one=True,
    ),
    # step is a device tensor here: checking it would synchronize the host.
    "multi_tensor_adam_capturable": OpPreconditions(
        (*_ADAM_ARGS, "inv_scale"), choices=_ADAM_CHOICES
    ),
    "multi_tensor_adam_capturable_master": OpPreconditions(
        (*_ADAM_ARGS, "inv_scale"), choices=_ADAM_CHOICES
    ),
    "multi_tensor_adagrad": OpPreconditions(
        ("lr", "epsilon", "mode", "weight_decay", "lr_tensor"), choices=(("mode", _FLAG),)
    ),
    "multi_tensor_novograd": OpPreconditions(
        (
            "grad_norms",
            "lr",
            "beta1",
            "beta2",
            "epsilon",
            "step",
            "bias_correction",
            "weight_decay",
            "grad_averaging",
            "mode",
            "norm_type",
            "step_tensor",
            "lr_tensor",
        ),
        choices=(*_LAMB_CHOICES, ("norm_type", (0, 2))),
    ),
    "multi_tensor_lamb": OpPreconditions(
        (*_LAMB_ARGS, "step_tensor", "lr_tensor"), choices=_LAMB_CHOICES
    ),
    "multi_tensor_lamb_mp": OpPreconditions(
        (*_LAMB_ARGS, "found_inf", "inv_scale"), choices=_LAMB_CHOICES
    ),
}


def check_chunk_size(op: str, chunk_size: Any) -> None:
    """Raise ``ValueError`` unless ``chunk_size`` is an int in [1, 2**30]."""
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or not 1 <= chunk_size <= MAX_CHUNK_SIZE
    ):
        raise ValueError(
            f"{op}: chunk_size must be an int in [1, 2**30], got {chunk_size!r}; "
            "Apex's default is 2048 * 32"
        )


def check_arguments(op: str, values: Mapping[str, Any]) -> None:
    """Check the scalar arguments ``values`` (by name) of ``op`` against its row of the table.

    Args:
        op: The op's name (a key of :data:`PRECONDITIONS`).
        values: Argument values by name; arguments not given are not checked.

    Raises:
        ValueError: A switch is out of range, or ``step`` is below 1 with bias correction.
    """
    rule = PRECONDITIONS[op]
    for name, allowed in rule.choices:
        if name in values and values[name] not in allowed:
            raise ValueError(f"{op}: {name} must be one of {list(allowed)}, got {values[name]!r}")
    if (
        rule.step_at_least_one
        and values.get("bias_correction") == 1
        and values.get("step_tensor") is None
    ):
        step = values.get("step")
        if isinstance(step, (int, float)) and step < 1:
            raise ValueError(f"{op}: step must be >= 1 when bias_correction is on, got {step}")


def check(op: str, chunk_size: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Check a call ``op(chunk_size, noop_flag, tensor_lists, *args, **kwargs)`` before dispatch.

    Raises:
        ValueError: ``chunk_size`` out of [1, 2**30], or a scalar argument breaks the op's
            row of :data:`PRECONDITIONS`.
    """
    check_chunk_size(op, chunk_size)
    rule = PRECONDITIONS.get(op)
    if rule is None:
        return
    values = dict(zip(rule.arguments, args, strict=False))
    values.update((k, v) for k, v in kwargs.items() if k not in _LEADING)
    check_arguments(op, values)
