"""Reference SGD and Adagrad ``amp_C`` ops (Adam's are in :mod:`amp_fused_ops.reference._adam`).

Re-exported by :mod:`amp_fused_ops.reference._ops`, which documents the conventions they follow.
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fused_ops.ops._preconditions import check_arguments
from amp_fused_ops.reference._common import (
    TensorLists,
    _check,
    _check_overlap,
    _check_state_dtype,
    _fp32,
    _write,
    resolve_lr,
    resolve_step,
)
from amp_fused_ops.reference._stochastic_round import (
    check_stochastic_round,
    round_params,
)

__all__ = ["multi_tensor_sgd", "multi_tensor_adagrad"]


@torch.no_grad()
def multi_tensor_sgd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    weight_decay: float,
    momentum: float,
    dampening: float,
    lr: float,
    nesterov: bool,
    first_run: bool,
    wd_after_momentum: bool,
    scale: float,
    sr_seed: int | None = None,
    sr_step: int | None = None,
    step_tensor: Tensor | None = None,
    lr_tensor: Tensor | None = None,
) -> None:
    """One SGD step (Apex ``FusedSGD``), in place, optionally writing a low-precision copy.

    Math in float32 (Apex's ``SGDFunctor``)::

        g = grad * scale
        g += weight_decay * p                      (unless wd_after_momentum)
        if momentum != 0:
            buf = g if first_run else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        g += weight_decay * p                      (if wd_after_momentum)
        p = p - lr * g;  copy = p                   (copy: the 4th list, if given)

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; when nonzero on entry nothing is written (checked
            on the device, no host sync). Never set by this op.
        tensor_lists: ``[grads, params, momentum_bufs]`` or ``[grads, params, momentum_bufs,
            model_copies]``; momentum buffers are left untouched when ``momentum`` is 0.
            Every list takes float32, float16 or bfloat16; each momentum buffer is float32
            or its param's dtype (Apex keeps it in the param's dtype).
        weight_decay: Weight decay.
        momentum: Momentum factor (0 disables the buffer).
        dampening: Dampening of the gradient in the momentum update.
        lr: Learning rate.
        nesterov: Use Nesterov momentum.
        first_run: Initialise the momentum buffers with the gradient (first step).
        wd_after_momentum: Apply weight decay after the momentum update instead of before.
        scale: Multiplier of the gradients (the inverse loss scale).
        sr_seed: When given, the new params (bfloat16, three lists) are rounded
            stochastically, as :func:`multi_tensor_adam`'s.
        sr_step: The step the random bits are keyed by (None: 0).
        step_tensor: ``sr_step`` as a one-element CPU tensor (what ``FusedSGD`` passes under
            ``torch.compile``); when given, ``sr_step`` is not read.
        lr_tensor: The learning rate as a one-element floating-point CPU tensor, read instead
            of ``lr`` when given (see :func:`resolve_lr`).

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype (a momentum buffer neither
            float32 nor its param's dtype included) or noop flag; ``sr_seed`` with params that
            are not bfloat16 or with model copies.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_sgd"
    names = [
        ("grads", "params", "momentum_bufs"),
        ("grads", "params", "momentum_bufs", "model_copies"),
    ]
    device = _check(op, chunk_size, noop_flag, tensor_lists, names)
    if device is None:
        return
    _check_state_dtype(op, tensor_lists, 2, 1)
    if sr_seed is not None:
        check_stochastic_round(op, tensor_lists, 3)
    _check_overlap(op, tensor_lists, (1, 2, 3) if len(tensor_lists) == 4 else (1, 2))
    grads, params, bufs = tensor_lists[0], tensor_lists[1], tensor_lists[2]
    skip = noop_flag.reshape(()) != 0
    p = _fp32(params)
    g = torch._foreach_mul(_fp32(grads, like=params), float(scale))
    if weight_decay != 0.0 and not wd_after_momentum:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    if momentum != 0.0:
        if first_run:
            new_bufs = g
        else:
            new_bufs = torch._foreach_mul(_fp32(bufs, like=params), momentum)
            torch._foreach_add_(new_bufs, g, alpha=1.0 - dampening)
        g = torch._foreach_add(g, new_bufs, alpha=momentum) if nesterov else new_bufs
        _write(bufs, new_bufs, skip)
    if weight_decay != 0.0 and wd_after_momentum:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    new_p = torch._foreach_add(p, g, alpha=-resolve_lr(op, lr, lr_tensor))
    round_step = resolve_step(op, sr_step or 0, step_tensor)
    _write(params, round_params(params, new_p, sr_seed, round_step), skip)
    if len(tensor_lists) == 4:
        _write(tensor_lists[3], new_p, skip)


ADAGRAD_MODE_L2 = 0  # weight decay added to the gradient
ADAGRAD_MODE_DECOUPLED = 1  # decoupled (AdamW-style) weight decay


@torch.no_grad()
def multi_tensor_adagrad(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    epsilon: float,
    mode: int,
    weight_decay: float,
    lr_tensor: Tensor | None = None,
) -> None:
    """One Adagrad step, in place, for every (grad, param, state_sum).

    Math in float32 (Apex's ``AdagradFunctor``)::

        g = grad (+ weight_decay * p in mode 0)
        h = h + g * g
        p = p - lr * (g / (sqrt(h) + epsilon) (+ weight_decay * p in mode 1))

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; neither read nor written (inf/nan propagate).
        tensor_lists: ``[grads, params, state_sums]``; params and sums updated in place.
            Every list takes float32, float16 or bfloat16; each sum is float32 or its
            param's dtype (Apex keeps it in the param's dtype).
        lr: Learning rate.
        epsilon: Added to the denominator.
        mode: 0 L2 regularisation (``torch.optim.Adagrad``), 1 decoupled weight decay.
        weight_decay: Weight decay.
        lr_tensor: The learning rate as a one-element floating-point CPU tensor, read instead
            of ``lr`` when given (see :func:`resolve_lr`).

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype (a sum neither float32 nor
            its param's dtype included), noop flag or mode.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_adagrad"
    check_arguments(op, {"mode": mode})
    names = [("grads", "params", "state_sums")]
    if _check(op, chunk_size, noop_flag, tensor_lists, names) is None:
        return
    _check_state_dtype(op, tensor_lists, 2, 1)
    _check_overlap(op, tensor_lists, (1, 2))
    grads, params, sums = tensor_lists
    p = _fp32(params)
    g = _fp32(grads, like=params)
    if mode == ADAGRAD_MODE_L2 and weight_decay != 0.0:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    h = torch._foreach_addcmul(_fp32(sums, like=params), g, g)
    denom = torch._foreach_sqrt(h)
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(g, denom)
    if mode == ADAGRAD_MODE_DECOUPLED and weight_decay != 0.0:
        torch._foreach_add_(update, p, alpha=weight_decay)
    _write(params, torch._foreach_add(p, update, alpha=-resolve_lr(op, lr, lr_tensor)))
    _write(sums, h)
