"""Reference LAMB ``amp_C`` ops of Apex beside ``multi_tensor_lamb``: the two stages and ``_mp``.

Re-exported by :mod:`amp_fused_ops.reference._ops`, which documents the conventions they follow.

* ``multi_tensor_lamb_stage1_cuda`` / ``multi_tensor_lamb_stage2_cuda`` (Apex's
  ``csrc/multi_tensor_lamb_stage_1.cu`` / ``csrc/multi_tensor_lamb_stage_2.cu``): the LAMB
  step cut in two, with the update kept in a list of its own between them and the per-tensor
  norms computed by the caller (NVIDIA's BERT recipes call them this way). The names end in
  ``_cuda`` because Apex's did; here they run on every device.
* ``multi_tensor_lamb_mp`` (``csrc/multi_tensor_lamb_mp.cu``): the whole step of Apex's
  ``FusedMixedPrecisionLamb`` with ``lr``, ``step``, the norms and the loss scale as device
  tensors, optionally on float32 masters of half model params.

All math is float32 whatever the storage dtypes (Apex's stages computed in the params' dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fused_ops.ops._preconditions import check_arguments
from amp_fused_ops.reference._adam import _adam_update
from amp_fused_ops.reference._common import (
    _FLOAT_DTYPES,
    _FP32_ONLY,
    TensorLists,
    _check,
    _check_overlap,
    _check_state_dtype,
    _check_state_lists,
    _fp32,
    _per_tensor,
    _raise_flag,
    _scalar,
    _write,
    resolve_step,
)
from amp_fused_ops.reference._layerwise import (
    MOMENT_MODE_DECOUPLED,
    _clip_divisor,
    _lamb_update,
    _trust_ratios,
)

__all__ = [
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_lamb_mp",
]


def _step_sizes(
    param_norms: Tensor, update_norms: Tensor, lr: Tensor | float, use_ratio: bool
) -> Tensor:
    """Per-tensor step size: ``lr * ||p|| / ||update||`` where both norms are nonzero and the
    ratio applies (``use_nvlamb`` or a nonzero weight decay), else ``lr``."""
    lr_t = torch.as_tensor(lr, dtype=torch.float32, device=param_norms.device)
    if not use_ratio:
        return lr_t.expand_as(param_norms)
    return lr_t * _trust_ratios(param_norms, update_norms)


@torch.no_grad()
def multi_tensor_lamb_stage1_cuda(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor_decay: Tensor,
    step: int,
    beta1: float,
    beta2: float,
    epsilon: float,
    global_grad_norm: Tensor | float,
    max_global_grad_norm: float,
    step_tensor: Tensor | None = None,
) -> None:
    """LAMB stage 1: the moments and the Adam-style update of every tensor, in place.

    Math in float32 (Apex's ``LAMBStage1Functor``), with ``decay`` the tensor's entry of
    ``per_tensor_decay``::

        clip = global_grad_norm / max_global_grad_norm if that norm is larger, else 1
        g = grad / clip
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / (sqrt(v / bc2) + epsilon) + decay * p

    with ``bc1 = 1 - beta1**(step + 1)`` and ``bc2 = 1 - beta2**(step + 1)``: as in Apex,
    ``step`` counts the steps already taken (0 on the first call) and bias correction is
    always on. Params and gradients are not modified; stage 2 applies the update.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; neither read nor written (inf/nan propagate).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs, updates]``; the moments (one
            dtype, float32 or the params') and the updates (float32 or the params' dtype) are
            written.
        per_tensor_decay: Float32 tensor of one weight decay per tensor.
        step: Steps taken before this one.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        epsilon: Added to the denominator.
        global_grad_norm: One-element float32 tensor (Apex) or a number: the L2 norm of all
            gradients together.
        max_global_grad_norm: Clipping threshold of ``global_grad_norm``.
        step_tensor: The step count as a one-element CPU tensor, read instead of ``step``
            when given (the optimizers pass it so under ``torch.compile``).

    Raises:
        TypeError: ``per_tensor_decay`` is not a tensor.
        ValueError: Malformed lists, sizes, dtypes, noop flag or ``per_tensor_decay``.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_lamb_stage1_cuda"
    step = resolve_step(op, step, step_tensor)
    names = [("grads", "params", "exp_avgs", "exp_avg_sqs", "updates")]
    device = _check(op, chunk_size, noop_flag, tensor_lists, names)
    if device is None:
        return
    _check_state_lists(op, tensor_lists, 2, 3, 1)  # the moments
    _check_state_dtype(op, tensor_lists, 4, 1)  # the updates
    _check_overlap(op, tensor_lists, (2, 3, 4))
    grads, params, exp_avgs, exp_avg_sqs, updates = tensor_lists
    decay = _per_tensor(op, "per_tensor_decay", per_tensor_decay, len(grads), device)
    bc1 = 1.0 - beta1 ** (step + 1)
    bc2 = 1.0 - beta2 ** (step + 1)
    clip = _clip_divisor(
        _scalar(op, "global_grad_norm", global_grad_norm, device), float(max_global_grad_norm)
    )

    p = _fp32(params)
    # The decay is per tensor: added below, not by _adam_update.
    update, m, v = _adam_update(
        torch._foreach_div(_fp32(grads, like=params), clip),
        p,
        _fp32(exp_avgs, like=params),
        _fp32(exp_avg_sqs, like=params),
        beta1,
        beta2,
        1.0 - beta1,
        epsilon,
        bc1,
        bc2,
        MOMENT_MODE_DECOUPLED,
        0.0,
    )
    torch._foreach_add_(update, torch._foreach_mul(p, list(decay.unbind(0))))
    _write(updates, update)
    _write(exp_avgs, m)
    _write(exp_avg_sqs, v)


