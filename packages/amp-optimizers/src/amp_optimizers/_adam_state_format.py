"""``FusedAdam`` state dicts and ``torch.optim.Adam`` / ``AdamW`` state dicts, both ways.

The two formats hold the same moments under the same keys (``exp_avg``, ``exp_avg_sq``) but
count steps differently: Apex's ``FusedAdam`` (and this one) keeps one ``step`` per param
group, ``torch.optim.Adam`` one ``step`` tensor per param, and torch's groups have no
``bias_correction`` (torch always corrects). So that a checkpoint moves between them:

* :func:`add_per_param_steps` writes the group's step into each param's state as well, as a
  float32 tensor (``FusedAdam.state_dict()`` does this), so ``torch.optim.Adam`` loads it, and
  :func:`drop_per_param_steps` takes those copies out again (``FusedAdam.load_state_dict``);
* :func:`from_torch_adam` turns a torch Adam / AdamW state dict into this format
  (``FusedAdam.load_state_dict`` calls it when the groups have no ``bias_correction``), and
  refuses what ``FusedAdam`` cannot continue (AMSGrad, ``maximize``, params at different steps).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "add_per_param_steps",
    "drop_per_param_steps",
    "from_torch_adam",
    "is_torch_adam_format",
]

logger = logging.getLogger(__name__)


def _as_number(step: Any) -> float:
    return float(step.item()) if isinstance(step, Tensor) else float(step)


def add_per_param_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``FusedAdam`` state dict whose param states also hold their group's step.

    The live state is not touched (the per-param dicts are copied, the tensors shared).
    """
    state = dict(state_dict["state"])
    for group in state_dict["param_groups"]:
        step = group.get("step")
        if step is None:
            continue
        step_t = torch.tensor(_as_number(step), dtype=torch.float32)
        for pid in group["params"]:
            if pid in state:
                state[pid] = {**state[pid], "step": step_t.clone()}
    return {**state_dict, "state": state}


def drop_per_param_steps(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ``FusedAdam`` state dict without the per-param steps of
    :func:`add_per_param_steps` (they repeat the group's)."""
    return {
        **state_dict,
        "state": {
            pid: {k: v for k, v in s.items() if k != "step"}
            for pid, s in state_dict["state"].items()
        },
    }


def is_torch_adam_format(state_dict: dict[str, Any]) -> bool:
    """Whether the state dict was saved by torch's Adam / AdamW rather than by FusedAdam: its
    groups lack ``bias_correction`` or carry torch's own keys (a torch optimizer that loaded a
    FusedAdam state dict keeps the groups' extra keys, and the steps that count are then the
    per-param ones)."""
    groups = state_dict.get("param_groups", [])
    return any("bias_correction" not in g or _TORCH_ONLY_KEYS & g.keys() for g in groups)


def from_torch_adam(state_dict: dict[str, Any], adam_w_mode: int) -> dict[str, Any]:
    """Convert a ``torch.optim.Adam`` / ``AdamW`` state dict into ``FusedAdam``'s format.

    Args:
        state_dict: What ``torch.optim.Adam(...).state_dict()`` returned.
        adam_w_mode: The loading ``FusedAdam``'s mode (1: decoupled weight decay).

    Returns:
        A new state dict: each group gets ``bias_correction`` (True unless the group says
        otherwise) and the ``step`` its params share; the per-param ``step`` entries and
        torch's own group keys are dropped; the moments are float32 (torch keeps those of
        half params in half).

    Raises:
        ValueError: AMSGrad or ``maximize`` was on, or the params of one group are at different
            steps (torch steps only params that had a gradient; FusedAdam counts per group).
    """
    # torch keeps the moments of half params in half; FusedAdam keeps them in float32 (exact).
    state = {
        pid: {k: v.float() if k in _MOMENTS and isinstance(v, Tensor) else v for k, v in s.items()}
        for pid, s in state_dict["state"].items()
    }
    groups = []
    for index, group in enumerate(state_dict["param_groups"]):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"cannot load a torch.optim.Adam state dict with {flag}=True into FusedAdam "
                    f"(group {index}); FusedAdam has no {flag} variant"
                )
        steps = {_as_number(state[pid].pop("step")) for pid in group["params"] if pid in state}
        if len(steps) > 1:
            raise ValueError(
                f"cannot load this torch.optim.Adam state dict into FusedAdam: the params of group "
                f"{index} are at different steps {sorted(steps)} (FusedAdam keeps one step per "
                "group); put the params that trained for fewer steps in a group of their own"
            )
        decoupled = group.get("decoupled_weight_decay")
        if (
            decoupled is not None
            and bool(decoupled) != bool(adam_w_mode)
            and group.get("weight_decay")
        ):
            logger.warning(
                "Loading a torch.optim.%s state dict into FusedAdam(adam_w_mode=%s): the weight "
                "decay changes from %s to %s from here on.",
                "AdamW" if decoupled else "Adam",
                bool(adam_w_mode),
                "decoupled" if decoupled else "L2",
                "decoupled" if adam_w_mode else "L2",
            )
        new = {k: v for k, v in group.items() if k not in _TORCH_ONLY_KEYS and k != "step"}
        new["bias_correction"] = bool(group.get("bias_correction", True))
        if steps:
            new["step"] = int(steps.pop())
        groups.append(new)
    return {"state": state, "param_groups": groups}


_MOMENTS = ("exp_avg", "exp_avg_sq")

# Group keys of torch's Adam that FusedAdam has no use for.
_TORCH_ONLY_KEYS = frozenset(
    {
        "amsgrad",
        "maximize",
        "foreach",
        "capturable",
        "differentiable",
        "fused",
        "decoupled_weight_decay",
    }
)
