"""What the tests know of each op of the registry, declared once and keyed by its name.

Every op of :data:`amp_fused_ops.ops._registry.REGISTRY` has one :class:`OpCase` here: a
sample call with the schema's arguments, the arguments the op writes in place, the
tolerances its kernels are held to against the pure-PyTorch reference, and whether a
compiled CPU kernel exists. The generic tests (``test_op_registry.py``,
``test_dispatcher_ops.py``) run every entry through every path, and
``test_every_registered_op_has_a_case`` fails when an op of the registry has no entry, so
adding an op means one registry entry, its kernels and one entry here.

The tolerance tables shared by the kernel tests live here too, so each is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from _op_errors import ERRORS, ErrorInput

Tolerance = dict[str, float]

# A kernel's result against the fp32 reference, both rounded to the output dtype: within two
# roundings of that dtype (2 ulps: 2 * 2**-10 for fp16; bf16 1.6e-2 as torch.testing's).
TWO_ROUNDINGS: Mapping[torch.dtype, Tolerance] = MappingProxyType(
    {
        torch.float32: {"rtol": 1e-5, "atol": 1e-6},
        torch.float16: {"rtol": 2 * 2.0**-10, "atol": 1e-5},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
    }
)
# Within one rounding of the output dtype: the element math is a single operation.
ONE_ROUNDING: Mapping[torch.dtype, Tolerance] = MappingProxyType(
    {
        torch.float32: {"rtol": 1e-5, "atol": 1e-6},
        torch.float16: {"rtol": 1e-3, "atol": 1e-5},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
    }
)


# The ways an op runs (``_op_paths.py``): its pure-PyTorch reference, the C++ CPU kernel, the
# CUDA kernel (on a GPU, or its emulated build on the CPU).
PATHS = ("reference", "cpu", "cuda")
REFERENCE_ONLY = frozenset({"reference"})

# The paths of the norm and SyncBN ops (``amp_fused_ops.ops._kernel_ops.KERNEL_OPS``): the norms
# have a C++ CPU kernel, the SyncBN ops a CUDA kernel only (CPU tensors take the reference).
_SYNCBN_PATHS = frozenset({"reference", "cuda"})
KERNEL_OP_PATHS: dict[str, frozenset[str]] = {
    "norm_forward": frozenset(PATHS),
    "norm_backward": frozenset(PATHS),
    "syncbn_welford_mean_var": _SYNCBN_PATHS,
    "syncbn_welford_parallel": _SYNCBN_PATHS,
    "syncbn_forward": _SYNCBN_PATHS,
    "syncbn_reduce": _SYNCBN_PATHS,
    "syncbn_backward": _SYNCBN_PATHS,
}


def noop_flag(value: int = 0, device: str | torch.device = "cpu") -> Tensor:
    """Apex's overflow buffer: a one-element int32 tensor holding ``value``."""
    return torch.full((1,), value, dtype=torch.int32, device=device)


def _lists(seed: int, dtype: torch.dtype = torch.float32, positive: bool = False) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(size, generator=gen) for size in (5, 3)]
    return [(t.abs() if positive else t).to(dtype) for t in tensors]


def _zeros() -> list[Tensor]:
    return [torch.zeros(5), torch.zeros(3)]


def _one(value: float) -> Tensor:
    return torch.tensor([value])


@dataclass(frozen=True)
class OpCase:
    """The test declaration of one registry op.

    Attributes:
        sample: One call with the schema's arguments (the tensor lists as separate arguments),
            on CPU tensors; a new call each time (the op writes some of them).
        writes: The arguments the op writes in place, as the schema must mark them.
        tolerances: Per dtype, how close a kernel's results must be to the reference's.
        errors: Calls with one mistake each and what every path raises (``_op_errors.py``).
        paths: The paths that have an implementation of the op (``PATHS``): the reference
            always; ``"cpu"`` where the C++ CPU extension has a kernel (else CPU tensors take
            the reference), ``"cuda"`` where the CUDA extension has one (else CUDA tensors
            take the reference).
    """

    sample: Callable[[], tuple[Any, ...]]
    writes: frozenset[str]
    tolerances: Mapping[torch.dtype, Tolerance] = field(default_factory=lambda: TWO_ROUNDINGS)
    paths: frozenset[str] = frozenset(PATHS)
    errors: tuple[ErrorInput, ...] = ()


def _writes(*names: str) -> frozenset[str]:
    return frozenset(names)


_ADAM_STATE = ("params", "exp_avgs", "exp_avg_sqs")

