"""Scenarios run inside every rank of a spawned Gloo world (see ``_parallel_launch.run_world``).

Each returns a JSON-able value (usually the largest error against a single-process
reference); the test in the parent process asserts on it. The reference is computed on every
rank from the same seeds, over the full (concatenated) batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from amp_parallel import (
    DistributedDataParallel,
    Reducer,
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
)

SCENARIOS: dict[str, Callable[[], Any]] = {}


def scenario(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        SCENARIOS[name] = fn
        return fn

    return register


def run(name: str) -> Any:
    if name.startswith("ddp:"):
        return ddp_parity(name[4:])
    if name.startswith("syncbn:"):
        return syncbn_parity(name[7:])
    return SCENARIOS[name]()


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def batch(step: int, world: int, per_rank: int = 4) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world * per_rank, 6, generator=g), torch.randn(
        world * per_rank, 3, generator=g
    )


def max_err(a: list[Tensor], b: list[Tensor], scale: float = 1.0) -> float:
    return max(
        float((x.detach().float() - scale * y.detach().float()).abs().max())
        for x, y in zip(a, b, strict=True)
    )


def same_on_all_ranks(tensors: list[Tensor]) -> bool:
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


# name -> (DDP kwargs, expected gradient / full-batch mean gradient); W = world size
DDP_CASES: dict[str, tuple[dict[str, Any], Callable[[int], float]]] = {
    "default": ({}, lambda w: 1.0),
    "message_size_1": ({"message_size": 1}, lambda w: 1.0),
    "message_size_large": ({"message_size": 10**9}, lambda w: 1.0),
    "delay_allreduce": ({"delay_allreduce": True}, lambda w: 1.0),
    "delay_allreduce_small_messages": (
        {"delay_allreduce": True, "message_size": 20},
        lambda w: 1.0,
    ),
    "no_average": ({"gradient_average": False}, lambda w: float(w)),
    "predivide_2": ({"gradient_predivide_factor": 2.0}, lambda w: 1.0),
    "predivide_4_no_average": (
        {"gradient_predivide_factor": 4.0, "gradient_average": False},
        lambda w: w / 4.0,
    ),
    "always_fp32": ({"allreduce_always_fp32": True}, lambda w: 1.0),
    "retain_buffers": ({"retain_allreduce_buffers": True, "message_size": 50}, lambda w: 1.0),
    "two_streams": ({"num_allreduce_streams": 2, "message_size": 30}, lambda w: 1.0),
    "triggers": ({"allreduce_trigger_params": "first_and_last"}, lambda w: 1.0),
    "split_factor_deprecated": ({"gradient_average_split_factor": 2.0}, lambda w: 1.0),
}


def ddp_parity(case: str) -> dict[str, Any]:
    """Three SGD steps; each step's gradients against the full-batch single-process run."""
    kwargs, factor_of = DDP_CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    factor = factor_of(world)
    ref = mlp(0)
    model = mlp(rank)  # ranks start different: the constructor must broadcast rank 0's
    kwargs = dict(kwargs)
    if kwargs.get("allreduce_trigger_params") == "first_and_last":
        params = list(model.parameters())
        kwargs["allreduce_trigger_params"] = [params[2], params[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, **kwargs)
    broadcast_err = max_err(list(model.parameters()), list(ref.parameters()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    errs = []
    for step in range(3):
        x, y = batch(step, world)
        F.mse_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        F.mse_loss(ref(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        errs.append(max_err(grads, [q.grad for q in ref.parameters()], factor))
        for p in model.parameters():
            p.grad.div_(factor)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out = {
        "broadcast_err": broadcast_err,
        "grad_err": max(errs),
        "param_err": max_err(list(model.parameters()), list(ref.parameters())),
        "identical": same_on_all_ranks(list(model.parameters())),
    }
    if kwargs.get("retain_allreduce_buffers"):
        out["buffers"] = len(ddp.allreduce_buffers)
    return out


@scenario("accumulate")
def accumulate() -> float:
    """disable_allreduce for one micro-batch, enable for the next: sum of both averages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = mlp(0), mlp(0)
    ddp = DistributedDataParallel(model)
    for micro, sync in ((0, False), (1, True)):
        ddp.enable_allreduce() if sync else ddp.disable_allreduce()
        x, y = batch(micro, world)
        F.mse_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        F.mse_loss(ref(x), y).backward()
    return max_err([p.grad for p in model.parameters()], [q.grad for q in ref.parameters()])


@scenario("no_sync_local")
def no_sync_local() -> float:
    """With all-reduce disabled, gradients stay local (equal to a local-batch backward)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = mlp(0), mlp(0)
    ddp = DistributedDataParallel(model)
    ddp.disable_allreduce()
    x, y = batch(0, world)
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    F.mse_loss(ddp(xs), ys).backward()
    F.mse_loss(ref(xs), ys).backward()
    return max_err([p.grad for p in model.parameters()], [q.grad for q in ref.parameters()])


def _amp_run(distributed: bool, always_fp32: bool) -> list[Tensor]:
    from amp_core import amp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert next(model.parameters()).dtype == torch.bfloat16
    net = (
        DistributedDataParallel(model, allreduce_always_fp32=always_fp32) if distributed else model
    )
    for step in range(3):
        x, y = batch(step, world)
        if distributed:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = F.mse_loss(net(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in amp.master_params(opt)]


@scenario("amp_o2_masters_from_rank0")
def amp_o2_masters_from_rank0() -> dict[str, Any]:
    """Ranks built with different seeds: after the wrap every rank has rank 0's fp32 masters."""
    from amp_core import amp

    model = mlp(dist.get_rank())  # a different initialization on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    DistributedDataParallel(model)
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    rank0 = [p.detach() for p in mlp(0).parameters()]  # fp32, as built on rank 0
    model_from_masters = all(
        torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), masters, strict=True)
    )
    return {
        "identical": same_on_all_ranks(masters),
        "err": max_err(masters, rank0),
        "model_from_masters": model_from_masters,
    }


@scenario("amp_o2_bf16")
def amp_o2_bf16() -> dict[str, Any]:
    """amp O2 (bf16 model, fp32 masters): masters match a full-batch run within bf16 error."""
    ref = _amp_run(False, False)
    out = {}
    for always_fp32 in (False, True):
        masters = _amp_run(True, always_fp32)
        out[f"fp32={always_fp32}"] = {
            "err": max(
                float(((m - r).abs() / (r.abs() + 1e-2)).max())
                for m, r in zip(masters, ref, strict=True)
            ),
            "identical": same_on_all_ranks(masters),
            "master_dtype": str(masters[0].dtype),
        }
    return out


@scenario("reducer")
def reducer() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = mlp(0), mlp(rank)
    red = Reducer(model)
    broadcast = max_err(list(model.parameters()), list(ref.parameters()))
    x, y = batch(0, world)
    F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    F.mse_loss(ref(x), y).backward()
    red.reduce()
    module_err = max_err([p.grad for p in model.parameters()], [q.grad for q in ref.parameters()])
    grads = [torch.full((3,), float(rank)), [torch.full((2, 2), 2.0 * rank, dtype=torch.float64)]]
    Reducer(grads).reduce()
    mean = (world - 1) / 2
    list_err = max(
        float((grads[0] - mean).abs().max()), float((grads[1][0] - 2 * mean).abs().max())
    )
    return {"broadcast": broadcast, "module": module_err, "list": list_err}


# ---------------------------------------------------------------------------- SyncBatchNorm
SYNCBN_CASES: dict[str, dict[str, Any]] = {
    "equal": {},
    "unequal": {"unequal": True},
    "channel_last": {"channel_last": True, "unequal": True},
    "fuse_relu_z": {"fuse_relu": True, "z": True, "unequal": True},
    "fuse_relu_z_channel_last": {"fuse_relu": True, "z": True, "channel_last": True},
    "2d_input": {"dims": 2, "unequal": True},
    "bf16": {"dtype": torch.bfloat16, "unequal": True},
    "momentum_none": {"momentum": None},
}


def _sizes(world: int, unequal: bool) -> list[int]:
    return [1 + 2 * r for r in range(world)] if unequal else [3] * world


def syncbn_parity(case: str) -> dict[str, float]:
    """SyncBatchNorm over ranks vs BatchNorm over the concatenated batch (2 steps + eval)."""
    cfg = SYNCBN_CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    channel_last, fuse, dims = (
        cfg.get("channel_last", False),
        cfg.get("fuse_relu", False),
        cfg.get("dims", 4),
    )
    dtype = cfg.get("dtype", torch.float32)
    momentum = cfg.get("momentum", 0.1)
    sizes = _sizes(world, cfg.get("unequal", False))
    C = 5
    torch.manual_seed(0)
    ref = (
        nn.BatchNorm2d(C, momentum=momentum) if dims == 4 else nn.BatchNorm1d(C, momentum=momentum)
    )
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    bn = convert_syncbn_model(type(ref)(C, momentum=momentum), channel_last=channel_last)
    assert isinstance(bn, SyncBatchNorm)
    bn.fuse_relu = fuse
    bn.load_state_dict(ref.state_dict())
    errs: dict[str, float] = {}
    tol_scale = 1.0
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        shape = (sum(sizes), C, 3, 2) if dims == 4 else (sum(sizes), C)
        x = torch.randn(shape, generator=g) * 2 + 1
        z = torch.randn(shape, generator=g) if cfg.get("z") else None
        gy = torch.randn(shape, generator=g)
        lo = sum(sizes[:rank])
        part = slice(lo, lo + sizes[rank])

        def layout(t: Tensor) -> Tensor:
            return t.movedim(1, -1).contiguous() if channel_last else t

        xr = layout(x).to(dtype).float()  # the reference sees the same rounded input
        xl = layout(x[part]).to(dtype).requires_grad_()
        zl = layout(z[part]).to(dtype).requires_grad_() if z is not None else None
        xf = layout(x).to(dtype).float().movedim(-1, 1) if channel_last else xr
        xf = xf.detach().requires_grad_()
        zf = z.to(dtype).float().requires_grad_() if z is not None else None
        out_ref = ref(xf)
        if zf is not None:
            out_ref = out_ref + zf
        if fuse:
            out_ref = torch.relu(out_ref)
        (out_ref * gy).sum().backward()
        out = bn(xl, zl)
        assert out.dtype == dtype
        (out.float() * layout(gy[part])).sum().backward()
        unlayout = (lambda t: t.movedim(-1, 1)) if channel_last else (lambda t: t)
        wgrad = torch.stack([bn.weight.grad, bn.bias.grad])
        dist.all_reduce(wgrad)  # each rank holds its share of the weight gradient
        ref_w = torch.stack([ref.weight.grad, ref.bias.grad])
        e = {
            "out": float((unlayout(out.float()) - out_ref[part]).abs().max()),
            "dx": float((unlayout(xl.grad.float()) - xf.grad[part]).abs().max()),
            "dw": float((wgrad - ref_w).abs().max() / ref_w.abs().max()),
            "running_mean": float((bn.running_mean - ref.running_mean).abs().max()),
            "running_var": float((bn.running_var - ref.running_var).abs().max()),
        }
        if zl is not None:
            e["dz"] = float((unlayout(zl.grad.float()) - zf.grad[part]).abs().max())
        for k, v in e.items():
            errs[k] = max(errs.get(k, 0.0), v)
        bn.zero_grad()
        ref.zero_grad()
    bn.eval()
    ref.eval()
    xe = torch.randn((2, C, 3, 2) if dims == 4 else (2, C)) + rank  # eval is local
    out_eval = bn(xe.movedim(1, -1).to(dtype) if channel_last else xe.to(dtype)).float()
    if channel_last:
        out_eval = out_eval.movedim(-1, 1)
    ref_eval = torch.relu(ref(xe)) if fuse else ref(xe)
    errs["eval"] = float((out_eval - ref_eval).abs().max())
    errs["tol_scale"] = tol_scale
    return errs


@scenario("syncbn_group_of_one")
def syncbn_group_of_one() -> float:
    """create_syncbn_process_group(1): each rank normalizes its own batch alone."""
    group = create_syncbn_process_group(1)
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x = torch.randn(4, 3, 2, 2) * (rank + 1)
    bn = SyncBatchNorm(3, process_group=group)
    ref = nn.BatchNorm2d(3)
    return float((bn(x) - ref(x)).abs().max())


@scenario("syncbn_empty_everywhere")
def syncbn_empty_everywhere() -> dict[str, Any]:
    """Every rank's batch is empty: running statistics unchanged, as nn.BatchNorm1d."""
    bn = SyncBatchNorm(3)
    with torch.no_grad():
        bn.running_mean.fill_(1.5)
        bn.running_var.fill_(2.5)
    x = torch.randn(0, 3, requires_grad=True)
    out = bn(x)
    out.sum().backward()
    return {
        "shape": list(out.shape),
        "running_mean": bn.running_mean.tolist(),
        "running_var": bn.running_var.tolist(),
        "tracked": int(bn.num_batches_tracked),
        "dx_shape": list(x.grad.shape),
    }


@scenario("syncbn_one_value_in_total")
def syncbn_one_value_in_total() -> dict[str, Any]:
    """One sample on rank 0, none elsewhere: every rank refuses, as torch's batch norm."""
    bn = SyncBatchNorm(3)
    before = bn.running_var.clone()
    rows = 1 if dist.get_rank() == 0 else 0
    try:
        bn(torch.randn(rows, 3))
    except ValueError as exc:
        message = str(exc)
    else:
        message = "no error"
    unchanged = torch.equal(before, bn.running_var) and int(bn.num_batches_tracked) == 0
    # The next call with a proper batch still works (no rank left waiting in a collective).
    out = bn(torch.randn(2, 3))
    return {"message": message, "unchanged": unchanged, "next_shape": list(out.shape)}


@scenario("syncbn_bad_group_size")
def syncbn_bad_group_size() -> str:
    try:
        create_syncbn_process_group(dist.get_world_size() + 1)
    except ValueError as exc:
        return str(exc)
    return "no error"


@scenario("ddp_wrap_twice")
def ddp_wrap_twice() -> list[str]:
    model = mlp(0)
    ddp = DistributedDataParallel(model)
    msgs = []
    for target in (ddp, model):
        try:
            DistributedDataParallel(target)
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


# ------------------------------------------------------------------------- failing ranks
def _failing_step(stay_alive: bool) -> dict[str, Any]:
    """Rank 1 raises between forward and backward; rank 0 must fail, not hang."""
    import time

    from _parallel_launch import FatalError

    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(mlp(0))
    x, y = batch(0, world)
    loss = F.mse_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank])
    if rank == 1:
        if stay_alive:  # the exception is swallowed and the rank stops taking part
            time.sleep(8)
            return {"role": "stalled"}
        raise FatalError("rank 1 fails mid-step on purpose")
    start = time.monotonic()
    try:
        loss.backward()
    except RuntimeError as exc:
        return {"role": "survivor", "error": str(exc), "seconds": time.monotonic() - start}
    return {"role": "survivor", "error": None, "seconds": time.monotonic() - start}


@scenario("rank_dies")
def rank_dies() -> dict[str, Any]:
    return _failing_step(stay_alive=False)


@scenario("rank_stalls")
def rank_stalls() -> dict[str, Any]:
    return _failing_step(stay_alive=True)
