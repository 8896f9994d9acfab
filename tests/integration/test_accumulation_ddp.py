"""Gradient accumulation under amp and a data-parallel wrapper, two Gloo ranks on the CPU.

The recipe of every data-parallel script: several micro-batches per step, the gradient
all-reduce switched off for all but the last (``no_sync()``, Apex's ``disable_allreduce()``,
FSDP2's ``set_requires_gradient_sync(False)``), each micro-batch's backward inside
``amp.scale_loss`` with or without ``delay_unscale``. Every rank must end with the gradient of
the whole batch (all ranks, all micro-batches) averaged as plain PyTorch gives it, at every
opt level, float16 and bfloat16, with a static and a dynamic loss scale; and an overflow in
one micro-batch of one rank must skip the step and back the scale off on every rank alike.

Each rank runs every case in one process; the parent compares the ranks with each other
(bitwise: after the all-reduce they hold the same numbers) and with a float32 reference of the
whole batch computed without any wrapper.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from amp_test_support import gloo_world_results

from amp_core import amp
from amp_optimizers import FusedAdam
from amp_parallel import DistributedDataParallel as ApexDDP

pytestmark = [pytest.mark.distributed]

WORLD = 2
MICRO = 3  # micro-batches per step on each rank

# name -> how the model is wrapped; every one reduces the gradient of the last micro-batch.
WRAPPERS = (
    "torch",
    "torch-bucket-view",
    "torch-static-graph",
    "torch-bf16-hook",
    "apex",
    "apex-delay-allreduce",
    "apex-fp32-allreduce",
    "apex-predivide",
    "fsdp2",
)
LEVELS = ("O0", "O1", "O2", "O3")
FSDP2_LEVELS = ("O0", "O1")  # O2 and O3 refuse DTensor params (test_fsdp2_amp.py)
DTYPES = (torch.float16, torch.bfloat16)
SCALES = ("static", "dynamic")


def _cases() -> list[tuple[str, str, bool, torch.dtype, str, str]]:
    """(wrapper, level, delay_unscale, dtype, scale, optimizer): torch's SGD everywhere, and
    FusedAdam at O2 (whose step reads the scaled gradients itself: amp's fused path)."""
    cases = []
    for wrapper, level, delay, dtype, scale in itertools.product(
        WRAPPERS, LEVELS, (False, True), DTYPES, SCALES
    ):
        if wrapper == "fsdp2" and level not in FSDP2_LEVELS:
            continue
        cases.append((wrapper, level, delay, dtype, scale, "sgd"))
        if level == "O2":
            cases.append((wrapper, level, delay, dtype, scale, "fused-adam"))
    return cases


def _overflow_cases() -> list[tuple[str, str, bool]]:
    """(wrapper, level, delay_unscale): an inf in rank 1's first micro-batch (float16)."""
    cases = []
    for wrapper, delay in itertools.product(WRAPPERS, (False, True)):
        for level in FSDP2_LEVELS[1:] if wrapper == "fsdp2" else ("O1", "O2"):
            cases.append((wrapper, level, delay))
    return cases


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro-batches: different on every rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)) for _ in range(3)]


