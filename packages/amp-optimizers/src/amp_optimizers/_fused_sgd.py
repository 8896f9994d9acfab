"""``FusedSGD``: Apex's multi-tensor SGD with momentum, on any device and dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import required

from amp_fused_ops import multi_tensor_applier, multi_tensor_op

from ._base import FusedOptimizerBase
from ._step_helpers import (
    AmpCOp,
    advance_step,
    check_nonnegative,
    group_by_device_dtype,
    lr_arguments,
    step_arguments,
)
from ._stochastic_round import (
    FLAG as _SR_FLAG,
)
from ._stochastic_round import (
    SEED as _SR_SEED,
)
from ._stochastic_round import (
    assign_default_seeds,
    check_stochastic_round_group,
    distributed_world_size,
    launch_seed,
    settle_default_seed,
    stochastic_round_options,
)

__all__ = ["FusedSGD"]


def _groups_with_own_lr(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list, checked to give every param group its own ``"lr"`` (for a
    ``FusedSGD`` built without ``lr=``); each one must be a number >= 0."""
    listed: list[Any] = [params] if isinstance(params, Tensor) else list(params)
    without = [i for i, g in enumerate(listed) if not isinstance(g, dict) or "lr" not in g]
    if not listed or without:
        groups = bool(listed) and all(isinstance(g, dict) for g in listed)
        raise ValueError(
            "FusedSGD: lr is required, e.g. FusedSGD(params, lr=0.1), unless every param group "
            "gives its own, e.g. FusedSGD([{'params': ..., 'lr': 0.1}])"
            + (f"; param groups {without} have none" if groups else "")
        )
    for i, group in enumerate(listed):
        check_nonnegative("FusedSGD", f"learning rate of param group {i}", group["lr"])
    return listed


