"""``FusedLAMB``: Apex's multi-tensor LAMB (layer-wise adaptive moments), any device and dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops import multi_tensor_applier, multi_tensor_op

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
    step_arguments,
    step_outside_graph,
)

__all__ = ["FusedLAMB", "check_lamb_args", "global_grad_norm", "lamb_moments", "launch_lamb"]


def global_grad_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    """L2 norm of all ``grads`` together, one ``multi_tensor_l2norm`` per ``(device, dtype)``.

    Returns:
        A one-element float32 tensor on ``device`` (no host sync).
    """
    buckets = group_by_device_dtype((g,) for g in grads)
    return _bucketed_grad_norm(
        {key: gs for key, (gs,) in buckets.items()}, device, sharded=holds_dtensors(grads)
    )


def _bucketed_grad_norm(
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]],
    device: torch.device,
    *,
    sharded: bool,
) -> Tensor:
    """:func:`global_grad_norm` of gradients already grouped by ``(device, dtype)``;
    ``sharded``: some are DTensors (their norms then span the ranks' shards)."""
    l2norm = multi_tensor_op("multi_tensor_l2norm", sharded=sharded)
    norms = []
    for (dev, _), gs in buckets.items():
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        total, _ = l2norm(multi_tensor_applier.chunk_size, flag, gs, False)
        norms.append(total.reshape(1).to(device))
    if not norms:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return torch.cat(norms).square().sum().sqrt().reshape(1)


def check_lamb_args(
    optimizer: str,
    *,
    lr: float | Tensor,
    eps: float,
    weight_decay: float,
    max_grad_norm: float,
    betas: tuple[float, float],
    amsgrad: bool,
) -> None:
    """The constructor checks every LAMB optimizer makes (Apex's, with clearer messages).

    Raises:
        RuntimeError: ``amsgrad=True``.
        ValueError: A negative ``lr``, ``eps``, ``weight_decay`` or ``max_grad_norm``, or betas
            outside [0, 1).
    """
    if amsgrad:
        raise RuntimeError(
            f"{optimizer} does not support the AMSGrad variant (amsgrad=True); pass amsgrad=False."
        )
    check_nonnegative(optimizer, "learning rate", lr)
    check_nonnegative(optimizer, "epsilon value", eps)
    check_nonnegative(optimizer, "weight_decay value", weight_decay)
    check_nonnegative(optimizer, "max_grad_norm", max_grad_norm)
    check_betas(optimizer, betas)


def lamb_moments(state: dict[str, Any], p: Tensor) -> tuple[Tensor, Tensor]:
    """``(exp_avg, exp_avg_sq)`` of ``p``, created as float32 zeros on first use."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
    return state["exp_avg"], state["exp_avg_sq"]


def launch_lamb(
    noop: Tensor,
    tensor_lists: list[list[Tensor]],
    group: dict[str, Any],
    *,
    lr: float | Tensor,
    step: int | Tensor,
    global_norm: Tensor,
    max_grad_norm: float,
    adam_w_mode: int,
    use_nvlamb: bool,
    sharded: bool = False,
) -> None:
    """One ``multi_tensor_lamb`` launch with the hyperparameters of ``group``.

    Args:
        noop: The int32 flag of the launch's device.
        tensor_lists: ``[grads, params, exp_avgs, exp_avg_sqs]`` of one ``(device, dtype)``.
        group: The param group (betas, eps, weight decay, bias correction, averaging).
        lr: Learning rate of this step (a tensor is read by the op, see ``docs/compile.rst``).
        step: Step number (1 for the first step); a one-element tensor under
            ``torch.compile`` (see :func:`advance_step`).
        global_norm: One-element float32 tensor on the launch's device; the op divides the
            gradients by ``global_norm / max_grad_norm`` when that exceeds 1.
        max_grad_norm: Clipping threshold of ``global_norm``.
        adam_w_mode: 1 decoupled weight decay, 0 L2 regularisation.
        use_nvlamb: Apply the trust ratio also without weight decay.
        sharded: The tensors are DTensors (FSDP2): the trust ratio's norms span the shards.
    """
    beta1, beta2 = group["betas"]
    step, step_tensor = step_arguments(step)
    lr, lr_tensor = lr_arguments(lr)
    multi_tensor_op("multi_tensor_lamb", sharded=sharded)(
        multi_tensor_applier.chunk_size,
        noop,
        *tensor_lists,
        lr,
        beta1,
        beta2,
        group["eps"],
        step,
        1 if group["bias_correction"] else 0,
        group["weight_decay"],
        1 if group["grad_averaging"] else 0,
        adam_w_mode,
        global_norm,
        max_grad_norm,
        use_nvlamb,
        step_tensor,
        lr_tensor,
    )


class FusedLAMB(FusedOptimizerBase):
    """LAMB with one multi-tensor launch per ``(device, dtype)`` (Apex's ``FusedLAMB``).

    Each step first takes the L2 norm of all gradients of all groups together and, when it
    exceeds ``max_grad_norm``, divides the gradients by ``norm / max_grad_norm``; then every
    tensor takes an Adam(W) update scaled by its trust ratio ``||p|| / ||update||`` (applied
    when ``weight_decay != 0`` or ``use_nvlamb``). Moments are float32 for every param dtype.

    Args:
        params: Iterable of params or param-group dicts.
        lr: Learning rate.
        bias_correction: Apply Adam's bias correction.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
        weight_decay: Weight decay.
        amsgrad: Not supported; True raises, as in Apex.
        adam_w_mode: Decoupled weight decay when True, L2 regularisation when False.
        grad_averaging: Scale the gradient by ``1 - beta1`` in the first moment.
        set_grad_none: ``zero_grad`` sets gradients to ``None`` instead of zeroing them.
        max_grad_norm: Clipping threshold of the global gradient norm (Apex reads it from the
            constructor's value, not per group).
        use_nvlamb: Apply the trust ratio also to tensors without weight decay.

    Raises:
        RuntimeError: ``amsgrad=True``.
        ValueError: A negative ``lr``, ``eps``, ``weight_decay`` or ``max_grad_norm``, or betas
            outside [0, 1).

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = FusedLAMB(model.parameters(), lr=1e-3)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
    """

    # Apex's op handles (read by code built on Apex's optimizers): the amp_C ops by name.
    multi_tensor_l2norm = AmpCOp("multi_tensor_l2norm")
    multi_tensor_lamb = AmpCOp("multi_tensor_lamb")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        check_lamb_args(
            "FusedLAMB",
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            betas=betas,
            amsgrad=amsgrad,
        )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def _moments(self, p: Tensor) -> tuple[Tensor, Tensor]:
        return lamb_moments(self.state[p], p)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step over every param that has a gradient.

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
        # Every group's layout (and its checks) before any group steps.
        plans = self.step_plans("FusedLAMB", self._moments)
        # The gradients by (device, dtype) in the order global_grad_norm would group them.
        by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for _, plan, group_grads in plans:
            for bucket in plan.buckets if plan is not None else []:
                key = (bucket.device, bucket.columns[0][0].dtype)
                by_key.setdefault(key, []).extend(bucket.grads(group_grads))
        if not by_key:
            return loss
        first = next(g for _, _, group_grads in plans for g in group_grads)
        sharded = any(plan.sharded for _, plan, _ in plans if plan is not None)
        norm = _bucketed_grad_norm(by_key, first.device, sharded=sharded)
        max_grad_norm = self.defaults["max_grad_norm"]
        for group, plan, group_grads in plans:
            if plan is None:
                continue
            step = advance_step(group)
            for bucket in plan.buckets:
                ps, ms, vs = bucket.columns
                launch_lamb(
                    self.noop_flag(bucket.device),
                    [bucket.grads(group_grads), ps, ms, vs],
                    group,
                    lr=group["lr"],
                    step=step,
                    global_norm=norm.to(bucket.device),
                    max_grad_norm=max_grad_norm,
                    adam_w_mode=self.adam_w_mode,
                    use_nvlamb=self.use_nvlamb,
                    sharded=plan.sharded,
                )
        return loss