def _reference_grads() -> list[torch.Tensor]:
    """The whole batch's gradient, float32, no wrapper: the mean over ranks of the sum over
    micro-batches of ``grad(loss / MICRO)``."""
    model = _model()
    for rank in range(WORLD):
        for x, y in _data(rank):
            (F.mse_loss(model(x), y) / MICRO / WORLD).backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _bf16_compress_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """A compression hook: the bucket all-reduced in bfloat16 (torch's own bf16 hook needs
    NCCL)."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(done: torch.futures.Future[Any]) -> torch.Tensor:
        return buffer.copy_(done.value()[0])

    return future.then(decompress)


# DDP checks the hook's annotations as objects (this module's are strings).
_bf16_compress_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    parallel = torch.nn.parallel.DistributedDataParallel
    if wrapper == "torch":
        return parallel(model)
    if wrapper == "torch-bucket-view":
        return parallel(model, gradient_as_bucket_view=True)
    if wrapper == "torch-static-graph":
        return parallel(model, static_graph=True)
    if wrapper == "torch-bf16-hook":
        wrapped = parallel(model)
        wrapped.register_comm_hook(None, _bf16_compress_hook)
        return wrapped
    if wrapper == "apex":
        return ApexDDP(model)
    if wrapper == "apex-delay-allreduce":
        return ApexDDP(model, delay_allreduce=True)
    if wrapper == "apex-fp32-allreduce":
        return ApexDDP(model, allreduce_always_fp32=True)
    if wrapper == "apex-predivide":
        return ApexDDP(model, gradient_predivide_factor=2.0)
    raise AssertionError(wrapper)


def _sync(
    wrapped: torch.nn.Module, wrapper: str, enabled: bool
) -> contextlib.AbstractContextManager:
    """The wrapper's way of accumulating without the all-reduce (``enabled=False``)."""
    if wrapper == "fsdp2":
        wrapped.set_requires_gradient_sync(enabled)  # type: ignore[operator]
        return contextlib.nullcontext()
    if wrapper.startswith("apex"):
        (wrapped.enable_allreduce if enabled else wrapped.disable_allreduce)()  # type: ignore[operator]
        return contextlib.nullcontext()
    return contextlib.nullcontext() if enabled else wrapped.no_sync()  # type: ignore[operator]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _setup(
    wrapper: str, level: str, dtype: torch.dtype, scale: str, kind: str = "sgd"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    loss_scale: float | str = 128.0 if scale == "static" else "dynamic"
    model = _model()
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer: torch.optim.Optimizer
    if kind == "fused-adam":
        optimizer = FusedAdam(model.parameters(), lr=0.5)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=level, loss_scale=loss_scale, verbosity=0,
        half_dtype=None if level == "O0" else dtype,
    )  # fmt: skip
    wrapped = model if wrapper == "fsdp2" else _wrap(model, wrapper)
    if wrapper == "torch-static-graph":
        # torch's static graph needs one synced backward before a no_sync() one.
        x, _ = _data(dist.get_rank())[0]
        wrapped(x).float().sum().backward()
        optimizer.zero_grad()
    return wrapped, optimizer


def _accumulate(
    wrapped: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    wrapper: str,
    delay: bool,
    inf_micro_batch: int | None = None,
) -> None:
    micro_batches = _data(dist.get_rank())
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with _sync(wrapped, wrapper, enabled=last):
            loss = F.mse_loss(wrapped(x).float(), y) / MICRO
            if i == inf_micro_batch:
                loss = loss * math.inf
            with amp.scale_loss(loss, optimizer, delay_unscale=delay and not last) as scaled:
                scaled.backward()


def _run_case(
    wrapper: str, level: str, delay: bool, dtype: torch.dtype, scale: str, kind: str
) -> Any:
    wrapped, optimizer = _setup(wrapper, level, dtype, scale, kind)
    _accumulate(wrapped, optimizer, wrapper, delay)
    grads = [_full(p.grad).float().clone() for p in amp.master_params(optimizer)]  # type: ignore[arg-type]
    optimizer.step()
    amp.close()
    return grads


def _run_overflow(wrapper: str, level: str, delay: bool) -> Any:
    wrapped, optimizer = _setup(wrapper, level, torch.float16, "dynamic")
    before = [_full(p).float().clone() for p in wrapped.parameters()]
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    inf_micro_batch = 0 if dist.get_rank() == 1 else None
    _accumulate(wrapped, optimizer, wrapper, delay, inf_micro_batch)
    optimizer.step()
    state = amp.state_dict()["loss_scaler0"]
    after = [_full(p).float().clone() for p in wrapped.parameters()]
    amp.close()
    return {"scale_before": scale, "state": state, "before": before, "after": after}


