"""The communication hook that gives torch's DDP engine Apex's all-reduce semantics.

``torch.nn.parallel.DistributedDataParallel`` owns bucketing, autograd hooks and the overlap
of communication with backward. It hands each ready bucket to :func:`allreduce_hook`, which
does what Apex's ``allreduce_bucket`` did: optional fp32 up-cast, pre-division, one
``all_reduce`` on the (round-robin) process group, post-multiplication for averaging.

Buckets are launched by the torch reducer strictly in index order and the last one is
flagged by ``GradBucket.is_last()``. The hook uses that to *defer* buckets: it returns a
pending future, keeps the bucket, and launches the collective later, at the latest when the
last bucket arrives, so every future is complete before torch finalizes the backward pass.
This is how ``delay_allreduce`` (everything after backward) and ``allreduce_trigger_params``
(a message is shipped when a trigger parameter's gradient is ready) are implemented.
"""

# No `from __future__ import annotations` here: torch validates the hook's annotations at
# register_comm_hook time and needs real objects (dist.GradBucket, Future[Tensor]).

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from ._comm import ProcessGroup, flatten, unflatten

log = logging.getLogger(__name__)


@dataclass
class HookState:
    """Everything the hook needs; lives on the DDP wrapper (no globals).

    Attributes:
        groups: Process groups used round-robin per message (``num_allreduce_streams``).
        world_size: Size of the process groups.
        gradient_average: Multiply by ``predivide / world_size`` after the all-reduce.
        predivide: ``gradient_predivide_factor``; gradients are divided by it before.
        always_fp32: All-reduce in fp32 whatever the gradient dtype.
        delay: Defer every bucket to the end of backward (``delay_allreduce``).
        trigger_ids: ``id()`` of the trigger parameters, or ``None``.
        retain: Keep the reduced flat buffers in :attr:`buffers`.
        prof: Mark each launch with ``torch.profiler.record_function``.
        timeout_s: The process group's timeout, quoted in error messages.
    """

    groups: list[ProcessGroup | None]
    world_size: int
    gradient_average: bool = True
    predivide: float = 1.0
    always_fp32: bool = False
    delay: bool = False
    trigger_ids: frozenset[int] | None = None
    retain: bool = False
    prof: bool = False
    timeout_s: float | None = None
    rank: int = 0
    buffers: list[Tensor] = field(default_factory=list)
    pending: list[tuple[int, Tensor, Future[Tensor]]] = field(default_factory=list)
    messages_sent: int = 0

    @property
    def deferred(self) -> bool:
        return self.delay or self.trigger_ids is not None

    def failure(self, what: str, exc: BaseException) -> RuntimeError:
        """Wrap a collective failure in an error that names the likely problem and the fix."""
        timeout = f"{self.timeout_s:g} s" if self.timeout_s is not None else "its timeout"
        return RuntimeError(
            f"amp_parallel.DistributedDataParallel: the gradient all-reduce of {what} failed on "
            f"rank {self.rank} of {self.world_size}. Another rank probably crashed, raised, or "
            f"stopped calling backward (the process group gives up after {timeout}); check the "
            "other ranks' logs for the first error. To fail faster, pass "
            f"init_process_group(timeout=...). Original error: {exc}"
        )


def _launch(state: HookState, tensors: list[Tensor], what: str) -> Future[list[Tensor]]:
    """All-reduce ``tensors`` (one dtype/device) as one message; resolve to reduced copies."""
    group = state.groups[state.messages_sent % len(state.groups)]
    state.messages_sent += 1
    flat = tensors[0].reshape(-1) if len(tensors) == 1 else flatten(tensors)
    if state.always_fp32 and flat.dtype != torch.float32:
        flat = flat.float()
    if state.predivide != 1.0:
        flat.mul_(1.0 / state.predivide)
    try:
        with (
            torch.profiler.record_function(f"amp_parallel.allreduce({what})")
            if state.prof
            else _null()
        ):
            work = dist.all_reduce(flat, group=group, async_op=True)
    except Exception as exc:  # a dead peer can fail the launch itself
        raise state.failure(what, exc) from exc
    assert work is not None
    post = state.predivide / state.world_size if state.gradient_average else 1.0

    def finish(fut: Future[list[Tensor]]) -> list[Tensor]:
        try:
            reduced = fut.value()[0]
        except Exception as exc:
            raise state.failure(what, exc) from exc
        if post != 1.0:
            reduced.mul_(post)
        if state.retain:
            state.buffers.append(reduced)
        if len(tensors) == 1 and reduced.data_ptr() == tensors[0].data_ptr():
            return tensors  # reduced in place
        # Copy back into the bucket buffers: torch rebuilds the bucket views with absolute
        # storage offsets, so a view into a larger flat tensor must not be returned.
        parts = [reduced] if len(tensors) == 1 else unflatten(reduced, tensors)
        for t, r in zip(tensors, parts, strict=True):
            t.copy_(r.view_as(t))
        return tensors

    return work.get_future().then(finish)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _flush(state: HookState) -> None:
    """Launch every pending bucket and resolve its future when its message completes."""
    pending, state.pending = state.pending, []
    if state.delay:  # Apex's delayed path: one message per message_size-sized bucket
        batches = [[item] for item in pending]
    else:  # trigger path: everything received so far, one message per dtype
        by_dtype: dict[torch.dtype, list[tuple[int, Tensor, Future[Tensor]]]] = {}
        for item in pending:
            by_dtype.setdefault(item[1].dtype, []).append(item)
        batches = list(by_dtype.values())
    for batch in batches:
        what = "buckets " + ",".join(str(i) for i, _, _ in batch)
        outs = [f for _, _, f in batch]
        try:
            fut = _launch(state, [b for _, b, _ in batch], what)
        except RuntimeError as exc:
            for out in outs:
                out.set_exception(exc)  # type: ignore[arg-type]  # torch stub says Tensor
            continue
        fut.add_done_callback(_resolver(outs))


def _resolver(outs: list[Future[Tensor]]) -> Callable[[Future[list[Tensor]]], None]:
    def resolve(fut: Future[list[Tensor]]) -> None:
        try:
            values = fut.value()
        except Exception as exc:
            for out in outs:
                out.set_exception(exc)  # type: ignore[arg-type]  # torch stub says Tensor
            return
        for out, value in zip(outs, values, strict=True):
            out.set_result(value)

    return resolve


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP communication hook with Apex's all-reduce semantics (see the module docstring)."""
    if bucket.index() == 0:
        state.buffers = []
        state.messages_sent = 0
    buffer = bucket.buffer()
    what = f"bucket {bucket.index()}"
    if not state.deferred:
        return _launch(state, [buffer], what).then(lambda f: f.value()[0])
    devices: list[int | str | torch.device] | None = (
        [buffer.device] if buffer.device.type == "cuda" else None
    )
    out: Future[Tensor] = Future(devices=devices)
    state.pending.append((bucket.index(), buffer, out))
    trigger = state.trigger_ids is not None and any(
        id(p) in state.trigger_ids for p in bucket.parameters()
    )
    if bucket.is_last() or trigger:
        _flush(state)
    return out
