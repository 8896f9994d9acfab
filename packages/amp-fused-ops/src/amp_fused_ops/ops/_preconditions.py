"""The preconditions on the scalar arguments of every ``amp_C`` op: how they are checked.

Each op's preconditions are part of its registry entry
(:attr:`amp_fused_ops.ops._registry.OpSpec.preconditions`: the scalar arguments in Apex's
order, taken from the schema, the allowed values of its switches and the ``step`` rule);
:func:`rules` lists them by op. The reference ops check them with :func:`check_arguments`; the
compiled kernels keep their own ``TORCH_CHECK`` guards (a ``ValueError`` too, in other words).
A call that succeeds is checked once, by the kernel that runs it. When an
:mod:`amp_fused_ops.amp_C` call fails, ``amp_C`` checks the call against them (:func:`check`)
before the error leaves it, so that a bad ``chunk_size``, ``mode``, ``bias_correction``,
``step`` ... gives the same ``ValueError``, with the same message, on every path; the kernels'
own words reach only a direct call of the extension. Under ``torch.compile`` ``amp_C`` checks
them before the call.

The per-tensor preconditions (list count and lengths, sizes, dtypes, layouts, devices,
overlap) stay with each path, which walks the tensors anyway; they raise the same exception
type on every path (``tests/test_contract_errors.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_CHUNK_SIZE", "OpPreconditions", "check", "check_arguments", "rules"]

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


_rules: Mapping[str, OpPreconditions] | None = None


def rules() -> Mapping[str, OpPreconditions]:
    """Every ``amp_C`` op that takes a chunk size, by name: its entry's preconditions
    (:attr:`amp_fused_ops.ops._registry.OpSpec.preconditions`)."""
    global _rules
    if _rules is None:
        # Imported on first use: the registry imports the references, which import this module.
        from amp_fused_ops.ops._registry import REGISTRY

        _rules = {
            name: spec.preconditions
            for name, spec in REGISTRY.items()
            if spec.preconditions is not None
        }
    return _rules


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
    """Check the scalar arguments ``values`` (by name) of ``op`` against its preconditions.

    Args:
        op: The op's name (a key of :func:`rules`).
        values: Argument values by name; arguments not given are not checked.

    Raises:
        ValueError: A switch is out of range, or ``step`` is below 1 with bias correction.
    """
    rule = rules()[op]
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
            preconditions.
    """
    check_chunk_size(op, chunk_size)
    rule = rules().get(op)
    if rule is None:
        return
    values = dict(zip(rule.arguments, args, strict=False))
    values.update((k, v) for k, v in kwargs.items() if k not in _LEADING)
    check_arguments(op, values)
