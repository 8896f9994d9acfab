"""bfloat16 stochastic rounding for FusedAdam and FusedSGD: option checks and launch seeds.

With ``bf16_stochastic_round=True`` a param group holds bfloat16 params and no float32 master
copy; the ops (``amp_C.multi_tensor_adam`` / ``multi_tensor_sgd`` with ``sr_seed``) round each
float32 result to bfloat16 stochastically, with random bits keyed by the launch's seed, the
step, the tensor's index in the launch and the element's offset in the tensor. The optimizer's
seed lives in each param group (``"stochastic_round_seed"``), so ``state_dict()`` saves it and
a run resumed from a checkpoint draws the same bits as one that never stopped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_stochastic_round_group", "launch_seed", "new_seed", "stochastic_round_options"]

FLAG = "bf16_stochastic_round"
SEED = "stochastic_round_seed"

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def new_seed(seed: int | None) -> int:
    """``seed``, or one drawn from torch's default generator (``torch.manual_seed`` fixes it)."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"stochastic_round_seed must be an int or None, got {type(seed).__name__} "
            f"{seed!r}; pass e.g. stochastic_round_seed=0"
        )
    return seed


def stochastic_round_options(bf16_stochastic_round: bool, seed: int | None) -> dict[str, Any]:
    """The param-group defaults of the option."""
    return {FLAG: bool(bf16_stochastic_round), SEED: new_seed(seed)}


def check_stochastic_round_group(
    optimizer: str, group: dict[str, Any], *, masters: bool, capturable: bool = False
) -> None:
    """Raise ``ValueError`` when a group asks for stochastic rounding where it cannot apply.

    Args:
        optimizer: The optimizer's name, for the message.
        group: The param group.
        masters: The optimizer keeps float32 master weights (``master_weights=True``, amp O2).
        capturable: The optimizer runs capturable steps.
    """
    if not group.get(FLAG, False):
        return
    if masters:
        raise ValueError(
            f"{optimizer}: bf16_stochastic_round=True rounds the bfloat16 params themselves and "
            "cannot be combined with float32 master weights (master_weights=True or amp O2), "
            "which already keep every update; use one or the other"
        )
    if capturable:
        raise ValueError(
            f"{optimizer}: bf16_stochastic_round=True is not supported with capturable=True; "
            "pass capturable=False (the plain step rounds stochastically)"
        )
    others = sorted({str(p.dtype) for p in _params(group["params"]) if p.dtype != torch.bfloat16})
    if others:
        raise ValueError(
            f"{optimizer}: bf16_stochastic_round=True needs bfloat16 params, got {others}; "
            "convert the model with model.to(torch.bfloat16), or put the other params in a "
            "param group with bf16_stochastic_round=False"
        )


def launch_seed(seed: int, launch: int) -> int:
    """The ``sr_seed`` of one launch of a step (its index among the step's launches), as an
    int64: launches (param groups, dtype buckets) draw independent bits."""
    mixed = (seed + _GOLDEN * (launch + 1)) & _MASK64
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


def _params(params: Iterable[Any]) -> Iterable[Tensor]:
    return (p for p in params if isinstance(p, Tensor))
