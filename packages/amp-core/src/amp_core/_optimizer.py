"""What ``amp.initialize`` does to an optimizer: master weights, unscaling, skipped steps.

All of it is recorded on the optimizer's :class:`OptimizerAmpState` (``optimizer._amp_state``).
``optimizer.step``, ``optimizer.zero_grad`` and ``optimizer.add_param_group`` are wrapped on
the instance (Apex's contract needs a step that can be skipped, which no PyTorch hook offers, and
a group added later needs the same treatment as the first ones); :meth:`remove` restores them.

Per step, the host reads the overflow flag once, in ``step()``, and only when it is checked
(at O1, O2 and O3, with any loss scale; with a dynamic one it reads the new scale in the same
sync): everything else (unscaling, the overflow check, the scale update, the copy
of the master weights into the model) is launched without waiting for the device.

Under O2, an optimizer that implements :class:`~amp_core._fused_master.FusedMasterWeightOptimizer`
keeps the masters itself and steps them in one fused pass (see that module): its gradients stay
scaled until ``step()``, which unscales, checks, steps and writes the model in one go, and the
loss scale is updated after that step.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._fused_master import supports_fused_master_weights
from ._scaler import LossScaler, coalesce_half_sparse_grads

if TYPE_CHECKING:
    from ._model import ModelAmpState
    from ._state import AmpSession

__all__ = ["OptimizerAmpState", "optimizer_state"]

logger = logging.getLogger("amp_core.scaler")

_HALF = (torch.float16, torch.bfloat16)


def _group_by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.device].append(t)
    return groups


class OptimizerAmpState:
    """Amp's record on one optimizer (``optimizer._amp_state``).

    Args:
        optimizer: The optimizer.
        session: The ``amp.initialize`` call it came from (loss scalers, properties).
        master_weights: Whether half params get fp32 master copies.
        fp32_masters: Full-precision values for params the model cast just now, used as the
            masters' initial values instead of the rounded half values.
        model_states: The models of the same call, told about masters made later (for a
            param group added after ``amp.initialize``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        session: AmpSession,
        master_weights: bool,
        fp32_masters: dict[nn.Parameter, torch.Tensor],
        model_states: list[ModelAmpState] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.session = session
        self.master_weights = master_weights
        self.model_states = model_states if model_states is not None else []
        self.model_params: list[nn.Parameter] = []  # half params stepped through a master
        self.masters: list[torch.Tensor] = []  # their fp32 masters, in the same order
        self.direct_params: list[torch.Tensor] = []  # params the optimizer steps itself
        self.grads_scaled = False  # grads hold scaled values (delay_unscale was used)
        self._stash: list[torch.Tensor | None] = []
        self._found_inf: torch.Tensor | None = None
        self._overflow_checks: list[tuple[int, torch.Tensor]] = []
        self._backward_seen = False
        self._host_skips = 0
        # Steps the fused path skipped on the device without reading the flag back (static
        # loss scale): summed there, read only when skipped_steps is asked for.
        self._device_skips: torch.Tensor | None = None
        self._original_step = optimizer.step
        self._original_zero_grad = optimizer.zero_grad
        # Wrappers such as LARC may lack add_param_group: then there is nothing to wrap.
        self._original_add_param_group = getattr(optimizer, "add_param_group", None)
        # The fused master-weight path: the optimizer keeps the masters (see _fused_master).
        self.fused = master_weights and supports_fused_master_weights(optimizer)
        # A backward whose scaled grads wait for the fused step: (scaler, loss_id, check).
        self._pending: tuple[LossScaler, int, bool] | None = None
        # After a fused step, the grads it read are still scaled by this (until zero_grad).
        self._stale_inv_scale: torch.Tensor | None = None
        if self.fused:
            self._enable_fused_masters(fp32_masters)
        elif master_weights:
            self._make_masters(fp32_masters)
        else:
            self.direct_params = [p for g in optimizer.param_groups for p in g["params"]]
        # Bound to the optimizer itself: LR schedulers re-bind `optimizer.step.__func__` to it.
        optimizer.step = types.MethodType(_amp_step, optimizer)  # type: ignore[method-assign]
        optimizer.zero_grad = types.MethodType(  # type: ignore[method-assign]
            _amp_zero_grad, optimizer
        )
        if self._original_add_param_group is not None:
            optimizer.add_param_group = types.MethodType(  # type: ignore[method-assign]
                _amp_add_param_group, optimizer
            )

    # -- construction ------------------------------------------------------------------------

    def _make_masters(self, fp32_masters: dict[nn.Parameter, torch.Tensor]) -> None:
        for group in self.optimizer.param_groups:
            self._make_group_masters(group, fp32_masters)

    def _make_group_masters(
        self, group: dict[str, Any], fp32_masters: dict[nn.Parameter, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Put fp32 masters in place of the half params of ``group``; return the new pairs."""
        optimizer = self.optimizer
        params = group["params"]
        pairs = []
        for i, param in enumerate(params):
            if param.dtype not in _HALF:
                self.direct_params.append(param)
                continue
            source = fp32_masters.get(param)
            # The pre-cast fp32 value when there is one (no rounding through half).
            master = source.float() if source is not None else param.detach().float()
            master.requires_grad_(True)
            params[i] = master
            if param in optimizer.state:  # move existing state onto the master
                optimizer.state[master] = {
                    k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                    for k, v in optimizer.state.pop(param).items()
                }
            self.model_params.append(param)
            self.masters.append(master)
            pairs.append((param, master))
        return pairs

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``optimizer.add_param_group`` after ``amp.initialize``: the new group is treated as
        ``initialize`` treated the others (fp32 masters for its half params under O2, whose
        fused optimizers make their state; unscaled and checked at every level)."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is not None and not isinstance(params, (torch.Tensor, set)):
            params = param_group["params"] = list(params)  # a generator is read once (as torch)
        given = [params] if isinstance(params, torch.Tensor) else list(params or [])
        known = {id(p) for p in self.model_params}
        if any(id(p) in known for p in given):
            raise ValueError(
                "some parameters appear in more than one parameter group (amp keeps fp32 "
                "master weights of them in an earlier group); add each parameter once."
            )
        assert self._original_add_param_group is not None  # only wrapped when there is one
        self._original_add_param_group(param_group)
        group = self.optimizer.param_groups[-1]
        if self.fused:
            pairs = self.optimizer.amp_enable_fused_master_weights({})  # type: ignore[attr-defined]
            by_param = {id(p): m for p, m in pairs}
            new = []
            for param in group["params"]:
                if id(param) in by_param:
                    self.model_params.append(param)
                    self.masters.append(by_param[id(param)])
                    new.append((param, by_param[id(param)]))
                else:
                    self.direct_params.append(param)
        elif self.master_weights:
            new = self._make_group_masters(group, {})
        else:
            new = []
            self.direct_params.extend(group["params"])
        for state in self.model_states:
            state.masters.update(new)

    def _enable_fused_masters(self, fp32_masters: dict[nn.Parameter, torch.Tensor]) -> None:
        optimizer: Any = self.optimizer
        pairs = optimizer.amp_enable_fused_master_weights(fp32_masters)
        by_param = {id(p): m for p, m in pairs}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in by_param:
                    self.model_params.append(param)
                    self.masters.append(by_param[id(param)])
                else:
                    self.direct_params.append(param)

    def remove(self) -> None:
        """Restore ``step``, ``zero_grad`` and ``add_param_group`` (master weights stay in the
        param groups, or, on the fused path, the optimizer goes back to stepping its params
        without amp's masters)."""
        patched: dict[str, Any] = {"step": _amp_step, "zero_grad": _amp_zero_grad}
        patched["add_param_group"] = _amp_add_param_group
        originals: dict[str, Any] = {"step": self._original_step}
        originals["zero_grad"] = self._original_zero_grad
        originals["add_param_group"] = self._original_add_param_group
        own = self.optimizer.__dict__
        for name, func in patched.items():
            if getattr(own.get(name), "__func__", None) is not func:
                continue  # not wrapped, or wrapped again since (_amp_step then delegates)
            original = originals[name]
            if getattr(original, "__func__", None) is getattr(type(self.optimizer), name, None):
                del own[name]  # the class's method again
            else:
                own[name] = original  # an instance attribute set before amp.initialize
        if self.fused:
            self._pending = None
            self.optimizer.amp_disable_fused_master_weights()  # type: ignore[attr-defined]

    # -- backward ------------------------------------------------------------------------------

    def prepare_backward(self) -> None:
        """Before a scaled backward: set existing grads aside so new ones arrive alone."""
        self.materialize()  # grads still scaled from a deferred backward: unscale them first
        self.settle_stale_grads()
        self._stash = []
        for p in self.direct_params:
            self._stash.append(p.grad)
            p.grad = None
        for p in self.model_params:
            p.grad = None

    def post_backward(
        self,
        scaler: LossScaler,
        found_inf: torch.Tensor,
        check: bool,
        defer_loss_id: int | None = None,
    ) -> bool:
        """After a scaled backward: unscale the new grads into place and add the set-aside ones.

        Master weights receive the model's half grads as fp32 (the model's grads are freed).

        On the fused path, when ``defer_loss_id`` is given and no earlier gradient waits, the
        gradients are left scaled for the fused step instead, and True is returned: the caller
        must then leave the scale update (and the overflow note) to ``step()``.
        """
        self._backward_seen = True
        if (
            self.fused
            and defer_loss_id is not None
            and self._pending is None
            and all(s is None for s in self._stash)
            and all(m.grad is None for m in self.masters)
        ):
            self._stash = []
            self._pending = (scaler, defer_loss_id, check)
            return True
        self._unscale_into_place(scaler, found_inf, check)
        return False

    def materialize(self) -> None:
        """Unscale a deferred backward's grads into place, as ``scale_loss`` exit would have.

        The half grads go to the masters' ``.grad`` as fp32, the others are unscaled in place,
        the loss scale is updated and the overflow noted for the next ``step()``. A no-op when
        no backward is deferred.
        """
        if self._pending is None:
            return
        scaler, loss_id, check = self._pending
        self._pending = None
        device = scaler.device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._stash = []
        self._unscale_into_place(scaler, found_inf, check)
        scaler.update_(found_inf)
        if check:
            self.note_overflow_check(loss_id, found_inf)

    def settle_stale_grads(self) -> None:
        """Grads a fused step read scaled and nobody zeroed: unscale them into place, so that
        they accumulate as they would on the ordinary path (the user skipped ``zero_grad``),
        and ``master_params`` or a second ``step()`` see them as the ordinary path leaves them.
        A no-op when there are none."""
        inv_scale, self._stale_inv_scale = self._stale_inv_scale, None
        if inv_scale is None:
            return
        with torch.no_grad():
            for p in self.direct_params:
                if p.grad is not None:
                    p.grad.mul_(inv_scale.to(p.grad.device))
            for p, master in zip(self.model_params, self.masters, strict=True):
                if p.grad is None:
                    continue
                grad = p.grad.float() * inv_scale.to(p.grad.device)
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                p.grad = None

    def _unscale_into_place(self, scaler: LossScaler, found_inf: torch.Tensor, check: bool) -> None:
        # A group added after the stash was made has nothing set aside.
        stash = self._stash + [None] * (len(self.direct_params) - len(self._stash))
        scaler.unscale_with_stash_(self.direct_params, stash, found_inf, check=check)
        self._stash = []

        pairs = [
            (p, m)
            for p, m in zip(self.model_params, self.masters, strict=True)
            if p.grad is not None
        ]
        if pairs:
            fresh = [p.grad.float() for p, _ in pairs]  # type: ignore[union-attr]
            scaler.unscale_(fresh, found_inf, check=check)
            for (param, master), grad in zip(pairs, fresh, strict=True):
                if master.grad is None:
                    master.grad = grad
                else:
                    master.grad.add_(grad)
                param.grad = None

    def check_grads(self, scaler: LossScaler, found_inf: torch.Tensor) -> None:
        """Raise ``found_inf`` when a gradient the optimizer will read holds an inf or a nan
        (a static scale of one: nothing to unscale; no master weights)."""
        coalesce_half_sparse_grads(self.direct_params)
        grads = [p.grad for p in self.direct_params if p.grad is not None]
        scaler.unscale_(grads, found_inf, check=True)

    def note_overflow_check(self, loss_id: int, found_inf: torch.Tensor) -> None:
        """Remember an overflow flag that the next ``step()`` must honour."""
        self._overflow_checks.append((loss_id, found_inf))
        self._found_inf = found_inf if self._found_inf is None else self._found_inf + found_inf

    # -- step -----------------------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for gradient overflow (reads the device-side count, if any, back)."""
        on_device = int(self._device_skips.item()) if self._device_skips is not None else 0
        return self._host_skips + on_device

    def _skip(self, closure: Callable[[], Any] | None) -> None:
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        self._host_skips += 1
        if self.session.verbosity > 0:
            for loss_id, flag in self._overflow_checks:
                if flag.item():
                    scaler = self.session.scalers[loss_id]
                    logger.warning(
                        "Gradient overflow.  Skipping step, loss scaler %d %s loss scale to %s",
                        loss_id,
                        "reducing" if scaler.dynamic else "keeping its static",
                        scaler.loss_scale(),
                    )
        self.clear_master_grads()

    def _read_overflow(self, found_inf: torch.Tensor, loss_ids: list[int]) -> bool:
        """The one host sync of a step: the overflow flag, and with it the current values of the
        dynamic scales that set it (the scalers' host hints of whether the scale is below one).
        """
        scalers: list[LossScaler] = []
        for loss_id in loss_ids:
            scaler = self.session.scalers[loss_id]
            if scaler.dynamic and scaler.device is not None and scaler not in scalers:
                scalers.append(scaler)
        values = [found_inf.float().reshape(())]
        values += [s.scale_tensor(s.device).to(found_inf.device) for s in scalers]  # type: ignore[arg-type]
        flag, *scales = torch.stack(values).tolist()
        for scaler, value in zip(scalers, scales, strict=True):
            scaler.note_host_scale(value)
        return bool(flag)

    def _fused_step(self, closure: Callable[[], Any] | None) -> Any:
        """``step()`` on the fused master-weight path: one pass, no master->model copy."""
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        self._backward_seen = False
        optimizer: Any = self.optimizer
        pending, self._pending = self._pending, None
        if pending is None:  # grads already unscaled into place (or none at all)
            self.settle_stale_grads()  # a second step() after one fused step
            found_inf, self._found_inf = self._found_inf, None
            checks, self._overflow_checks = self._overflow_checks, []
            if found_inf is not None and self._read_overflow(found_inf, [i for i, _ in checks]):
                self._overflow_checks = checks
                self._skip(None)
                self._overflow_checks = []
                return None
            device = self._any_device()
            if device is None:
                return None
            one = torch.ones((), dtype=torch.float32, device=device)
            optimizer.amp_fused_master_step(one, torch.zeros_like(one))
            self.clear_master_grads()
            return None
        scaler, loss_id, check = pending
        scale = scaler.scale_tensor(scaler.device or self._any_device() or torch.device("cpu"))
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        # Reads the scaled grads, unscales, checks, steps the masters, writes the model.
        optimizer.amp_fused_master_step(inv_scale, found_inf)
        # The half grads are consumed (and, on overflow, dropped) with the masters' grads; the
        # fp32 params' grads stay, still scaled, until zero_grad or settle_stale_grads.
        self.clear_master_grads()
        self._stale_inv_scale = inv_scale
        scaler.update_(found_inf)
        if not (check and scaler.dynamic):
            # A static scale reads nothing back, but the fused step still skipped an overflow on
            # the device: count it there.
            skipped = (found_inf != 0).to(torch.int64)
            self._device_skips = (
                skipped if self._device_skips is None else self._device_skips + skipped
            )
        elif self._read_overflow(found_inf, [loss_id]):  # the one host sync of a step
            self._overflow_checks = [(loss_id, found_inf)]
            self._skip(None)
            self._overflow_checks = []
        return None

    def _any_device(self) -> torch.device | None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                return p.device
        return None

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.fused:
            return self._fused_step(closure)
        found_inf, self._found_inf = self._found_inf, None
        checks, self._overflow_checks = self._overflow_checks, []
        # The one host sync of a step.
        if found_inf is not None and self._read_overflow(found_inf, [i for i, _ in checks]):
            self._overflow_checks = checks
            self._skip(closure)
            self._overflow_checks = []
            return None
        if (
            self.masters
            and not self._backward_seen
            and any(p.grad is not None for p in self.model_params)
        ):
            warnings.warn(
                "The model has gradients that were never copied to its fp32 master weights; "
                "run backward inside `with amp.scale_loss(loss, optimizer) as scaled_loss:`.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._backward_seen = False
        result = self._original_step() if closure is None else self._original_step(closure)
        if self.masters:
            self.copy_masters_to_model()
            self.clear_master_grads()
        return result

    def clear_master_grads(self) -> None:
        """Drop the masters' gradients after a step, taken or skipped (as Apex's O2 did).

        ``model.zero_grad()`` cannot reach the masters, so a loop that clears only the model's
        gradients (the transformers ``Trainer`` does) would otherwise add every step's
        gradients to the last ones. The model's half gradients were consumed with them.
        """
        for master in self.masters:
            master.grad = None
        for param in self.model_params:
            param.grad = None

    def copy_masters_to_model(self) -> None:
        with torch.no_grad():
            by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for param, master in zip(self.model_params, self.masters, strict=True):
                dst, src = by_device.setdefault(param.device, ([], []))
                dst.append(param)
                src.append(master)
            for dst, src in by_device.values():
                torch._foreach_copy_(dst, src)

    def _zero_grad(self, set_to_none: bool = True) -> None:
        if self.fused:
            # A deferred backward still owes its scale update; its grads are then dropped.
            self.materialize()
            for master in self.masters:
                master.grad = None
            self._found_inf = None
            self._overflow_checks = []
            self._stale_inv_scale = None
        self._original_zero_grad(set_to_none=set_to_none)
        # Model grads in flight (accumulated with delay_unscale) belong to the same step.
        for p in self.model_params:
            p.grad = None


# After amp.close(), a wrapper someone else still holds (an LR scheduler's) calls the class's.
def _amp_step(optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
    state = optimizer_state(optimizer)
    if state is None:
        return type(optimizer).step(optimizer, *(() if closure is None else (closure,)))
    return state._step(closure)


def _amp_zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    state = optimizer_state(optimizer)
    if state is None:
        return type(optimizer).zero_grad(optimizer, set_to_none=set_to_none)
    state._zero_grad(set_to_none)


def _amp_add_param_group(optimizer: Any, param_group: dict[str, Any]) -> None:
    state = optimizer_state(optimizer)
    if state is None:
        return type(optimizer).add_param_group(optimizer, param_group)
    state.add_param_group(param_group)


def optimizer_state(optimizer: Any) -> OptimizerAmpState | None:
    state = getattr(optimizer, "_amp_state", None)
    return state if isinstance(state, OptimizerAmpState) else None
