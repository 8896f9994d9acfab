"""Adam's written semantics hold on every path: the reference, the CPU kernel, the CUDA kernel.

The element math is one header (csrc/common/adam_math.h) for both compiled paths, and the
reference writes the same formula in PyTorch ops; these cases tell the possible orders
apart by their result, not by a rounding:

* decoupled decay enters the update, as in Apex (``p -= lr * (update + wd * p)``), so an
  infinite parameter becomes nan (torch.optim.AdamW's ``p *= 1 - lr * wd`` would keep inf);
* a weight decay of 0 adds no term at all, so an infinite parameter stays infinite in both
  modes (``0 * inf`` would be nan).

The CUDA kernel runs under ``nox -s cuda_emulation``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from _cpu_extension_helpers import load_from, session_cache
from _kernel_target import EMULATED, extension
from amp_fused_ops.reference import _ops as _reference

# Under the emulation session the CPU kernel is left to `nox -s tests` (no second CPU build).
PATHS = ["reference", "cuda (emulated)"] if EMULATED else ["reference", "cpu"]
pytestmark = pytest.mark.cuda_emulation


@pytest.fixture(scope="module")
def impls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if EMULATED:
        return {"reference": _reference, "cuda (emulated)": extension()}
    return {"reference": _reference, "cpu": load_from(session_cache(tmp_path_factory).cache)}


def _step(impl: Any, mode: int, weight_decay: float, master: bool) -> torch.Tensor:
    """One step on 37 elements whose element 5 is +inf; returns the new params (float32)."""
    g = torch.Generator().manual_seed(0)
    params = torch.randn(37, generator=g)
    params[5] = math.inf
    grads = torch.randn(37, generator=g)
    m, v = torch.zeros(37), torch.zeros(37)
    flag = torch.zeros(1, dtype=torch.int32)
    if master:
        model = params.to(torch.bfloat16)
        one = torch.ones(1)
        impl.multi_tensor_adam_capturable_master(
            64, flag, [[grads], [model], [m], [v], [params]], one * 1e-2, 0.9, 0.999, 1e-8, one,
            mode, 1, weight_decay, one,
        )  # fmt: skip
    else:
        impl.multi_tensor_adam(64, flag, [[grads], [params], [m], [v]], 1e-2, 0.9, 0.999, 1e-8,
                               1, mode, 1, weight_decay)  # fmt: skip
    return params


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("master", [False, True], ids=["adam", "capturable_master"])
def test_decoupled_decay_enters_the_update_as_in_apex(impls, path, master):
    params = _step(impls[path], 1, 0.1, master)
    assert math.isnan(params[5].item())
    assert torch.isfinite(params[:5]).all() and torch.isfinite(params[6:]).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("master", [False, True], ids=["adam", "capturable_master"])
@pytest.mark.parametrize("mode", [0, 1])
def test_weight_decay_zero_adds_no_term(impls, path, master, mode):
    params = _step(impls[path], mode, 0.0, master)
    assert params[5].item() == math.inf
    assert torch.isfinite(params[:5]).all() and torch.isfinite(params[6:]).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", [0, 1])
def test_paths_agree_on_a_float32_step(impls, path, mode):
    """Same formula, same float32 operations: equal up to the last bits (contractions)."""
    want = _step(_reference, mode, 0.01, False)
    got = _step(impls[path], mode, 0.01, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)


# The other optimizers with a weight decay share the rule (csrc/common/optim_math.h): a weight
# decay of 0 adds no term, so an infinite parameter stays infinite.


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", [0, 1])
def test_adagrad_weight_decay_zero_adds_no_term(impls, path, mode):
    g = torch.Generator().manual_seed(1)
    params = torch.randn(37, generator=g)
    params[5] = math.inf
    grads = torch.randn(37, generator=g)
    sums = torch.rand(37, generator=g)
    flag = torch.zeros(1, dtype=torch.int32)
    impls[path].multi_tensor_adagrad(64, flag, [[grads], [params], [sums]], 1e-2, 1e-10, mode,
                                     0.0)  # fmt: skip
    assert params[5].item() == math.inf
    assert torch.isfinite(params[:5]).all() and torch.isfinite(params[6:]).all()