def _apex_docs_example(use_amp: bool) -> list[torch.Tensor]:
    """Apex's documented accumulation loop ("Gradient accumulation across iterations"), two
    steps of three micro-batches, under torch's DDP with ``no_sync()`` for the micro-batches
    that only accumulate; with amp O1 (float16) or plain PyTorch."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if use_amp:
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    iters_to_accumulate = MICRO
    micro_batches = _data(dist.get_rank()) + _data(dist.get_rank() + WORLD)
    for i, (x, y) in enumerate(micro_batches, start=1):
        step_now = i % iters_to_accumulate == 0
        with contextlib.nullcontext() if step_now else wrapped.no_sync():
            loss = F.mse_loss(wrapped(x).float(), y) / iters_to_accumulate
            if not use_amp:
                loss.backward()
            elif step_now:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                with amp.scale_loss(loss, optimizer, delay_unscale=True) as scaled_loss:
                    scaled_loss.backward()
        if step_now:
            optimizer.step()
            optimizer.zero_grad()
    weights = [p.detach().float().clone() for p in model.parameters()]
    amp.close()
    return weights


def _worker(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in _cases():
        try:
            results[repr(case)] = _run_case(*case)
        except Exception as error:
            raise RuntimeError(f"{case}") from error
        dist.barrier()
    for case in _overflow_cases():
        results[repr(("overflow", *case))] = _run_overflow(*case)
        dist.barrier()
    results["apex-docs amp"] = _apex_docs_example(use_amp=True)
    results["apex-docs plain"] = _apex_docs_example(use_amp=False)
    return results


@pytest.fixture(scope="module")
def world_results() -> list[dict[str, Any]]:
    return gloo_world_results(_worker, WORLD)


def _tolerance(wrapper: str, level: str, dtype: torch.dtype) -> float:
    """Largest error allowed, relative to the largest reference gradient."""
    if wrapper == "torch-bf16-hook" or (level != "O0" and dtype == torch.bfloat16):
        return 4e-2  # bfloat16 arithmetic or a bfloat16 all-reduce
    return 1e-5 if level == "O0" else 8e-3


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_rank_ends_with_the_whole_batch_average(
    world_results: list[dict[str, Any]], wrapper: str
) -> None:
    reference = _reference_grads()
    failures = []
    for case in _cases():
        if case[0] != wrapper:
            continue
        _, level, delay, dtype, scale, kind = case
        name = f"{level} {kind} delay_unscale={delay} {dtype} {scale}"
        per_rank = [results[repr(case)] for results in world_results]
        for g0, g1 in zip(*per_rank, strict=True):
            if not torch.equal(g0, g1):
                failures.append(f"{name}: the ranks differ by {(g0 - g1).abs().max():.3g}")
                break
        bound = _tolerance(wrapper, level, dtype) * max(r.abs().max().item() for r in reference)
        for got, want in zip(per_rank[0], reference, strict=True):
            error = (got - want).abs().max().item()
            if not error <= bound:
                failures.append(f"{name}: {error:.3g} from the whole batch (bound {bound:.3g})")
                break
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(
    world_results: list[dict[str, Any]], wrapper: str
) -> None:
    failures = []
    for case in _overflow_cases():
        if case[0] != wrapper:
            continue
        name = f"{case[1]} delay_unscale={case[2]}"
        per_rank = [results[repr(("overflow", *case))] for results in world_results]
        for rank, result in enumerate(per_rank):
            halved = result["scale_before"] / 2
            if result["state"]["loss_scale"] != halved:
                failures.append(f"{name}: rank {rank}'s scale is {result['state']} (not {halved})")
            for old, new in zip(result["before"], result["after"], strict=True):
                if not torch.equal(old, new):
                    failures.append(f"{name}: rank {rank} stepped")
                    break
        if per_rank[0]["state"] != per_rank[1]["state"]:
            failures.append(f"{name}: the ranks' scalers differ: {per_rank[0]['state']}, "
                            f"{per_rank[1]['state']}")  # fmt: skip
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_apex_documented_accumulation_loop_matches_plain_ddp(
    world_results: list[dict[str, Any]],
) -> None:
    """Apex's documented loop, two steps under torch's DDP: every rank holds the weights plain
    PyTorch DDP trains on the same data (O1 float16 tolerance)."""
    amp_weights = [results["apex-docs amp"] for results in world_results]
    plain = world_results[0]["apex-docs plain"]
    for w0, w1 in zip(*amp_weights, strict=True):
        assert torch.equal(w0, w1), "the ranks' weights differ"
    for got, want in zip(amp_weights[0], plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
