"""Apex's bucket helpers of ``apex.parallel.distributed`` (``flat_dist_call`` and friends).

A collective over several ranks is exercised end to end by the Apex script run under torchrun
(``tests/integration/test_apex_run.py``); here ``call`` is a stand-in that changes its tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from amp_parallel import (
    apply_flat_dist_call,
    extract_tensors,
    flat_dist_call,
    split_by_type,
    split_half_float_double,
)


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, generator=gen),
        torch.randn(2, 2, generator=gen).to(torch.bfloat16),
        torch.randn(4, generator=gen),
        torch.randn(5, generator=gen).double(),
    ]


def test_flat_dist_call_runs_one_call_per_type_and_writes_back() -> None:
    tensors = _tensors()
    expected = [t * 2 + 1 for t in tensors]
    calls: list[tuple[torch.dtype, int, tuple[int, ...]]] = []

    def call(flat: torch.Tensor, a: int, b: int) -> None:
        calls.append((flat.dtype, flat.numel(), (a, b)))
        flat.mul_(a).add_(b)

    flat_dist_call(tensors, call, (2, 1))
    assert calls == [
        (torch.float32, 7, (2, 1)),
        (torch.bfloat16, 4, (2, 1)),
        (torch.float64, 5, (2, 1)),
    ]
    for t, e in zip(tensors, expected, strict=True):
        assert t.dtype == e.dtype and torch.equal(t, e)


def test_all_reduce_averages(monkeypatch) -> None:
    # Four ranks holding the same values: the sum is four times each, the average itself.
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: t.mul_(4))
    bucket = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    apply_flat_dist_call(bucket, dist.all_reduce)
    assert torch.equal(bucket[0], torch.tensor([1.0, 2.0]))
    assert torch.equal(bucket[1], torch.tensor([3.0]))


def test_split_helpers_and_extract_tensors() -> None:
    a, b, c, d = _tensors()
    assert list(split_by_type([a, b, c, d])) == [
        "torch.FloatTensor",
        "torch.BFloat16Tensor",
        "torch.DoubleTensor",
    ]
    half = a.half()
    assert [[t.dtype for t in g] for g in split_half_float_double([d, a, b, half, c])] == [
        [torch.float16],
        [torch.bfloat16],
        [torch.float32, torch.float32],
        [torch.float64],
    ]
    found: list[torch.Tensor] = []
    extract_tensors((a, [b, {"x": 1}, (c,)], 3, None), found)
    assert [id(t) for t in found] == [id(a), id(b), id(c)]
