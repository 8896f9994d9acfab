"""amp over sharded (FSDP2, DTensor) parameters: local gradients and one overflow decision.

Under FSDP2 each rank holds one shard of every gradient. Unscaling and the inf/nan check work
on the local shards; but an inf in one rank's shard must skip the step on *every* rank (and
back the scale off everywhere), or the ranks' parameters and scales drift apart. So after a
check over DTensor gradients the overflow flag is all-reduced (``MAX``) over every dimension
of the gradients' device meshes.

O2 and O3 cast the model to half and step float32 master copies that live outside the model;
a DTensor parameter has no such copy in FSDP2, so :func:`refuse_sharded_cast` stops those
levels at ``amp.initialize`` with the alternatives that work.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["all_reduce_found_inf", "local_grads", "refuse_sharded_cast"]


def _dtensor_type() -> type | None:
    """``DTensor`` when ``torch.distributed.tensor`` is imported (nothing is one before)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_grads(grads: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
    """``grads`` with each DTensor replaced by its local shard, and the DTensors' meshes.

    Returns:
        ``(tensors, meshes)``: in-place changes to a local shard change the DTensor; ``meshes``
        holds each distinct device mesh once (empty when no gradient is a DTensor).
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return list(grads), []
    tensors: list[torch.Tensor] = []
    meshes: list[Any] = []
    for g in grads:
        if type(g) is dtensor:
            mesh = g.device_mesh  # type: ignore[attr-defined]
            if not any(mesh is m for m in meshes):
                meshes.append(mesh)
            tensors.append(g.to_local())  # type: ignore[attr-defined]
        else:
            tensors.append(g)
    return tensors, meshes


def all_reduce_found_inf(found_inf: torch.Tensor, meshes: Sequence[Any]) -> None:
    """Make ``found_inf`` the largest of its values over every rank of ``meshes``, in place.

    One ``all_reduce`` per mesh dimension (the maximum over each dimension in turn is the
    maximum over the whole mesh); the flag stays on its device (no host sync with NCCL).
    """
    if not meshes:
        return
    import torch.distributed as dist

    for mesh in meshes:
        for dim in range(mesh.ndim):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


def refuse_sharded_cast(
    models: Sequence[nn.Module], opt_level: str, cast_model_type: torch.dtype | None
) -> None:
    """Raise when an opt level that casts the model (O2, O3) meets DTensor parameters.

    Raises:
        RuntimeError: A model has a DTensor (FSDP2 ``fully_shard``) parameter; the message
            names the alternatives.
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    for model in models:
        for name, param in model.named_parameters():
            if type(param) is dtensor:
                raise RuntimeError(
                    f"amp.initialize(opt_level={opt_level!r}) got {type(model).__name__} with "
                    f"the DTensor (FSDP2 fully_shard) parameter {name!r}: {opt_level} casts "
                    f"the model to {cast_model_type} and steps float32 master copies kept "
                    "outside it, which sharded parameters do not have. Use FSDP2's own mixed "
                    "precision, fully_shard(module, mp_policy=MixedPrecisionPolicy("
                    "param_dtype=torch.bfloat16)) with opt_level 'O0' or 'O1', or shard a "
                    "half model and step it with "
                    "amp_optimizers.FusedMixedPrecisionLamb(reduced_precision_dtype=...), "
                    "which keeps its float32 masters sharded as the parameters."
                )
