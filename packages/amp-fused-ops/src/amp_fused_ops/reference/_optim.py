"""Reference Adam (plain, capturable, capturable master-weight), SGD and Adagrad ``amp_C`` ops.

Re-exported by :mod:`amp_fused_ops.reference._ops`, which documents the conventions they follow.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    _check_state_dtype,
    _fp32,
    _raise_flag,
    _scalar,
    _Tensors,
    _write,
    resolve_lr,
    resolve_step,
)
from amp_fused_ops.reference._stochastic_round import stochastic_round_bf16

__all__ = [
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_sgd",
    "multi_tensor_adagrad",
]

# ---------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------


def _check_stochastic_round(op: str, tensor_lists: TensorLists, lists: int) -> None:
    """The preconditions of ``sr_seed``: bfloat16 params, no list of model copies."""
    if len(tensor_lists) != lists:
        raise ValueError(
            f"{op}: stochastic rounding (sr_seed) rounds the params themselves; pass {lists} "
            f"tensor lists (no model copies), got {len(tensor_lists)}"
        )
    for i, p in enumerate(tensor_lists[1]):
        if p.dtype != torch.bfloat16:
            raise ValueError(
                f"{op}: stochastic rounding (sr_seed) needs bfloat16 params, got {p.dtype} for "
                f"tensor_lists[1][{i}]; pass sr_seed=None for other dtypes"
            )


def _round_params(
    params: Sequence[Tensor], new_p: _Tensors, sr_seed: int | None, sr_step: int
) -> _Tensors:
    """``new_p`` rounded stochastically for ``params`` when ``sr_seed`` is given, else as is."""
    if sr_seed is None:
        return new_p
    return [
        stochastic_round_bf16(v, p, sr_seed, sr_step, i)
        for i, (p, v) in enumerate(zip(params, new_p, strict=True))
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
        _check_stochastic_round(op, tensor_lists, 4)
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
    _write(params, _round_params(params, new_p, sr_seed, step if sr_step is None else sr_step))
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
    lr_t = _scalar(lr, device)
    step_t = _scalar(step, device)
    one = torch.ones((), dtype=torch.float32, device=device)
    bc1 = 1.0 - torch.pow(beta1, step_t) if bias_correction == 1 else one
    bc2 = 1.0 - torch.pow(beta2, step_t) if bias_correction == 1 else one

    weights = list(tensor_lists[4]) if master else _fp32(params)
    unscaled = torch._foreach_mul(_fp32(grads, like=params), _scalar(inv_scale, device))
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
        _check_stochastic_round(op, tensor_lists, 3)
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
    _write(params, _round_params(params, new_p, sr_seed, round_step), skip)
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
