"""DTensor (FSDP2) arguments of the ``amp_C`` ops: local shards, and norms that span shards.

FSDP2 hands the optimizer DTensor parameters, gradients and state. Each rank holds one shard of
every tensor, so

* an element-wise op (Adam, SGD, Adagrad) steps the local shards and is done;
* an op that reduces over whole tensors (the L2 norms, LAMB's trust ratio ``||p|| / ||u||``,
  NovoGrad's per-tensor gradient norms) needs each tensor's norm over *all* its shards. Each
  rank takes the norm of its shards, and the partial results are combined across the ranks that
  hold the other shards: the sums of squares are all-reduced (``SUM``) for the L2 norm, the
  maxima (``MAX``) for the infinity norm. Only the mesh dimensions on which the tensor is
  ``Shard``-ed are reduced over; along a ``Replicate`` dimension every rank already holds the
  same values, and summing them would count the tensor twice.

:func:`sharded_norms` sets, for the duration of one op, which process groups each tensor
position reduces over; :func:`per_tensor_norms` (used by every reference op that takes a norm)
reads it. Plain tensors in the same lists (a parameter FSDP2 does not manage) are reduced over
nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "dtensor_type",
    "outside_graph",
    "per_tensor_norms",
    "shard_groups",
    "sharded_norms",
    "tensor_norms",
    "to_local",
]

# Per position of the op's first tensor list: the process groups its norm is reduced over.
_GROUPS: contextvars.ContextVar[Sequence[tuple[Any, ...]] | None] = contextvars.ContextVar(
    "amp_fused_ops_shard_groups", default=None
)


def dtensor_type() -> Any:
    """``torch.distributed.tensor.DTensor`` when that module is imported, else None.

    Nothing can be a DTensor before it is imported, so the check costs no import.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def to_local(value: Any) -> Any:
    """``value``'s local tensor when it is a DTensor, else ``value`` itself."""
    dtensor = dtensor_type()
    if dtensor is not None and type(value) is dtensor:
        return value.to_local()
    return value


def shard_groups(op: str, t: Tensor) -> tuple[Any, ...]:
    """The process groups over which a whole-tensor reduction of ``t`` must be combined.

    One group per mesh dimension on which ``t`` is ``Shard``-ed; none for ``Replicate`` dims or
    a plain tensor.

    Raises:
        ValueError: ``t`` has a ``Partial`` placement (its local values are not its shard).
    """
    dtensor = dtensor_type()
    if dtensor is None or type(t) is not dtensor:
        return ()
    groups = []
    for dim, placement in enumerate(t.placements):  # type: ignore[attr-defined]
        if placement.is_shard():
            groups.append(t.device_mesh.get_group(dim))  # type: ignore[attr-defined]
        elif not placement.is_replicate():
            raise ValueError(
                f"{op}: a DTensor argument has placement {placement} on mesh dimension {dim}; "
                "only Shard and Replicate placements can be stepped (call "
                "redistribute() on the gradients first)"
            )
    return tuple(groups)


@contextlib.contextmanager
def sharded_norms(groups: Sequence[tuple[Any, ...]]) -> Iterator[None]:
    """Make :func:`per_tensor_norms` reduce position ``i`` over ``groups[i]`` inside the block."""
    token = _GROUPS.set(groups)
    try:
        yield
    finally:
        _GROUPS.reset(token)


def per_tensor_norms(tensors: Sequence[Tensor], ord: float) -> Tensor:
    """Float32 ``(len(tensors),)`` tensor of the ``ord``-norm (2 or inf) of each tensor.

    Inside :func:`sharded_norms` each norm is that of the whole tensor of which ``tensors[i]`` is
    one shard: the local partial results are all-reduced over that position's groups.
    """
    groups = _GROUPS.get()
    if groups is None or not any(groups):
        return torch.stack(torch._foreach_norm(list(tensors), ord)).float()
    local = _local_norms(tensors, ord)
    assert len(groups) == len(tensors), (len(groups), len(tensors))
    import torch.distributed as dist

    l2 = ord != math.inf
    reduce_op = dist.ReduceOp.SUM if l2 else dist.ReduceOp.MAX
    positions: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(groups):
        if g:
            positions.setdefault(g, []).append(i)
    result = local
    for group_set, index in positions.items():
        idx = torch.tensor(index, device=local.device)
        # L2: the squares add up across shards; inf: the largest shard maximum is the maximum.
        values = local.index_select(0, idx)
        if l2:
            values = values.square()
        for group in group_set:
            dist.all_reduce(values, op=reduce_op, group=group)
        result = result.index_copy(0, idx, values.sqrt() if l2 else values)
    return result


