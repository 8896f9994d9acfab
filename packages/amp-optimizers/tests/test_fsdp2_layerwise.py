"""The optimizers that reduce over whole tensors, on FSDP2 (DTensor) parameters: two Gloo ranks.

FusedLAMB's trust ratio ``||p|| / ||update||``, FusedNovoGrad's per-tensor gradient norms and
the global gradient norm that both LAMBs clip with are norms of whole tensors; each rank holds
one shard, so the partial sums of squares (maxima for the infinity norm) are all-reduced over
the mesh. A norm taken on the local shard alone would train silently wrong: the norms are
compared with those of the full tensors, and each optimizer's params after a few steps with
those of the same optimizer on the unsharded model.

Tolerance: the sharded norm is ``sqrt(n0**2 + n1**2)`` of the shards' norms instead of one
norm over all elements, and the sharded step runs the ops' PyTorch reference instead of the
compiled CPU kernel; both differ from the unsharded step by float32 rounding only (a few ulps
per step), far below what a rank-local norm changes (percents).
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

from amp_fused_ops import amp_C, multi_tensor_applier
from amp_optimizers import FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
STEPS = 3
# Float32 rounding of the norms (see the module docstring), over STEPS steps.
RTOL, ATOL = 1e-5, 1e-6

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
    # A small max_grad_norm: the global norm clips every step.
    "FusedLAMB_clip_nvlamb": lambda ps: FusedLAMB(
        ps, lr=1e-2, weight_decay=0.0, max_grad_norm=0.05, use_nvlamb=True
    ),
    "FusedLAMB_l2": lambda ps: FusedLAMB(ps, lr=1e-2, adam_w_mode=False, grad_averaging=False),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
    "FusedNovoGrad_inf_inside": lambda ps: FusedNovoGrad(
        ps, lr=1e-2, norm_type=0, reg_inside_moment=True, weight_decay=0.01
    ),
    "FusedNovoGrad_init_zero": lambda ps: FusedNovoGrad(ps, lr=1e-2, init_zero=True),
    "FusedMixedPrecisionLamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, max_grad_norm=0.05),
}


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    # Sizes that do not divide evenly by the world size (FSDP2 pads the last shard), and a
    # last layer whose bias has one element: rank 1's shard of it is empty.
    model = torch.nn.Sequential(
        torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 5), torch.nn.Linear(5, 1)
    )
    return model.to(dtype)


def _batches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(6, 9, generator=gen).to(dtype) for _ in range(STEPS)]


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype = torch.float32
) -> None:
    for x in _batches(dtype):
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        optimizer.step()


def _shard(model: torch.nn.Module, layers: list[int] | None = None) -> torch.nn.Module:
    """``fully_shard`` each Linear (``layers`` only, else all and the root)."""
    from torch.distributed.fsdp import fully_shard

    for i, layer in enumerate(model):
        if isinstance(layer, torch.nn.Linear) and (layers is None or i in layers):
            fully_shard(layer)
    if layers is None:
        fully_shard(model)
    return model


def _assert_params_equal(sharded: torch.nn.Module, reference: torch.nn.Module, msg: str) -> None:
    for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        torch.testing.assert_close(full, q.detach(), rtol=RTOL, atol=ATOL, msg=msg)


def _check_norms() -> None:
    """amp_C's norm ops on DTensors give the norms of the whole tensors (float64 reference)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    mesh_2d = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    gen = torch.Generator().manual_seed(2)
    full = [torch.randn(7, 3, generator=gen), torch.randn(1, generator=gen) * 3]
    full.append(torch.randn(5, generator=gen))
    cases = {
        "Shard(0)": [distribute_tensor(t, mesh, [Shard(0)]) for t in full],
        # Every rank holds the whole tensor: nothing may be summed across ranks.
        "Replicate()": [distribute_tensor(t, mesh, [Replicate()]) for t in full],
        # HSDP-like: replicated over the first mesh dim, sharded over the second (size 1).
        "(Replicate(), Shard(0))": [
            distribute_tensor(t, mesh_2d, [Replicate(), Shard(0)]) for t in full
        ],
        # A plain tensor among DTensors: its own local norm.
        "mixed": [distribute_tensor(full[0], mesh, [Shard(0)]), full[1].clone(), full[2]],
    }
    expected = torch.stack([t.double().norm() for t in full]).float()
    expected_total = torch.cat([t.double().flatten() for t in full]).norm().float()
    for name, xs in cases.items():
        flag = torch.zeros(1, dtype=torch.int32)
        total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [xs], True)
        torch.testing.assert_close(per, expected, rtol=1e-6, atol=0, msg=name)
        torch.testing.assert_close(total, expected_total.reshape(1), rtol=1e-6, atol=0, msg=name)
        assert flag.item() == 0, name
    # An inf in one rank's shard raises the flag on every rank.
    xs = [distribute_tensor(full[0].clone(), mesh, [Shard(0)])]
    if dist.get_rank() == 1:
        xs[0].to_local()[0, 0] = math.inf
    flag = torch.zeros(1, dtype=torch.int32)
    multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [xs], True)
    assert flag.item() == 1, "the flag of an inf on rank 1"


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        _check_norms()
        for name, make in OPTIMIZERS.items():
            reference = _model()
            _train(reference, make(list(reference.parameters())))
            sharded = _shard(_model())
            _train(sharded, make(list(sharded.parameters())))
            assert all(isinstance(p, DTensor) for p in sharded.parameters()), name
            _assert_params_equal(sharded, reference, name)

            # Mixed: layer 0 sharded, the rest plain, in two param groups and in one.
            mixed = _shard(_model(), layers=[0])
            params = list(mixed.parameters())
            assert isinstance(params[0], DTensor) and not isinstance(params[2], DTensor)
            _train(mixed, make([{"params": params[:2]}, {"params": params[2:]}]))
            _assert_params_equal(mixed, reference, f"{name}, two groups")
            mixed = _shard(_model(), layers=[0])
            _train(mixed, make(list(mixed.parameters())))
            _assert_params_equal(mixed, reference, f"{name}, one group")

        # bfloat16 params with float32 masters (FusedMixedPrecisionLamb's own use).
        def make_mp(ps: Any) -> torch.optim.Optimizer:
            return FusedMixedPrecisionLamb(
                ps, lr=1e-2, max_grad_norm=0.05, reduced_precision_dtype=torch.bfloat16
            )

        reference = _model(torch.bfloat16)
        reference_opt = make_mp(list(reference.parameters()))
        _train(reference, reference_opt, torch.bfloat16)
        sharded = _shard(_model(torch.bfloat16))
        sharded_opt = make_mp(list(sharded.parameters()))
        _train(sharded, sharded_opt, torch.bfloat16)
        for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
            master = sharded_opt.state[p]["master_param"]
            assert isinstance(master, DTensor) and master.placements == p.placements
            torch.testing.assert_close(
                master.full_tensor(), reference_opt.state[q]["master_param"], rtol=RTOL, atol=ATOL
            )
    finally:
        dist.destroy_process_group()
    exit_passed_rank()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_layerwise_optimizers_reduce_norms_across_fsdp2_shards() -> None:
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        mp.spawn(_worker, args=(init_file,), nprocs=WORLD, join=True)
