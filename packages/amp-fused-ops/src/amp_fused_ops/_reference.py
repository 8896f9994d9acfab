"""Pure-PyTorch reference implementations of the ``amp_C`` multi-tensor ops.

Every function here has the calling convention of the Apex ``amp_C`` op of the same name::

    op(chunk_size, noop_flag, tensor_lists, *op_args)

and is the test oracle for the compiled CPU and CUDA kernels, and the path that runs when no
compiled extension is available. The reference is written for correctness first:

* math in float32 whatever the storage dtype (float32, float16 or bfloat16), results cast back
  to the dtype of the tensor they are written to;
* results are written with ``Tensor.copy_``, so every tensor keeps its shape, strides and
  memory format (contiguous, channels-last, any strided layout);
* ``chunk_size`` is validated and otherwise ignored: results never depend on it;
* no host synchronisation: skip decisions that depend on device values (the ``noop_flag``,
  non-finite gradients) are taken with ``torch.where`` on the device.

How each op treats ``noop_flag`` (a one-element int32 tensor), following Apex's kernels:

============================== ============================ ===================================
op                             skips all writes if set      sets it to 1 when
============================== ============================ ===================================
multi_tensor_scale             no (inf/nan propagate)       an input is inf/nan
multi_tensor_axpby             no (inf/nan propagate)       a checked input is inf/nan
multi_tensor_l2norm            no                           the norm is inf/nan
multi_tensor_unscale_l2norm    no                           the norm is inf/nan
multi_tensor_adam              no (inf/nan propagate)       never
multi_tensor_adam_capturable_  yes                          a grad * inv_scale is inf/nan
master                                                      (then nothing is written either)
multi_tensor_sgd               yes                          never
multi_tensor_adagrad           no (inf/nan propagate)       never
============================== ============================ ===================================

Tensors at the same position of different lists must have the same number of elements. When
their shapes differ they are matched element by element in row-major (flattened) order, which
for contiguous tensors is Apex's memory order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_sgd",
    "multi_tensor_adagrad",
]

TensorLists = Sequence[Sequence[Tensor]]
# What torch._foreach_* accept and return.
_Tensors = list[Tensor] | tuple[Tensor, ...]

# Storage dtypes every op accepts; math always runs in float32.
_FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
_FP32_ONLY: tuple[torch.dtype, ...] = (torch.float32,)


# ---------------------------------------------------------------------------------------------
# Preconditions
# ---------------------------------------------------------------------------------------------


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _check(
    op: str,
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    list_names: Sequence[Sequence[str]],
    dtypes: Sequence[Sequence[torch.dtype]] | None = None,
) -> torch.device | None:
    """Validate the arguments every multi-tensor op shares.

    Args:
        op: Name of the op, used in error messages.
        chunk_size: Elements per chunk; must be a positive int (results do not depend on it).
        noop_flag: One-element int32 tensor on the device of the tensors.
        tensor_lists: The op's lists of tensors.
        list_names: Each accepted layout of ``tensor_lists``, as the names of its lists (for
            example ``[("grads", "params", "momentum_bufs")]``).
        dtypes: Allowed dtypes per list position; defaults to float32/float16/bfloat16 for all.

    Returns:
        The device of the tensors, or None when the lists hold no tensor.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: The lists have the wrong count or lengths, sizes mismatch, or the noop flag
            or a dtype is not accepted.
        RuntimeError: Tensors (or the noop flag) sit on different devices.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(tensor_lists, (list, tuple)):
        raise TypeError(
            f"{op}: tensor_lists must be a list of lists of tensors, got "
            f"{type(tensor_lists).__name__}"
        )
    counts = [len(names) for names in list_names]
    if len(tensor_lists) not in counts:
        layouts = " or ".join("[" + ", ".join(names) + "]" for names in list_names)
        raise ValueError(
            f"{op}: expected {' or '.join(map(str, counts))} tensor lists ({layouts}), "
            f"got {len(tensor_lists)}"
        )
    n = len(tensor_lists[0])
    for i, tensors in enumerate(tensor_lists):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(
                f"{op}: tensor_lists[{i}] must be a list of tensors, got {type(tensors).__name__}"
            )
        if len(tensors) != n:
            raise ValueError(
                f"{op}: tensor_lists[{i}] has {len(tensors)} tensors but tensor_lists[0] has {n}; "
                "every list must hold one tensor per position"
            )
    if not isinstance(noop_flag, Tensor):
        raise TypeError(
            f"{op}: noop_flag must be a tensor, got {type(noop_flag).__name__}; "
            "create it with torch.zeros(1, dtype=torch.int32, device=...)"
        )
    if noop_flag.dtype != torch.int32 or noop_flag.numel() != 1:
        raise ValueError(
            f"{op}: noop_flag must be a one-element int32 tensor, got dtype "
            f"{noop_flag.dtype} with {noop_flag.numel()} elements; "
            "create it with torch.zeros(1, dtype=torch.int32, device=...)"
        )
    if n == 0:
        return None
    device = tensor_lists[0][0].device if isinstance(tensor_lists[0][0], Tensor) else None
    allowed_per_list = dtypes if dtypes is not None else [_FLOAT_DTYPES] * len(tensor_lists)
    for i, tensors in enumerate(tensor_lists):
        allowed = allowed_per_list[i]
        for j, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(
                    f"{op}: tensor_lists[{i}][{j}] must be a tensor, got {type(t).__name__}"
                )
            if t.device != device:
                raise RuntimeError(
                    f"{op}: tensor_lists[{i}][{j}] is on {t.device} but tensor_lists[0][0] is on "
                    f"{device}; move all tensors of one call to the same device"
                )
            if t.dtype not in allowed:
                raise ValueError(
                    f"{op}: tensor_lists[{i}][{j}] has dtype {t.dtype}; this list accepts "
                    f"{_dtype_names(allowed)}"
                )
            if t.numel() != tensor_lists[0][j].numel():
                raise ValueError(
                    f"{op}: tensor_lists[{i}][{j}] has {t.numel()} elements but "
                    f"tensor_lists[0][{j}] has {tensor_lists[0][j].numel()}; tensors at the same "
                    "position must have the same number of elements"
                )
    if noop_flag.device != device:
        raise RuntimeError(
            f"{op}: noop_flag is on {noop_flag.device} but the tensors are on {device}; "
            "create it on the tensors' device"
        )
    return device


