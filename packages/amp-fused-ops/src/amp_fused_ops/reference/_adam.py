"""Reference Adam ``amp_C`` ops: plain, capturable and capturable with master weights.

Re-exported by :mod:`amp_fused_ops.reference._ops`, which documents the conventions they follow.
:func:`_adam_update` is also the first half of LAMB's step
(:mod:`amp_fused_ops.reference._layerwise`, :mod:`amp_fused_ops.reference._lamb_stages`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fused_ops.ops._preconditions import check_arguments
from amp_fused_ops.reference._common import (
    _FLOAT_DTYPES,
    _FP32_ONLY,
    TensorLists,
    _any_nonfinite,
    _check,
    _check_overlap,
    _fp32,
    _raise_flag,
    _scalar,
    _Tensors,
    _write,
    resolve_lr,
    resolve_step,
)
from amp_fused_ops.reference._stochastic_round import (
    check_stochastic_round,
    round_params,
)

__all__ = [
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
]

ADAM_MODE_L2 = 0  # weight decay added to the gradient (Adam with L2 regularisation)
ADAM_MODE_ADAMW = 1  # decoupled weight decay (AdamW)


def _adam_update(
    grads: _Tensors,
    params: _Tensors,
    exp_avgs: _Tensors,
    exp_avg_sqs: _Tensors,
    beta1: float,
    beta2: float,
    beta3: float,
    eps: float,
    bias_correction1: Tensor | float,
    bias_correction2: Tensor | float,
    mode: int,
    weight_decay: float,
) -> tuple[_Tensors, _Tensors, _Tensors]:
    """The moments and the Adam-style update on float32 lists (Adam's and LAMB's first pass).

    Returns new ``(update, exp_avgs, exp_avg_sqs)``::

        g = grads (+ weight_decay * params in mode 0)
        m = beta1 * m + beta3 * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / (sqrt(v / bc2) + eps) (+ weight_decay * params in mode 1)

    A ``weight_decay`` of 0 adds no term. The inputs are not modified (they may alias the
    caller's tensors).
    """
    if mode == ADAM_MODE_L2 and weight_decay != 0.0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    m = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(m, grads, alpha=beta3)
    v = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
    denom = torch._foreach_div(v, bias_correction2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, bias_correction1)
    torch._foreach_div_(update, denom)
    if mode == ADAM_MODE_ADAMW and weight_decay != 0.0:
        torch._foreach_add_(update, params, alpha=weight_decay)
    return update, m, v


def _adam_math(
    grads: _Tensors,
    params: _Tensors,
    exp_avgs: _Tensors,
    exp_avg_sqs: _Tensors,
    lr: Tensor | float,
    beta1: float,
    beta2: float,
    eps: float,
    bias_correction1: Tensor | float,
    bias_correction2: Tensor | float,
    mode: int,
    weight_decay: float,
) -> tuple[_Tensors, _Tensors, _Tensors]:
    """One Adam step on float32 lists; returns new ``(params, exp_avgs, exp_avg_sqs)``.

    The inputs are not modified (they may alias the caller's tensors).
    """
    update, m, v = _adam_update(
        grads,
        params,
        exp_avgs,
        exp_avg_sqs,
        beta1,
        beta2,
        1.0 - beta1,
        eps,
        bias_correction1,
        bias_correction2,
        mode,
        weight_decay,
    )
    torch._foreach_mul_(update, lr)
    new_params = torch._foreach_sub(params, update)
    return new_params, m, v


@torch.no_grad()
def multi_tensor_adam(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    step_tensor: Tensor | None = None,
    sr_seed: int | None = None,
    sr_step: int | None = None,
    lr_tensor: Tensor | None = None,
) -> None:
    """One Adam / AdamW step, in place, for every (grad, param, exp_avg, exp_avg_sq).

    Math in float32, Apex's ``AdamFunctor`` (``csrc/common/adam_math.h`` is the same formula
    for the compiled kernels)::

        g = grad (+ weight_decay * p in mode 0)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / (sqrt(v / bc2) + eps) (+ weight_decay * p in mode 1)
        p = p - lr * update

    with ``bc1 = 1 - beta1**step`` and ``bc2 = 1 - beta2**step`` when ``bias_correction`` is
    1, else 1.

    Where this differs from ``torch.optim``: in mode 1 the decoupled decay enters the update
    (``p -= lr * (update + weight_decay * p)``), as in Apex, where ``torch.optim.AdamW``
    first multiplies ``p *= 1 - lr * weight_decay`` and then subtracts ``lr * update`` (the
    results differ in rounding, and an infinite parameter becomes nan here). Where this
    differs from Apex: a ``weight_decay`` of 0 adds no term at all, so an infinite parameter
    stays infinite (Apex's kernel added ``0 * p``, a nan).

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; neither read nor written (inf/nan propagate, as
            in Apex).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]``: grads and params float32,
            float16 or bfloat16 (each list one dtype); the moments float32, as Apex's kernel
            reads them. Params and moments are updated in place.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        step: Step number (1 for the first step), for bias correction.
        mode: 0 L2 regularisation (``torch.optim.Adam``), 1 decoupled decay (``AdamW``).
        bias_correction: 1 to apply bias correction, 0 not to.
        weight_decay: Weight decay.
        step_tensor: The step count as a one-element CPU tensor, read instead of ``step``
            when given (the optimizers pass it so under ``torch.compile``).
        sr_seed: When given, the new params (bfloat16) are rounded stochastically instead of to
            nearest, with random bits keyed by ``(sr_seed, sr_step)``, the tensor's index in
            the lists and the element's offset in the tensor (:mod:`._stochastic_round`).
        sr_step: The step the random bits are keyed by (low 32 bits); by default ``step``.
        lr_tensor: The learning rate as a one-element floating-point CPU tensor, read instead
            of ``lr`` when given (see :func:`resolve_lr`).

    Raises:
        ValueError: Malformed lists, sizes, dtypes, noop flag, mode or bias_correction; a
            step below 1 with bias correction; a written tensor that shares
            memory with another tensor of the call; ``sr_seed`` with params that are not
            bfloat16.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_adam"
    step = resolve_step(op, step, step_tensor)
    lr = resolve_lr(op, lr, lr_tensor)
    check_arguments(op, {"mode": mode, "bias_correction": bias_correction, "step": step})
    names = [("grads", "params", "exp_avgs", "exp_avg_sqs")]
    dtypes = [_FLOAT_DTYPES, _FLOAT_DTYPES, _FP32_ONLY, _FP32_ONLY]
    if _check(op, chunk_size, noop_flag, tensor_lists, names, dtypes) is None:
        return
    if sr_seed is not None:
        check_stochastic_round(op, tensor_lists, 4)
    _check_overlap(op, tensor_lists, (1, 2, 3))
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists
    bc1 = 1.0 - beta1**step if bias_correction == 1 else 1.0
    bc2 = 1.0 - beta2**step if bias_correction == 1 else 1.0
    new_p, new_m, new_v = _adam_math(
        _fp32(grads, like=params),
        _fp32(params),
        _fp32(exp_avgs, like=params),
        _fp32(exp_avg_sqs, like=params),
        float(lr),
        beta1,
        beta2,
        eps,
        bc1,
        bc2,
        mode,
        weight_decay,
    )
    _write(params, round_params(params, new_p, sr_seed, step if sr_step is None else sr_step))
    _write(exp_avgs, new_m)
    _write(exp_avg_sqs, new_v)


@torch.no_grad()
def multi_tensor_adam_capturable_master(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Adam step on float32 master weights, writing the low-precision model copy in the same op.

    Capturable: ``lr``, ``step`` and ``inv_scale`` are device tensors and nothing syncs the host,
    so the call can be recorded in a CUDA graph. The gradient is ``grad * inv_scale`` (the loss
    scale removed); the Adam math is that of :func:`multi_tensor_adam`, applied to the masters.

    Nothing is written (params, masters and moments keep their values) when ``noop_flag`` is
    nonzero on entry -- the ``found_inf`` pattern of ``torch.amp.GradScaler`` -- or when any
    unscaled gradient holds an inf or a nan; in the latter case ``noop_flag`` is set to 1.
    Gradients are never modified (Apex wrote the unscaled gradients back into them).

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor, read and possibly set (see above).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs, master_params]``: grads and
            params float32, float16 or bfloat16; moments and masters float32.
        lr: One-element float32 tensor, the learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        step: One-element tensor (int32 in Apex, any number dtype here), the step number.
        mode: 0 L2 regularisation, 1 decoupled decay (AdamW).
        bias_correction: 1 to apply bias correction, 0 not to.
        weight_decay: Weight decay.
        inv_scale: One-element float32 tensor, the inverse of the loss scale.

    Raises:
        ValueError: Malformed lists, sizes, dtypes, noop flag, mode or bias_correction.
        RuntimeError: Tensors on different devices.
    """
    return _capturable_adam(
        "multi_tensor_adam_capturable_master",
        chunk_size,
        noop_flag,
        tensor_lists,
        lr,
        beta1,
        beta2,
        eps,
        step,
        mode,
        bias_correction,
        weight_decay,
        inv_scale,
    )


@torch.no_grad()
def multi_tensor_adam_capturable(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Capturable Adam step in place on the params themselves (Apex's capturable path).

    ``lr``, ``step`` and ``inv_scale`` are device tensors and nothing syncs the host, so the
    call can be recorded in a CUDA graph. The gradient is ``grad * inv_scale``; the Adam math
    is that of :func:`multi_tensor_adam`, in float32, on the params' values; params keep their
    dtype and are rounded once per step.

    As in Apex, the unscaled gradient ``grad * inv_scale`` is written back into each gradient
    (so that ``torch.amp.GradScaler`` users find unscaled gradients after the step). Nothing
    is written -- gradients, params and moments keep their values -- when ``noop_flag`` is
    nonzero on entry (the ``found_inf`` pattern of ``torch.amp.GradScaler``) or when any
    unscaled gradient holds an inf or a nan; in the latter case ``noop_flag`` is set to 1
    (Apex's kernel wrote the non-finite values into the params instead).

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor, read and possibly set (see above).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]``: grads and params float32,
            float16 or bfloat16; moments float32 (Apex's kernel reads them as float32; it
            rounded them to the params' dtype when storing, which this op does not).
        lr: One-element float32 tensor, the learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        step: One-element tensor (int32 in Apex, any number dtype here), the step number.
        mode: 0 L2 regularisation, 1 decoupled decay (AdamW).
        bias_correction: 1 to apply bias correction, 0 not to.
        weight_decay: Weight decay.
        inv_scale: One-element float32 tensor, the inverse of the loss scale.

    Raises:
        ValueError: Malformed lists, sizes, dtypes, noop flag, mode or bias_correction.
        RuntimeError: Tensors on different devices.
    """
    _capturable_adam(
        "multi_tensor_adam_capturable",
        chunk_size,
        noop_flag,
        tensor_lists,
        lr,
        beta1,
        beta2,
        eps,
        step,
        mode,
        bias_correction,
        weight_decay,
        inv_scale,
    )


def _capturable_adam(
    op: str,
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: Tensor,
    mode: int,
    bias_correction: int,
    weight_decay: float,
    inv_scale: Tensor,
) -> None:
    """Both capturable Adam ops: with a fifth list of float32 masters (``..._master``: the
    masters are stepped, the params written from them, the grads left alone), or without
    (the params are stepped and the unscaled grads written back)."""
    check_arguments(op, {"mode": mode, "bias_correction": bias_correction})
    master = op.endswith("_master")
    names: list[tuple[str, ...]] = [("grads", "params", "exp_avgs", "exp_avg_sqs")]
    dtypes = [_FLOAT_DTYPES, _FLOAT_DTYPES, _FP32_ONLY, _FP32_ONLY]
    if master:
        names, dtypes = [(*names[0], "master_params")], [*dtypes, _FP32_ONLY]
    device = _check(op, chunk_size, noop_flag, tensor_lists, names, dtypes)
    if device is None:
        return
    # A float32 param may be its own master (lists 1 and 4); nothing else may share memory.
    # Without masters the unscaled grads are written back.
    if master:
        _check_overlap(op, tensor_lists, (1, 2, 3, 4), in_place=[(1, 4)])
    else:
        _check_overlap(op, tensor_lists, (0, 1, 2, 3))
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists[:4]
    lr_t = _scalar(op, "lr", lr, device)
    step_t = _scalar(op, "step", step, device)
    one = torch.ones((), dtype=torch.float32, device=device)
    bc1 = 1.0 - torch.pow(beta1, step_t) if bias_correction == 1 else one
    bc2 = 1.0 - torch.pow(beta2, step_t) if bias_correction == 1 else one

    weights = list(tensor_lists[4]) if master else _fp32(params)
    unscaled = torch._foreach_mul(
        _fp32(grads, like=params), _scalar(op, "inv_scale", inv_scale, device)
    )
    nonfinite = _any_nonfinite(unscaled, device)
    skip = (noop_flag.reshape(()) != 0) | nonfinite
    new_p, new_m, new_v = _adam_math(
        unscaled,
        weights,
        _fp32(exp_avgs, like=params),
        _fp32(exp_avg_sqs, like=params),
        lr_t,
        beta1,
        beta2,
        eps,
        bc1,
        bc2,
        mode,
        weight_decay,
    )
    if master:
        _write(tensor_lists[4], new_p, skip)
    else:
        _write(grads, unscaled, skip)
    _write(params, new_p, skip)
    _write(exp_avgs, new_m, skip)
    _write(exp_avg_sqs, new_v, skip)
    _raise_flag(noop_flag, nonfinite)
