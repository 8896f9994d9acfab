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
:mod:`amp_optimizers._adam_masters`; the device path's lists and steps in
:mod:`amp_optimizers._adam_device_path`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ._adam_device_path import AdamDevicePath
from ._adam_masters import HALF_DTYPES
from ._adam_state_format import (
    add_per_param_steps,
    drop_per_param_steps,
    from_torch_adam,
    is_torch_adam_format,
)
from ._adam_step import device_scalar, fused_adam
from ._step_helpers import (
    AmpCOp,
    advance_step,
    check_betas,
    check_nonnegative,
    step_arguments,
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


class FusedAdam(AdamDevicePath):
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
        self._device_step(grad_scale, found_inf)
        return loss

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
