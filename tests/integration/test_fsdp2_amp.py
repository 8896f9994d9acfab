"""amp with FSDP2 (DTensor) models and the fused optimizers, two Gloo ranks on the CPU.

* O0 and O1 (float16 and bfloat16) over an FSDP2 model train as over the unsharded model.
* The loss scaler's overflow decision is one decision: an inf in one rank's gradient shard
  skips the step and backs the scale off on both ranks.
* FSDP2's own ``MixedPrecisionPolicy(param_dtype=...)`` with FusedAdam / FusedLAMB trains as
  the unsharded model whose forward and backward run on low-precision copies of the params.
* O2 and O3 (half model, float32 masters outside it) refuse DTensor params at
  ``amp.initialize``, naming the alternatives.

Both ranks see the same batches, so FSDP2's averaged gradients are the unsharded ones:
``(g + g) / 2 == g`` exactly. Element-wise steps (FusedAdam) are then bitwise; FusedLAMB's
norms over shards differ by float32 rounding (see amp-optimizers' test_fsdp2_layerwise.py).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from amp_test_support import exit_passed_rank

from amp_core import amp
from amp_optimizers import FusedAdam, FusedLAMB

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
STEPS = 3
LAMB_TOL = (1e-5, 1e-6)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 5))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(6, 9, generator=gen) for _ in range(STEPS)]


def _shard(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _amp_train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, opt_level: str, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, loss_scale="dynamic",
        half_dtype=None if dtype == torch.float32 else dtype,
        verbosity=0,
    )  # fmt: skip
    for x in _batches():
        optimizer.zero_grad()
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return model, optimizer


def _check_opt_levels() -> None:
    for opt_level, dtype in [("O0", torch.float32), ("O1", torch.float16), ("O1", torch.bfloat16)]:
        name = f"{opt_level} {dtype}"
        ref_model = _model()
        _amp_train(ref_model, FusedAdam(ref_model.parameters(), lr=1e-2), opt_level, dtype)
        ref_scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        amp.close()
        sharded = _shard(_model())
        _amp_train(sharded, FusedAdam(sharded.parameters(), lr=1e-2), opt_level, dtype)
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == ref_scale, name
        amp.close()
        for p, q in zip(sharded.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(_full(p), q.detach(), rtol=0, atol=0, msg=name)


def _check_overflow_agreed(dtype: torch.dtype) -> None:
    """An inf in rank 1's gradient shard only: both ranks skip and halve the scale."""
    sharded = _shard(_model())
    optimizer = FusedAdam(sharded.parameters(), lr=1e-2)
    sharded, optimizer = amp.initialize(
        sharded, optimizer, opt_level="O1", half_dtype=dtype, loss_scale="dynamic", verbosity=0
    )
    before = [_full(p).clone() for p in sharded.parameters()]
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    loss = sharded(_batches()[0]).float().square().mean()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        if dist.get_rank() == 1:
            weight = next(iter(sharded.parameters()))
            weight.grad.to_local()[0, 0] = math.inf  # type: ignore[union-attr]
    optimizer.step()
    after_scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    amp.close()
    # Each rank's own view, then the other rank's: the same decision on both.
    decided = torch.tensor([after_scale])
    gathered = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_gather(gathered, decided)
    assert [g.item() for g in gathered] == [scale / 2] * WORLD, (dtype, gathered)
    for p, old in zip(sharded.parameters(), before, strict=True):
        torch.testing.assert_close(_full(p), old, rtol=0, atol=0, msg=f"{dtype}: stepped")


def _check_mixed_precision_policy() -> None:
    """FSDP2's MixedPrecisionPolicy with the fused optimizers, amp off (O0)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    makers: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], tuple[float, float]]] = {
        "FusedAdam": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01), (0.0, 0.0)),
        "FusedLAMB": (lambda ps: FusedLAMB(ps, lr=1e-2, max_grad_norm=0.05), LAMB_TOL),
    }
    for dtype in (torch.bfloat16, torch.float16):
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for name, (make, (rtol, atol)) in makers.items():
            # Reference: float32 params; forward and backward on low-precision copies of them
            # (what FSDP2 all-gathers), their gradients upcast to float32 for the step.
            reference = _model()
            ref_opt = make(list(reference.parameters()))
            for x in _batches():
                ref_opt.zero_grad()
                named = reference.named_parameters()
                copies = {k: v.detach().to(dtype).requires_grad_() for k, v in named}
                out = torch.func.functional_call(reference, copies, (x.to(dtype),))
                out.float().square().mean().backward()
                for k, p in reference.named_parameters():
                    p.grad = copies[k].grad.float()  # type: ignore[union-attr]
                ref_opt.step()
            sharded = _shard(_model(), mp_policy=policy)
            optimizer = make(list(sharded.parameters()))
            for x in _batches():
                optimizer.zero_grad()
                sharded(x).float().square().mean().backward()
                optimizer.step()
            for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
                assert p.dtype == torch.float32, name  # the sharded params stay float32
                torch.testing.assert_close(
                    _full(p), q.detach(), rtol=rtol, atol=atol, msg=f"{name} {dtype}"
                )


def _check_o2_o3_refused() -> None:
    for opt_level in ("O2", "O3"):
        sharded = _shard(_model())
        optimizer = FusedAdam(sharded.parameters(), lr=1e-2)
        try:
            amp.initialize(sharded, optimizer, opt_level=opt_level, verbosity=0)
        except RuntimeError as error:
            text = str(error)
            assert f"amp.initialize(opt_level='{opt_level}')" in text, text
            assert "DTensor (FSDP2 fully_shard) parameter '0.weight'" in text, text
            assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in text, text
            assert "FusedMixedPrecisionLamb" in text, text
        else:
            raise AssertionError(f"{opt_level} accepted DTensor params")
        finally:
            amp.close()
        # Nothing was cast: the sharded params are float32 still.
        assert all(p.dtype == torch.float32 for p in sharded.parameters()), opt_level


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        _check_o2_o3_refused()
        _check_overflow_agreed(torch.float16)
        _check_overflow_agreed(torch.bfloat16)
        _check_opt_levels()
        _check_mixed_precision_policy()
    finally:
        amp.close()
        dist.destroy_process_group()
    exit_passed_rank()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_amp_with_fsdp2_models() -> None:
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
