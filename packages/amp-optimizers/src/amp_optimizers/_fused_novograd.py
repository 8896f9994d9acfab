"""``FusedNovoGrad``: Apex's multi-tensor NovoGrad, on any device and dtype."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops import multi_tensor_applier, multi_tensor_op, tensor_norms

from ._base import FusedOptimizerBase
from ._step_helpers import (
    AmpCOp,
    advance_step,
    check_betas,
    check_nonnegative,
    group_by_device_dtype,
    holds_dtensors,
    lr_arguments,
    outside_graph,
    params_with_grads,
    step_arguments,
    step_outside_graph,
)

__all__ = ["FusedNovoGrad"]


class FusedNovoGrad(FusedOptimizerBase):
    """NovoGrad with one multi-tensor launch per ``(device, dtype)`` (Apex's ``FusedNovoGrad``).

    The second moment is one number per tensor: a running blend of the norms of its gradients
    (``state["exp_avg_sq"]``, a 0-dim float32 tensor, stored as a norm, not its square). Before a
    tensor's first step it holds that step's gradient norm (so the first blend changes nothing)
    or, with ``init_zero=True``, zero. Per step, with ``denom = exp_avg_sq / bc2 + eps``::

        reg_inside_moment:   m = beta1 * m + beta3 * (grad / denom + weight_decay * p)
                             p = p - lr * m / bc1
        otherwise:           m = beta1 * m + beta3 * grad
                             p = p - lr * ((m / bc1) / denom + weight_decay * p)

    with ``beta3 = 1 - beta1`` if ``grad_averaging`` else 1. First moments are float32.

    Args:
        params: Iterable of params or param-group dicts.
        lr: Learning rate.
        bias_correction: Apply bias correction (``bc1 = 1 - beta1**t``,
            ``bc2 = sqrt(1 - beta2**t)``).
        betas: Decay rates of the first moment and of the blended gradient norm.
        eps: Added to the denominator.
        weight_decay: Weight decay.
        amsgrad: Not supported; True raises, as in Apex.
        reg_inside_moment: Put the weight decay inside the first moment (NovoGrad paper) instead
            of decoupling it.
        grad_averaging: Scale the gradient by ``1 - beta1`` in the first moment.
        norm_type: 2 for the L2 norm, 0 for the infinity norm.
        init_zero: Start the blended norms at zero instead of the first gradient norms.
        set_grad_none: ``zero_grad`` sets gradients to ``None`` instead of zeroing them.

    Raises:
        RuntimeError: ``amsgrad=True``.
        ValueError: A negative ``lr``, ``eps`` or ``weight_decay``, betas outside [0, 1), or a
            ``norm_type`` other than 0 or 2.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = FusedNovoGrad(model.parameters(), lr=1e-3)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
    """

    # Apex's op handles (read by code built on Apex's optimizers): the amp_C ops by name.
    multi_tensor_novograd = AmpCOp("multi_tensor_novograd")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError(
                "FusedNovoGrad does not support the AMSGrad variant (amsgrad=True); pass "
                "amsgrad=False."
            )
        check_nonnegative("FusedNovoGrad", "learning rate", lr)
        check_nonnegative("FusedNovoGrad", "epsilon value", eps)
        check_nonnegative("FusedNovoGrad", "weight_decay value", weight_decay)
        check_betas("FusedNovoGrad", betas)
        if norm_type not in (0, 2):
            raise ValueError(
                f"FusedNovoGrad only supports the L2 (norm_type=2) and infinity (norm_type=0) "
                f"norms, got norm_type={norm_type!r}"
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        super().__init__(params, defaults)
        self.moment_mode = 0 if reg_inside_moment else 1
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One NovoGrad step over every param that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        if step_outside_graph(self.param_groups):
            return outside_graph(self._step, closure)
        return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        loss = self._run_closure(closure)
        for group in self.param_groups:
            params = params_with_grads("FusedNovoGrad", group["params"])
            if not params:
                continue
            step, step_tensor = step_arguments(advance_step(group))
            beta1, beta2 = group["betas"]
            rows = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = self._first_norm(p, group)
                rows.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
            novograd = multi_tensor_op("multi_tensor_novograd", sharded=holds_dtensors(params))
            lr, lr_tensor = lr_arguments(group["lr"])
            for (device, _), (ps, gs, ms, norms) in group_by_device_dtype(rows).items():
                blended = torch.stack(norms)
                novograd(
                    multi_tensor_applier.chunk_size,
                    self.noop_flag(device),
                    gs,
                    ps,
                    ms,
                    blended,
                    lr,
                    beta1,
                    beta2,
                    group["eps"],
                    step,
                    1 if group["bias_correction"] else 0,
                    group["weight_decay"],
                    1 if group["grad_averaging"] else 0,
                    self.moment_mode,
                    group["norm_type"],
                    step_tensor,
                    lr_tensor,
                )
                torch._foreach_copy_(norms, list(blended.unbind()))
        return loss

    @staticmethod
    def _first_norm(p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        assert p.grad is not None
        if group["init_zero"]:
            return torch.zeros((), dtype=torch.float32, device=p.device)
        if not torch.compiler.is_compiling() and hasattr(p.grad, "full_tensor"):
            # A DTensor (FSDP2) gradient: the norm of the whole gradient, reduced over the
            # mesh; every rank keeps the same plain 0-dim tensor, as for a plain param.
            ord = math.inf if group["norm_type"] == 0 else 2.0
            return tensor_norms([p.grad], ord).reshape(())
        g = p.grad.float()
        norm = g.abs().max() if group["norm_type"] == 0 else g.norm(2)
        return norm.reshape(()).clone()
