"""The checks of :class:`amp_optimizers.FP16_Optimizer`'s inputs: its wrapped optimizer's param
groups (at construction) and a saved state (``load_state_dict``), with messages that say what to
pass instead. Nothing here changes what it checks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from amp_core import check_count, check_scale

__all__ = ["DYNAMIC_STATE_KEYS", "STATE_KEYS", "check_param_groups", "check_saved_state"]

_HALF = (torch.float16, torch.bfloat16)

# The keys of FP16_Optimizer.state_dict() (a dynamic loss scale adds the second tuple's).
STATE_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "optimizer_state_dict")
DYNAMIC_STATE_KEYS = ("last_overflow_iter", "scale_factor", "scale_window")


def check_saved_state(state: Any, sizes: list[int]) -> dict[str, Any]:
    """The fields of a saved state, each checked (nothing is changed here)."""
    where = "FP16_Optimizer.load_state_dict"
    if not isinstance(state, dict):
        raise TypeError(
            f"{where} expects the dict returned by FP16_Optimizer.state_dict(), got "
            f"{type(state).__name__}."
        )
    dynamic = state.get("dynamic_loss_scale", False)
    if not isinstance(dynamic, bool):
        raise TypeError(
            f'{where}: state_dict["dynamic_loss_scale"] must be a bool, got {dynamic!r}.'
        )
    required = STATE_KEYS + ("fp32_groups_flat",) + (DYNAMIC_STATE_KEYS if dynamic else ())
    missing = [k for k in required if k not in state]
    unknown = [k for k in state if k not in required]
    if missing or unknown:
        raise ValueError(
            f"{where}: missing key(s) {missing}, unknown key(s) {unknown}; pass the dict "
            "returned by FP16_Optimizer.state_dict() (the dynamic keys "
            f"{list(DYNAMIC_STATE_KEYS)} belong to a dynamic loss scale only)."
        )
    out: dict[str, Any] = {"dynamic": dynamic}
    out["cur_scale"] = check_scale(state["cur_scale"], f'{where}: state_dict["cur_scale"]')
    out["cur_iter"] = check_count(state["cur_iter"], f'{where}: state_dict["cur_iter"]')
    if dynamic:
        if out["cur_scale"] < 1:
            raise ValueError(
                f'{where}: state_dict["cur_scale"] must be >= 1 for a dynamic scale (its '
                f"floor), got {out['cur_scale']!r}."
            )
        last = check_count(
            state["last_overflow_iter"], f'{where}: state_dict["last_overflow_iter"]', minimum=-1
        )
        if last >= out["cur_iter"]:
            raise ValueError(
                f'{where}: state_dict["last_overflow_iter"]={last} must be below '
                f'state_dict["cur_iter"]={out["cur_iter"]} (or -1 before any overflow).'
            )
        out["last_overflow_iter"] = last
        factor = state["scale_factor"]
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not 1 < factor < math.inf
        ):
            raise ValueError(
                f'{where}: state_dict["scale_factor"] must be a finite number > 1, got {factor!r}.'
            )
        out["scale_factor"] = float(factor)
        out["scale_window"] = check_count(
            state["scale_window"], f'{where}: state_dict["scale_window"]', minimum=1
        )
    inner = state["optimizer_state_dict"]
    if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
        raise TypeError(
            f'{where}: state_dict["optimizer_state_dict"] must be FusedAdam.state_dict(), got '
            f"{type(inner).__name__}."
        )
    masters = state["fp32_groups_flat"]
    if not isinstance(masters, (list, tuple)) or not all(isinstance(m, Tensor) for m in masters):
        raise TypeError(
            f'{where}: state_dict["fp32_groups_flat"] must be a list of tensors, got '
            f"{type(masters).__name__}."
        )
    saved_sizes = [m.numel() for m in masters]
    if sizes != saved_sizes:
        raise ValueError(
            f"{where}: the saved flat masters have {saved_sizes} elements per group "
            f'(state_dict["fp32_groups_flat"]), this '
            f"optimizer's have {sizes}. Build the model and the optimizer exactly as for the "
            "run that saved the checkpoint."
        )
    if any(m.dtype != torch.float32 for m in masters):
        raise TypeError(f'{where}: state_dict["fp32_groups_flat"] must hold float32 tensors.')
    if masters and not bool(torch.stack([m.detach().isfinite().all() for m in masters]).all()):
        raise ValueError(
            f'{where}: state_dict["fp32_groups_flat"] holds an inf or a nan; the checkpoint is '
            "corrupt."
        )
    out["masters"] = list(masters)
    return out


def check_param_groups(param_groups: list[dict[str, Any]]) -> None:
    """Refuse what one flat half buffer per group cannot hold (before anything is changed)."""
    for g, group in enumerate(param_groups):
        params = group["params"]
        if not params:
            raise ValueError(
                f"FP16_Optimizer: param group {g} is empty; every group becomes one flat "
                "buffer, so leave empty groups out of the FusedAdam."
            )
        first = params[0]
        for i, p in enumerate(params):
            if p.dtype not in _HALF:
                raise TypeError(
                    f"FP16_Optimizer: every param must be float16 or bfloat16, param {i} of "
                    f"group {g} is {p.dtype} with shape {tuple(p.shape)}. Cast the model first "
                    "(model.half() or model.bfloat16()), or use amp_legacy_fp16.FP16_Optimizer "
                    "for models that keep float32 params."
                )
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(
                    f"FP16_Optimizer: param group {g} mixes {first.dtype} on {first.device} and "
                    f"{p.dtype} on {p.device} (param {i}); each group becomes one flat buffer, "
                    "so put params of another dtype or device in a group of their own."
                )
            if not p.requires_grad:
                raise ValueError(
                    f"FP16_Optimizer: param {i} of group {g} (shape {tuple(p.shape)}) does not "
                    "require grad; leave frozen params out of the FusedAdam."
                )
