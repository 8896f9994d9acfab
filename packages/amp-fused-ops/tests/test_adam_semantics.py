"""Adam's written semantics hold on every path: the reference, the CPU kernel, the CUDA kernel.

The element math is one header (csrc/common/adam_math.h) for both compiled paths, and the
reference writes the same formula in PyTorch ops; these cases tell the possible orders
apart by their result, not by a rounding:

* decoupled decay enters the update, as in Apex (``p -= lr * (update + wd * p)``), so an
  infinite parameter becomes nan (torch.optim.AdamW's ``p *= 1 - lr * wd`` would keep inf);
* a weight decay of 0 adds no term at all, so an infinite parameter stays infinite in both
  modes (``0 * inf`` would be nan).

Each case runs on every path of its op (``_op_paths.py``); the CUDA kernel on a GPU or under
``nox -s cuda_emulation``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from _op_cases import noop_flag
from _op_paths import OpPath, paths
from amp_fused_ops.reference import _ops as _reference

_ADAM_OPS = ("multi_tensor_adam", "multi_tensor_adam_capturable_master")


def _step(
    op: Callable[[str], Any], device: str, mode: int, weight_decay: float, master: bool
) -> torch.Tensor:
    """One step (``op(name)``: the op ``name``, tensors on ``device``) on 37 elements whose
    element 5 is +inf; returns the new params (float32, on the CPU)."""
    g = torch.Generator().manual_seed(0)
    params = torch.randn(37, generator=g)
    params[5] = math.inf
    grads = torch.randn(37, generator=g)
    params, grads = params.to(device), grads.to(device)
    m, v = torch.zeros_like(params), torch.zeros_like(params)
    if master:
        model = params.to(torch.bfloat16)
        one = torch.ones(1, device=device)
        op("multi_tensor_adam_capturable_master")(
            64, noop_flag(0, device), [[grads], [model], [m], [v], [params]], one * 1e-2, 0.9,
            0.999, 1e-8, one, mode, 1, weight_decay, one,
        )  # fmt: skip
    else:
        op("multi_tensor_adam")(64, noop_flag(0, device), [[grads], [params], [m], [v]], 1e-2,
                                0.9, 0.999, 1e-8, 1, mode, 1, weight_decay)  # fmt: skip
    return params.cpu()


@pytest.mark.parametrize("path", paths(*_ADAM_OPS), indirect=True)
@pytest.mark.parametrize("master", [False, True], ids=["adam", "capturable_master"])
def test_decoupled_decay_enters_the_update_as_in_apex(path: OpPath, master: bool) -> None:
    params = _step(path.op, path.device, 1, 0.1, master)
    assert math.isnan(params[5].item())
    assert torch.isfinite(params[:5]).all() and torch.isfinite(params[6:]).all()


@pytest.mark.parametrize("path", paths(*_ADAM_OPS), indirect=True)
@pytest.mark.parametrize("master", [False, True], ids=["adam", "capturable_master"])
@pytest.mark.parametrize("mode", [0, 1])
def test_weight_decay_zero_adds_no_term(path: OpPath, master: bool, mode: int) -> None:
    params = _step(path.op, path.device, mode, 0.0, master)
    assert params[5].item() == math.inf
    assert torch.isfinite(params[:5]).all() and torch.isfinite(params[6:]).all()


@pytest.mark.parametrize("path", paths("multi_tensor_adam"), indirect=True)
@pytest.mark.parametrize("mode", [0, 1])
def test_paths_agree_on_a_float32_step(path: OpPath, mode: int) -> None:
    """Same formula, same float32 operations: equal up to the last bits (contractions)."""
    got = _step(path.op, path.device, mode, 0.01, False)
    want = _step(lambda name: getattr(_reference, name), "cpu", mode, 0.01, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)


# The other optimizers with a weight decay share the rule (csrc/common/optim_math.h): a weight
# decay of 0 adds no term, so an infinite parameter stays infinite.


@pytest.mark.parametrize("path", paths("multi_tensor_adagrad"), indirect=True)
@pytest.mark.parametrize("mode", [0, 1])
def test_adagrad_weight_decay_zero_adds_no_term(path: OpPath, mode: int) -> None:
    g = torch.Generator().manual_seed(1)
    params = torch.randn(37, generator=g)
    params[5] = math.inf
    grads = torch.randn(37, generator=g)
    sums = torch.rand(37, generator=g)
    params, grads, sums = (t.to(path.device) for t in (params, grads, sums))
    path.op("multi_tensor_adagrad")(64, path.flag(), [[grads], [params], [sums]], 1e-2, 1e-10,
                                    mode, 0.0)  # fmt: skip
    params = params.cpu()
    assert params[5].item() == math.inf
    assert torch.isfinite(params[:5]).all() and torch.isfinite(params[6:]).all()
