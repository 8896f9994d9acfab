"""bfloat16 stochastic rounding for FusedAdam and FusedSGD: option checks and launch seeds.

With ``bf16_stochastic_round=True`` a param group holds bfloat16 params and no float32 master
copy; the ops (``amp_C.multi_tensor_adam`` / ``multi_tensor_sgd`` with ``sr_seed``) round each
float32 result to bfloat16 stochastically, with random bits keyed by the launch's seed, the
step, the tensor's index in the launch and the element's offset in the tensor. The optimizer's
seed lives in each param group (``"stochastic_round_seed"``), so ``state_dict()`` saves it and
a run resumed from a checkpoint draws the same bits as one that never stopped.

Where a seed comes from when none is given (``docs/bf16_training.rst``):

* Nothing is drawn while no param group rounds stochastically: an optimizer with the option
  off leaves torch's default generator as it found it, as ``torch.optim``'s optimizers do.
* The first group that rounds stochastically without a seed draws the optimizer's default seed
  from torch's default generator (:func:`assign_default_seeds`: once per optimizer, when the
  group is added), so ``torch.manual_seed`` fixes it; every such group uses it.
* Under ``torch.distributed``, ranks seeded differently (``torch.manual_seed(base + rank)``)
  draw different defaults, and the same all-reduced gradients would round differently on each
  rank: the first step broadcasts rank 0's default to every rank of the default process group
  (:func:`agree_default_seed`, one collective, once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._step_helpers import (
    first_param_device,
)

__all__ = [
    "agree_default_seed",
    "assign_default_seeds",
    "check_seed",
    "check_stochastic_round_group",
    "distributed_world_size",
    "launch_seed",
    "settle_default_seed",
    "stochastic_round_options",
]

FLAG = "bf16_stochastic_round"
SEED = "stochastic_round_seed"

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def check_seed(seed: Any) -> int | None:
    """``seed`` if it is an int or None (None: the optimizer's default, drawn when needed)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(
            f"stochastic_round_seed must be an int or None, got {type(seed).__name__} "
            f"{seed!r}; pass e.g. stochastic_round_seed=0"
        )
    return seed


def stochastic_round_options(bf16_stochastic_round: bool, seed: int | None) -> dict[str, Any]:
    """The param-group defaults of the option (nothing drawn: see :func:`assign_default_seeds`)."""
    return {FLAG: bool(bf16_stochastic_round), SEED: check_seed(seed)}


def assign_default_seeds(defaults: dict[str, Any], groups: Iterable[dict[str, Any]]) -> int | None:
    """Give each group that rounds stochastically without a seed the optimizer's default seed.

    The default (``defaults["stochastic_round_seed"]``) is drawn from torch's default generator
    the first time a group needs it, and only then: one ``torch.randint`` call.

    Returns:
        The seed drawn by this call, or None when none was drawn.
    """
    drawn = None
    for group in groups:
        if group.get(FLAG, False) and group.get(SEED) is None:
            if defaults.get(SEED) is None:
                drawn = defaults[SEED] = int(torch.randint(0, 2**62, (1,)).item())
            group[SEED] = defaults[SEED]
    return drawn


def distributed_world_size() -> int:
    """The size of the default process group, 1 outside ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


@torch._disable_dynamo
def agree_default_seed(
    optimizer: str,
    seed: int,
    defaults: dict[str, Any],
    groups: Iterable[dict[str, Any]],
    device: torch.device,
) -> None:
    """Replace this rank's drawn default ``seed`` by rank 0's, in ``defaults`` and the groups.

    Every rank of the default process group must call it (the first step of the optimizer).
    Groups with a seed of their own keep it. Runs eagerly (a graph break under
    ``torch.compile``, at the first step only).

    Raises:
        RuntimeError: The broadcast failed; the message gives the fix (an explicit seed).
    """
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    try:
        dist.broadcast(value, src=0)
    except (RuntimeError, ValueError) as error:
        raise RuntimeError(
            f"{optimizer}: bf16_stochastic_round=True without a stochastic_round_seed draws a "
            "default seed, which every rank must share (ranks rounding the same gradients "
            "differently drift apart); broadcasting it from rank 0 failed on "
            f"{device} ({error}). Pass the same stochastic_round_seed=<int> on every rank."
        ) from error
    agreed = int(value.item())
    if defaults.get(SEED) == seed:
        defaults[SEED] = agreed
    for group in groups:
        if group.get(SEED) == seed:
            group[SEED] = agreed


def settle_default_seed(
    optimizer: str,
    defaults: dict[str, Any],
    groups: list[dict[str, Any]],
    unagreed: int | None,
) -> int | None:
    """Seeds for the groups that round stochastically without one (:func:`assign_default_seeds`),
    and the default agreed across ranks when ``torch.distributed`` runs several
    (:func:`agree_default_seed`).

    Args:
        optimizer: The optimizer's name, for errors.
        defaults: The optimizer's defaults (their seed is the default seed).
        groups: Its param groups.
        unagreed: A default seed this rank drew and has not agreed with the others yet.

    Returns:
        The default seed still to agree: None once agreed (or when none was drawn).
    """
    drawn = assign_default_seeds(defaults, groups)
    if drawn is not None:
        unagreed = drawn
    if unagreed is not None and distributed_world_size() > 1:
        agree_default_seed(optimizer, unagreed, defaults, groups, first_param_device(groups))
        return None
    return unagreed


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