def _local_norms(tensors: Sequence[Tensor], ord: float) -> Tensor:
    """The norms of local shards, one of which may be empty (FSDP2's last shards of a tensor
    smaller than the world): an empty shard's norm is 0, the identity of both reductions."""
    nonempty = [t for t in tensors if t.numel()]
    norms = iter(torch._foreach_norm(nonempty, ord) if nonempty else ())
    device = tensors[0].device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([next(norms).float() if t.numel() else zero for t in tensors])


_eager_call: Callable[..., Any] | None = None


def outside_graph(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run eagerly while ``torch.compile`` traces (a graph break).

    The norm-taking ops (and :func:`tensor_norms`) step DTensor arguments in their PyTorch
    reference and all-reduce the shards' partial norms over the ranks. Traced, that reference
    breaks the graph at its host reads, recompiles as the step count changes, and once Dynamo
    makes the shards' sizes symbolic it confuses the shapes of uneven shards, which differ
    between ranks. Called on the DTensors as in eager mode, the op gives the eager result,
    with one graph break per call and no recompilation. ``torch.compiler.disable`` imports
    ``torch._dynamo``, so the wrapper is made on first use (always under ``torch.compile``,
    which has imported it).
    """
    global _eager_call
    if _eager_call is None:
        _eager_call = torch.compiler.disable(_call)
    return _eager_call(fn, *args, **kwargs)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def tensor_norms(tensors: Sequence[Tensor], ord: float = 2.0) -> Tensor:
    """The ``ord``-norm (2 or ``math.inf``) of each tensor, of the whole tensor for a DTensor.

    A DTensor's norm is reduced over the mesh dimensions it is sharded on (so every rank gets
    the same value); a plain tensor's is its own. This is the norm the fused optimizers use
    for sharded (FSDP2) parameters.

    Args:
        tensors: Plain tensors or DTensors (with ``Shard`` / ``Replicate`` placements), all on
            one device.
        ord: 2 for the L2 norm, ``math.inf`` for the largest absolute value.

    Returns:
        A plain float32 tensor of ``len(tensors)`` norms on the tensors' device.

    Raises:
        ValueError: ``ord`` is neither 2 nor inf, or a DTensor has a ``Partial`` placement.

    Example:
        >>> tensor_norms([torch.ones(4), torch.full((2,), -3.0)], math.inf)
        tensor([1., 3.])
    """
    if ord not in (2, math.inf):
        raise ValueError(f"tensor_norms: ord must be 2 or math.inf, got {ord!r}")
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    dtensor = dtensor_type()
    if (
        torch.compiler.is_compiling()
        and dtensor is not None
        and any(type(t) is dtensor for t in tensors)
    ):
        return outside_graph(tensor_norms, tensors, ord)  # see outside_graph
    groups = [shard_groups("tensor_norms", t) for t in tensors]
    with sharded_norms(groups):
        # Float32 math for half tensors too (a half norm would round the result to half).
        return per_tensor_norms([to_local(t).float() for t in tensors], ord)


def agree_nonfinite(
    noop_flag: Tensor, grads: Sequence[Tensor], inv_scale: Any, groups: Sequence[tuple[Any, ...]]
) -> None:
    """Raise ``noop_flag`` on every rank when any rank's ``grads * inv_scale`` has an inf/nan.

    For the ops that skip the whole step on such a value (capturable Adam): each rank reads only
    its shards, so without this an inf in one rank's shard would skip the step there only.
    ``grads`` are local shards; the flag (with its value on entry) is all-reduced (``MAX``) over
    every group in ``groups``.
    """
    import torch.distributed as dist

    device = noop_flag.device
    bad = noop_flag.reshape(()) != 0
    present = [g for g in grads if g.numel()]
    if present:
        scale = inv_scale if isinstance(inv_scale, Tensor) else torch.tensor(float(inv_scale))
        unscaled = torch._foreach_mul([g.float() for g in present], scale.to(device).float())
        norms = torch.stack(torch._foreach_norm(unscaled, math.inf))
        bad = bad | ~torch.isfinite(norms).all()
    flag = bad.to(torch.int32).reshape(1)
    seen: list[Any] = []
    for group_set in groups:
        for group in group_set:
            if not any(group is s for s in seen):
                seen.append(group)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    noop_flag.copy_(flag.reshape(noop_flag.shape))
