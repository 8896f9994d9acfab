"""``FusedAdagrad`` state dicts and ``torch.optim.Adagrad`` state dicts, both ways.

Both keep each param's sum of squared gradients under ``sum``. ``torch.optim.Adagrad`` also
keeps a per-param ``step`` (a float32 tensor) and reads its groups' ``lr_decay`` and
``initial_accumulator_value``; Apex's ``FusedAdagrad`` had neither. This ``FusedAdagrad`` counts
each param's steps (an int in its live state) and is torch's Adagrad with ``lr_decay=0`` and
``initial_accumulator_value=0``, except that ``adagrad_w_mode`` decays weights decoupled, which
torch's Adagrad cannot. So that a checkpoint moves between them:

* :func:`to_torch_adagrad_format` is what ``FusedAdagrad.state_dict()`` returns: the step of
  each param as a float32 tensor, and the two group keys torch reads. A group with decoupled
  weight decay gets no per-param ``step``: ``torch.optim.Adagrad.load_state_dict`` then refuses
  it (``KeyError: 'step'``) instead of continuing with L2 weight decay;
* :func:`from_adagrad_state_dict` turns either format into what ``FusedAdagrad`` loads, and
  refuses what it cannot continue (``lr_decay``, ``maximize``, a param without a sum when the
  sums start above zero).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

__all__ = ["decays_decoupled", "from_adagrad_state_dict", "to_torch_adagrad_format"]

logger = logging.getLogger(__name__)

# Group keys that torch's Adagrad reads and FusedAdagrad has no use for (FusedAdagrad's math is
# torch's with lr_decay=0 and initial_accumulator_value=0).
_TORCH_ONLY_KEYS = frozenset(
    {"lr_decay", "initial_accumulator_value", "foreach", "maximize", "differentiable", "fused"}
)
# Keys that only a state dict saved by torch's Adagrad has (FusedAdagrad writes the two above).
_SAVED_BY_TORCH_KEYS = frozenset({"foreach", "maximize", "differentiable", "fused"})


def _as_number(value: Any) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def decays_decoupled(group: dict[str, Any], adagrad_w_mode: int) -> bool:
    """Whether the group's weight decay is decoupled (which torch's Adagrad cannot continue)."""
    return bool(adagrad_w_mode) and _as_number(group["weight_decay"]) != 0.0


def to_torch_adagrad_format(state_dict: dict[str, Any], adagrad_w_mode: int) -> dict[str, Any]:
    """A copy of a ``FusedAdagrad`` state dict that ``torch.optim.Adagrad`` can load too.

    Each param's step count becomes a float32 tensor (a param loaded from a state without one
    counts from that load), and each group gets ``lr_decay=0`` and
    ``initial_accumulator_value=0``. The params of a group with decoupled weight decay keep no
    ``step``, so that torch's Adagrad refuses to load them rather than decay them as L2. The live
    state is not touched (the dicts are copied, the tensors shared).

    Args:
        state_dict: What ``torch.optim.Optimizer.state_dict`` returned for the FusedAdagrad.
        adagrad_w_mode: The FusedAdagrad's mode (1: decoupled weight decay).

    Returns:
        The new state dict.
    """
    state = dict(state_dict["state"])
    groups = []
    for group in state_dict["param_groups"]:
        decoupled = decays_decoupled(group, adagrad_w_mode)
        for pid in group["params"]:
            if pid not in state:
                continue
            entry = {k: v for k, v in state[pid].items() if k != "step"}
            if not decoupled:
                step = state[pid].get("step", 0)
                entry["step"] = torch.tensor(_as_number(step), dtype=torch.float32)
            state[pid] = entry
        groups.append({**group, "lr_decay": 0, "initial_accumulator_value": 0.0})
    return {**state_dict, "state": state, "param_groups": groups}


def from_adagrad_state_dict(state_dict: dict[str, Any], adagrad_w_mode: int) -> dict[str, Any]:
    """Turn a ``FusedAdagrad`` or ``torch.optim.Adagrad`` state dict into what FusedAdagrad loads.

    Args:
        state_dict: What ``FusedAdagrad.state_dict()`` or ``torch.optim.Adagrad.state_dict()``
            returned (or Apex's ``FusedAdagrad``: sums only).
        adagrad_w_mode: The loading FusedAdagrad's mode (1: decoupled weight decay).

    Returns:
        A new state dict: steps as ints, sums as float32 (torch keeps a half param's sum in the
        param's dtype), torch's own group keys dropped.

    Raises:
        ValueError: A group has ``lr_decay`` other than 0 or ``maximize=True`` (FusedAdagrad has
            neither), or sums that start above zero (``initial_accumulator_value``) and a param
            without one, whose sum FusedAdagrad would start at zero.
    """
    state = {pid: dict(s) for pid, s in state_dict["state"].items()}
    groups = []
    for index, group in enumerate(state_dict["param_groups"]):
        if group.get("maximize"):
            raise ValueError(
                "cannot load a torch.optim.Adagrad state dict with maximize=True into "
                f"FusedAdagrad (group {index}); FusedAdagrad has no maximize variant: negate "
                "the loss instead, or keep torch.optim.Adagrad"
            )
        lr_decay = _as_number(group.get("lr_decay", 0))
        if lr_decay != 0.0:
            raise ValueError(
                f"cannot load a torch.optim.Adagrad state dict with lr_decay={lr_decay} into "
                f"FusedAdagrad (group {index}); FusedAdagrad has no learning-rate decay: keep "
                "torch.optim.Adagrad, or train with lr_decay=0 (an LR scheduler can decay lr)"
            )
        initial = _as_number(group.get("initial_accumulator_value", 0))
        missing = [pid for pid in group["params"] if "sum" not in state.get(pid, {})]
        if initial != 0.0 and missing:
            raise ValueError(
                "cannot load this torch.optim.Adagrad state dict into FusedAdagrad: group "
                f"{index} has initial_accumulator_value={initial} and params {missing} have no "
                "sum yet (FusedAdagrad would start theirs at 0); load it into "
                "torch.optim.Adagrad, or save it after every param has taken a step"
            )
        for pid in group["params"]:
            entry = state.get(pid)
            if entry is None:
                continue
            if "step" in entry:
                entry["step"] = int(_as_number(entry["step"]))
            total = entry.get("sum")
            if isinstance(total, Tensor) and total.dtype != torch.float32:
                entry["sum"] = total.float()
        if _SAVED_BY_TORCH_KEYS & group.keys() and decays_decoupled(group, adagrad_w_mode):
            logger.warning(
                "Loading a torch.optim.Adagrad state dict into FusedAdagrad(adagrad_w_mode=True): "
                "the weight decay of group %d changes from L2 to decoupled from here on.",
                index,
            )
        groups.append({k: v for k, v in group.items() if k not in _TORCH_ONLY_KEYS})
    return {"state": state, "param_groups": groups}
