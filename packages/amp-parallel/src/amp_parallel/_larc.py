"""Apex's ``LARC``: layer-wise adaptive rate scaling (clipping) around any optimizer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["LARC"]

log = logging.getLogger(__name__)


class LARC:
    """Wrap an optimizer and scale each parameter's gradient by its LARS trust ratio.

    For every parameter with a gradient, with ``wd`` the group's weight decay::

        local_lr = trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps)
        local_lr = min(local_lr / lr, 1)       # clip=True ("LARC clipping")
        g = (g + wd * p) * local_lr             # weight decay folded into the gradient

    then the wrapped optimizer steps with its own weight decay set to 0 (restored after).
    Parameters whose norm or gradient norm is zero keep their gradient unchanged. The ratio
    is computed on the device: no host synchronization per parameter.

    Args:
        optimizer: The optimizer to wrap (``param_groups``, ``state``, ``state_dict`` pass
            through to it).
        trust_coefficient: LARS trust coefficient ``eta``.
        clip: ``True``: clip the adaptive lr at the group lr (LARC); ``False``: scale
            (LARS, the effective lr is ``lr * local_lr``).
        eps: Added to the denominator.

    Example:
        >>> optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        >>> loss.backward()
        >>> optimizer.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trust_coefficient: float = 0.02,
        clip: bool = True,
        eps: float = 1e-8,
    ) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "pass e.g. LARC(torch.optim.SGD(model.parameters(), lr=0.1))."
            )
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self) -> dict[str, Any]:
        return self.optim.__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optim.__setstate__(state)

    def __repr__(self) -> str:
        return (
            f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, "
            f"eps={self.eps}, {self.optim!r})"
        )

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state``."""
        return self.optim.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (settable)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def _adapt(self, group: dict[str, Any], weight_decay: float) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            grad: Tensor = p.grad
            param_norm = torch.linalg.vector_norm(p.float())
            grad_norm = torch.linalg.vector_norm(grad.float())
            ratio = (
                self.trust_coefficient
                * param_norm
                / (grad_norm + param_norm * weight_decay + self.eps)
            )
            if self.clip:
                ratio = torch.clamp(ratio / group["lr"], max=1.0)
            active = (param_norm != 0) & (grad_norm != 0)
            scale = torch.where(active, ratio, torch.ones_like(ratio))
            if weight_decay != 0:
                wd = torch.where(
                    active, torch.full_like(ratio, weight_decay), torch.zeros_like(ratio)
                )
                grad.add_((wd * p.float()).to(grad.dtype))
            grad.mul_(scale.to(grad.dtype))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Adapt the gradients, then step the wrapped optimizer.

        Args:
            closure: Optional; re-evaluates the loss (called before the gradients are adapted).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved = []
        for group in self.optim.param_groups:
            weight_decay = float(group.get("weight_decay", 0.0))
            saved.append(weight_decay)
            self._adapt(group, weight_decay)
            if "weight_decay" in group:
                group["weight_decay"] = 0
        try:
            self.optim.step()
        finally:  # restore even when the step raises (Apex left weight decay at 0)
            for group, weight_decay in zip(self.optim.param_groups, saved, strict=True):
                if "weight_decay" in group:
                    group["weight_decay"] = weight_decay
        return loss
