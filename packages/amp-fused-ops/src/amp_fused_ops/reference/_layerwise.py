"""Reference LAMB and NovoGrad ``amp_C`` ops: optimizers with a per-tensor (layer-wise) scale.

Re-exported by :mod:`amp_fused_ops.reference._ops`, which documents the conventions they follow.
Both follow Apex's kernels (``csrc/multi_tensor_lamb.cu``, ``csrc/multi_tensor_novograd.cu``)
except that gradients are never modified (Apex's LAMB stores the update in the gradients) and
intermediate values stay in float32 whatever the storage dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fused_ops.ops._preconditions import check_arguments
from amp_fused_ops.ops._sharding import per_tensor_norms
from amp_fused_ops.reference._adam import _adam_update
from amp_fused_ops.reference._common import (
    TensorLists,
    _check,
    _check_overlap,
    _check_state_lists,
    _fp32,
    _per_tensor,
    _raise_flag,
    _scalar,
    _Tensors,
    _write,
    resolve_lr,
    resolve_step,
)

__all__ = ["multi_tensor_lamb", "multi_tensor_novograd"]

MOMENT_MODE_L2 = 0  # weight decay added to the gradient (L2 regularisation)
MOMENT_MODE_DECOUPLED = 1  # decoupled weight decay (AdamW-style)
NORM_TYPE_INF = 0  # NovoGrad: per-tensor max-abs norm
NORM_TYPE_L2 = 2  # NovoGrad: per-tensor L2 norm


def _per_tensor_norms(tensors: Sequence[Tensor], ord: float) -> Tensor:
    """Float32 ``(len(tensors),)`` tensor of the ``ord``-norm of each tensor (of each whole
    tensor when the op runs on DTensor shards: :mod:`amp_fused_ops.ops._sharding`)."""
    return per_tensor_norms(tensors, ord)


def _clip_divisor(norm: Tensor, max_norm: Tensor | float) -> Tensor:
    """LAMB's clipping divisor of the gradients: ``norm / max_norm`` when ``norm`` is larger,
    else 1 (a ``max_norm`` of 0 clips every nonzero norm: ``g / inf = 0``, as Apex)."""
    return torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm))


def _trust_ratios(param_norms: Tensor, update_norms: Tensor) -> Tensor:
    """LAMB's per-tensor trust ratio ``||p|| / ||update||`` where both norms are nonzero, else 1.

    The callers apply it only when the ratio applies (``use_nvlamb`` or a nonzero weight decay).
    """
    usable = (param_norms != 0) & (update_norms != 0)
    return torch.where(usable, param_norms / update_norms, torch.ones_like(param_norms))


def _lamb_update(
    g: _Tensors,
    params: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    beta1: float,
    beta2: float,
    beta3: float,
    epsilon: float,
    bc1: Tensor | float,
    bc2: Tensor | float,
    mode: int,
    weight_decay: float,
) -> tuple[_Tensors, _Tensors, _Tensors, _Tensors, Tensor, Tensor]:
    """LAMB's first pass on the clipped float32 gradients ``g`` (the storage lists are read).

    Returns float32 ``(params, update, exp_avgs, exp_avg_sqs, param_norms, update_norms)``:
    the update of :func:`_adam_update` and the per-tensor L2 norms of the params and updates.
    """
    p = _fp32(params)
    update, m, v = _adam_update(
        g,
        p,
        _fp32(exp_avgs, like=params),
        _fp32(exp_avg_sqs, like=params),
        beta1,
        beta2,
        beta3,
        epsilon,
        bc1,
        bc2,
        mode,
        weight_decay,
    )
    return p, update, m, v, _per_tensor_norms(p, 2), _per_tensor_norms(update, 2)


@torch.no_grad()
def multi_tensor_lamb(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    global_grad_norm: Tensor | float,
    max_grad_norm: float,
    use_nvlamb: bool | None = None,
    step_tensor: Tensor | None = None,
    lr_tensor: Tensor | None = None,
) -> None:
    """One LAMB step, in place, for every (grad, param, exp_avg, exp_avg_sq).

    Math in float32 (Apex's ``LAMBStage1Functor`` and ``LAMBStage2Functor``)::

        clip = global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1
        g = grad / clip (+ weight_decay * p in mode 0)
        m = beta1 * m + beta3 * g          beta3 = 1 - beta1 if grad_averaging else 1
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / (sqrt(v / bc2) + epsilon) (+ weight_decay * p in mode 1)
        ratio = ||p|| / ||update||         per tensor, when use_nvlamb or weight_decay != 0
                                           and both norms are nonzero; else 1
        p = p - lr * ratio * update

    with ``bc1 = 1 - beta1**step`` and ``bc2 = 1 - beta2**step`` when ``bias_correction`` is
    1, else 1. ``||p||`` is the L2 norm of the parameter before the step. As in Apex, a
    ``max_grad_norm`` of 0 makes every nonzero ``global_grad_norm`` clip the gradients to 0.

    Unlike Apex, the gradients are not modified (Apex's kernel overwrote them with the update)
    and the update keeps float32 precision before its norm is taken.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; never read (the step is always written, inf/nan
            propagate), set to 1 when a parameter or update norm is inf or nan (Apex's norm
            kernels do the same).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]``; params and both moments are
            updated in place and keep their dtypes.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        epsilon: Added to the denominator.
        step: Step number (1 for the first step), for bias correction.
        bias_correction: 1 to apply bias correction, 0 not to.
        weight_decay: Weight decay.
        grad_averaging: 1 to scale the gradient by ``1 - beta1`` in the first moment, 0 not to.
        mode: 0 L2 regularisation (decay added to the gradient), 1 decoupled decay.
        global_grad_norm: One-element float32 tensor (Apex) or a number: the L2 norm of all
            gradients together, used for clipping.
        max_grad_norm: Clipping threshold of ``global_grad_norm``.
        use_nvlamb: Apply the trust ratio to every tensor, also when ``weight_decay`` is 0
            (None means False, as in Apex).
        step_tensor: The step count as a one-element CPU tensor, read instead of ``step``
            when given (the optimizers pass it so under ``torch.compile``).
        lr_tensor: The learning rate as a one-element floating-point CPU tensor, read instead
            of ``lr`` when given (see :func:`resolve_lr`).

    Raises:
        ValueError: Malformed lists, sizes, dtypes, noop flag, bias_correction, grad_averaging
            or mode.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_lamb"
    step = resolve_step(op, step, step_tensor)
    lr = resolve_lr(op, lr, lr_tensor)
    check_arguments(
        op, {"bias_correction": bias_correction, "grad_averaging": grad_averaging, "mode": mode}
    )
    names = [("grads", "params", "exp_avgs", "exp_avg_sqs")]
    device = _check(op, chunk_size, noop_flag, tensor_lists, names)
    if device is None:
        return
    _check_state_lists(op, tensor_lists, 2, 3, 1)
    _check_overlap(op, tensor_lists, (1, 2, 3))
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists
    bc1 = 1.0 - beta1**step if bias_correction == 1 else 1.0
    bc2 = 1.0 - beta2**step if bias_correction == 1 else 1.0
    beta3 = 1.0 - beta1 if grad_averaging == 1 else 1.0

    clip = _clip_divisor(
        _scalar(op, "global_grad_norm", global_grad_norm, device), float(max_grad_norm)
    )

    g = torch._foreach_div(_fp32(grads, like=params), clip)
    p, update, m, v, param_norms, update_norms = _lamb_update(
        g, params, exp_avgs, exp_avg_sqs, beta1, beta2, beta3, epsilon, bc1, bc2, mode, weight_decay
    )
    finite = torch.isfinite(param_norms).all() & torch.isfinite(update_norms).all()
    if use_nvlamb or weight_decay != 0.0:
        ratios = _trust_ratios(param_norms, update_norms)
        update = [u * r for u, r in zip(update, ratios.unbind(0), strict=True)]
    _write(params, torch._foreach_add(p, update, alpha=-float(lr)))
    _write(exp_avgs, m)
    _write(exp_avg_sqs, v)
    _raise_flag(noop_flag, ~finite)


@torch.no_grad()
def multi_tensor_novograd(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    grad_norms: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    step: int,
    bias_correction: int,
    weight_decay: float,
    grad_averaging: int,
    mode: int,
    norm_type: int,
    step_tensor: Tensor | None = None,
    lr_tensor: Tensor | None = None,
) -> None:
    """One NovoGrad step, in place, for every (grad, param, exp_avg).

    The second moment is one number per tensor, kept by the caller in ``grad_norms`` as a
    *norm* (not its square) and blended in place with the norm ``n`` of this step's gradient,
    as Apex's ``multi_tensor_norm_out_cuda`` does::

        norm_type 2: grad_norms[i] = sqrt(beta2 * grad_norms[i]**2 + (1 - beta2) * n**2)
        norm_type 0: grad_norms[i] = beta2 * grad_norms[i] + (1 - beta2) * n   (n = max |g|)

    There is no first-step special case in the op (nor in Apex's kernel): Apex's
    ``FusedNovoGrad`` initialises ``grad_norms`` before the first step either to the first
    gradients' norms (the default, so the first blend returns ``n``) or to zeros
    (``init_zero=True``). Then, in float32 (Apex's ``NovoGradFunctor``), with
    ``denom = grad_norms[i] / bc2 + epsilon``::

        mode 0: g = grad / denom + weight_decay * p
                m = beta1 * m + beta3 * g
                p = p - lr * m / bc1
        mode 1: m = beta1 * m + beta3 * grad
                p = p - lr * ((m / bc1) / denom + weight_decay * p)

    where ``beta3 = 1 - beta1`` if ``grad_averaging`` else 1, and ``bc1 = 1 - beta1**step``,
    ``bc2 = sqrt(1 - beta2**step)`` when ``bias_correction`` is 1, else 1.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; never read (the step is always written, inf/nan
            propagate), set to 1 when a gradient norm is inf or nan.
        tensor_lists: ``[grads, params, exp_avgs]``; params and first moments are updated in
            place and keep their dtypes. Gradients are not modified.
        grad_norms: Float32 tensor of ``len(grads)`` elements on the tensors' device, the
            blended per-tensor gradient norms; updated in place.
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Decay of the blended gradient norm.
        epsilon: Added to the denominator.
        step: Step number (1 for the first step), for bias correction.
        bias_correction: 1 to apply bias correction, 0 not to.
        weight_decay: Weight decay.
        grad_averaging: 1 to scale the gradient by ``1 - beta1`` in the first moment, 0 not to.
        mode: 0 weight decay inside the moment (``reg_inside_moment``), 1 decoupled decay.
        norm_type: 2 L2 norm, 0 infinity (max-abs) norm.
        step_tensor: The step count as a one-element CPU tensor, read instead of ``step``
            when given (the optimizers pass it so under ``torch.compile``).
        lr_tensor: The learning rate as a one-element floating-point CPU tensor, read instead
            of ``lr`` when given (see :func:`resolve_lr`).

    Raises:
        TypeError: ``grad_norms`` (or another argument) has the wrong type.
        ValueError: Malformed lists, sizes, dtypes, noop flag, ``grad_norms`` size or dtype,
            bias_correction, grad_averaging, mode or norm_type.
        RuntimeError: Tensors (or ``grad_norms``) on different devices.
    """
    op = "multi_tensor_novograd"
    step = resolve_step(op, step, step_tensor)
    lr = resolve_lr(op, lr, lr_tensor)
    check_arguments(
        op,
        {
            "bias_correction": bias_correction,
            "grad_averaging": grad_averaging,
            "mode": mode,
            "norm_type": norm_type,
        },
    )
    if not isinstance(grad_norms, Tensor):
        raise TypeError(f"{op}: grad_norms must be a tensor, got {type(grad_norms).__name__}")
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("grads", "params", "exp_avgs")])
    if device is None:
        return
    _check_state_lists(op, tensor_lists, 2, 2, 1)
    _check_overlap(op, tensor_lists, (1, 2))
    grads, params, exp_avgs = tensor_lists
    old = _per_tensor(op, "grad_norms", grad_norms, len(grads), device)
    bc1 = 1.0 - beta1**step if bias_correction == 1 else 1.0
    bc2 = math.sqrt(1.0 - beta2**step) if bias_correction == 1 else 1.0
    beta3 = 1.0 - beta1 if grad_averaging == 1 else 1.0

    p = _fp32(params)
    g = _fp32(grads, like=params)
    if norm_type == NORM_TYPE_L2:
        n = _per_tensor_norms(g, 2)
        blended = torch.sqrt(beta2 * old.square() + (1.0 - beta2) * n.square())
    else:
        n = _per_tensor_norms(g, math.inf)
        blended = beta2 * old + (1.0 - beta2) * n
    denoms = (blended / bc2 + epsilon).unbind(0)

    m = torch._foreach_mul(_fp32(exp_avgs, like=params), beta1)
    update: _Tensors
    if mode == MOMENT_MODE_L2:
        scaled = [x / d for x, d in zip(g, denoms, strict=True)]
        if weight_decay != 0.0:
            torch._foreach_add_(scaled, p, alpha=weight_decay)
        torch._foreach_add_(m, scaled, alpha=beta3)
        update = torch._foreach_div(m, bc1)
    else:
        torch._foreach_add_(m, g, alpha=beta3)
        update = [x / bc1 / d for x, d in zip(m, denoms, strict=True)]
        if weight_decay != 0.0:
            torch._foreach_add_(update, p, alpha=weight_decay)
    _write(params, torch._foreach_add(p, update, alpha=-float(lr)))
    _write(exp_avgs, m)
    grad_norms.copy_(blended.reshape(grad_norms.shape))
    _raise_flag(noop_flag, ~torch.isfinite(n).all())
