"""``FusedMixedPrecisionLamb``: LAMB over half params with float32 master weights (Apex's).

The LAMB math is :class:`~amp_optimizers.FusedLAMB`'s; the op is Apex's own for this
optimizer, ``amp_C.multi_tensor_lamb_mp``, which takes every per-step number as a device
tensor. What this optimizer adds is the mixed-precision plumbing:

* params whose dtype is ``reduced_precision_dtype`` get a float32 master copy in their state
  (``"master_param"``, made on their first step); the op steps the master and writes the half
  param from it in the same call;
* ``lr`` and ``step`` are tensors on the params' device in every param group (Apex's layout);
* under ``torch.amp.GradScaler`` the scaler's ``grad_scale`` and ``found_inf`` are read on
  the device: the op multiplies the gradients by the inverse scale and clips against
  ``max_grad_norm * scale`` (the norm is of the scaled gradients), and the step is skipped
  when ``found_inf`` is set or the gradient norm is not finite; after the step the gradients
  are unscaled in place, as the scaler leaves them for a plain optimizer.

Nothing in a step reads a value back to the host: the skip decision is the op's ``found_inf``
and the step count advances by 0 or 1 on the device, so a step traces into one
``torch.compile`` graph and can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops import multi_tensor_applier, multi_tensor_op

from ._base import FusedOptimizerBase
from ._fused_lamb import check_lamb_args, global_grad_norm, lamb_moments
from ._step_helpers import (
    AmpCOp,
    check_nonnegative,
    group_by_device_dtype,
    holds_dtensors,
    params_with_grads,
    unscale_grads_in_place,
)

__all__ = ["FusedMixedPrecisionLamb"]

_NAME = "FusedMixedPrecisionLamb"
_REDUCED_DTYPES = (None, torch.float16, torch.bfloat16)


class FusedMixedPrecisionLamb(FusedOptimizerBase):
    """LAMB for half models: float32 masters and moments, device ``lr``/``step``, GradScaler.

    Drop-in for ``apex.optimizers.FusedMixedPrecisionLamb`` (same constructor signature and
    defaults). The update is :class:`~amp_optimizers.FusedLAMB`'s: the global L2 norm of all
    gradients clips them to ``max_grad_norm``, then every tensor takes an Adam(W) update scaled
    by its trust ratio ``||p|| / ||update||``. For a param of dtype ``reduced_precision_dtype``
    the master (float32) is stepped and the param is its rounded copy; every other param
    (float32, or a half dtype that is not ``reduced_precision_dtype``) is stepped in place.
    Moments are float32 for every param.

    The step is skipped (params, moments, masters and ``step`` untouched) when a
    ``GradScaler`` reports an inf/nan, or, with no scaler, when the gradient norm is not
    finite, as in Apex.

    Args:
        params: Iterable of params or param-group dicts.
        lr: Learning rate; kept as a 0-dim float32 tensor on the params' device in each group.
        step: Initial step count; kept as a one-element int32 tensor in each group.
        bias_correction: Apply Adam's bias correction.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
        weight_decay: Weight decay.
        amsgrad: Not supported; True raises, as in Apex.
        adam_w_mode: Decoupled weight decay when True, L2 regularisation when False.
        grad_averaging: Scale the gradient by ``1 - beta1`` in the first moment.
        max_grad_norm: Clipping threshold of the global gradient norm (of the unscaled
            gradients; read from the constructor's value, as in Apex).
        use_nvlamb: Apply the trust ratio also to tensors without weight decay.
        reduced_precision_dtype: ``torch.float16`` or ``torch.bfloat16``: params of this dtype
            get float32 master weights. ``None``: no masters, every param is stepped in place.

    Raises:
        RuntimeError: ``amsgrad=True``.
        ValueError: A negative ``lr``, ``eps``, ``weight_decay`` or ``max_grad_norm``, betas
            outside [0, 1), a negative ``step``, or a ``reduced_precision_dtype`` other than
            None, float16 or bfloat16.

    Works with ``torch.amp.GradScaler``: the optimizer declares ``_step_supports_amp_scaling``,
    so ``scaler.step(optimizer)`` hands over its ``grad_scale`` and ``found_inf`` tensors,
    which are read on the device; after the step ``.grad`` holds the unscaled gradients (as
    with a plain optimizer, whose gradients the scaler unscales in place). ``GradScaler``
    needs float16 or float32 gradients on CUDA (PyTorch has no CUDA kernel to unscale
    bfloat16 ones); a bfloat16 model trains without a scaler, and a step whose gradient norm
    is not finite is then skipped all the same.

    A step makes no host sync (the skip decision, ``lr`` and ``step`` stay on the device), so
    it traces into one ``torch.compile`` graph and can be captured in a CUDA graph; a GradScaler
    skip leaves everything, ``step`` included, as it was.

    Example:
        >>> model = torch.nn.Linear(4, 4).bfloat16()
        >>> opt = FusedMixedPrecisionLamb(
        ...     model.parameters(), lr=1e-3, reduced_precision_dtype=torch.bfloat16
        ... )
        >>> model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
    """

    _step_supports_amp_scaling = True

    # Apex's op handles (read by code built on Apex's optimizers): the amp_C ops by name.
    multi_tensor_l2norm = AmpCOp("multi_tensor_l2norm_mp")
    multi_tensor_lamb = AmpCOp("multi_tensor_lamb_mp")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        step: int = 0,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        reduced_precision_dtype: torch.dtype | None = None,
    ) -> None:
        check_lamb_args(
            _NAME,
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            betas=betas,
            amsgrad=amsgrad,
        )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{_NAME}: invalid step {step!r}; it must be an int >= 0")
        if reduced_precision_dtype not in _REDUCED_DTYPES:
            raise ValueError(
                f"{_NAME}: reduced_precision_dtype must be None, torch.float16 or "
                f"torch.bfloat16, got {reduced_precision_dtype!r}"
            )
        defaults = dict(
            lr=_lr_tensor(lr),
            step=torch.tensor([step], dtype=torch.int32),
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.reduced_precision_dtype = reduced_precision_dtype
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb
        # Apex's attribute; the float32 copies of half params live in the state here.
        self.param_groups_full_precision: list[dict[str, Any]] = []

    # -- param groups -----------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its ``lr`` and ``step`` become its own tensors on its device.

        Args:
            param_group: The group, as for ``torch.optim.Optimizer.add_param_group``; a float
                ``lr`` or int ``step`` is turned into a tensor.

        Raises:
            ValueError: An ``lr`` that is not a number >= 0 (or a one-element tensor holding
                one), or a ``step`` that is not an int >= 0 (or a one-element tensor); the
                group is then not added.
        """
        candidate = self.candidate_group(param_group)
        if candidate is not None:
            _check_group_scalars(candidate)
        super().add_param_group(param_group)
        self._place_group_scalars(self.param_groups[-1])

    def _after_load_group(self, group: dict[str, Any]) -> None:
        self._place_group_scalars(group)

    @staticmethod
    def _place_group_scalars(group: dict[str, Any]) -> None:
        # A copy per group: torch's add_param_group hands every group the same default tensor.
        params = group["params"]
        device = params[0].device if params else torch.device("cpu")
        group["lr"] = _lr_tensor(group["lr"]).to(device)
        step = group.get("step", 0)
        step_t = step.detach().clone() if isinstance(step, Tensor) else torch.tensor(int(step))
        group["step"] = step_t.to(device=device, dtype=torch.int32).reshape(1)

    # -- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step over every param that has a gradient, unless it must be skipped.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: A sparse gradient, or a param dtype other than float32/16/bf16.
        """
        loss = self._run_closure(closure)
        per_group = [params_with_grads(_NAME, g["params"]) for g in self.param_groups]
        grads = [p.grad for params in per_group for p in params if p.grad is not None]
        if not grads:
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        self._lamb_step(per_group, grads, grad_scale, getattr(self, "found_inf", None))
        if isinstance(grad_scale, Tensor):
            unscale_grads_in_place(grads, grad_scale)
        return loss

    def _lamb_step(
        self, per_group: list[list[Tensor]], grads: list[Tensor], grad_scale: Any, found_inf: Any
    ) -> None:
        device = grads[0].device

        norm = global_grad_norm(grads, device)  # (1,) of the gradients as they are (scaled)
        skip = ~torch.isfinite(norm)
        if isinstance(found_inf, Tensor):
            skip |= found_inf.to(device).reshape(1) != 0
        if isinstance(grad_scale, Tensor):
            scale = grad_scale.to(device=device, dtype=torch.float32).reshape(1)
        else:
            scale = torch.ones(1, dtype=torch.float32, device=device)
        inv_scale = scale.double().reciprocal().float()
        # The norm is of the scaled gradients: so is the threshold the op compares it with.
        max_grad_norm = scale * float(self.defaults["max_grad_norm"])
        skip_f = skip.to(torch.float32)
        taken = (~skip).to(torch.int32)

        # Everything stays on the device: the skip decision reaches the op as its found_inf,
        # and each group's step count advances by 0 or 1 in place.
        for group, params in zip(self.param_groups, per_group, strict=True):
            if not params:
                continue
            group["step"].add_(taken.to(group["step"].device))
            beta1, beta2 = group["betas"]
            rows = []
            for p in params:
                state = self.state[p]
                exp_avg, exp_avg_sq = lamb_moments(state, p)
                rows.append((p, p.grad, self._stepped_tensor(state, p), exp_avg, exp_avg_sq))
            lamb = multi_tensor_op("multi_tensor_lamb_mp", sharded=holds_dtensors(params))
            for (dev, _), (ps, gs, targets, ms, vs) in group_by_device_dtype(rows).items():
                # Masters are stepped and rounded into the params (the op's model_params).
                model_params = ps if targets[0] is not ps[0] else None
                lamb(
                    multi_tensor_applier.chunk_size,
                    self.noop_flag(dev),
                    gs,
                    targets,
                    ms,
                    vs,
                    model_params,
                    group["lr"].to(dev),
                    beta1,
                    beta2,
                    group["eps"],
                    group["step"].to(dev),
                    1 if group["bias_correction"] else 0,
                    group["weight_decay"],
                    1 if group["grad_averaging"] else 0,
                    self.adam_w_mode,
                    norm.to(dev),
                    max_grad_norm.to(dev),
                    self.use_nvlamb,
                    skip_f.to(dev),
                    inv_scale.to(dev),
                )

    def _stepped_tensor(self, state: dict[str, Any], p: Tensor) -> Tensor:
        """The tensor the op steps for ``p``: its float32 master, or ``p`` itself."""
        if p.dtype != self.reduced_precision_dtype:
            return p
        master = state.get("master_param")
        if master is None:
            # Made on the first step, not in the constructor (Apex): a DDP broadcast of the
            # model after the optimizer was built must reach the masters.
            master = state["master_param"] = p.detach().to(torch.float32, copy=True)
        return master


def _check_group_scalars(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the group's ``lr`` and ``step`` can become its tensors."""
    check_nonnegative(_NAME, "learning rate", group["lr"])
    step = group.get("step", 0)
    if isinstance(step, Tensor):
        if step.numel() != 1:
            raise ValueError(
                f"{_NAME}: invalid step of shape {tuple(step.shape)}; a tensor step must hold "
                "one value, e.g. torch.tensor([0], dtype=torch.int32)"
            )
    elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{_NAME}: invalid step {step!r}; it must be an int >= 0")


def _lr_tensor(lr: float | Tensor) -> Tensor:
    """A new 0-dim float32 tensor holding ``lr`` (on ``lr``'s device when it is a tensor)."""
    if isinstance(lr, Tensor):
        return lr.detach().to(torch.float32, copy=True).reshape(())
    return torch.tensor(float(lr), dtype=torch.float32)
