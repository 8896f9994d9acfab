"""Master weights: float32 copies of half params, the gradients unscaled into them, the step.

Every mixed-precision optimizer of the toolkit (amp O2, ``amp_legacy_fp16.FP16_Optimizer``, the
legacy handle's ``OptimWrapper`` and ``amp_optimizers.FP16_Optimizer``) keeps its masters and
takes its step through this module, so the rules are written once:

* a half param (fp16 or bf16) of an optimizer's param group is replaced there by a float32
  master, which the optimizer steps (:meth:`MasterWeights.adopt_param`); float32 params are
  stepped directly (:attr:`MasterWeights.direct_params`);
* a scaled backward first sets the direct params' older (already unscaled) gradients aside
  (:meth:`MasterWeights.set_aside_grads`), so that unscaling touches only the new ones
  (:meth:`MasterWeights.unscale_direct_grads`, :meth:`MasterWeights.unscale_into_masters`);
* a step is skipped, leaving every param and the optimizer state as they were, when the
  gradients overflowed; otherwise the optimizer steps and the model is refreshed from the
  masters (:meth:`MasterWeights.step`). An optimizer that keeps the masters itself and steps
  them in one fused pass skips on the device instead (:func:`fused_master_step`);
* the master is the truth of its weight, and an in-place edit of the half param (``fill_``,
  ``copy_``, ``nn.init``) made since the masters were last written into the model is taken
  into the master before the master is read or stepped (:meth:`MasterWeights.take_model_edits`):
  the version counters of the half params (and the count of their ``.data`` accesses,
  :mod:`amp_core._param_watch`) tell which ones may have changed, and within those, the
  elements whose half value no longer equals the rounded master take the edited value;
* :meth:`MasterWeights.release` gives the param groups back their model params (float32, with
  the masters' values) when amp's wrapping is removed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

# fused_master_step and read_overflow live in _master_step; importable from here as before.
from ._master_step import fused_master_step, read_overflow
from ._param_watch import Stamp, stamp, stamps, unwatch, watch

__all__ = [
    "GradUnscaler",
    "MasterWeights",
    "fused_master_step",
    "match_state_dtypes",
    "read_overflow",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)

T = TypeVar("T")


class GradUnscaler(Protocol):
    """What unscales gradients: :class:`~amp_core.LossScaler` and the legacy scalers."""

    def unscale_(self, grads: list[Tensor], found_inf: Tensor, *, check: bool) -> None: ...

    def unscale_with_stash_(
        self,
        params: list[Tensor],
        stash: list[Tensor | None],
        found_inf: Tensor,
        *,
        check: bool,
    ) -> None: ...


class MasterWeights:
    """The float32 masters of an optimizer's half params, and its directly stepped params.

    Args:
        direct_params: Params the optimizer steps as they are (float32 params, or every param
            when there are no masters).

    Attributes:
        model_params: The half params of the model that have a master, in order.
        masters: Their float32 masters, in the same order.
        direct_params: The params the optimizer steps without a master.

    Example:
        >>> weights = MasterWeights()
        >>> for group in optimizer.param_groups:
        ...     weights.adopt_group(group, optimizer.state)
        >>> weights.set_aside_grads()
        >>> (loss.float() * scale).backward()
        >>> found_inf = torch.zeros(())
        >>> weights.unscale_direct_grads(scaler, found_inf, check=True)
        >>> weights.unscale_into_masters(scaler, found_inf, check=True)
        >>> weights.step(optimizer.step, overflow=bool(found_inf.item()))
    """

    def __init__(self, direct_params: Iterable[Tensor] = ()) -> None:
        self.model_params: list[Tensor] = []
        self.masters: list[Tensor] = []
        self.direct_params: list[Tensor] = list(direct_params)
        # The half params' stamps (stamp) when the masters were last written into them.
        self._versions: list[Stamp] = []
        # The direct params' gradients from before the current scaled backward (unscaled).
        self._stash: list[Tensor | None] = []

    def pairs(self) -> Iterator[tuple[Tensor, Tensor]]:
        """``(model_param, master)`` for every param with a master."""
        return zip(self.model_params, self.masters, strict=True)

    # -- building --------------------------------------------------------------------------

    def add_pair(self, model_param: Tensor, master: Tensor) -> None:
        """Record a master made elsewhere (by a fused master-weight optimizer)."""
        watch(model_param)
        self.model_params.append(model_param)
        self.masters.append(master)
        self._versions.append(stamp(model_param))

    def adopt_param(
        self,
        group: dict[str, Any],
        index: int,
        optimizer_state: MutableMapping[Any, Any],
        source: Tensor | None = None,
    ) -> Tensor:
        """Replace the half param ``group["params"][index]`` by a new float32 master.

        Args:
            group: The optimizer's param group.
            index: Where the param is in ``group["params"]``.
            optimizer_state: The optimizer's ``state``: the param's entry, if any, moves to the
                master, its floating tensors cast to float32.
            source: A full-precision value to start the master from (instead of the rounded
                half value).

        Returns:
            The master.
        """
        param = group["params"][index]
        # The full-precision source when there is one (no rounding through half).
        master = (source if source is not None else param.detach()).float()
        master.requires_grad_(True)
        group["params"][index] = master
        if param in optimizer_state:
            optimizer_state[master] = {
                k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in optimizer_state.pop(param).items()
            }
        self.add_pair(param, master)
        return master

    def adopt_group(
        self,
        group: dict[str, Any],
        optimizer_state: MutableMapping[Any, Any],
        sources: dict[Any, Tensor] | None = None,
    ) -> list[tuple[Tensor, Tensor]]:
        """Give every half param of ``group`` a master (:meth:`adopt_param`); the others are
        stepped directly. Returns the new ``(model_param, master)`` pairs."""
        sources = sources or {}
        pairs = []
        for index, param in enumerate(group["params"]):
            if param.dtype not in HALF_DTYPES:
                self.direct_params.append(param)
                continue
            master = self.adopt_param(group, index, optimizer_state, sources.get(param))
            pairs.append((param, master))
        return pairs

    # -- gradients ---------------------------------------------------------------------------

    def set_aside_grads(self) -> None:
        """Before a scaled backward: set the direct params' gradients aside, so that the new
        ones arrive alone and only they are unscaled (Apex unscaled the older ones again)."""
        self._stash = [p.grad for p in self.direct_params]
        for p in self.direct_params:
            p.grad = None

    def drop_set_aside_grads(self) -> None:
        """Forget the gradients set aside (the step's gradients were zeroed)."""
        self._stash = []

    def has_set_aside_grads(self) -> bool:
        """Whether a gradient is set aside (waiting to be added back when unscaling)."""
        return any(g is not None for g in self._stash)

    def unscale_direct_grads(self, scaler: GradUnscaler, found_inf: Tensor, *, check: bool) -> None:
        """Unscale the direct params' new gradients in place and add back those set aside.

        A param added after the gradients were set aside had nothing set aside.
        """
        stash = self._stash + [None] * (len(self.direct_params) - len(self._stash))
        self._stash = []
        scaler.unscale_with_stash_(self.direct_params, stash, found_inf, check=check)

    def unscale_into_masters(
        self, scaler: GradUnscaler, found_inf: Tensor, *, check: bool, accumulate: bool = True
    ) -> None:
        """Unscale the model params' half gradients into their masters' ``.grad`` (float32).

        Args:
            scaler: Unscales (and, with ``check``, raises ``found_inf`` on an inf or a nan).
            found_inf: 0-dim float32 overflow flag.
            check: Check the gradients for inf/nan.
            accumulate: Add to the masters' gradients and free the half ones (amp O2), or
                replace the masters' gradients and keep the half ones (``FP16_Optimizer``,
                whose half gradients accumulate between its steps).
        """
        fresh: list[Tensor] = []
        with torch.no_grad():
            for param, master in self.pairs():
                grad = param.grad
                if grad is None:
                    if not accumulate:
                        master.grad = None
                    continue
                if accumulate or master.grad is None:
                    new = grad.detach().float()  # a new tensor: the grad is half
                else:
                    new = master.grad.detach_().copy_(grad)
                fresh.append(new)
            if fresh:
                scaler.unscale_(fresh, found_inf, check=check)
            new_grads = iter(fresh)
            for param, master in self.pairs():
                if param.grad is None:
                    continue
                grad = next(new_grads)
                if not accumulate:
                    master.grad = grad
                else:
                    master.grad = grad if master.grad is None else master.grad.add_(grad)
                    param.grad = None

    def drop_model_grads(self) -> None:
        """Drop the model params' half gradients (those with a master)."""
        for param in self.model_params:
            param.grad = None

    def clear_grads(self) -> None:
        """Drop the masters' gradients and the model params' half ones."""
        for master in self.masters:
            master.grad = None
        self.drop_model_grads()

    # -- the step ----------------------------------------------------------------------------

    def copy_to_model(self) -> None:
        """Write the masters into the model's half params (one foreach copy per device)."""
        by_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
        for param, master in self.pairs():
            dst, src = by_device.setdefault(param.device, ([], []))
            dst.append(param)
            src.append(master)
        with torch.no_grad():
            for dst, src in by_device.values():
                torch._foreach_copy_(dst, src)
        self.note_model_versions()

    def note_model_versions(self) -> None:
        """Remember the half params' stamps: they hold the masters' values now."""
        self._versions = stamps(self.model_params)

    def take_model_edits(self, *, strict: bool = True) -> None:
        """Take in-place edits of the half params into their masters.

        A half param whose version counter moved, or whose ``.data`` was replaced, since the
        masters were last written into the model was changed by something else
        (``nn.init.zeros_``, ``fill_``, ``copy_`` under ``no_grad``, ``param.data = ...``, a
        data-parallel broadcast). Its master then takes the edited value where the
        half value differs from the rounded master, and keeps its full precision elsewhere, so
        that the edit is neither reverted by the next step nor missing from ``state_dict()``.

        Args:
            strict: Raise for a half param whose shape no longer matches its master's (its
                ``.data`` was replaced by a tensor of another shape); else leave that master
                as it is (amp.close() then gives the param back as it is).

        Raises:
            RuntimeError: With ``strict``, a half param's shape no longer matches its
                master's.
        """
        now_stamps = stamps(self.model_params)
        if now_stamps == self._versions:
            return  # the usual case: nothing wrote the model since the masters did
        with torch.no_grad():
            for (param, master), noted, now in zip(
                self.pairs(), self._versions, now_stamps, strict=True
            ):
                if now == noted:
                    continue
                if param.shape != master.shape:
                    if not strict:
                        continue
                    raise RuntimeError(
                        f"A parameter of shape {tuple(param.shape)} has an fp32 master weight "
                        f"of shape {tuple(master.shape)}: its data was replaced by a tensor of "
                        "another shape after amp.initialize. Change a model's shapes before "
                        "amp.initialize, or call amp.close(), change the model, build a new "
                        "optimizer and call amp.initialize again."
                    )
                # Compared where the master lives, in the dtype the param had when the masters
                # were written into it (a model moved or widened since is no edit).
                edited = param.detach().to(master.device)
                written = noted[2]
                differs = edited.to(written) != master.detach().to(written)
                master.copy_(torch.where(differs, edited.to(master.dtype), master.detach()))
        self._versions = now_stamps

    def release(self, optimizer: Any) -> None:
        """Give ``optimizer``'s param groups back the model params in place of their masters.

        Each half param takes its master's value as float32 (where nothing did so before), and
        the optimizer state moves from the master back to the param, as it is (float32); half
        state of a param that is no longer half is widened to the param's dtype. After this the
        optimizer steps the model's own params, as plain PyTorch does, and there are no masters
        left here.
        """
        self.take_model_edits(strict=False)
        for param in self.model_params:
            unwatch(param)
        by_master = {id(m): p for p, m in self.pairs()}
        with torch.no_grad():
            for param, master in self.pairs():
                if param.dtype in HALF_DTYPES and param.shape == master.shape:
                    param.data = master.detach().clone()
                # The unscaled gradient goes with the value (a plain step reads it).
                grad = master.grad
                if grad is not None and (param.dtype, param.shape) == (grad.dtype, grad.shape):
                    param.grad = grad.detach()
        for group in optimizer.param_groups:
            params = group["params"]
            for index, held in enumerate(params):
                model_param = by_master.get(id(held))
                if model_param is None:
                    continue
                params[index] = model_param
                if held in optimizer.state:
                    optimizer.state[model_param] = optimizer.state.pop(held)
        # No masters any more: the model params are stepped directly.
        self.direct_params = [*self.model_params, *self.direct_params]
        self.model_params, self.masters, self._versions = [], [], []
        # A param widened back from half (O3's, by amp.close()) gets its half state widened too.
        match_state_dtypes(
            optimizer.state, [p for g in optimizer.param_groups for p in g["params"]]
        )

    def step(self, optimizer_step: Callable[[], T], *, overflow: bool) -> T | None:
        """The step, or its skip: the one place that decides.

        Args:
            optimizer_step: Steps the masters and the direct params (e.g. ``optimizer.step``).
            overflow: Whether the gradients of this step overflowed.

        Returns:
            What ``optimizer_step`` returned, or ``None`` when the step was skipped (nothing
            stepped, nothing copied: every param and the optimizer state stay as they were).
        """
        self.take_model_edits()
        if overflow:
            return None
        result = optimizer_step()
        self.copy_to_model()
        return result


def match_state_dtypes(optimizer_state: MutableMapping[Any, Any], params: Iterable[Tensor]) -> None:
    """Cast the floating optimizer state of each param to the param's dtype (but ``"step"``),
    as ``torch.optim.Optimizer.load_state_dict`` does: after amp changed a param's dtype (O3's
    cast at ``amp.initialize``, the widening at ``amp.close()``), a torch optimizer steps it."""
    for param in params:
        state = optimizer_state.get(param)
        if not state or not param.is_floating_point():
            continue
        for key, value in state.items():
            if (
                key != "step"
                and torch.is_tensor(value)
                and value.is_floating_point()
                and value.dtype != param.dtype
            ):
                state[key] = value.to(param.dtype)
