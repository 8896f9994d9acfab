"""FusedAdam(capturable=True) on half params without master weights: no float32 copies.

Such params are their own masters. Without a scale to undo (no ``GradScaler``), the device
path steps them with ``multi_tensor_adam_capturable``, which computes in float32 from the
params themselves; before, each param got a float32 copy at every step that
``multi_tensor_adam_capturable_master`` stepped and wrote back. The two must give the same
params and moments bit for bit (in one process and under DDP with two Gloo ranks, where the
ranks must also agree), and the new step must make no float32 copy of a param.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from amp_test_support import gloo_world_results
from torch.utils._python_dispatch import TorchDispatchMode

from amp_optimizers import FusedAdam, _adam_step

STEPS = 4


@contextmanager
def _float32_copies_as_before() -> Iterator[None]:
    """The device path as it was: every half param without a master stepped on a float32 copy
    by the master op (the op lists of a scaled step)."""
    original = _adam_step._device_op_lists

    def copies(lists: list[list[torch.Tensor]], *, unscaled: bool) -> Any:
        del unscaled
        return original(lists, unscaled=False)

    _adam_step._device_op_lists = copies
    try:
        yield
    finally:
        _adam_step._device_op_lists = original


class _CopiesOfParams(TorchDispatchMode):
    """Counts the float32 copies made of ``params`` (``.float()``, ``.to(float32)``)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype):
            source = args[0]
            dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            if dtype == torch.float32 and source.data_ptr() in self.ptrs:
                self.count += 1
        return func(*args, **kwargs)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(
        dtype
    )


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def _train(model: torch.nn.Module, batches: list[torch.Tensor], wrap: Any = None) -> FusedAdam:
    optimizer = FusedAdam(_groups(model), lr=1e-2, weight_decay=0.05, capturable=True)
    net = wrap(model) if wrap is not None else model
    for x in batches:
        optimizer.zero_grad()
        net(x).float().square().mean().backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_params_step_without_copies_as_they_did_with_them(dtype: torch.dtype) -> None:
    model, before = _model(dtype), _model(dtype)
    torch.manual_seed(1)
    batches = [torch.randn(8, 12, dtype=dtype) for _ in range(STEPS)]
    optimizer = _train(model, batches[:-1])
    with _float32_copies_as_before():
        reference = _train(before, batches[:-1])
    # The last step, watched: the reference copies every param, the new step none.
    for opt, net in ((optimizer, model), (reference, before)):
        opt.zero_grad()
        net(batches[-1]).float().square().mean().backward()
    watch = _CopiesOfParams(list(model.parameters()))
    with watch:
        optimizer.step()
    watch_before = _CopiesOfParams(list(before.parameters()))
    with _float32_copies_as_before(), watch_before:
        reference.step()
    assert watch.count == 0
    assert watch_before.count == len(list(before.parameters()))
    for p, q in zip(model.parameters(), before.parameters(), strict=True):
        assert p.dtype == dtype
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], reference.state[q][key]), key
    steps = [group["step"] for group in optimizer.param_groups]
    assert all(float(s) == STEPS for s in steps)


def test_a_scaled_step_of_half_params_still_steps_float32_copies() -> None:
    # With a GradScaler the master op (on copies) keeps the .grad it leaves unscaled once.
    model = _model(torch.bfloat16)
    optimizer = FusedAdam(_groups(model), lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = torch.randn(8, 12, dtype=torch.bfloat16)
    scaler.scale(model(x).float().square().mean()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    watch = _CopiesOfParams(list(model.parameters()))
    with watch:
        scaler.step(optimizer)
    assert watch.count == len(scaled)
    for p, g in zip(model.parameters(), scaled, strict=True):
        torch.testing.assert_close(p.grad, (g.float() / 4.0).to(g.dtype), rtol=0, atol=0)


def _ddp_rank(rank: int) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    model = _model(torch.bfloat16)
    before, reference = copy.deepcopy(model), copy.deepcopy(model).float()
    torch.manual_seed(100 + rank)  # each rank its own batches
    batches = [torch.randn(8, 12) for _ in range(STEPS)]
    _train(model, [x.bfloat16() for x in batches], DistributedDataParallel)
    with _float32_copies_as_before():
        _train(before, [x.bfloat16() for x in batches], DistributedDataParallel)
    torch_adam = torch.optim.AdamW(_groups(reference), lr=1e-2, weight_decay=0.05)
    net = DistributedDataParallel(reference)
    for x in batches:
        torch_adam.zero_grad()
        net(x).square().mean().backward()
        torch_adam.step()
    return {
        key: torch.cat([p.detach().float().reshape(-1) for p in m.parameters()])
        for key, m in (("new", model), ("before", before), ("torch", reference))
    }


@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ranks_agree_under_ddp_and_match_the_copies_and_torch() -> None:
    ranks = gloo_world_results(_ddp_rank, 2)
    for result in ranks:
        assert torch.equal(result["new"], result["before"])
        # bfloat16 params against float32 AdamW: within a few bfloat16 roundings (lr 1e-2).
        torch.testing.assert_close(result["new"], result["torch"], rtol=2e-2, atol=2e-2)
    assert torch.equal(ranks[0]["new"], ranks[1]["new"])
