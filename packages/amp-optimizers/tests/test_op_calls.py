"""The fused optimizers call the dispatcher ops with the schemas' own arguments.

Apex's calling convention (``amp_C`` through ``multi_tensor_applier``) is for code written
against Apex; a step of these optimizers goes to ``torch.ops.amp_fused_ops.<op>`` directly:
no call of an ``amp_C`` op in between (Apex's convention, with its per-call checks; whether the
params are DTensors is decided once per step instead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from amp_fused_ops import amp_C
from amp_optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

OPTIMIZERS: dict[str, tuple[Callable[[list[torch.Tensor]], Any], set[str]]] = {
    "FusedAdam": (lambda ps: FusedAdam(ps, lr=1e-2), {"multi_tensor_adam"}),
    "FusedAdam capturable": (
        lambda ps: FusedAdam(ps, lr=1e-2, capturable=True),
        {"multi_tensor_adam_capturable_master"},
    ),
    "FusedSGD": (lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9), {"multi_tensor_sgd"}),
    "FusedLAMB": (
        lambda ps: FusedLAMB(ps, lr=1e-2),
        {"multi_tensor_l2norm", "multi_tensor_lamb"},
    ),
    "FusedNovoGrad": (lambda ps: FusedNovoGrad(ps, lr=1e-2), {"multi_tensor_novograd"}),
    "FusedAdagrad": (lambda ps: FusedAdagrad(ps, lr=1e-2), {"multi_tensor_adagrad"}),
    "FusedMixedPrecisionLamb": (
        lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2),
        {"multi_tensor_l2norm", "multi_tensor_lamb_mp"},
    ),
}


class _OpNames(TorchDispatchMode):
    """Records the names of this package's ops that reach the dispatcher, and the chunk sizes
    (the first argument) of its multi-tensor ops."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.chunk_sizes: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "amp_fused_ops":
            self.names.add(name)
            if name.startswith("multi_tensor_"):
                self.chunk_sizes.add(args[0])
        return func(*args, **kwargs or {})


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_calls_the_ops_without_the_apex_convention(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    through_amp_C: list[str] = []
    for op_name in amp_C.__all__:
        real = getattr(amp_C, op_name)

        def recorded(*args: Any, _real: Any = real, _name: str = op_name, **kwargs: Any) -> Any:
            through_amp_C.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(amp_C, op_name, recorded)
    make, ops = OPTIMIZERS[name]
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator).requires_grad_() for n in (3, 40)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer = make(params)
    before = [p.detach().clone() for p in params]
    with _OpNames() as seen:
        optimizer.step()
    assert seen.names == ops
    assert through_amp_C == []  # the dispatcher ops directly, not Apex's amp_C convention
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_launches_with_the_chunk_size_of_multi_tensor_applier_at_that_step(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Apex's optimizers passed ``multi_tensor_applier.chunk_size`` as it was at each step."""
    from amp_fused_ops import multi_tensor_applier

    make, _ = OPTIMIZERS[name]
    params = [torch.randn(n).requires_grad_() for n in (3, 40)]
    optimizer = make(params)
    for chunk_size in (2048 * 32, 16):
        monkeypatch.setattr(multi_tensor_applier, "chunk_size", chunk_size)
        for p in params:
            p.grad = torch.randn(p.shape)
        with _OpNames() as seen:
            optimizer.step()
        assert seen.chunk_sizes == {chunk_size}
