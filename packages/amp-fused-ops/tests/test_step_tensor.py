"""The ops with Apex's ``int step`` also take the count as ``step_tensor`` (a CPU tensor).

(``multi_tensor_sgd`` takes the ``sr_step`` its bfloat16 stochastic rounding is keyed by so.)

``torch.compile`` makes a Python int read from a param group a constant of the graph, so an
optimizer whose step count changes every step would recompile every step; the optimizers pass
the count as a tensor there instead. The kernels and the reference must read it exactly as
the int: the same bits for ``step=k`` and for ``step=0, step_tensor=tensor(k)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE, extension
from amp_fused_ops import extensions, reference

STEP = 7


def _lists(count: int, *, positive_last: bool = False) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(count)
    shapes = [(5, 3), (70,)]
    lists = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(count)]
    if positive_last:
        lists[-1] = [t.abs() for t in lists[-1]]
    return lists


# Each case: the tensor lists, then the arguments after them with the step count at ``STEP``'s
# place given as a function of (step int); the last argument slot is where step_tensor goes.
CASES: dict[str, tuple[Callable[[], list[list[Tensor]]], Callable[[int], tuple[Any, ...]]]] = {
    "multi_tensor_adam": (
        lambda: _lists(4, positive_last=True),
        lambda step: (1e-3, 0.9, 0.999, 1e-8, step, 1, 1, 0.01),
    ),
    "multi_tensor_lamb": (
        lambda: _lists(4, positive_last=True),
        lambda step: (1e-3, 0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, torch.tensor([1.0]), 1.0, False),
    ),
    "multi_tensor_novograd": (
        lambda: _lists(3),
        lambda step: (torch.tensor([1.0, 2.0]), 0.01, 0.9, 0.999, 1e-8, step, 1, 0.0, 1, 0, 2),
    ),
    "multi_tensor_lamb_stage1_cuda": (
        lambda: [*_lists(3), [t.abs() for t in _lists(4)[3]], [torch.zeros(5, 3), torch.zeros(70)]],
        lambda step: (torch.tensor([0.01, 0.01]), step, 0.9, 0.999, 1e-6, torch.tensor([1.0]), 1.0),
    ),
    # The step stochastic rounding keys its bits by (bfloat16 params, seed 3).
    "multi_tensor_sgd": (
        lambda: [[t.bfloat16() for t in part] for part in _lists(3)],
        lambda step: (0.01, 0.9, 0.0, 0.1, False, False, False, 1.0, 3, step),
    ),
}  # fmt: skip


def _run(op: Callable[..., Any], name: str, step_tensor: Tensor | None, device: str) -> list[Any]:
    make_lists, make_args = CASES[name]
    lists = [[t.to(device) for t in part] for part in make_lists()]
    args = [a.to(device) if isinstance(a, Tensor) else a for a in make_args(STEP)]
    if step_tensor is not None:
        where = next(i for i, a in enumerate(args) if type(a) is int and a == STEP)
        args[where] = 0  # not read when the tensor is given
        args.append(step_tensor)
    op(2048, torch.zeros(1, dtype=torch.int32, device=device), lists, *args)
    return [t.cpu() for part in lists for t in part] + [
        a.cpu() for a in args if isinstance(a, Tensor)
    ]


def _assert_same_bits(a: list[Tensor], b: list[Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _paths() -> dict[str, tuple[Any, str]]:
    return {"reference": (reference, "cpu"), "cpu": (extensions.get_extension("cpu"), "cpu")}


@pytest.mark.parametrize("path", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_step_tensor_gives_the_bits_of_the_int_step(name: str, path: str, dtype: Any) -> None:
    module, device = _paths()[path]
    if module is None:
        pytest.fail(f"the {path} kernels are unavailable")
    op = getattr(module, name)
    by_int = _run(op, name, None, device)
    by_tensor = _run(op, name, torch.tensor(STEP, dtype=dtype), device)
    _assert_same_bits(by_tensor[: len(by_int)], by_int)
    other = _run(op, name, torch.tensor(STEP + 1, dtype=dtype), device)
    assert not all(torch.equal(x, y) for x, y in zip(other, by_int, strict=False))


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernels_read_a_cpu_step_tensor(name: str) -> None:
    op = getattr(extension(), name)
    by_int = _run(op, name, None, DEVICE)
    by_tensor = _run(op, name, torch.tensor(STEP), DEVICE)
    _assert_same_bits(by_tensor[: len(by_int)], by_int)
    if DEVICE == "cuda":  # a count on the device would need a sync to read
        with pytest.raises(ValueError, match="step_tensor must be a one-element CPU tensor"):
            _run(op, name, torch.tensor(STEP, device="cuda"), DEVICE)


@pytest.mark.parametrize("path", ["reference", "cpu"])
@pytest.mark.parametrize(
    ("step_tensor", "match"),
    [
        (torch.tensor([1.0, 2.0]), "step_tensor must be a one-element CPU tensor"),
        (torch.tensor(2.5), "step_tensor must hold a whole number >= 0, got 2.5"),
        (torch.tensor(-1.0), "step_tensor must hold a whole number >= 0"),
    ],
)
def test_a_bad_step_tensor_is_refused(path: str, step_tensor: Tensor, match: str) -> None:
    module, device = _paths()[path]
    with pytest.raises(ValueError, match=f"multi_tensor_adam: {match}"):
        _run(module.multi_tensor_adam, "multi_tensor_adam", step_tensor, device)


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck_with_a_step_tensor(name: str) -> None:
    extensions.get_extension("cpu")
    make_lists, make_args = CASES[name]
    lists = make_lists()
    args = list(make_args(0))
    overload = getattr(torch.ops.amp_fused_ops, name).default
    # The schema's list arguments, an optional one not given (sgd's model_copies) as None.
    slots = [a for a in overload._schema.arguments if "List[Tensor]" in str(a.type)]
    lists = [*lists, *[None] * (len(slots) - len(lists))]
    torch.library.opcheck(
        overload,
        (2048, torch.zeros(1, dtype=torch.int32), *lists, *args),
        {"step_tensor": torch.tensor(STEP)},
    )
