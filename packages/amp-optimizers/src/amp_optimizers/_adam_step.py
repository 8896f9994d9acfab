"""The Adam step of :class:`amp_optimizers.FusedAdam` as one function of tensor lists.

As ``torch.optim.adam`` keeps the math of a step in one function that takes lists and numbers
(the class only gathers the lists), :class:`~amp_optimizers.FusedAdam` gathers the gradients,
params, moments and masters of a param group by ``(device, dtype)`` and calls
:func:`fused_adam`, from each of its three paths (the plain step, the ``GradScaler`` step and
amp O2's fused master-weight step). It runs one of two implementations:

* :func:`_plain_adam`: one ``multi_tensor_adam`` launch per bucket, params of any float
  dtype stepped in place, ``lr`` and ``step`` host numbers or tensors read on the host;
* :func:`_device_adam`: one ``multi_tensor_adam_capturable_master`` launch per bucket
  (``capturable``, master weights, a ``GradScaler``, amp O2), with the step count, ``lr``, the
  inverse scale and the skip flag on the device; ``multi_tensor_adam_capturable`` for half
  params without masters when there is no scale to undo (:func:`_device_op_lists`).

Both call the dispatcher ops with their schemas' arguments
(:func:`amp_fused_ops.multi_tensor_op`), in their sharded form when the caller says the params
are DTensors (FSDP2). The helpers below them are the device path's small pieces: device
scalars and inf/nan checks.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from amp_fused_ops import StepPlanLists, multi_tensor_applier, multi_tensor_op

from ._step_helpers import lr_arguments

__all__ = [
    "NoopFlag",
    "device_scalar",
    "fused_adam",
    "is_device_scalar",
    "raise_on_nonfinite",
    "raise_on_nonfinite_flag",
]


class NoopFlag(Protocol):
    """An optimizer's int32 noop flag of a device (``FusedOptimizerBase.noop_flag``): reset to
    0, unless ``reset=False`` (the caller writes it whole)."""

    def __call__(self, device: torch.device, *, reset: bool = True) -> Tensor: ...


def fused_adam(
    tensor_lists: Sequence[list[list[Tensor]]],
    noop_flag: NoopFlag,
    *,
    device_path: bool,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: int,
    bias_correction: int,
    step: int | Tensor,
    step_tensor: Tensor | None = None,
    seeds: Sequence[int] = (),
    inv_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    check_finite: bool = False,
    sharded: bool = False,
    plan_lists: StepPlanLists | None = None,
) -> None:
    """One Adam step of one param group.

    Args:
        tensor_lists: One entry per ``(device, dtype)`` of the params, each the lists
            ``[grads, params, exp_avgs, exp_avg_sqs]``, plus ``masters`` on the device path (a
            param without a master weight is its own: a float32 one, or a half one, which the
            step computes in float32).
        noop_flag: The optimizer's int32 flag of a device, zeroed when asked for (before each
            plain launch; once per group on the device path).
        device_path: Step on the device path (:func:`_device_adam`) instead of the plain one.
        lr: The learning rate: a number or a tensor on the plain path (a tensor stays a
            tensor: data of a compiled step), a 0-dim float32 tensor on the device path.
        betas: ``(beta1, beta2)``.
        eps: Added to the denominator.
        weight_decay: The decay.
        adam_w_mode: 1: decoupled weight decay (AdamW); 0: L2 added to the gradient.
        bias_correction: 1 to correct the moments' bias, else 0.
        step: Plain path: the step count after this step (``step_arguments``). Device path:
            the group's count before it, a 0-dim float32 tensor on the device, advanced in place
            when the step is taken.
        step_tensor: Plain path: the same count as a tensor, or None (``step_arguments``).
        seeds: Plain path: one stochastic-rounding seed per bucket, or empty to round to
            nearest.
        inv_scale: Device path: the gradients' multiplier, a 0-dim float32 tensor (None: 1).
        found_inf: Device path: a 0-dim float32 flag; nonzero skips the step on the device.
        check_finite: Device path: check every bucket but the largest (launched first) for
            inf/nan before any is written, so that an inf anywhere skips the whole group, and
            raise ``found_inf`` when the step was skipped (not needed when ``found_inf``
            already covers every gradient, as ``GradScaler``'s does).
        sharded: The params are DTensors (FSDP2), decided once per step by the caller.
        plan_lists: Plain path: step on these stored lists, their gradients gathered
            (``tensor_lists`` then empty): one ``multi_tensor_adam_plan`` per bucket.
    """
    if device_path:
        assert isinstance(lr, Tensor) and isinstance(step, Tensor)
        _device_adam(
            tensor_lists,
            noop_flag,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            bias_correction=bias_correction,
            step=step,
            inv_scale=inv_scale,
            found_inf=found_inf,
            check_finite=check_finite,
            sharded=sharded,
        )
    else:
        assert not isinstance(step, Tensor)
        _plain_adam(
            tensor_lists,
            noop_flag,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            bias_correction=bias_correction,
            step=step,
            step_tensor=step_tensor,
            seeds=seeds,
            sharded=sharded,
            plan_lists=plan_lists,
        )


def _plain_adam(
    tensor_lists: Sequence[list[list[Tensor]]],
    noop_flag: NoopFlag,
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: int,
    bias_correction: int,
    step: int,
    step_tensor: Tensor | None,
    seeds: Sequence[int],
    sharded: bool,
    plan_lists: StepPlanLists | None,
) -> None:
    """:func:`fused_adam` on the plain path: ``multi_tensor_adam`` per bucket, or
    ``multi_tensor_adam_plan`` per bucket of ``plan_lists``."""
    beta1, beta2 = betas
    lr, lr_tensor = lr_arguments(lr)
    hyper = (lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, weight_decay, step_tensor)

    def rest(index: int) -> tuple[Any, ...]:
        # Stochastic rounding: a seed per launch; the op keys the bits by its own step count
        # (step or step_tensor, so a compiled step does not recompile).
        return (*hyper, seeds[index] if seeds else None, None, lr_tensor)

    # The chunk size is read at each step, as Apex's optimizers did.
    if plan_lists is not None:
        planned = torch.ops.amp_fused_ops.multi_tensor_adam_plan.default
        device, handle = plan_lists.device, plan_lists.handle
        for index in range(plan_lists.buckets):
            chunk_size = multi_tensor_applier.chunk_size
            planned(chunk_size, noop_flag(device), handle, index, *rest(index))
        return
    adam = multi_tensor_op("multi_tensor_adam", sharded=sharded)
    for index, lists in enumerate(tensor_lists):
        flag = noop_flag(lists[1][0].device)
        adam(multi_tensor_applier.chunk_size, flag, *lists, *rest(index))


def _device_adam(
    tensor_lists: Sequence[list[list[Tensor]]],
    noop_flag: NoopFlag,
    *,
    lr: Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: int,
    bias_correction: int,
    step: Tensor,
    inv_scale: Tensor | None,
    found_inf: Tensor | None,
    check_finite: bool,
    sharded: bool,
) -> None:
    """:func:`fused_adam` on the device path: ``multi_tensor_adam_capturable_master`` per
    bucket, the skip decided on the device (the group's int32 ``noop`` flag)."""
    if not tensor_lists:
        return
    device = tensor_lists[0][1][0].device
    beta1, beta2 = betas
    if found_inf is None:
        noop = noop_flag(device)
    else:  # 1 where found_inf is nonzero, written whole
        noop = noop_flag(device, reset=False)
        torch.ne(found_inf.to(device).reshape(1), 0, out=noop)
    # Largest bucket first: its own launch checks its gradients before writing anything and
    # raises the flag that the later launches read, so only the others need a pre-check for
    # an inf to skip the whole group.
    buckets = tensor_lists
    if len(buckets) > 1:
        buckets = sorted(buckets, key=lambda lists: sum(t.numel() for t in lists[1]), reverse=True)
    if check_finite:
        for lists in buckets[1:]:
            raise_on_nonfinite(noop, lists[0])
    next_step = step + 1
    unscaled = inv_scale is None
    if inv_scale is None:
        inv_scale = torch.ones((), dtype=torch.float32, device=device)
    for lists in buckets:
        name, op_lists = _device_op_lists(lists, unscaled=unscaled)
        multi_tensor_op(name, sharded=sharded)(
            multi_tensor_applier.chunk_size,  # read at each step, as Apex's optimizers did
            noop,
            *op_lists,
            lr,
            beta1,
            beta2,
            eps,
            next_step,
            adam_w_mode,
            bias_correction,
            weight_decay,
            inv_scale.to(device),
        )
    # The step count advances only when the step was taken, decided on the device (a device
    # tensor from here on: reading it back would sync the host). In place: a CUDA graph that
    # captured this step advances the same tensor on every replay.
    step.add_(noop.reshape(()) == 0)
    if check_finite:
        assert found_inf is not None
        torch.maximum(found_inf, noop.reshape(()), out=found_inf)


def _device_op_lists(
    lists: list[list[Tensor]], *, unscaled: bool
) -> tuple[str, list[list[Tensor]]]:
    """The device-path op of one bucket ``[grads, params, exp_avgs, exp_avg_sqs, masters]``
    and its lists.

    ``multi_tensor_adam_capturable_master`` steps float32 masters and writes the params from
    them. Half params that are their own masters (no master weights) are stepped in float32
    by ``multi_tensor_adam_capturable`` on the params themselves, with the same result, when
    ``unscaled`` (no inverse scale: that op would also write unscaled gradients back, which a
    scaled step's caller does itself); else each gets a float32 copy for this step, which the
    master op steps and writes back.
    """
    grads, params, exp_avgs, exp_avg_sqs, masters = lists
    # The usual buckets first, with no per-param list built: float32 params, or masters.
    if params[0].dtype == torch.float32 or not any(map(operator.is_, masters, params)):
        return "multi_tensor_adam_capturable_master", lists
    own = [m is p for p, m in zip(params, masters, strict=True)]
    if unscaled and all(own):
        return "multi_tensor_adam_capturable", [grads, params, exp_avgs, exp_avg_sqs]
    masters = [
        p.float() if is_own else m for p, m, is_own in zip(params, masters, own, strict=True)
    ]
    return "multi_tensor_adam_capturable_master", [grads, params, exp_avgs, exp_avg_sqs, masters]


def device_scalar(value: float | Tensor, device: torch.device) -> Tensor:
    """A 0-dim float32 tensor on ``device`` (no host sync for a tensor already there).

    A number is written by a fill on the device (``torch.full``), not copied from the host
    (``torch.tensor(..., device=...)``), which a CUDA graph capture cannot hold.
    """
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


def is_device_scalar(value: Any, device: torch.device) -> bool:
    """Whether ``value`` is a 0-dim float32 tensor on ``device`` (a capturable step count)."""
    return (
        isinstance(value, Tensor)
        and value.device == device
        and value.dtype == torch.float32
        and value.dim() == 0
    )


def _any_nonfinite(grads: list[Tensor]) -> Tensor:
    """A 0-dim bool tensor: whether any of ``grads`` holds an inf or a nan (on the device).

    The max-norm of a tensor is an inf or a nan exactly when one of its elements is; the norms
    are checked in their own dtypes, stacked (promoted to a common one) in one op.
    """
    norms = torch._foreach_norm(grads, float("inf"))
    return torch.isfinite(torch.stack(norms)).all().logical_not_()


def raise_on_nonfinite(noop: Tensor, grads: list[Tensor]) -> None:
    """Set the int32 ``noop`` flag when any of ``grads`` holds an inf or a nan (on the device)."""
    if not grads:
        return
    noop.masked_fill_(_any_nonfinite(grads).to(noop.device), 1)


def raise_on_nonfinite_flag(found_inf: Tensor, grads: list[Tensor]) -> None:
    """Set the float ``found_inf`` to 1 when any of ``grads`` holds an inf or a nan."""
    if not grads:
        return
    found_inf.masked_fill_(_any_nonfinite(grads).to(found_inf.device), 1.0)
