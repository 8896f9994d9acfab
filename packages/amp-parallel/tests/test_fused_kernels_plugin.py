"""amp-fused-ops plugs into SyncBatchNorm's statistics and the bucket flatten, when installed.

amp-fused-ops is an optional dependency (the ``kernels`` extra): with it, ``local_moments``
and ``flatten`` / ``unflatten`` call its functions; without it, PyTorch's. The results agree
up to float rounding either way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from torch._utils import _flatten_dense_tensors

from amp_parallel import _comm, _syncbn_function


@pytest.fixture
def without_amp_fused_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make ``import amp_fused_ops`` fail, and forget what the lazy imports found."""
    monkeypatch.setitem(sys.modules, "amp_fused_ops", None)  # None in sys.modules: ImportError
    _syncbn_function.fused_syncbn.cache_clear()
    _comm.fused_flatten.cache_clear()
    yield
    _syncbn_function.fused_syncbn.cache_clear()
    _comm.fused_flatten.cache_clear()


def _moments_by_formula(x: torch.Tensor, channel_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dims = _syncbn_function.reduce_dims(x, channel_last)
    var, mean = torch.var_mean(x.double(), dim=dims, correction=0)
    count = x.numel() // mean.numel()
    return mean, var * count


def test_kernels_are_found_when_installed():
    amp_fused_ops = pytest.importorskip("amp_fused_ops")
    _syncbn_function.fused_syncbn.cache_clear()
    _comm.fused_flatten.cache_clear()
    assert _syncbn_function.fused_syncbn() is amp_fused_ops.syncbn
    assert _comm.fused_flatten() == (amp_fused_ops.flatten, amp_fused_ops.unflatten)


def test_without_amp_fused_ops_pytorch_does_the_work(without_amp_fused_ops):
    assert _syncbn_function.fused_syncbn() is None
    assert _comm.fused_flatten() is None
    x = torch.randn(5, 3, 4)
    mean, m2, count = _syncbn_function.local_moments(x, channel_last=False)
    want_mean, want_m2 = _moments_by_formula(x, channel_last=False)
    assert count == 20
    torch.testing.assert_close(mean, want_mean.float())
    torch.testing.assert_close(m2, want_m2.float())
    tensors = [torch.randn(2, 3), torch.randn(4)]
    flat = _comm.flatten(tensors)
    assert torch.equal(flat, _flatten_dense_tensors(tensors))
    views = _comm.unflatten(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(views, tensors, strict=True))


@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_moments_agree_with_and_without_the_kernels(channel_last, dtype):
    pytest.importorskip("amp_fused_ops")
    _syncbn_function.fused_syncbn.cache_clear()
    x = (torch.randn(6, 4, 3, 2) * 2 + 1).to(dtype)
    x = x.movedim(1, -1) if channel_last else x  # SyncBatchNorm's channel_last input: a view
    mean, m2, count = _syncbn_function.local_moments(x, channel_last)
    want_mean, want_m2 = _moments_by_formula(x, channel_last)
    assert mean.dtype == m2.dtype == torch.float32 and count == 36
    torch.testing.assert_close(mean, want_mean.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m2, want_m2.float(), rtol=1e-5, atol=1e-4)


def test_flatten_copies_a_single_tensor_either_way():
    t = torch.arange(4.0)
    flat = _comm.flatten([t])
    flat.zero_()
    assert torch.equal(t, torch.arange(4.0))
