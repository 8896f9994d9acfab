"""The gradient side of loss scaling: unscale in place, check for inf and nan, scale.

:class:`~amp_core.LossScaler` keeps the scale and its updates; this module does what it asks of
the gradients, grouped by (device, dtype): PyTorch's fused check-and-unscale where it has a
kernel for the group, else the same result in foreach passes, and the extra check of the
unscaled values that a scale below one needs. DTensor (FSDP2) gradients are handled through their
local shards, sparse COO ones through their values.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ._sharded import all_reduce_found_inf, local_grads

if TYPE_CHECKING:
    from ._scaler import LossScaler

__all__ = [
    "GradGroups",
    "coalesce_half_sparse_grads",
    "group_grads",
    "scale_grads_",
    "unscale_groups_",
]

# The gradients of one call by (device, dtype), in order of first appearance.
GradGroups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]


def _norm_nonfinite(tensors: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """:func:`_mark_nonfinite` through max-norms: reads the tensors once, writes nothing.

    Much slower than the fused check on CPU (PyTorch's inf-norm is not vectorized there), so
    used only where the fused op cannot take the tensors.
    """
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return
    # The inf-norm (max |x|) is inf or nan exactly when a value is; it cannot overflow.
    norms = torch._foreach_norm(tensors, math.inf)
    bad = torch.stack([n.float() for n in norms]).isfinite().all().logical_not()
    found_inf.masked_fill_(bad.to(found_inf.device), 1.0)


# (device type, dtype) pairs without a kernel of torch._amp_foreach_non_finite_check_and_unscale_
# (PyTorch's CUDA kernel takes float32 and float16, not bfloat16), learned on first use.
_NO_FUSED_UNSCALE: set[tuple[str, torch.dtype]] = set()

# A 0-dim float32 one per device: the inverse scale of a check that changes no value.
_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def _fused_check(
    group: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> bool:
    """PyTorch's fused check-and-unscale of ``group`` (one device, one dtype), in one pass;
    False (nothing done) where it has no kernel for the group's device and dtype.

    The op raises before it writes anything, so a group it refuses is left as it was.
    """
    key = (group[0].device.type, group[0].dtype)
    if key in _NO_FUSED_UNSCALE:
        return False
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
    except NotImplementedError:
        _NO_FUSED_UNSCALE.add(key)
        return False
    return True


def _mark_nonfinite(group: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Raise ``found_inf`` (on the device) when a tensor of ``group`` (one device, one dtype)
    holds an inf or a nan; every value stays as it was.

    The fused check with an inverse scale of exactly one, which hands each value back untouched
    (PyTorch's kernels skip the multiply for a scale of one: bit for bit, nan payloads and
    subnormals included). Tensors that must not be written to even so (part of an autograd
    graph, inference tensors) and groups without a fused kernel are checked through max-norms.
    """
    if any(t.requires_grad or t.is_inference() for t in group) or not _fused_check(
        group, found_inf, _one(found_inf.device)
    ):
        _norm_nonfinite(group, found_inf)


def _check_and_unscale(
    group: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Raise ``found_inf`` when a tensor of ``group`` (one device, one dtype) is not finite,
    then multiply the group by ``inv_scale``, in place.

    PyTorch's fused op where it has a kernel for the group's device and dtype; else the same
    result in two foreach passes (the check reads the values before they are multiplied, as the
    fused op does).
    """
    if not _fused_check(group, found_inf, inv_scale):
        _norm_nonfinite(group, found_inf)
        torch._foreach_mul_(group, inv_scale)


def _dense_parts(grads: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors to unscale in place: a dense grad itself, a sparse COO grad's values."""
    parts = []
    for g in grads:
        if g.layout is torch.strided:
            parts.append(g)
        elif g.layout is torch.sparse_coo:
            parts.append(g._values())  # a view: unscaling it unscales the gradient
        else:
            raise TypeError(
                f"amp cannot unscale a gradient with layout {g.layout}; dense and sparse COO "
                "gradients (e.g. nn.Embedding(sparse=True)) are supported."
            )
    return parts


def scale_grads_(grads: Iterable[torch.Tensor], scaler: LossScaler) -> None:
    """Multiply ``grads`` in place by the current scale of ``scaler`` (DTensor gradients
    through their local shards, sparse COO ones through their values)."""
    local, _ = local_grads(grads)
    groups: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in _dense_parts(local):
        groups[g.device].append(g)
    for device, group in groups.items():
        scale = scaler.scale_tensor(scaler.device or device).to(device, non_blocking=True)
        torch._foreach_mul_(group, scale)


def coalesce_half_sparse_grads(params: Iterable[torch.Tensor]) -> None:
    """Coalesce the half-precision sparse gradients of ``params`` in place of the old ones.

    An uncoalesced sparse gradient holds one value per occurrence of an index; the optimizer
    sums them, which can overflow in fp16 although each value is finite. Summed first, the
    overflow check sees them (torch's GradScaler does the same).
    """
    for p in params:
        g = p.grad
        half = g is not None and g.dtype in (torch.float16, torch.bfloat16)
        if half and g.is_sparse and not g.is_coalesced():  # type: ignore[union-attr]
            p.grad = g.coalesce()  # type: ignore[union-attr]


def group_grads(grads: Iterable[torch.Tensor]) -> tuple[GradGroups, list[Any]]:
    """The tensors of ``grads`` to unscale in place, grouped by (device, dtype), and the meshes
    of the DTensor (FSDP2) gradients among them (their local shards are grouped)."""
    local, meshes = local_grads(grads)
    groups: GradGroups = defaultdict(list)
    for g in _dense_parts(local):
        groups[(g.device, g.dtype)].append(g)
    return groups, meshes


def unscale_groups_(
    groups: GradGroups,
    meshes: list[Any],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None,
    *,
    check: bool,
    check_output: bool,
) -> None:
    """Multiply each group in place by ``inv_scale`` and, with ``check``, raise ``found_inf``
    on an inf or a nan (see :meth:`LossScaler.unscale_`).

    Args:
        groups: As :func:`group_grads` returns them.
        meshes: Likewise: with ``check``, the flag is all-reduced over them (a collective).
        found_inf: 0-dim fp32 flag, only ever raised.
        inv_scale: ``1 / scale``, or ``None`` for a static scale of one (check only).
        check: Check the gradients before they are unscaled.
        check_output: Check them after too (a scale below one: finite * (1/scale) may
            overflow).
    """
    for (device, _), group in groups.items():
        local_inv = None if inv_scale is None else inv_scale.to(device, non_blocking=True)
        if not check:
            assert local_inv is not None
            torch._foreach_mul_(group, local_inv)
            continue
        local_inf = (
            found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
        )
        if local_inv is None:  # a static scale of one: check only, no value changes
            _mark_nonfinite(group, local_inf)
        else:  # one fused pass: check, then multiply
            _check_and_unscale(group, local_inf, local_inv)
            if check_output:  # finite * (1/scale > 1) may overflow
                _mark_nonfinite(group, local_inf)
        if local_inf is not found_inf:
            found_inf.add_(local_inf.to(found_inf.device, non_blocking=True))
    if check:
        # An inf in one rank's shard skips the step on every rank.
        all_reduce_found_inf(found_inf, meshes)
