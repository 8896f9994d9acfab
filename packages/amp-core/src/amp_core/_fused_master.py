"""The protocol of an optimizer that steps amp O2's master weights itself, in one fused pass.

Under O2, amp normally keeps float32 master copies of the half params in the optimizer's param
groups, unscales the half gradients into the masters' ``.grad`` at ``scale_loss`` exit, lets the
optimizer step the masters and copies them back into the model: four passes over memory.

An optimizer that implements :class:`FusedMasterWeightOptimizer` (``amp_optimizers.FusedAdam``
does) takes this over: amp leaves the half params in its param groups, asks it to keep the
masters, leaves the gradients scaled at ``scale_loss`` exit, and at ``optimizer.step()`` passes
the inverse loss scale and a device overflow flag to :meth:`amp_fused_master_step`, which reads
the half gradients, unscales them, checks them for inf/nan, steps the masters and writes the
half params in one pass. The loss scale is then updated after the step, from that flag.

Whenever the fused pass cannot be used as is (a second backward before the step, several
optimizers in one ``scale_loss``, ``delay_overflow_check``, or a call to
``amp.master_params`` that must see unscaled master gradients), amp *materializes*: it puts the
unscaled float32 gradients into the masters' ``.grad`` exactly as the ordinary O2 path does, and
the fused step then reads those with an inverse scale of 1.

After every fused step (taken or skipped) amp drops the masters' ``.grad`` and the half params'
gradients, as Apex's O2 step dropped its master gradients: ``model.zero_grad()`` alone then
starts the next step clean.

The protocol is opt-in by type (an optimizer without these three methods gets the ordinary O2
path) and reversible (:meth:`amp_disable_fused_master_weights`, called when amp's wrapping of
the optimizer is removed).

Any optimizer (fused master weights or not) may also refuse an ``amp.initialize`` call it could
not step, before amp changes anything, by defining ``amp_check_initialize`` (see
:func:`check_amp_initialize`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["FusedMasterWeightOptimizer", "check_amp_initialize", "supports_fused_master_weights"]


@runtime_checkable
class FusedMasterWeightOptimizer(Protocol):
    """An optimizer that keeps amp O2's float32 masters and steps them in one fused pass."""

    def amp_enable_fused_master_weights(
        self, fp32_sources: Mapping[torch.Tensor, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Create float32 masters for the half params in the param groups.

        Args:
            fp32_sources: Full-precision values of params the model cast just now (use them
                as the masters' initial values instead of the rounded half values).

        Returns:
            ``(model_param, master)`` for every half param; each master is a float32 tensor
            whose ``.grad`` the optimizer reads when amp sets it. These tensors stay the
            masters until :meth:`amp_disable_fused_master_weights`: amp exports them as the
            weights (the model's ``state_dict()``, ``amp.master_params``), so the optimizer
            must step exactly them, also after its state was cleared, replaced or deleted by
            hand (``del optimizer.state[p]`` resets the moments, not the weight) or loaded
            (values copied into them, never new tensors).
        """
        ...

    def amp_disable_fused_master_weights(self) -> None:
        """Undo :meth:`amp_enable_fused_master_weights`."""
        ...

    def amp_fused_master_step(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Step every param with a gradient, reading ``grad * inv_scale``.

        Must skip the whole step on the device when ``found_inf`` is nonzero on entry or a
        gradient holds an inf or a nan, and in the latter case set ``found_inf`` (0-dim float32)
        to a nonzero value. A master's ``.grad``, when set, replaces its half param's gradient.
        """
        ...


def supports_fused_master_weights(optimizer: object) -> bool:
    """Whether ``optimizer`` implements :class:`FusedMasterWeightOptimizer`."""
    return isinstance(optimizer, FusedMasterWeightOptimizer)


def check_amp_initialize(optimizer: Any, *, master_weights: bool, cast: torch.dtype | None) -> None:
    """Let ``optimizer`` refuse an ``amp.initialize`` call before amp changes anything.

    An optimizer (or the optimizer that a wrapper such as LARC holds as ``.optim``) may define
    ``amp_check_initialize(*, master_weights, cast)`` and raise there, with the fix, when it
    could not step what the call would make: ``amp_optimizers``' bfloat16 stochastic rounding
    refuses float32 master weights and a model cast to a dtype other than bfloat16.

    Args:
        optimizer: An optimizer passed to ``amp.initialize``.
        master_weights: Whether the call keeps float32 masters of the half params (O2).
        cast: The dtype the call casts the models to, or ``None`` for no cast.
    """
    for candidate in (optimizer, getattr(optimizer, "optim", None)):
        check = getattr(candidate, "amp_check_initialize", None)
        if callable(check):
            check(master_weights=master_weights, cast=cast)
