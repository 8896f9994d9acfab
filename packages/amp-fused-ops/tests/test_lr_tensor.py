"""The ops with Apex's ``float lr`` also take the learning rate as a tensor (``lr_tensor``).

``torch.optim`` accepts a tensor ``lr``, which under ``torch.compile`` is data of the graph: a
scheduler that changes it recompiles nothing. A float read from a param group would be a
constant of the graph instead, and a tensor given for a ``float`` argument of the schema
fails the trace. The ops therefore take an optional ``lr_tensor`` (read on the host, as
``step_tensor`` is), and Apex's calling convention (``amp_C``) sends a tensor given as ``lr``
there. The kernels and the reference must read it exactly as the float: the same bits for
``lr=x`` and for ``lr=tensor(x)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE, extension
from amp_fused_ops import extensions, reference

LR = 0.0625  # exact in float32, so a float32 tensor holds the float's value


def _lists(count: int, *, positive_last: bool = False) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(count)
    shapes = [(5, 3), (70,)]
    lists = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(count)]
    if positive_last:
        lists[-1] = [t.abs() for t in lists[-1]]
    return lists


# Each case: the tensor lists, then the arguments after them with the learning rate at the
# place of ``lr`` (given as a function of lr).
CASES: dict[str, tuple[Callable[[], list[list[Tensor]]], Callable[[Any], tuple[Any, ...]]]] = {
    "multi_tensor_adam": (
        lambda: _lists(4, positive_last=True),
        lambda lr: (lr, 0.9, 0.999, 1e-8, 3, 1, 1, 0.01),
    ),
    "multi_tensor_sgd": (
        lambda: _lists(3),
        lambda lr: (0.1, 0.9, 0.0, lr, False, False, False, 1.0),
    ),
    "multi_tensor_adagrad": (
        lambda: _lists(3, positive_last=True),
        lambda lr: (lr, 1e-10, 0, 0.1),
    ),
    "multi_tensor_lamb": (
        lambda: _lists(4, positive_last=True),
        lambda lr: (lr, 0.9, 0.999, 1e-6, 3, 1, 0.01, 1, 1, torch.tensor([1.0]), 1.0, False),
    ),
    "multi_tensor_novograd": (
        lambda: _lists(3),
        lambda lr: (torch.tensor([1.0, 2.0]), lr, 0.9, 0.999, 1e-8, 3, 1, 0.0, 1, 0, 2),
    ),
}  # fmt: skip


def _run(op: Callable[..., Any], name: str, lr: Any, device: str, **kwargs: Any) -> list[Tensor]:
    make_lists, make_args = CASES[name]
    lists = [[t.to(device) for t in part] for part in make_lists()]
    args = [a.to(device) if isinstance(a, Tensor) and a is not lr else a for a in make_args(lr)]
    op(2048, torch.zeros(1, dtype=torch.int32, device=device), lists, *args, **kwargs)
    return [t.cpu() for part in lists for t in part]


def _assert_same_bits(a: list[Tensor], b: list[Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _paths() -> dict[str, tuple[Any, str]]:
    return {"reference": (reference, "cpu"), "cpu": (extensions.get_extension("cpu"), "cpu")}


@pytest.mark.parametrize("path", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tensor_lr_gives_the_bits_of_the_float_lr(name: str, path: str, dtype: Any) -> None:
    module, device = _paths()[path]
    if module is None:
        pytest.fail(f"the {path} kernels are unavailable")
    op = getattr(module, name)
    by_float = _run(op, name, LR, device)
    # As Apex's lr argument, and as the schema's own lr_tensor (lr then unread).
    _assert_same_bits(_run(op, name, torch.tensor(LR, dtype=dtype), device), by_float)
    _assert_same_bits(_run(op, name, 0.0, device, lr_tensor=torch.tensor([LR])), by_float)
    other = _run(op, name, torch.tensor(2 * LR), device)
    assert not all(torch.equal(x, y) for x, y in zip(other, by_float, strict=True))


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernels_read_a_tensor_lr(name: str) -> None:
    op = getattr(extension(), name)
    by_float = _run(op, name, LR, DEVICE)
    _assert_same_bits(_run(op, name, torch.tensor(LR), DEVICE), by_float)
    # A tensor on the device is copied to the host, where the kernels read it.
    _assert_same_bits(_run(op, name, torch.tensor(LR, device=DEVICE), DEVICE), by_float)


@pytest.mark.parametrize("path", ["reference", "cpu"])
@pytest.mark.parametrize(
    ("lr_tensor", "match"),
    [
        (torch.tensor([1.0, 2.0]), "lr_tensor must be a one-element floating-point CPU tensor"),
        (torch.tensor(1), "lr_tensor must be a one-element floating-point CPU tensor"),
    ],
)
def test_a_bad_lr_tensor_is_refused(path: str, lr_tensor: Tensor, match: str) -> None:
    module, device = _paths()[path]
    with pytest.raises(ValueError, match=f"multi_tensor_sgd: {match}"):
        _run(module.multi_tensor_sgd, "multi_tensor_sgd", 0.0, device, lr_tensor=lr_tensor)


def test_a_tensor_lr_and_an_lr_tensor_together_are_refused() -> None:
    op = extensions.get_extension("cpu").multi_tensor_adagrad
    with pytest.raises(ValueError, match="multi_tensor_adagrad: lr is a tensor and lr_tensor"):
        _run(op, "multi_tensor_adagrad", torch.tensor(LR), "cpu", lr_tensor=torch.tensor(LR))


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck_with_an_lr_tensor(name: str) -> None:
    extensions.get_extension("cpu")
    make_lists, make_args = CASES[name]
    lists = make_lists()
    args = list(make_args(0.0))
    overload = getattr(torch.ops.amp_fused_ops, name).default
    # The schema's list arguments, an optional one not given (sgd's model_copies) as None.
    slots = [a for a in overload._schema.arguments if "List[Tensor]" in str(a.type)]
    lists = [*lists, *[None] * (len(slots) - len(lists))]
    torch.library.opcheck(
        overload,
        (2048, torch.zeros(1, dtype=torch.int32), *lists, *args),
        {"lr_tensor": torch.tensor(LR)},
    )