OP_CASES: dict[str, OpCase] = {
    "multi_tensor_scale": OpCase(
        lambda: (64, noop_flag(), _lists(0), _zeros(), 0.5),
        _writes("noop_flag", "outs"),
        ONE_ROUNDING,
        errors=ERRORS["multi_tensor_scale"],
    ),
    "multi_tensor_sgd": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2), None, 0.0, 0.9, 0.0, 0.1, False,
            False, False, 1.0,
        ),
        _writes("params", "momentum_bufs", "model_copies"),
        errors=ERRORS["multi_tensor_sgd"],
    ),
    "multi_tensor_axpby": OpCase(
        lambda: (64, noop_flag(), _lists(0), _lists(1), _zeros(), 2.0, 3.0, -1),
        _writes("noop_flag", "outs"),
        errors=ERRORS["multi_tensor_axpby"],
    ),
    "multi_tensor_l2norm": OpCase(
        lambda: (64, noop_flag(), _lists(0), True), _writes("noop_flag"),
        errors=ERRORS["multi_tensor_l2norm"],
    ),
    "multi_tensor_l2norm_mp": OpCase(
        lambda: (64, noop_flag(), _lists(0), True), _writes("noop_flag"),
        errors=ERRORS["multi_tensor_l2norm_mp"],
    ),
    "multi_tensor_l2norm_scale": OpCase(
        lambda: (64, noop_flag(), _lists(0), _zeros(), 0.5, True),
        _writes("noop_flag", "outs"),
        paths=REFERENCE_ONLY,  # no kernel: every device takes the reference
        errors=ERRORS["multi_tensor_l2norm_scale"],
    ),
    "multi_tensor_unscale_l2norm": OpCase(
        lambda: (64, noop_flag(), _lists(0), _one(0.5), True), _writes("noop_flag"),
        errors=ERRORS["multi_tensor_unscale_l2norm"],
    ),
    "multi_tensor_lamb_stage1_cuda": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), _zeros(),
            torch.tensor([0.01, 0.01]), 1, 0.9, 0.999, 1e-6, _one(1.0), 1.0,
        ),
        _writes("exp_avgs", "exp_avg_sqs", "updates"),
        errors=ERRORS["multi_tensor_lamb_stage1_cuda"],
    ),
    "multi_tensor_lamb_stage2_cuda": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), torch.tensor([1.0, 2.0]),
            torch.tensor([0.5, 0.7]), 0.01, 0.01, False,
        ),
        _writes("params"),
        errors=ERRORS["multi_tensor_lamb_stage2_cuda"],
    ),
    "multi_tensor_adam": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), 1e-3,
            0.9, 0.999, 1e-8, 1, 1, 1, 0.01,
        ),
        _writes(*_ADAM_STATE),
        errors=ERRORS["multi_tensor_adam"],
    ),
    "multi_tensor_adam_capturable": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True),
            _one(1e-3), 0.9, 0.999, 1e-8, _one(1), 1, 1, 0.01, _one(1.0),
        ),
        _writes("noop_flag", "grads", *_ADAM_STATE),
        errors=ERRORS["multi_tensor_adam_capturable"],
    ),
    "multi_tensor_adam_capturable_master": OpCase(
        lambda: (
            64, noop_flag(), _lists(0, torch.bfloat16), _lists(1, torch.bfloat16), _lists(2),
            _lists(3, positive=True), _lists(1), _one(1e-3), 0.9, 0.999, 1e-8, _one(1), 1, 1,
            0.01, _one(1.0),
        ),
        _writes("noop_flag", *_ADAM_STATE, "masters"),
        errors=ERRORS["multi_tensor_adam_capturable_master"],
    ),
    "multi_tensor_adagrad": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2, positive=True), 0.01, 1e-10, 1,
            0.0,
        ),
        _writes("params", "state_sums"),
        errors=ERRORS["multi_tensor_adagrad"],
    ),
    "multi_tensor_novograd": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2), torch.tensor([1.0, 2.0]), 0.01,
            0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 0, 2,
        ),
        _writes("noop_flag", "params", "exp_avgs", "grad_norms"),
        errors=ERRORS["multi_tensor_novograd"],
    ),
    "multi_tensor_lamb": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), 1e-3,
            0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, _one(1.0), 1.0, False,
        ),
        _writes("noop_flag", *_ADAM_STATE),
        errors=ERRORS["multi_tensor_lamb"],
    ),
    "multi_tensor_lamb_mp": OpCase(
        lambda: (
            64, noop_flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), None,
            _one(1e-3), 0.9, 0.999, 1e-6, _one(1), 1, 0.01, 1, 1, _one(1.0), _one(1.0), False,
            _one(0.0), _one(1.0),
        ),
        _writes("noop_flag", *_ADAM_STATE, "model_params"),
        paths=REFERENCE_ONLY,  # no kernel: every device takes the reference
        errors=ERRORS["multi_tensor_lamb_mp"],
    ),
    "update_scale_hysteresis": OpCase(
        lambda: (
            _one(1024.0), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            _one(0.0), 2.0, 0.5, 2000, 2,
        ),
        _writes("current_scale", "growth_tracker", "hysteresis_tracker"),
        paths=frozenset({"reference", "cuda"}),  # a CUDA kernel only
    ),
}  # fmt: skip


def missing_cases(registered: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """(registry ops without an entry here, entries here that name no registry op)."""
    return sorted(set(registered) - set(OP_CASES)), sorted(set(OP_CASES) - set(registered))
