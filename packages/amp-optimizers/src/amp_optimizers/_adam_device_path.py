"""FusedAdam's device path: the step of ``capturable=True``, master weights and ``GradScaler``.

The lists of ``multi_tensor_adam_capturable_master`` (gradients, params, moments, masters) of
each param group, by ``(device, dtype)``: from the group's cached layout (a step plan of kind
``"device"``, checked as the plain path's is), or gathered at each step for an amp O2 step in
which masters hold the gradients (amp put unscaled ones there). Then one functional step per
group (:func:`~amp_optimizers._adam_step.fused_adam`), an inf or a nan anywhere skipping all
of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._adam_masters import AdamMasterWeights
from ._adam_step import device_scalar, fused_adam, is_device_scalar, raise_on_nonfinite_flag
from ._step_helpers import (
    group_by_device_dtype,
    holds_dtensors,
    params_with_grads,
    unscale_grads_in_place,
)
from ._step_plan import StepPlan

__all__ = ["AdamDevicePath"]

_DEVICE_PLAN = "device"  # the StepPlan kind of the device path: [params, m, v, masters]


class AdamDevicePath(AdamMasterWeights):
    """The device path of :class:`~amp_optimizers.FusedAdam` (a mixin of it)."""

    # The device path (capturable, master weights, GradScaler, amp O2's step when no master
    # holds a gradient) caches its layout, as the plain path does. Off: every step gathers its
    # lists in Python, as before the cache.
    _plans_device_path = True
    adam_w_mode: int  # set by FusedAdam

    def _device_step(self, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """One step of every group on the device path: ``grad_scale`` and ``found_inf`` as a
        ``GradScaler`` hands them to the step (None without one)."""
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        work = self._device_work()
        # GradScaler's found_inf already covers every gradient: no pre-check needed.
        self._device_run(work, inv_scale, found_inf, covered=found_inf is not None)
        if grad_scale is not None:
            # As the scaler leaves .grad for a plain optimizer (and Apex's capturable kernel
            # left it): unscaled, whether or not the step was skipped.
            unscale_grads_in_place([g for *_, grads in work for g in grads], grad_scale)

    @torch.no_grad()
    def amp_fused_master_step(self, inv_scale: Tensor, found_inf: Tensor) -> None:
        """amp O2's step (:meth:`AdamMasterWeights.amp_fused_master_step`), on the groups' cached
        layouts when every gradient is the param's own ``.grad`` (no master holds one: the
        usual step after a backward); else with the lists gathered at this step."""
        if self._plans_device_path and all(m.grad is None for m in self._amp_masters.values()):
            self._device_run(self._device_work(), inv_scale, found_inf, covered=False)
            return
        super().amp_fused_master_step(inv_scale, found_inf)

    def _device_work(
        self,
    ) -> list[tuple[dict[str, Any], list[list[list[Tensor]]], bool, list[Tensor]]]:
        """Per group with a gradient: ``(group, the op's lists, sharded, its gradients)``."""
        if self._plans_device_path:
            # The layout of each group cached as on the plain path, its columns those of
            # multi_tensor_adam_capturable_master: params, moments, masters.
            device_plans = self.step_plans("FusedAdam", self._device_columns, kind=_DEVICE_PLAN)
            return [
                (group, self._device_lists(plan, grads), plan.sharded, grads)
                for group, plan, grads in device_plans
                if plan is not None
            ]
        work = []
        for group in self.param_groups:
            params = params_with_grads("FusedAdam", group["params"])
            if params:
                lists = self._device_rows(params, use_master_grads=False)
                grads = [p.grad for p in params if p.grad is not None]
                work.append((group, lists, holds_dtensors(params), grads))
        return work

    def _device_run(
        self,
        work: list[tuple[dict[str, Any], list[list[list[Tensor]]], bool, list[Tensor]]],
        inv_scale: Tensor | None,
        found_inf: Tensor | None,
        *,
        covered: bool,
    ) -> None:
        """Step the groups of :meth:`_device_work` as one step: all of them, or none.

        ``covered``: ``found_inf`` already says whether any gradient holds an inf or a nan
        (a ``GradScaler``'s). Else every group but the first is checked before any is written,
        into ``found_inf`` (a flag of this step's own when None); the first group's launches
        check their own gradients, and each group's skip flag is folded into the flag, which
        the later groups read.
        """
        if covered:
            assert found_inf is not None
            for group, lists, sharded, _ in work:
                self._device_group(group, lists, sharded, inv_scale, found_inf, check_finite=False)
            return
        if not work:
            return
        if found_inf is None:
            found_inf = torch.zeros((), dtype=torch.float32, device=work[0][1][0][1][0].device)
        for _, _, _, grads in work[1:]:
            raise_on_nonfinite_flag(found_inf, grads)
        for group, lists, sharded, _ in work:
            self._device_group(group, lists, sharded, inv_scale, found_inf, check_finite=True)

    def _device_columns(self, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The state columns of ``p`` on the device path: its moments and its master (``p``
        itself where it has none: a float32 param, or a half param without master weights)."""
        state = self._state(p)
        return state["exp_avg"], state["exp_avg_sq"], state.get("master_param", p)

    @staticmethod
    def _device_lists(plan: StepPlan, grads: list[Tensor]) -> list[list[list[Tensor]]]:
        """The lists ``[grads, params, exp_avgs, exp_avg_sqs, masters]`` of each bucket of a
        device-path plan (a param without a master weight is its own, as
        :func:`~amp_optimizers._adam_step.fused_adam` takes them)."""
        return [[bucket.grads(grads), *bucket.columns] for bucket in plan.buckets]

    def _device_rows(
        self, params: list[Tensor], *, use_master_grads: bool
    ) -> list[list[list[Tensor]]]:
        """The op's lists of each ``(device, dtype)`` of ``params`` (those with a gradient), read
        at this step: ``use_master_grads`` reads a half param's gradient from its master's
        ``.grad`` when that is set (amp put the unscaled gradient there)."""
        rows = []
        for p in params:
            state = self._state(p)
            master = state.get("master_param")
            grad = p.grad
            if use_master_grads and master is not None and master.grad is not None:
                grad = master.grad
            if master is None:
                master = p  # its own master: fused_adam steps it in float32
            rows.append((p, grad, state["exp_avg"], state["exp_avg_sq"], master))
        return [
            [gs, ps, ms, vs, masters]
            for ps, gs, ms, vs, masters in group_by_device_dtype(rows).values()
        ]

    def _device_group(
        self,
        group: dict[str, Any],
        lists: list[list[list[Tensor]]],
        sharded: bool,
        inv_scale: Tensor | None,
        found_inf: Tensor | None,
        *,
        check_finite: bool,
    ) -> None:
        """Step one group on the device path: ``lists`` as :func:`fused_adam` takes them (one
        entry per ``(device, dtype)``, its params those with a gradient); ``sharded``: they are
        DTensors; ``inv_scale``, ``found_inf`` and ``check_finite`` as :func:`fused_adam` takes
        them."""
        device = lists[0][1][0].device
        step_t = group.get("step", 0)
        if not is_device_scalar(step_t, device):
            # The group's own count from here on, advanced in place by the step.
            step_t = group["step"] = device_scalar(step_t, device).clone()
        lr_t = device_scalar(group["lr"], device)
        fused_adam(
            lists,
            self.noop_flag,
            device_path=True,
            lr=lr_t,
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adam_w_mode=self.adam_w_mode,
            bias_correction=1 if group["bias_correction"] else 0,
            step=step_t,
            inv_scale=inv_scale,
            found_inf=found_inf,
            check_finite=check_finite,
            sharded=sharded,
        )

    def _device_steps(
        self,
        work: list[tuple[dict[str, Any], list[Tensor]]],
        inv_scale: Tensor | None,
        found_inf: Tensor,
        *,
        use_master_grads: bool,
    ) -> None:
        """Step several groups on the device path as one step: all of them, or none.

        Every group but the first is checked for inf/nan before any is written; the first
        group's launches check their own gradients, and each group's skip flag is folded into
        ``found_inf`` (0-dim float32, raised on the device), which the later groups read.
        """
        for _group, params in work[1:]:
            grads = [self._amp_grad(p) if use_master_grads else p.grad for p in params]
            raise_on_nonfinite_flag(found_inf, [g for g in grads if g is not None])
        for group, params in work:
            self._device_group(
                group,
                self._device_rows(params, use_master_grads=use_master_grads),
                holds_dtensors(params),
                inv_scale,
                found_inf,
                check_finite=True,
            )
