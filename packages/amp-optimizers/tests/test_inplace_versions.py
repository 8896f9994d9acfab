"""A step of the fused optimizers is an in-place update to autograd, as torch.optim's is.

A graph built before ``step()`` and backpropagated after it must fail with autograd's "modified
by an inplace operation" error instead of silently using the new weights; torch.optim's
optimizers raise it because ATen's in-place ops bump the params' version counters. Checked on
the compiled CPU kernels (which write through raw pointers) and on the reference path
(``amp_fused_ops.extensions.use_reference()``, its calls counted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from amp_fused_ops import extensions
from amp_optimizers import FusedAdam, FusedSGD

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "torch.optim.SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    "FusedSGD-no-momentum": lambda ps: FusedSGD(ps, lr=0.1),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=0.1),
    "FusedAdam-capturable": lambda ps: FusedAdam(ps, lr=0.1, capturable=True),
}
# The amp_C op each fused optimizer runs here.
OPS = {
    "FusedSGD": "multi_tensor_sgd",
    "FusedSGD-no-momentum": "multi_tensor_sgd",
    "FusedAdam": "multi_tensor_adam",
    "FusedAdam-capturable": "multi_tensor_adam_capturable_master",
}


@pytest.fixture(params=["compiled", "reference"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "compiled" and extensions.get_extension("cpu") is None:
        pytest.skip(f"no compiled CPU extension: {extensions.unavailable_reason('cpu')}")
    yield str(request.param)


def _step(opt: torch.optim.Optimizer, path: str, name: str) -> None:
    """``opt.step()`` on ``path``; on the reference path, the reference of its op ran."""
    if path == "compiled":
        if name in OPS:  # the compiled CPU kernel of the op is the one that runs
            assert hasattr(extensions.get_extension("cpu"), OPS[name])
        opt.step()
        return
    with extensions.use_reference() as calls:
        opt.step()
    if name in OPS:
        assert calls[f"amp_fused_ops::{OPS[name]}"] == 1, calls


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (3, 40)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_backward_after_step_through_a_graph_built_before_raises(path: str, name: str) -> None:
    params = _params()
    opt = OPTIMIZERS[name](params)
    stale = sum((p * p).sum() for p in params)  # the graph saves every param
    sum((p * p * p).sum() for p in params).backward()
    _step(opt, path, name)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_bumps_every_param_version(path: str, name: str) -> None:
    params = _params()
    opt = OPTIMIZERS[name](params)
    sum((p * p).sum() for p in params).backward()
    before = [p._version for p in params]
    _step(opt, path, name)
    assert all(p._version > v for p, v in zip(params, before, strict=True))