class FusedSGD(FusedOptimizerBase):
    """SGD with momentum, one multi-tensor launch per ``(device, dtype)`` (Apex's ``FusedSGD``).

    Same math as ``torch.optim.SGD`` (the first step puts the gradient itself into the momentum
    buffer), plus Apex's ``wd_after_momentum``. Momentum buffers are float32 for every param
    dtype.

    Args:
        params: Iterable of params or param-group dicts.
        lr: Learning rate. Required unless every param group gives its own ``"lr"`` (Apex's
            ``lr=required``, as ``torch.optim.SGD`` had it).
        momentum: Momentum factor.
        dampening: Dampening of the gradient in the momentum update.
        weight_decay: Weight decay (L2 penalty).
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        wd_after_momentum: Apply the weight decay after the momentum update.
        materialize_master_grads: Kept for Apex compatibility. Apex used it to pick between
            two ways of feeding amp's fp32 master gradients; here amp O2 always gives this
            optimizer float32 master params with float32 gradients, so it changes nothing.
        set_grad_none: ``zero_grad`` sets gradients to ``None`` instead of zeroing them.
        bf16_stochastic_round: Pure bfloat16 training without master weights: round each
            updated bfloat16 param stochastically (unbiased) instead of to nearest. A
            param-group option; the group's params must be bfloat16. The group counts its
            steps in ``"stochastic_round_step"``, which keys the random bits (an int, or a
            one-element CPU tensor once the step has run under ``torch.compile``).
        stochastic_round_seed: Seed of the rounding's random bits. Default: drawn from torch's
            default generator (one ``torch.randint`` call, so ``torch.manual_seed`` fixes it)
            when the first param group with ``bf16_stochastic_round=True`` is added, and, under
            ``torch.distributed``, replaced at the first step by rank 0's draw on every rank
            (one broadcast over the default process group: every rank must step). Nothing is
            drawn while no group rounds stochastically. Saved in ``state_dict()``: a resumed
            run continues bit for bit.

    Raises:
        ValueError: A missing ``lr`` (no ``lr=`` and a param group without its own), a
            negative ``lr``, negative ``momentum`` or ``weight_decay``,
            Nesterov without momentum or with dampening, or ``bf16_stochastic_round=True``
            with params that are not bfloat16 (or with amp O2's float32 master params).

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
    """

    # A default stochastic_round_seed drawn on this rank, not yet agreed with the other ranks.
    _sr_unagreed_seed: int | None = None

    # Apex's op handles (read by code built on Apex's optimizers): the amp_C ops by name.
    multi_tensor_sgd = AmpCOp("multi_tensor_sgd")

    # The steady step runs on the lists the compiled kernels keep (multi_tensor_sgd_plan).
    _stores_step_plans = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        *,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int | None = None,
    ) -> None:
        if lr is required:
            params = _groups_with_own_lr(params)
        else:
            check_nonnegative("FusedSGD", "learning rate", lr)
        check_nonnegative("FusedSGD", "momentum value", momentum)
        check_nonnegative("FusedSGD", "weight_decay value", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                "FusedSGD: Nesterov momentum requires a momentum and zero dampening, got "
                f"momentum={momentum!r}, dampening={dampening!r}"
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            **stochastic_round_options(bf16_stochastic_round, stochastic_round_seed),
        )
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        # Apex's record of the loss scale its amp handed FusedSGD through backward (1.0: none);
        # kept for code that reads or resets it. amp here unscales before step(), so 1.0.
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        self.set_grad_none = set_grad_none
        self._fresh_buffers: set[int] = set()  # ids of params given a buffer in this step
        self._sr_unagreed_seed = assign_default_seeds(self.defaults, self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (checked for ``bf16_stochastic_round`` before it is added).

        Args:
            param_group: The params and the hyperparameters that differ from the defaults.

        Raises:
            ValueError: The group asks for ``bf16_stochastic_round`` with params that are not
                bfloat16; the group is then not added.
        """
        candidate = self.candidate_group(param_group)
        if candidate is not None:
            check_stochastic_round_group("FusedSGD", candidate, masters=False)
        super().add_param_group(param_group)
        if hasattr(self, "_fresh_buffers"):  # unset while the constructor adds its groups
            drawn = assign_default_seeds(self.defaults, self.param_groups[-1:])
            if drawn is not None:
                self._sr_unagreed_seed = drawn

    def _settle_stochastic_round_seeds(self) -> None:
        self._sr_unagreed_seed = settle_default_seed(
            "FusedSGD", self.defaults, self.param_groups, self._sr_unagreed_seed
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def _momentum_buffer(self, p: Tensor) -> tuple[Tensor]:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            self._fresh_buffers.add(id(p))
        return (state["momentum_buffer"],)

    def _split_first_run(
        self, params: list[Tensor], grads: list[Tensor]
    ) -> list[tuple[bool, torch.device, list[list[Tensor]]]]:
        """The launches of a step in which some momentum buffers are new: those apart."""
        rows: dict[bool, list[tuple[Tensor, Tensor, Tensor]]] = {True: [], False: []}
        for p, g in zip(params, grads, strict=True):
            rows[id(p) in self._fresh_buffers].append((p, g, self.state[p]["momentum_buffer"]))
        return [
            (first_run, device, [gs, ps, bufs])
            for first_run, first_rows in rows.items()
            for (device, _), (ps, gs, bufs) in group_by_device_dtype(first_rows).items()
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One SGD step over every param that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = self._run_closure(closure)
        if self._sr_unagreed_seed is not None and distributed_world_size() > 1:
            self._settle_stochastic_round_seeds()
        self._fresh_buffers = set()
        # Every group's layout (and its checks) before any group steps.
        plans = self.stored_step_plans("FusedSGD", self._momentum_buffer)
        for group_index, (group, plan, grads) in enumerate(plans):
            if plan is None:
                continue
            rounding = group.get(_SR_FLAG, False)
            # The count keying the random bits (a tensor under torch.compile, see advance_step).
            sr_step, sr_step_tensor = (
                step_arguments(advance_step(group, "stochastic_round_step"))
                if rounding
                else (0, None)
            )
            # The op's first_run flag holds for a whole launch: params whose momentum buffer is
            # new (the first step, or a param whose first gradient comes later) are launched
            # apart from those that continue their buffer.
            launches: list[tuple[bool, torch.device, list[list[Tensor]]]]
            if grads is None:  # the kernels gathered the gradients into plan.lists
                launches = [(False, b.device, []) for b in plan.buckets]
            elif not self._fresh_buffers or self._fresh_buffers.isdisjoint(map(id, plan.params)):
                launches = [(False, b.device, [b.grads(grads), *b.columns]) for b in plan.buckets]
            else:
                launches = self._split_first_run(plan.params, grads)
                self.invalidate_step_plans()  # the next step continues every buffer
            sgd = multi_tensor_op("multi_tensor_sgd", sharded=plan.sharded)
            lr, lr_tensor = lr_arguments(group["lr"])
            for launch_index, (first_run, device, lists) in enumerate(launches):
                seed = None
                if rounding:
                    if group.get(_SR_SEED) is None:  # the option was switched on by hand
                        self._settle_stochastic_round_seeds()
                    seed = launch_seed(group[_SR_SEED], (group_index << 16) + launch_index)
                hyper = (
                    group["weight_decay"],
                    group["momentum"],
                    group["dampening"],
                    lr,
                    group["nesterov"],
                    first_run,
                    self.wd_after_momentum,
                    1.0,
                    seed,
                    sr_step if rounding else None,
                    sr_step_tensor,
                    lr_tensor,
                )
                flag = self.noop_flag(device)
                if not lists:  # bucket launch_index of the lists the kernels keep
                    assert plan.lists is not None
                    sgd_plan = torch.ops.amp_fused_ops.multi_tensor_sgd_plan.default
                    handle = plan.lists.handle
                    sgd_plan(multi_tensor_applier.chunk_size, flag, handle, launch_index, *hyper)
                else:  # grads, params, momentum buffers; no model copies
                    sgd(multi_tensor_applier.chunk_size, flag, *lists, None, *hyper)
        return loss
