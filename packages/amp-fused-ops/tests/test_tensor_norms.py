"""``amp_fused_ops.tensor_norms`` on plain tensors (DTensors: amp-optimizers' FSDP2 tests)."""

from __future__ import annotations

import math

import pytest
import torch

from amp_fused_ops import tensor_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ord", [2.0, math.inf])
def test_norms_of_plain_tensors_match_float64(dtype: torch.dtype, ord: float) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(7, 3, generator=gen).to(dtype), torch.randn(4, generator=gen).to(dtype)]
    expected = torch.stack([torch.linalg.vector_norm(t.double(), ord) for t in tensors]).float()
    got = tensor_norms(tensors, ord)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_no_tensors_give_no_norms() -> None:
    assert tensor_norms([]).shape == (0,)


def test_other_norm_orders_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor_norms: ord must be 2 or math.inf, got 1"):
        tensor_norms([torch.ones(3)], 1)