def _check_choice(op: str, name: str, value: int, choices: Sequence[int]) -> None:
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {list(choices)}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Helpers (all device-side, no host sync)
# ---------------------------------------------------------------------------------------------


def _fp32(tensors: Sequence[Tensor], like: Sequence[Tensor] | None = None) -> _Tensors:
    """Float32 values of ``tensors``, reshaped to the shapes of ``like`` where those differ.

    The result may alias the input (a float32 tensor is returned as is): never modify it in
    place.
    """
    out = [t.float() for t in tensors]
    if like is not None:
        out = [
            t if t.shape == r.shape else t.reshape(r.shape) for t, r in zip(out, like, strict=True)
        ]
    return out


def _write(dst: Sequence[Tensor], src: Sequence[Tensor], skip: Tensor | None = None) -> None:
    """Copy ``src`` into ``dst`` (cast, layout kept); keep ``dst`` where ``skip`` is true."""
    for d, s in zip(dst, src, strict=True):
        if s.shape != d.shape:
            s = s.reshape(d.shape)
        d.copy_(s if skip is None else torch.where(skip, d, s))


def _any_nonfinite(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """0-dim bool tensor: does any of ``tensors`` hold an inf or a nan."""
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([~torch.isfinite(t).all() for t in tensors]).any()


def _raise_flag(noop_flag: Tensor, condition: Tensor) -> None:
    """Set ``noop_flag`` to 1 where the 0-dim bool ``condition`` holds (no host sync)."""
    noop_flag.masked_fill_(condition, 1)


def _scalar(value: Tensor | float, device: torch.device) -> Tensor:
    """A 0-dim float32 tensor on ``device`` from a Python number or a one-element tensor."""
    if isinstance(value, Tensor):
        return value.reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------
# Elementwise ops and norms
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def multi_tensor_scale(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float
) -> None:
    """``out = in * scale`` for every pair; flags inf/nan inputs.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if any input holds an inf or a nan.
            Outputs are written either way (inf/nan propagate).
        tensor_lists: ``[ins, outs]``; ``outs[i]`` may be ``ins[i]`` and may have another
            dtype (for example float16 in, float32 out).
        scale: Multiplier.

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.

    Example:
        >>> flag = torch.zeros(1, dtype=torch.int32)
        >>> ins, outs = [torch.ones(3, dtype=torch.half)], [torch.empty(3)]
        >>> multi_tensor_scale(2048, flag, [ins, outs], 0.5)
        >>> outs[0]
        tensor([0.5000, 0.5000, 0.5000])
    """
    op = "multi_tensor_scale"
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("ins", "outs")])
    if device is None:
        return
    ins, outs = tensor_lists
    found = _any_nonfinite(ins, device)
    _write(outs, torch._foreach_mul(_fp32(ins), float(scale)))
    _raise_flag(noop_flag, found)


