"""``FusedAdam``'s float32 master weights: Apex's view of them and amp O2's fused protocol.

A half param's master lives in its optimizer state (``state[p]["master_param"]``), made at its
first step with ``master_weights=True``, or when amp O2 asks for masters through amp-core's
``FusedMasterWeightOptimizer`` protocol
(:meth:`~AdamMasterWeights.amp_enable_fused_master_weights`). Under O2 amp exports those
tensors as the weights, so they stay the masters until amp lets go
(:meth:`~AdamMasterWeights.amp_disable_fused_master_weights`): a state cleared or deleted by
hand gets them back, and a loaded state dict is copied into them.

:class:`AdamMasterWeights` is the mixin that holds this. The Adam step is ``FusedAdam``'s: amp
O2's :meth:`~AdamMasterWeights.amp_fused_master_step` hands it the groups to step on its device
path, with the masters' gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ._base import FusedOptimizerBase
from ._step_helpers import params_with_grads

__all__ = ["HALF_DTYPES", "AdamMasterWeights"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


class AdamMasterWeights(FusedOptimizerBase):
    """The master-weight side of ``FusedAdam`` (a mixin: ``FusedAdam`` sets the attributes and
    implements the hooks at the end).

    Attributes:
        master_weights: Masters asked for at construction (``master_weights=True``).
        _amp_master: amp O2 switched the master-weight path on.
        _amp_masters: Under amp O2, each half param's master, as amp holds it (amp exports
            these).
    """

    master_weights: bool
    _amp_master: bool
    _amp_masters: dict[Tensor, Tensor]

    @property
    def param_groups_master(self) -> list[dict[str, list[Tensor | None]]]:
        """Apex's view of the float32 master weights: one ``{"params": [...]}`` per param group,
        holding each param's master (``state[p]["master_param"]``) or None where it has none
        (a float32 param, master weights off, or before the first step created it)."""
        return [{"params": [self._master_of(p) for p in g["params"]]} for g in self.param_groups]

    def _master_of(self, p: Tensor) -> Tensor | None:
        """The master of ``p``: the one in its state, else the one amp O2 holds (if any)."""
        state = self.state.get(p)
        master = state.get("master_param") if state else None
        if master is None and self._amp_master:
            master = self._amp_masters.get(p)
        return master

    def _uses_masters(self) -> bool:
        return self.master_weights or self._amp_master

    def _masters_by_id(self) -> dict[int, Tensor]:
        """Every master there is now, by id of its param (kept across ``load_state_dict``)."""
        return {
            id(p): master
            for g in self.param_groups
            for p in g["params"]
            if (master := self._master_of(p)) is not None
        }

    def _keep_masters(self, masters: dict[int, Tensor]) -> None:
        """Put the masters of :meth:`_masters_by_id` back into the state just loaded: the loaded
        values copied into them (amp O2 holds references), kept where the state has none."""
        for group in self.param_groups:
            for p in group["params"]:
                old = masters.get(id(p))
                if old is None:
                    continue
                state = self.state[p]
                new = state.get("master_param")
                if new is not None:
                    old.copy_(new)
                state["master_param"] = old

    # -- amp O2: amp_core's FusedMasterWeightOptimizer protocol ---------------------------

    def amp_enable_fused_master_weights(
        self, fp32_sources: Mapping[Tensor, Tensor]
    ) -> list[tuple[Tensor, Tensor]]:
        """Keep float32 masters of the half params in this optimizer (called by amp O2).

        Args:
            fp32_sources: Full-precision values of params the model cast just now, used as the
                masters' initial values.

        Returns:
            ``(model_param, master)`` for every half param.
        """
        for group in self.param_groups:
            self._check_stochastic_round(group, masters=True)
        self._amp_master = True
        self.invalidate_step_plans()
        pairs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype in HALF_DTYPES:
                    state = self._state(p, fp32_sources.get(p))
                    pairs.append((p, state["master_param"]))
        self._amp_masters.update(pairs)
        return pairs

    def amp_disable_fused_master_weights(self) -> None:
        """Undo :meth:`amp_enable_fused_master_weights` (masters dropped unless
        ``master_weights=True`` was asked for at construction)."""
        self._amp_master = False
        self._amp_masters = {}
        self.invalidate_step_plans()
        if not self.master_weights:
            for state in self.state.values():
                state.pop("master_param", None)

    @torch.no_grad()
    def amp_fused_master_step(self, inv_scale: Tensor, found_inf: Tensor) -> None:
        """One step reading ``grad * inv_scale``; skipped on the device when ``found_inf`` is
        nonzero or a gradient holds an inf or a nan, in which case ``found_inf`` is raised.

        A half param's gradient is its master's ``.grad`` when amp put one there (already
        unscaled; amp then passes ``inv_scale = 1``), else the param's own ``.grad``. An inf
        anywhere skips every group: all groups but the first are checked before any is written.

        Args:
            inv_scale: 0-dim float32 tensor, the inverse loss scale.
            found_inf: 0-dim float32 tensor, read and raised on the device.
        """
        work = []
        for group in self.param_groups:
            params = []
            for p in group["params"]:
                master = self._master_of(p)
                has_master_grad = master is not None and master.grad is not None
                if p.grad is not None or has_master_grad:
                    params.append(p)
            if params:
                params_with_grads("FusedAdam", [p for p in params if p.grad is not None])
                work.append((group, params))
        self._device_steps(work, inv_scale, found_inf, use_master_grads=True)

    def _amp_grad(self, p: Tensor) -> Tensor:
        """The gradient amp O2's step reads for ``p``: its master's ``.grad`` when set."""
        master = self._master_of(p)
        if master is not None and master.grad is not None:
            return master.grad
        assert p.grad is not None
        return p.grad

    # -- implemented by FusedAdam ----------------------------------------------------------

    def _state(self, p: Tensor, master_source: Tensor | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def _check_stochastic_round(self, group: dict[str, Any], *, masters: bool = False) -> None:
        raise NotImplementedError

    def _device_steps(
        self,
        work: list[tuple[dict[str, Any], list[Tensor]]],
        inv_scale: Tensor | None,
        found_inf: Tensor,
        *,
        use_master_grads: bool,
    ) -> None:
        raise NotImplementedError
