"""``FusedAdam``: Apex's multi-tensor Adam / AdamW, on any device and dtype.

Shaped as ``torch.optim.Adam``: the class validates its arguments, builds and loads the state,
and its ``step`` gathers each param group's tensor lists by ``(device, dtype)`` for one
functional step, :func:`~amp_optimizers._adam_step.fused_adam`, on one of two paths:

* the **plain path** (default): ``multi_tensor_adam`` steps params of any float dtype in place,
  with float32 moments; ``lr`` and ``step`` are Python numbers.
* the **device path** (``capturable=True``, ``master_weights=True``, a ``GradScaler``, or amp
  O2): ``multi_tensor_adam_capturable_master`` reads the (possibly scaled, possibly half)
  gradients, multiplies them by ``inv_scale``, steps float32 masters and writes the model params
  in the same pass; ``lr``, ``step``, the inverse scale and the skip flag stay on the device, so
  nothing syncs the host and the step can be captured in a CUDA graph.

The master weights, and amp O2's protocol that steps them, are in
:mod:`amp_optimizers._adam_masters`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ._adam_masters import HALF_DTYPES, AdamMasterWeights
from ._adam_state_format import (
    add_per_param_steps,
    drop_per_param_steps,
    from_torch_adam,
    is_torch_adam_format,
)
from ._adam_step import device_scalar, fused_adam, is_device_scalar, raise_on_nonfinite_flag
from ._step_helpers import (
    AmpCOp,
    advance_step,
    check_betas,
    check_nonnegative,
    group_by_device_dtype,
    holds_dtensors,
    params_with_grads,
    step_arguments,
    unscale_grads_in_place,
)
from ._step_plan import StepPlan
from ._stochastic_round import FLAG as _SR_FLAG
from ._stochastic_round import SEED as _SR_SEED
from ._stochastic_round import (
    assign_default_seeds,
    check_stochastic_round_group,
    distributed_world_size,
    launch_seed,
    settle_default_seed,
    stochastic_round_options,
)

__all__ = ["FusedAdam"]

_DEVICE_PLAN = "device"  # the StepPlan kind of the device path: [params, m, v, masters]


class FusedAdam(AdamMasterWeights):
    """Adam and AdamW with one multi-tensor launch per ``(device, dtype)`` (Apex's ``FusedAdam``).

    Drop-in for ``apex.optimizers.FusedAdam``: same positional signature and defaults. Params
    may be float32, float16 and bfloat16 in the same optimizer; the moments are always float32.

    Args:
        params: Iterable of params or param-group dicts.
        lr: Learning rate.
        bias_correction: Apply Adam's bias correction.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
        adam_w_mode: Decoupled weight decay (AdamW) when True, L2 regularisation (Adam) when
            False.
        weight_decay: Weight decay.
        amsgrad: Not supported; True raises, as in Apex.
        set_grad_none: ``zero_grad`` sets the gradients to ``None`` instead of zeroing them.
        capturable: Keep ``lr`` and the step count on the device (the group's ``lr`` becomes a
            tensor) so that ``step`` never syncs the host and can be captured in a CUDA graph.
        master_weights: Keep a float32 master copy of every half param (in the optimizer state,
            ``"master_param"``); each step reads the half gradient, steps the master and writes
            the half param in one pass.
        bf16_stochastic_round: Pure bfloat16 training without master weights: round each
            updated bfloat16 param stochastically (unbiased: an update smaller than half the
            bfloat16 spacing still moves the param on average) instead of to nearest (where
            it is lost). A param-group option; the group's params must be bfloat16, and
            ``master_weights`` and ``capturable`` must be off. See the docs' "bfloat16
            training" page.
        stochastic_round_seed: Seed of the rounding's random bits. Default: drawn from torch's
            default generator (one ``torch.randint`` call, so ``torch.manual_seed`` fixes it)
            when the first param group with ``bf16_stochastic_round=True`` is added, and, under
            ``torch.distributed``, replaced at the first step by rank 0's draw on every rank
            (one broadcast over the default process group: every rank must step). Nothing is
            drawn while no group rounds stochastically. Saved in ``state_dict()`` (param
            groups): a resumed run continues bit for bit.

    Raises:
        RuntimeError: ``amsgrad=True``.
        ValueError: A negative ``lr``, ``eps`` or ``weight_decay``, or betas outside [0, 1);
            ``bf16_stochastic_round=True`` with params that are not bfloat16, with
            ``master_weights=True`` (or amp O2) or with ``capturable=True``.

    Works with ``torch.amp.GradScaler``. With ``capturable=True`` or ``master_weights=True``
    the optimizer declares ``_step_supports_amp_scaling`` (as Apex's capturable FusedAdam):
    it reads the scaler's ``grad_scale`` and ``found_inf`` on the device, unscales inside the
    step, skips it (state untouched) on inf/nan with no host sync, and writes the unscaled
    gradients back into ``.grad``. Otherwise the scaler unscales ``.grad`` in place and skips
    ``step()`` itself, as for any optimizer (and, as torch's, refuses float16 gradients: use
    ``capturable=True`` or ``master_weights=True`` for float16 params). Either way ``.grad``
    holds the unscaled gradients after ``scaler.step(optimizer)``.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
    """

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether ``torch.amp.GradScaler`` leaves the unscaling to ``step`` (Apex: only when
        capturable; here also with master weights, which it did not allow without)."""
        return bool(self.capturable or self.master_weights)

    # A default stochastic_round_seed drawn on this rank, not yet agreed with the other ranks.
    _sr_unagreed_seed: int | None = None

    # The plain path steps on the lists the compiled kernels hold (multi_tensor_adam_plan).
    _stores_step_plans = True
    # The device path (capturable, master weights, GradScaler) caches its layout too; the
    # amp O2 step, whose gradients may be the masters' own, gathers its lists at every step.
    _plans_device_path = True

    # Apex's op handles (read by code built on Apex's optimizers): the amp_C ops by name.
    multi_tensor_adam = AmpCOp("multi_tensor_adam")
    multi_tensor_adam_capturable = AmpCOp("multi_tensor_adam_capturable")
    multi_tensor_adam_capturable_master = AmpCOp("multi_tensor_adam_capturable_master")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        bf16_stochastic_round: bool = False,
        stochastic_round_seed: int | None = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError(
                "FusedAdam does not support the AMSGrad variant (amsgrad=True); use "
                "torch.optim.Adam(amsgrad=True) instead."
            )
        check_nonnegative("FusedAdam", "learning rate", lr)
        check_nonnegative("FusedAdam", "epsilon value", eps)
        check_nonnegative("FusedAdam", "weight_decay value", weight_decay)
        check_betas("FusedAdam", betas)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            **stochastic_round_options(bf16_stochastic_round, stochastic_round_seed),
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        self._amp_master = False  # amp O2 switched the master-weight path on
        self._amp_masters = {}  # under amp O2: each half param's master, as amp holds it
        for group in self.param_groups:
            self._check_stochastic_round(group)
        self._sr_unagreed_seed = assign_default_seeds(self.defaults, self.param_groups)
        if capturable:
            for group in self.param_groups:
                self._after_load_group(group)

    # -- state ----------------------------------------------------------------------------

    def _state(self, p: Tensor, master_source: Tensor | None = None) -> dict[str, Any]:
        """The state of ``p``, created where missing (as on its first step).

        Under amp O2 the master of a half param is the one amp holds and exports: state
        cleared or deleted by hand (``del optimizer.state[p]``) gets zero moments again, as
        in torch.optim, but keeps that master, which is the weight itself, not a statistic.
        """
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        if self._uses_masters() and p.dtype in HALF_DTYPES and "master_param" not in state:
            master = self._amp_masters.get(p) if self._amp_master else None
            if master is None:
                source = p if master_source is None else master_source
                master = source.detach().to(dtype=torch.float32, copy=True)
            state["master_param"] = master
        return state

    def state_dict(self) -> dict[str, Any]:
        """The state dict; each param's state also holds its group's ``step`` (a float32
        tensor), so that ``torch.optim.Adam`` / ``AdamW`` can load it too.

        .. note:: With ``capturable=True`` the step is read back from the device.
        """
        return add_per_param_steps(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict` (bitwise, float32 state kept), or one
        saved by ``torch.optim.Adam`` / ``AdamW`` (converted: one step per group).

        Master weights that exist already (amp O2 holds references to them) are overwritten in
        place rather than replaced, and kept when the loaded state has none.

        Raises:
            ValueError: A torch Adam state dict that FusedAdam cannot continue (AMSGrad,
                ``maximize``, params of one group at different steps).
        """
        if is_torch_adam_format(state_dict):
            state_dict = from_torch_adam(state_dict, self.adam_w_mode)
        else:
            state_dict = drop_per_param_steps(state_dict)
        masters = self._masters_by_id()
        super().load_state_dict(state_dict)
        self._keep_masters(masters)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; with ``capturable=True`` its ``lr`` becomes a device tensor too.

        Args:
            param_group: The params and the hyperparameters that differ from the defaults.

        Raises:
            ValueError: The group asks for ``bf16_stochastic_round`` where it cannot apply (see
                the class); the group is then not added.
        """
        constructed = hasattr(self, "_amp_master")  # unset while the constructor adds groups
        candidate = self.candidate_group(param_group) if constructed else None
        if candidate is not None:
            self._check_stochastic_round(candidate)
        super().add_param_group(param_group)
        if constructed:
            drawn = assign_default_seeds(self.defaults, self.param_groups[-1:])
            if drawn is not None:
                self._sr_unagreed_seed = drawn
        if getattr(self, "capturable", False):
            self._after_load_group(self.param_groups[-1])

    def _check_stochastic_round(self, group: dict[str, Any], *, masters: bool = False) -> None:
        check_stochastic_round_group(
            "FusedAdam",
            group,
            masters=masters or self._uses_masters(),
            capturable=self.capturable,
        )

    def _after_load_group(self, group: dict[str, Any]) -> None:
        if not self.capturable or not group["params"]:
            return
        device = group["params"][0].device
        if not isinstance(group["lr"], Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
        group["lr"] = group["lr"].to(device=device, dtype=torch.float32)
        # The step count exists from the start: a step captured in a CUDA graph advances this
        # tensor in place, and must not create it (a new tensor would not be replayed).
        group["step"] = device_scalar(group.get("step", 0), device).clone()

    # -- step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step over every param that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: A sparse gradient, or a param dtype other than float32/16/bf16.
        """
        loss = self._run_closure(closure)
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if not isinstance(found_inf, Tensor):
            found_inf = None
        use_device_path = (
            self.capturable
            or self._uses_masters()
            or grad_scale is not None
            or found_inf is not None
        )
        if not use_device_path:
            if self._sr_unagreed_seed is not None and distributed_world_size() > 1:
                self._settle_stochastic_round_seeds()
            # Every group's layout (and its checks) before any group steps.
            plans = self.stored_step_plans("FusedAdam", self._moments)
            for index, (group, plan, grads) in enumerate(plans):
                if plan is not None:
                    self._plain_group(group, plan, grads, index)
            return loss
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        # Per group with a gradient: (group, the op's lists, sharded, its gradients).
        work: list[tuple[dict[str, Any], list[list[list[Tensor]]], bool, list[Tensor]]]
        if self._plans_device_path:
            # The layout of each group cached as on the plain path, its columns those of
            # multi_tensor_adam_capturable_master: params, moments, masters.
            device_plans = self.step_plans("FusedAdam", self._device_columns, kind=_DEVICE_PLAN)
            work = [
                (group, self._device_lists(plan, grads), plan.sharded, grads)
                for group, plan, grads in device_plans
                if plan is not None
            ]
        else:
            work = []
            for group in self.param_groups:
                params = params_with_grads("FusedAdam", group["params"])
                if params:
                    lists = self._device_rows(params, use_master_grads=False)
                    grads = [p.grad for p in params if p.grad is not None]
                    work.append((group, lists, holds_dtensors(params), grads))
        if found_inf is not None:
            # GradScaler's found_inf already covers every gradient: no pre-check needed.
            for group, lists, sharded, _ in work:
                self._device_group(group, lists, sharded, inv_scale, found_inf, check_finite=False)
        elif work:
            # An inf or a nan anywhere skips every group, as one step: every group but the
            # first is checked before any is written; the first group's launches check their
            # own gradients, and each group's skip flag is folded into own_flag.
            own_flag = torch.zeros((), dtype=torch.float32, device=work[0][1][0][1][0].device)
            for _, _, _, grads in work[1:]:
                raise_on_nonfinite_flag(own_flag, grads)
            for group, lists, sharded, _ in work:
                self._device_group(group, lists, sharded, inv_scale, own_flag, check_finite=True)
        if grad_scale is not None:
            # As the scaler leaves .grad for a plain optimizer (and Apex's capturable kernel
            # left it): unscaled, whether or not the step was skipped.
            unscale_grads_in_place([g for *_, grads in work for g in grads], grad_scale)
        return loss

    def _device_columns(self, p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The state columns of ``p`` on the device path: its moments and its master (``p``
        itself where it has none: a float32 param, or a half param without master weights)."""
        state = self._state(p)
        return state["exp_avg"], state["exp_avg_sq"], state.get("master_param", p)

    @staticmethod
    def _device_lists(plan: StepPlan, grads: list[Tensor]) -> list[list[list[Tensor]]]:
        """The op's lists ``[grads, params, exp_avgs, exp_avg_sqs, masters]`` of each bucket of
        a device-path plan. A half param without a master gets a float32 copy, made at each
        step, that the op steps and writes back."""
        out = []
        for bucket in plan.buckets:
            params, exp_avgs, exp_avg_sqs, masters = bucket.columns
            if params[0].dtype != torch.float32 and any(map(operator.is_, masters, params)):
                pairs = zip(params, masters, strict=True)
                masters = [p.float() if m is p else m for p, m in pairs]
            out.append([bucket.grads(grads), params, exp_avgs, exp_avg_sqs, masters])
        return out

    def _settle_stochastic_round_seeds(self) -> None:
        self._sr_unagreed_seed = settle_default_seed(
            "FusedAdam", self.defaults, self.param_groups, self._sr_unagreed_seed
        )

    def _moments(self, p: Tensor) -> tuple[Tensor, Tensor]:
        state = self._state(p)
        return state["exp_avg"], state["exp_avg_sq"]

    def _plain_group(
        self,
        group: dict[str, Any],
        plan: StepPlan,
        grads: list[Tensor] | None,
        group_index: int,
    ) -> None:
        """Step one group on the plain path: its cached plan's lists, the count on the host;
        ``grads`` None: the compiled kernels gathered them into ``plan.lists``."""
        step, step_tensor = step_arguments(advance_step(group))
        seeds: list[int] = []
        if group.get(_SR_FLAG, False):
            if group.get(_SR_SEED) is None:  # the option was switched on in the group by hand
                self._settle_stochastic_round_seeds()
            first = group_index << 16  # a seed per launch: (group, bucket)
            seeds = [launch_seed(group[_SR_SEED], first + i) for i in range(len(plan.buckets))]
        lists = [] if grads is None else [[b.grads(grads), *b.columns] for b in plan.buckets]
        fused_adam(
            lists,
            self.noop_flag,
            plan_lists=plan.lists if grads is None else None,
            device_path=False,
            # A tensor lr stays a tensor: data of a compiled step, not a constant.
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adam_w_mode=self.adam_w_mode,
            bias_correction=1 if group["bias_correction"] else 0,
            step=step,
            step_tensor=step_tensor,
            seeds=seeds,
            sharded=plan.sharded,
        )

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
                # float32 params are their own masters; half params without master weights
                # get a temporary float32 copy that the op steps and writes back.
                master = p if p.dtype == torch.float32 else p.float()
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