@torch.no_grad()
def multi_tensor_axpby(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    a: float,
    b: float,
    arg_to_check: int,
) -> None:
    """``out = a * x + b * y`` for every triple; flags inf/nan in the checked inputs.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if a checked input holds an inf or a nan.
            Outputs are written either way.
        tensor_lists: ``[xs, ys, outs]``; an output may alias an input.
        a: Multiplier of ``x``.
        b: Multiplier of ``y``.
        arg_to_check: Which inputs the inf/nan check looks at: -1 both, 0 ``x``, 1 ``y``.

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype, noop flag or arg_to_check.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_axpby"
    _check_choice(op, "arg_to_check", arg_to_check, (-1, 0, 1))
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("xs", "ys", "outs")])
    if device is None:
        return
    xs, ys, outs = tensor_lists
    checked = (list(xs) if arg_to_check in (-1, 0) else []) + (
        list(ys) if arg_to_check in (-1, 1) else []
    )
    found = _any_nonfinite(checked, device)
    result = torch._foreach_mul(_fp32(xs), float(a))
    torch._foreach_add_(result, _fp32(ys, like=xs), alpha=float(b))
    _write(outs, result)
    _raise_flag(noop_flag, found)


def _l2norms(
    op: str,
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Tensor | float | None,
    per_tensor: bool | None,
) -> tuple[Tensor, Tensor]:
    device = _check(op, chunk_size, noop_flag, tensor_lists, [("xs",)])
    if device is None:
        empty = torch.empty(0, dtype=torch.float32, device=noop_flag.device)
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), empty
    (xs,) = tensor_lists
    values = _fp32(xs)
    if inv_scale is not None:
        values = torch._foreach_mul(values, _scalar(inv_scale, device))
    norms = torch.stack(torch._foreach_norm(values, 2))  # (n,) float32
    # Sum of squares then sqrt, as the kernels do: an overflowing sum is inf, not rescaled.
    total = norms.square().sum().sqrt().reshape(1)
    _raise_flag(noop_flag, ~torch.isfinite(total[0]))
    per = norms if per_tensor else torch.empty(0, dtype=torch.float32, device=device)
    return total, per


@torch.no_grad()
def multi_tensor_l2norm(
    chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[Tensor, Tensor]:
    """L2 norm of all tensors together, and optionally of each tensor, in float32.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if the total norm is inf or nan.
        tensor_lists: ``[xs]``.
        per_tensor: Also return the norm of each tensor (None means False, as in Apex).

    Returns:
        ``(total_norm, per_tensor_norms)``: a one-element float32 tensor, and a float32 tensor
        of ``len(xs)`` norms (an empty tensor when ``per_tensor`` is false).

    Raises:
        ValueError: Malformed lists, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.
    """
    return _l2norms("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, None, per_tensor)


@torch.no_grad()
def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: TensorLists,
    inv_scale: Tensor | float,
    per_tensor: bool | None = False,
) -> tuple[Tensor, Tensor]:
    """L2 norms of ``x * inv_scale`` (the norm of unscaled gradients), in float32.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; set to 1 if the total norm is inf or nan.
        tensor_lists: ``[xs]``; not modified.
        inv_scale: One-element float32 tensor (Apex) or a Python number.
        per_tensor: Also return the norm of each tensor.

    Returns:
        ``(total_norm, per_tensor_norms)`` as :func:`multi_tensor_l2norm`.

    Raises:
        ValueError: Malformed lists, bad dtype or noop flag.
        RuntimeError: Tensors on different devices.
    """
    return _l2norms(
        "multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor
    )


# ---------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------

ADAM_MODE_L2 = 0  # weight decay added to the gradient (Adam with L2 regularisation)
ADAM_MODE_ADAMW = 1  # decoupled weight decay (AdamW)


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
    if mode == ADAM_MODE_L2 and weight_decay != 0.0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    m = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(m, grads, alpha=1.0 - beta1)
    v = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
    # update = (m / bc1) / (sqrt(v / bc2) + eps) [+ wd * p in AdamW mode]
    denom = torch._foreach_div(v, bias_correction2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, bias_correction1)
    torch._foreach_div_(update, denom)
    if mode == ADAM_MODE_ADAMW and weight_decay != 0.0:
        torch._foreach_add_(update, params, alpha=weight_decay)
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
) -> None:
    """One Adam / AdamW step, in place, for every (grad, param, exp_avg, exp_avg_sq).

    Math in float32 (Apex's ``AdamFunctor``)::

        g = grad (+ weight_decay * p in mode 0)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / (sqrt(v / bc2) + eps) (+ weight_decay * p in mode 1)
        p = p - lr * update

    with ``bc1 = 1 - beta1**step`` and ``bc2 = 1 - beta2**step`` when ``bias_correction`` is
    1, else 1.

    Args:
        chunk_size: Elements per chunk (validated, otherwise unused).
        noop_flag: One-element int32 tensor; neither read nor written (inf/nan propagate, as
            in Apex).
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]``; params and both moments are
            updated in place and keep their dtypes (float32 state recommended).
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the denominator.
        step: Step number (1 for the first step), for bias correction.
        mode: 0 L2 regularisation (``torch.optim.Adam``), 1 decoupled decay (``AdamW``).
        bias_correction: 1 to apply bias correction, 0 not to.
        weight_decay: Weight decay.

    Raises:
        ValueError: Malformed lists, sizes, dtypes, noop flag, mode or bias_correction.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_adam"
    _check_choice(op, "mode", mode, (ADAM_MODE_L2, ADAM_MODE_ADAMW))
    _check_choice(op, "bias_correction", bias_correction, (0, 1))
    names = [("grads", "params", "exp_avgs", "exp_avg_sqs")]
    if _check(op, chunk_size, noop_flag, tensor_lists, names) is None:
        return
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
    _write(params, new_p)
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
    op = "multi_tensor_adam_capturable_master"
    _check_choice(op, "mode", mode, (ADAM_MODE_L2, ADAM_MODE_ADAMW))
    _check_choice(op, "bias_correction", bias_correction, (0, 1))
    names = [("grads", "params", "exp_avgs", "exp_avg_sqs", "master_params")]
    dtypes = [_FLOAT_DTYPES, _FLOAT_DTYPES, _FP32_ONLY, _FP32_ONLY, _FP32_ONLY]
    device = _check(op, chunk_size, noop_flag, tensor_lists, names, dtypes)
    if device is None:
        return
    grads, params, exp_avgs, exp_avg_sqs, masters = tensor_lists
    lr_t = _scalar(lr, device)
    step_t = _scalar(step, device)
    one = torch.ones((), dtype=torch.float32, device=device)
    bc1 = 1.0 - torch.pow(beta1, step_t) if bias_correction == 1 else one
    bc2 = 1.0 - torch.pow(beta2, step_t) if bias_correction == 1 else one

    unscaled = torch._foreach_mul(_fp32(grads, like=masters), _scalar(inv_scale, device))
    nonfinite = _any_nonfinite(unscaled, device)
    skip = (noop_flag.reshape(()) != 0) | nonfinite
    new_p, new_m, new_v = _adam_math(
        unscaled,
        list(masters),
        _fp32(exp_avgs, like=masters),
        _fp32(exp_avg_sqs, like=masters),
        lr_t,
        beta1,
        beta2,
        eps,
        bc1,
        bc2,
        mode,
        weight_decay,
    )
    _write(masters, new_p, skip)
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
        weight_decay: Weight decay.
        momentum: Momentum factor (0 disables the buffer).
        dampening: Dampening of the gradient in the momentum update.
        lr: Learning rate.
        nesterov: Use Nesterov momentum.
        first_run: Initialise the momentum buffers with the gradient (first step).
        wd_after_momentum: Apply weight decay after the momentum update instead of before.
        scale: Multiplier of the gradients (the inverse loss scale).

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype or noop flag.
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
    new_p = torch._foreach_add(p, g, alpha=-lr)
    _write(params, new_p, skip)
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
        lr: Learning rate.
        epsilon: Added to the denominator.
        mode: 0 L2 regularisation (``torch.optim.Adagrad``), 1 decoupled weight decay.
        weight_decay: Weight decay.

    Raises:
        ValueError: Malformed lists, mismatched sizes, bad dtype, noop flag or mode.
        RuntimeError: Tensors on different devices.
    """
    op = "multi_tensor_adagrad"
    _check_choice(op, "mode", mode, (ADAGRAD_MODE_L2, ADAGRAD_MODE_DECOUPLED))
    names = [("grads", "params", "state_sums")]
    if _check(op, chunk_size, noop_flag, tensor_lists, names) is None:
        return
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
    _write(params, torch._foreach_add(p, update, alpha=-lr))
    _write(sums, h)
