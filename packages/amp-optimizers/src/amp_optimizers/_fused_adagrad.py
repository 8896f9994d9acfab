"""``FusedAdagrad``: Apex's multi-tensor Adagrad, on any device and dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops import multi_tensor_applier, multi_tensor_op

from ._adagrad_state_format import from_adagrad_state_dict, to_torch_adagrad_format
from ._base import FusedOptimizerBase
from ._step_helpers import (
    AmpCOp,
    advance_step,
    check_nonnegative,
    group_by_device_dtype,
    holds_dtensors,
    lr_arguments,
    params_with_grads,
)

__all__ = ["FusedAdagrad"]


class FusedAdagrad(FusedOptimizerBase):
    """Adagrad with one multi-tensor launch per ``(device, dtype)`` (Apex's ``FusedAdagrad``).

    Same math as ``torch.optim.Adagrad`` with ``lr_decay=0`` and
    ``initial_accumulator_value=0``; the accumulated squares are float32 for every param dtype.
    Each param's state holds its ``sum`` and, as torch's, its ``step`` count, so that
    :meth:`state_dict` loads into ``torch.optim.Adagrad`` and :meth:`load_state_dict` takes
    torch's.

    Args:
        params: Iterable of params or param-group dicts.
        lr: Learning rate.
        eps: Added to the denominator.
        weight_decay: Weight decay.
        set_grad_none: ``zero_grad`` sets gradients to ``None`` instead of zeroing them.
        adagrad_w_mode: Decoupled weight decay (AdamW-style) instead of L2 regularisation.

    Raises:
        ValueError: A negative ``lr``, ``eps`` or ``weight_decay``.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = FusedAdagrad(model.parameters(), lr=1e-2)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
    """

    # Apex's op handles (read by code built on Apex's optimizers): the amp_C ops by name.
    multi_tensor_adagrad = AmpCOp("multi_tensor_adagrad")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
    ) -> None:
        check_nonnegative("FusedAdagrad", "learning rate", lr)
        check_nonnegative("FusedAdagrad", "epsilon value", eps)
        check_nonnegative("FusedAdagrad", "weight_decay value", weight_decay)
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))
        self.set_grad_none = set_grad_none
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adagrad step over every param that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = self._run_closure(closure)
        for group in self.param_groups:
            rows = []
            group_params = params_with_grads("FusedAdagrad", group["params"])
            for p in group_params:
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros_like(p, dtype=torch.float32)
                # Counted for torch's Adagrad format (its math here needs none).
                advance_step(state)
                rows.append((p, p.grad, state["sum"]))
            adagrad = multi_tensor_op("multi_tensor_adagrad", sharded=holds_dtensors(group_params))
            lr, lr_tensor = lr_arguments(group["lr"])
            for (device, _), (ps, gs, sums) in group_by_device_dtype(rows).items():
                adagrad(
                    multi_tensor_applier.chunk_size,
                    self.noop_flag(device),
                    gs,
                    ps,
                    sums,
                    lr,
                    group["eps"],
                    self.adagrad_w_mode,
                    group["weight_decay"],
                    lr_tensor,
                )
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The state dict, in a format ``torch.optim.Adagrad`` loads as well.

        Each param's state holds its ``sum`` (float32) and its ``step`` count as a float32
        tensor (a param loaded from a state without one, such as Apex's, counts from the load);
        each group also holds ``lr_decay=0`` and ``initial_accumulator_value=0``, the values of
        this optimizer's math. ``torch.optim.Adagrad`` has no decoupled weight decay: with
        ``adagrad_w_mode`` and a nonzero ``weight_decay``, the group's params keep no ``step``, so
        that its ``load_state_dict`` refuses them (``KeyError: 'step'``) instead of continuing with
        L2 weight decay. :meth:`load_state_dict` takes every such dict back, bitwise.
        """
        return to_torch_adagrad_format(super().state_dict(), self.adagrad_w_mode)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict` (bitwise, float32 sums kept), by
        ``torch.optim.Adagrad`` (its sums made float32) or by Apex's ``FusedAdagrad``.

        Raises:
            ValueError: A torch Adagrad state dict that FusedAdagrad cannot continue: a group
                with ``lr_decay`` other than 0 or with ``maximize=True``, or with sums that
                start above zero (``initial_accumulator_value``) and a param that has none yet.
        """
        super().load_state_dict(from_adagrad_state_dict(state_dict, self.adagrad_w_mode))
