"""The multi-tensor ops called with their schemas' own arguments, on tensors or DTensor shards.

:func:`multi_tensor_op` is how code that knows its tensors' layout calls an op of
:data:`~amp_fused_ops.ops._registry.REGISTRY`: the fused optimizers of amp-optimizers, which
decide once per step, from their parameters, whether the tensors are DTensors (FSDP2) and ask
for the sharded call only then. A plain call is the dispatcher op itself: no wrapper, no
conversion, no look at the tensors' types.

On DTensor arguments (:func:`sharded_call`) an op steps each rank's local shards; the ops that
take norms of whole tensors reduce them over the ranks that hold the other shards
(:mod:`amp_fused_ops.ops._sharding`), and the ops that skip a step on a non-finite gradient
agree on that decision across the ranks first. ``amp_C`` (Apex's calling convention,
:mod:`amp_fused_ops.ops._apex_convention`) uses the same functions for callers that pass
DTensors to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.ops._registry import OPS_NAMESPACE, REGISTRY
from amp_fused_ops.ops._sharding import (
    agree_nonfinite,
    dtensor_type,
    outside_graph,
    shard_groups,
    sharded_norms,
    to_local,
)
from amp_fused_ops.reference._common import find_wrong_device

__all__ = [
    "SHARD_FLAG_OPS",
    "SHARD_LOCAL_OPS",
    "SHARD_NORM_OPS",
    "PLAIN_TENSOR_TYPES",
    "holds_dtensor",
    "multi_tensor_op",
    "raise_wrong_device",
    "sharded_call",
]


def multi_tensor_op(name: str, *, sharded: bool = False) -> Callable[..., Any]:
    """The multi-tensor op ``name``, called with its schema's arguments.

    ``op(chunk_size, noop_flag, list_0, list_1, ..., *scalars)``: the lists Apex passes in one
    ``tensor_lists`` are separate arguments (an optional last list may be None), and the
    scalars have the schema's types (``torch.ops.amp_fused_ops.<name>.default._schema``). The
    dispatcher picks the kernel: compiled (CPU, CUDA) or the PyTorch reference; the first
    call on a device loads its compiled extension.

    Args:
        name: An op of ``amp_C`` (``amp_fused_ops.amp_C.__all__``), e.g.
            ``"multi_tensor_adam"``.
        sharded: The tensors may be DTensors (FSDP2 parameters, gradients and state): each
            rank steps its local shards, with the norms and overflow decisions agreed across
            the ranks. A plain tensor in the lists is stepped as it is. Decide it once per
            step from the parameters; a plain call (the default) does not look for DTensors.

    Returns:
        The dispatcher op ``torch.ops.amp_fused_ops.<name>.default`` itself, or (``sharded``)
        a function with the same arguments.

    Raises:
        ValueError: ``name`` is not a multi-tensor op.

    Example:
        >>> adam = multi_tensor_op("multi_tensor_adam")
        >>> adam(2048 * 32, flag, grads, params, exp_avgs, exp_avg_sqs,
        ...      1e-3, 0.9, 0.999, 1e-8, step, 1, 1, 0.0)  # doctest: +SKIP
    """
    spec = REGISTRY.get(name)
    if spec is None or not spec.list_counts:
        raise ValueError(
            f"multi_tensor_op: {name!r} is not a multi-tensor op; expected one of "
            f"{', '.join(n for n, s in REGISTRY.items() if s.list_counts)}"
        )
    overload = getattr(getattr(torch.ops, OPS_NAMESPACE), name).default
    if not sharded:
        return overload
    call = _sharded_ops.get(name)
    if call is None:
        call = _sharded_ops[name] = _sharded_op(name, overload)
    return call


# Op name -> its sharded form, made on first use.
_sharded_ops: dict[str, Callable[..., Any]] = {}


def _sharded_op(name: str, overload: Any) -> Callable[..., Any]:
    most = max(REGISTRY[name].list_counts)

    def call(chunk_size: int, noop_flag: Tensor, *args: Any) -> Any:
        if name in SHARD_NORM_OPS and torch.compiler.is_compiling():
            # The cross-rank reductions run outside the graph (see outside_graph).
            return outside_graph(call, chunk_size, noop_flag, *args)
        lists = [part for part in args[:most] if part is not None]
        return sharded_call(name, overload, chunk_size, noop_flag, lists, args[most:], {})

    call.__name__ = call.__qualname__ = f"{name}_sharded"
    return call


# Ops whose kernels work element by element and never raise the noop flag: on DTensor
# (sharded) arguments they step each rank's local shards, which is the whole answer.
SHARD_LOCAL_OPS = frozenset({"multi_tensor_adam", "multi_tensor_sgd", "multi_tensor_adagrad"})

# Ops that take norms of whole tensors (and raise the noop flag only from those norms): on
# DTensor arguments their reference runs on the local shards with each norm all-reduced over
# the ranks that hold the tensor's other shards (amp_fused_ops.ops._sharding). A compiled kernel
# takes a norm inside one launch and cannot wait for other ranks.
SHARD_NORM_OPS = frozenset(
    {
        "multi_tensor_l2norm",
        "multi_tensor_l2norm_mp",
        "multi_tensor_unscale_l2norm",
        "multi_tensor_l2norm_scale",
        "multi_tensor_lamb",
        "multi_tensor_lamb_mp",
        "multi_tensor_novograd",
    }
)


# Ops that skip the whole step when a gradient read is not finite (and raise the flag): on
# DTensor arguments the ranks first agree on that decision (amp_fused_ops.ops._sharding), then each
# steps its local shards.
SHARD_FLAG_OPS = frozenset({"multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master"})


# Types no DTensor has: a list of these alone needs no walk (see holds_dtensor).
PLAIN_TENSOR_TYPES = frozenset({Tensor, torch.nn.Parameter})


def holds_dtensor(dtensor: type, lists: Sequence[Sequence[Any] | None]) -> bool:
    """Whether any tensor of ``lists`` is a ``dtensor``.

    One set test per list for lists of plain tensors and parameters, in C; a list with other
    types (tensor subclasses) is walked.
    """
    for part in lists:
        if (
            part is not None
            and not PLAIN_TENSOR_TYPES.issuperset(map(type, part))
            and any(type(t) is dtensor for t in part)
        ):
            return True
    return False


def _local_shards(name: str, lists: list[Any]) -> tuple[list[Any], list[tuple[Any, ...]] | None]:
    """``lists`` with every DTensor replaced by its local shard (FSDP2 parameters and state).

    Returns:
        ``(lists, groups)``: ``groups`` is None when no argument is a DTensor, else the process
        groups each position's norm spans (:func:`amp_fused_ops.ops._sharding.shard_groups`).

    Raises:
        NotImplementedError: DTensor arguments to an op of none of :data:`SHARD_LOCAL_OPS`,
            :data:`SHARD_NORM_OPS` and :data:`SHARD_FLAG_OPS`: it raises the noop flag from
            the values it reads, and on one rank's shards that would be that rank's answer
            only.
        ValueError: The tensors of one position are not sharded alike.
    """
    dtensor = dtensor_type()
    if dtensor is None or not holds_dtensor(dtensor, lists):
        return lists, None
    if name not in SHARD_LOCAL_OPS | SHARD_NORM_OPS | SHARD_FLAG_OPS:
        raise NotImplementedError(
            f"{name} got DTensor (sharded) arguments: the op raises the overflow flag from the "
            "values it reads, and on one rank's shards it would give that rank's answer only. "
            "Step sharded (FSDP2) parameters with the fused optimizers instead (FusedAdam, "
            "FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad, FusedMixedPrecisionLamb), "
            "which take their norms and overflow decisions across the shards"
        )
    local: list[Any] = []
    for index, part in enumerate(lists):
        if part is None:
            local.append(None)
            continue
        shards = []
        for position, t in enumerate(part):
            reference = lists[0][position]
            # A plain param (an nn.Parameter) beside its plain gradient is alike.
            if (type(t) is dtensor) != (type(reference) is dtensor) or (
                type(t) is dtensor
                and (t.placements, t.device_mesh) != (reference.placements, reference.device_mesh)
            ):
                raise ValueError(
                    f"{name}: tensor_lists[{index}][{position}] and tensor_lists[0][{position}] "
                    "are not sharded alike (a DTensor and a plain tensor, or other placements "
                    "or meshes); the optimizer state must be sharded as its parameter"
                )
            shards.append(t.to_local() if type(t) is dtensor else t)
        local.append(shards)
    return local, [shard_groups(name, t) for t in lists[0]]


def sharded_call(
    name: str,
    overload: Any,
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: Sequence[Sequence[Tensor]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    scalars: Callable[[list[Any], tuple[Any, ...], dict[str, Any]], Any] | None = None,
) -> Any:
    """``overload`` (the op ``name``) on DTensor (FSDP2) arguments: on their local shards, with
    the norms and overflow decisions agreed across the ranks (see :func:`_local_shards`).

    ``scalars(local_lists, args, kwargs)``, when given, returns ``(args, kwargs)`` as the
    kernel takes them (``amp_C`` turns Python numbers into tensors there); the reference of a
    norm op takes them as given. Lists without any DTensor: the op as it is.
    """
    most = max(REGISTRY[name].list_counts)
    lists: list[Any] = [*tensor_lists, *([None] * (most - len(tensor_lists)))]
    lists, groups = _local_shards(name, lists)
    if groups is not None and name in SHARD_NORM_OPS:
        return _sharded_reference(name, chunk_size, noop_flag, lists, groups, args, kwargs)
    if groups is not None and name in SHARD_FLAG_OPS:
        names = [argument.name for argument in overload._schema.arguments[2 + most :]]
        at = names.index("inv_scale")
        inv_scale = kwargs.get("inv_scale", args[at] if at < len(args) else 1.0)
        agree_nonfinite(noop_flag, lists[0], to_local(inv_scale), groups)
    if scalars is not None:
        args, kwargs = scalars(lists, args, kwargs)
    try:
        return overload(chunk_size, noop_flag, *lists, *args, **kwargs)
    except NotImplementedError:
        raise_wrong_device(name, noop_flag, tensor_lists)
        raise


def raise_wrong_device(name: str, noop_flag: Tensor, tensor_lists: Sequence[Any]) -> None:
    """Raise the kernels' device check error when a tensor is on another device than
    ``noop_flag``: called on the ``NotImplementedError`` of a device the op has no kernel for,
    which the dispatcher raises before any kernel's own device check."""
    wrong = find_wrong_device(name, noop_flag, tensor_lists)
    if wrong is not None:
        raise wrong from None


def _sharded_reference(
    name: str,
    chunk_size: int,
    noop_flag: Tensor,
    lists: list[Any],
    groups: list[tuple[Any, ...]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The reference of ``name`` on local shards, its norms reduced over ``groups``."""
    args = tuple(to_local(a) for a in args)
    kwargs = {k: to_local(v) for k, v in kwargs.items()}
    with sharded_norms(groups):
        return REGISTRY[name].reference(
            chunk_size, noop_flag, [part for part in lists if part is not None], *args, **kwargs
        )