@torch.no_grad()
def multi_tensor_lamb_stage2_cuda(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    per_tensor_param_norm: Tensor,
    per_tensor_update_norm: Tensor,
    lr: float,
    weight_decay: float,
    use_nvlamb: bool | None = None,
) -> None:
    """LAMB stage 2: ``p = p - ratio * update`` with one trust ratio per tensor, in place.

    ``ratio = lr * param_norm / update_norm`` when both norms of the tensor are nonzero and
    either ``use_nvlamb`` is true or ``weight_decay`` is nonzero (Apex: "only apply to those
    with non-zero weight decay"); otherwise ``ratio = lr``. Math in float32.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; neither read nor written (inf/nan propagate).
        tensor_lists: ``[params, updates]`` (updates float32 or the params' dtype); params are
            written.
        per_tensor_param_norm: Float32 tensor of one L2 norm per param (taken before stage 1).
        per_tensor_update_norm: Float32 tensor of one L2 norm per update.
        lr: Learning rate.
        weight_decay: Only tested against 0 (the decay itself is in the update of stage 1).
        use_nvlamb: Apply the ratio whatever the weight decay (None means False, as in Apex).

    Raises:
        TypeError: A norm argument is not a tensor.
        ValueError: Malformed lists, sizes, dtypes, noop flag or norm tensors.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_lamb_stage2_cuda"
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("params", "updates")])
    if device is None:
        return
    _check_state_dtype(op, tensor_lists, 1, 0)  # the updates
    _check_overlap(op, tensor_lists, (0,))
    params, updates = tensor_lists
    n = len(params)
    param_norms = _per_tensor(op, "per_tensor_param_norm", per_tensor_param_norm, n, device)
    update_norms = _per_tensor(op, "per_tensor_update_norm", per_tensor_update_norm, n, device)
    ratios = _step_sizes(
        param_norms, update_norms, float(lr), bool(use_nvlamb) or weight_decay != 0.0
    )
    step = torch._foreach_mul(_fp32(updates, like=params), list(ratios.unbind(0)))
    _write(params, torch._foreach_sub(_fp32(params), step))


@torch.no_grad()
def multi_tensor_lamb_mp(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: Tensor,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: Tensor,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor,
    max_grad_norm: Tensor,
    use_nvlamb: bool | None,
    found_inf: Tensor,
    inv_scale: Tensor,
) -> None:
    """One LAMB step with device-side scalars, optionally on float32 masters (Apex's ``_mp``).

    Math in float32 (Apex's ``multi_tensor_lamb_mp``), with ``g = grad * inv_scale``::

        clip = global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1
        g = g / clip (+ weight_decay * p in mode 0)
        m = beta1 * m + beta3 * g          beta3 = 1 - beta1 if grad_averaging else 1
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / (sqrt(v / bc2) + epsilon) (+ weight_decay * p in mode 1)
        p = p - ratio * update             ratio as multi_tensor_lamb_stage2_cuda, with lr

    with ``bc1 = 1 - beta1**step``, ``bc2 = 1 - beta2**step`` when ``bias_correction`` is 1.
    ``global_grad_norm`` and ``max_grad_norm`` are both of the *scaled* gradients (Apex's
    ``FusedMixedPrecisionLamb`` passes ``max_grad_norm * scale``), so the clip is unscaled.

    Nothing is written when ``noop_flag`` or ``found_inf`` is nonzero on entry, or when a
    param or update norm is inf or nan (then ``noop_flag`` is set to 1). Apex read the flag
    but not ``found_inf`` (its optimizer copies ``found_inf`` into the flag first), and when an
    update norm was not finite it had already written the moments. Gradients are not modified
    (Apex stored the update in them).

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor, read and possibly set (see above).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]`` (moments float32 or the
            params' dtype) or ``[grads, master_params, exp_avgs, exp_avg_sqs, model_params]``
            (masters and moments float32; the model params receive the new masters).
        lr: One-element tensor, the learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        epsilon: Added to the denominator.
        step: One-element tensor (int32 in Apex, any number dtype here), the step number.
        bias_correction: 1 to apply bias correction, 0 not to.
        weight_decay: Weight decay.
        grad_averaging: 1 to scale the gradient by ``1 - beta1`` in the first moment, 0 not to.
        mode: 0 L2 regularisation, 1 decoupled decay.
        global_grad_norm: One-element tensor, the L2 norm of all (scaled) gradients.
        max_grad_norm: One-element tensor, the clipping threshold (of scaled gradients).
        use_nvlamb: Apply the trust ratio also when ``weight_decay`` is 0 (None means False).
        found_inf: One-element tensor; nonzero skips the step.
        inv_scale: One-element tensor, the inverse of the loss scale.

    Raises:
        ValueError: Malformed lists, sizes, dtypes, noop flag, bias_correction,
            grad_averaging or mode.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_lamb_mp"
    check_arguments(
        op, {"bias_correction": bias_correction, "grad_averaging": grad_averaging, "mode": mode}
    )
    names = [
        ("grads", "params", "exp_avgs", "exp_avg_sqs"),
        ("grads", "master_params", "exp_avgs", "exp_avg_sqs", "model_params"),
    ]
    dtypes = None
    if isinstance(tensor_lists, (list, tuple)) and len(tensor_lists) == 5:
        dtypes = [_FLOAT_DTYPES, _FP32_ONLY, _FP32_ONLY, _FP32_ONLY, _FLOAT_DTYPES]
    device = _check(op, chunk_size, noop_flag, tensor_lists, names, dtypes)
    if device is None:
        return
    # A float32 model param may be its own master (lists 1 and 4).
    _check_overlap(op, tensor_lists, (1, 2, 3, 4), in_place=[(1, 4)])
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists[:4]
    step_t = _scalar(op, "step", step, device)
    one = torch.ones((), dtype=torch.float32, device=device)
    bc1 = 1.0 - torch.pow(beta1, step_t) if bias_correction == 1 else one
    bc2 = 1.0 - torch.pow(beta2, step_t) if bias_correction == 1 else one
    beta3 = 1.0 - beta1 if grad_averaging == 1 else 1.0
    clip = _clip_divisor(
        _scalar(op, "global_grad_norm", global_grad_norm, device),
        _scalar(op, "max_grad_norm", max_grad_norm, device),
    )

    g = torch._foreach_mul(_fp32(grads, like=params), _scalar(op, "inv_scale", inv_scale, device))
    torch._foreach_div_(g, clip)
    p, update, m, v, param_norms, update_norms = _lamb_update(
        g, params, exp_avgs, exp_avg_sqs, beta1, beta2, beta3, epsilon, bc1, bc2, mode, weight_decay
    )
    nonfinite = ~(torch.isfinite(param_norms).all() & torch.isfinite(update_norms).all())
    skip = (
        (noop_flag.reshape(()) != 0)
        | (_scalar(op, "found_inf", found_inf, device) != 0)
        | nonfinite
    )
    use_ratio = bool(use_nvlamb) or weight_decay != 0.0
    ratios = _step_sizes(param_norms, update_norms, _scalar(op, "lr", lr, device), use_ratio)
    new_p = torch._foreach_sub(p, torch._foreach_mul(update, list(ratios.unbind(0))))
    _write(params, new_p, skip)
    if len(tensor_lists) == 5:
        _write(tensor_lists[4], new_p, skip)
    _write(exp_avgs, m, skip)
    _write(exp_avg_sqs, v, skip)
    _raise_flag(noop_flag, nonfinite)
