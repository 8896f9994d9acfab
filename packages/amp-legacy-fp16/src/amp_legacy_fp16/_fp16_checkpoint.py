"""``FP16_Optimizer.state_dict`` / ``load_state_dict``: save and restore, every field checked."""

from __future__ import annotations

from typing import Any

import torch

from ._loss_scaler import DynamicLossScaler, LossScaler, scaler_from_state_dict

__all__ = ["CheckpointMixin"]

_STATE_KEYS = (
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "first_closure_call_this_step",
    "optimizer_state_dict",
    "fp32_from_fp16",
)


class CheckpointMixin:
    """The checkpoint methods of :class:`~amp_legacy_fp16.FP16_Optimizer`."""

    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler | DynamicLossScaler
    dynamic_loss_scale: bool
    overflow: bool
    first_closure_call_this_step: bool
    fp32_from_fp16_groups: list[list[torch.Tensor]]
    all_fp32_from_fp16_params: list[torch.Tensor]

    def _master_params_to_model_params(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: the scaler, flags, the wrapped optimizer's state and the
        fp32 masters.

        Save the model's ``state_dict()`` beside it. The values are references (as torch's
        ``Optimizer.state_dict``): serialize or copy them before training on.

        Returns:
            A dict of plain data and tensors (loadable with ``torch.load(weights_only=True)``).
        """
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach() for m in group] for group in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into this (newly built) optimizer.

        The masters are restored exactly (not re-derived from the half params), and the half
        params are refreshed from them, so training resumes bitwise. Every field is checked
        before anything is loaded: on an error this optimizer is left as it was.

        Raises:
            KeyError: when a key of :meth:`state_dict` is missing.
            TypeError: when a field has the wrong type (a flag that is not a bool, a scale that
                is not a number, masters that are not float32 tensors...).
            ValueError: for an unknown key, an impossible value (a loss scale of 0, negative,
                inf or nan; a negative counter; non-finite masters), a loss scaler that
                disagrees with ``dynamic_loss_scale``, or masters that do not match this
                optimizer's params.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"FP16_Optimizer.load_state_dict expects the dict returned by "
                f"FP16_Optimizer.state_dict(), got {type(state_dict).__name__}."
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(
                f"FP16_Optimizer.load_state_dict: missing key(s) {missing}; pass the dict "
                "returned by FP16_Optimizer.state_dict()."
            )
        unknown = [k for k in state_dict if k not in _STATE_KEYS]
        if unknown:
            raise ValueError(
                f"FP16_Optimizer.load_state_dict: unknown key(s) {unknown}; pass the dict "
                "returned by FP16_Optimizer.state_dict()."
            )
        flags = {}
        for key in ("dynamic_loss_scale", "overflow", "first_closure_call_this_step"):
            if not isinstance(state_dict[key], bool):
                raise TypeError(
                    f'FP16_Optimizer.load_state_dict: state_dict["{key}"] must be a bool, got '
                    f"{state_dict[key]!r}."
                )
            flags[key] = state_dict[key]
        scaler = scaler_from_state_dict(state_dict["loss_scaler"], 'state_dict["loss_scaler"]')
        if scaler.dynamic != flags["dynamic_loss_scale"]:
            raise ValueError(
                f'FP16_Optimizer.load_state_dict: state_dict["dynamic_loss_scale"] is '
                f"{flags['dynamic_loss_scale']} but the saved loss scaler is "
                f"{'dynamic' if scaler.dynamic else 'static'}; the checkpoint is inconsistent."
            )
        inner = state_dict["optimizer_state_dict"]
        if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
            raise TypeError(
                'FP16_Optimizer.load_state_dict: state_dict["optimizer_state_dict"] must be the '
                f"wrapped optimizer's state_dict(), got {type(inner).__name__}."
            )
        saved_masters = _check_masters(state_dict["fp32_from_fp16"], self.fp32_from_fp16_groups)
        # Everything is valid. The wrapped optimizer checks its own state first (and raises
        # before changing anything); then nothing can fail.
        self.optimizer.load_state_dict(inner)
        self.loss_scaler = scaler
        self.dynamic_loss_scale = flags["dynamic_loss_scale"]
        self.overflow = flags["overflow"]
        self.first_closure_call_this_step = flags["first_closure_call_this_step"]
        with torch.no_grad():
            for current, saved in zip(self.all_fp32_from_fp16_params, saved_masters, strict=True):
                current.copy_(saved)
        self._master_params_to_model_params()


def _check_masters(saved: Any, groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The saved fp32 masters, flattened, after checking them against this optimizer's."""
    where = 'FP16_Optimizer.load_state_dict: state_dict["fp32_from_fp16"]'
    if not isinstance(saved, (list, tuple)) or not all(
        isinstance(g, (list, tuple)) and all(isinstance(m, torch.Tensor) for m in g) for g in saved
    ):
        raise TypeError(f"{where} must be a list of lists of tensors, got {type(saved).__name__}.")
    shapes = [[tuple(m.shape) for m in g] for g in groups]
    saved_shapes = [[tuple(m.shape) for m in g] for g in saved]
    if shapes != saved_shapes:
        raise ValueError(
            f"{where}: the saved fp32 masters have shapes {saved_shapes}, this optimizer's have "
            f"{shapes}. Build the model and the optimizer exactly as for the run that saved the "
            "checkpoint."
        )
    flat = [m for g in saved for m in g]
    if any(m.dtype != torch.float32 for m in flat):
        raise TypeError(f"{where}: the masters must be float32 tensors.")
    if flat and not bool(torch.stack([m.detach().isfinite().all() for m in flat]).all()):
        raise ValueError(f"{where}: a master holds an inf or a nan; the checkpoint is corrupt.")
    return flat
