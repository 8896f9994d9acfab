"""The Adam step of :class:`amp_optimizers.FusedAdam` as functions of tensor lists.

As ``torch.optim.adam`` keeps the math of a step in functions that take lists and numbers
(the class only gathers the lists), :class:`~amp_optimizers.FusedAdam` gathers its params,
gradients, moments and masters and calls one of these:

* :func:`adam_launch`: one ``amp_C.multi_tensor_adam`` launch, the plain path (params of any
  float dtype stepped in place, ``lr`` and ``step`` host numbers or tensors read on the host);
* :func:`capturable_adam`: the device path (``capturable``, master weights, a ``GradScaler``,
  amp O2), ``amp_C.multi_tensor_adam_capturable_master`` per ``(device, dtype)`` bucket with
  the step count, ``lr``, the inverse scale and the skip flag on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops import amp_C, multi_tensor_applier

from ._step_helpers import group_by_device_dtype

__all__ = [
    "adam_launch",
    "capturable_adam",
    "device_scalar",
    "is_device_scalar",
    "raise_on_nonfinite",
    "raise_on_nonfinite_flag",
]


def adam_launch(
    noop: Tensor,
    lists: list[list[Tensor]],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    step: int,
    step_tensor: Tensor | None,
    adam_w_mode: int,
    bias_correction: int,
    weight_decay: float,
    rounding: tuple[int, ...] = (),
) -> None:
    """One plain-path launch on ``[grads, params, exp_avgs, exp_avg_sqs]``.

    Args:
        noop: The op's int32 flag (nonzero skips the launch).
        lists: The four tensor lists, one ``(device, dtype)`` of params.
        lr: The learning rate; a tensor stays a tensor (data of a compiled step).
        betas: ``(beta1, beta2)``.
        eps: Added to the denominator.
        step: The step count after this step (``step_arguments``).
        step_tensor: The same count as a tensor, or None (``step_arguments``).
        adam_w_mode: 1: decoupled weight decay (AdamW); 0: L2 added to the gradient.
        bias_correction: 1 to correct the moments' bias, else 0.
        weight_decay: The decay.
        rounding: ``(seed,)`` to round bfloat16 params stochastically, else empty.
    """
    beta1, beta2 = betas
    multi_tensor_applier(
        amp_C.multi_tensor_adam,
        noop,
        lists,
        lr,
        beta1,
        beta2,
        eps,
        step,
        adam_w_mode,
        bias_correction,
        weight_decay,
        step_tensor,
        *rounding,
    )


def capturable_adam(
    rows: Sequence[tuple[Any, ...]],
    noop: Tensor,
    *,
    step: Tensor,
    lr: Tensor,
    betas: tuple[float, float],
    eps: float,
    adam_w_mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
    precheck: bool,
) -> None:
    """One device-path step of one param group; advances ``step`` in place when it was taken.

    Args:
        rows: ``(param, grad, exp_avg, exp_avg_sq, master)`` per param, on one device (a
            float32 param is its own master).
        noop: The int32 skip flag of that device, raised on the device by the launches.
        step: The group's step count, a 0-dim float32 tensor on the device.
        lr: The learning rate, a 0-dim float32 tensor on the device.
        betas: ``(beta1, beta2)``.
        eps: Added to the denominator.
        adam_w_mode: 1: decoupled weight decay (AdamW); 0: L2 added to the gradient.
        bias_correction: 1 to correct the moments' bias, else 0.
        weight_decay: The decay.
        inv_scale: The gradients' multiplier, a 0-dim float32 tensor.
        precheck: Check every bucket but the largest (launched first) for inf/nan before any
            is written, so that an inf anywhere skips the whole group.
    """
    if not rows:
        return
    device = rows[0][0].device
    beta1, beta2 = betas
    # Largest bucket first: its own launch checks its gradients before writing anything and
    # raises the flag that the later launches read, so only the others need a pre-check for
    # an inf to skip the whole group.
    buckets = sorted(
        group_by_device_dtype(list(rows)).items(),
        key=lambda kv: sum(t.numel() for t in kv[1][0]),
        reverse=True,
    )
    if precheck:
        for _, (_, gs, *_unused) in buckets[1:]:
            raise_on_nonfinite(noop, gs)
    next_step = step + 1
    for _, (ps, gs, ms, vs, masters) in buckets:
        multi_tensor_applier(
            amp_C.multi_tensor_adam_capturable_master,
            noop,
            [gs, ps, ms, vs, masters],
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
    step.add_((noop.reshape(()) == 0).to(torch.float32))


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


def raise_on_nonfinite(noop: Tensor, grads: list[Tensor]) -> None:
    """Set the int32 ``noop`` flag when any of ``grads`` holds an inf or a nan (on the device)."""
    if not grads:
        return
    norms = torch._foreach_norm(grads, float("inf"))
    bad = ~torch.isfinite(torch.stack([n.float() for n in norms])).all()
    noop.masked_fill_(bad.to(noop.device), 1)


def raise_on_nonfinite_flag(found_inf: Tensor, grads: list[Tensor]) -> None:
    """Set the float ``found_inf`` to 1 when any of ``grads`` holds an inf or a nan."""
    if not grads:
        return
    norms = torch._foreach_norm(grads, float("inf"))
    bad = ~torch.isfinite(torch.stack([n.float() for n in norms])).all()
    found_inf.masked_fill_(bad.to(found_inf.device), 1.0)
