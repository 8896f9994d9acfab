"""flatten / unflatten (Apex's ``apex_C``) against ``torch._utils``' dense-tensor pair."""

from __future__ import annotations

import pytest
import torch
from amp_test_support import DEVICES
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from amp_fused_ops import flatten, unflatten


def _tensors(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (7,), (), (0, 5), (2, 1, 3), (1,)]
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_flatten_and_unflatten_match_torch(device, dtype):
    tensors = _tensors(device, dtype)
    flat = flatten(tensors)
    expected = _flatten_dense_tensors(tensors)
    assert flat.dtype == dtype and flat.device.type == device and flat.dim() == 1
    assert torch.equal(flat, expected)
    views = unflatten(flat, tensors)
    expected_views = _unflatten_dense_tensors(expected, tensors)
    assert len(views) == len(expected_views) == len(tensors)
    for v, e, t in zip(views, expected_views, tensors, strict=True):
        assert v.shape == e.shape == t.shape
        assert torch.equal(v, e) and torch.equal(v, t)


def test_flatten_copies_even_a_single_tensor():
    # torch's _flatten_dense_tensors returns a view for one tensor; a bucket must not alias
    # the gradient it was filled from.
    t = torch.arange(6.0).view(2, 3)
    flat = flatten([t])
    flat.zero_()
    assert torch.equal(t, torch.arange(6.0).view(2, 3))


def test_flatten_takes_non_contiguous_tensors():
    t = torch.arange(12.0).view(3, 4).t()  # (4, 3), not contiguous
    assert torch.equal(flatten([t, torch.ones(2)]), torch.cat([t.reshape(-1), torch.ones(2)]))


def test_unflatten_returns_views_of_the_buffer():
    tensors = [torch.zeros(2, 2), torch.zeros(3)]
    flat = flatten(tensors)
    views = unflatten(flat, tensors)
    flat.fill_(5.0)
    assert all(torch.equal(v, torch.full_like(v, 5.0)) for v in views)
    assert views[1].data_ptr() == flat.data_ptr() + 4 * flat.element_size()


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="at least one tensor, got an empty list"):
        flatten([])
    with pytest.raises(ValueError, match=r"tensor 1 is torch\.float16 on cpu; group them first"):
        flatten([torch.ones(2), torch.ones(2, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"tensor 0 has layout torch\.sparse_coo"):
        flatten([torch.eye(2).to_sparse()])
    with pytest.raises(ValueError, match=r"1-D tensor of 5 elements .* got shape \(6,\)"):
        unflatten(torch.zeros(6), [torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"got shape \(2, 3\)"):
        unflatten(torch.zeros(2, 3), [torch.zeros(6)])
