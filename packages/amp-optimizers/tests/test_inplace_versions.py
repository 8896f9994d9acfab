"""A step of the fused optimizers is an in-place update to autograd, as torch.optim's is.

A graph built before ``step()`` and backpropagated after it must fail with autograd's "modified
by an inplace operation" error instead of silently using the new weights; torch.optim's
optimizers raise it because ATen's in-place ops bump the params' version counters. Checked on
the compiled CPU kernels (which write through raw pointers) and on the reference path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # The loader reads AMP_FUSED_OPS_DISABLE once per process: start over around each test.
    extensions.clear_cache()
    if request.param == "reference":
        monkeypatch.setenv(extensions.DISABLE_ENV, "1")
        assert extensions.get_extension("cpu") is None
    elif extensions.get_extension("cpu") is None:
        pytest.skip(f"no compiled CPU extension: {extensions.unavailable_reason('cpu')}")
    yield str(request.param)
    extensions.clear_cache()


def _compiled_op(name: str) -> Any:
    """The compiled CPU kernel ``amp_C.<name>`` runs, or None (the reference op runs)."""
    return getattr(extensions.get_extension("cpu"), name, None)


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (3, 40)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_backward_after_step_through_a_graph_built_before_raises(path: str, name: str) -> None:
    params = _params()
    opt = OPTIMIZERS[name](params)
    if name in OPS:
        kernel: Any = _compiled_op(OPS[name])
        assert (kernel is None) == (path == "reference")
    stale = sum((p * p).sum() for p in params)  # the graph saves every param
    sum((p * p * p).sum() for p in params).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_bumps_every_param_version(path: str, name: str) -> None:
    params = _params()
    opt = OPTIMIZERS[name](params)
    sum((p * p).sum() for p in params).backward()
    before = [p._version for p in params]
    opt.step()
    assert all(p._version > v for p, v in zip(params, before, strict=True))
