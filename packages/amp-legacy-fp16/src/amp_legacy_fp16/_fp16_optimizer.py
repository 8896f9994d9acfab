"""``FP16_Optimizer``: fp32 master weights and loss scaling around any torch optimizer.

Half params (fp16 or bf16) of the wrapped optimizer are replaced in its param groups by fp32
master copies, which the optimizer steps; the half params are refreshed from them after every
step. fp32 params are stepped directly. The loss is scaled in :meth:`FP16_Optimizer.backward`;
:meth:`FP16_Optimizer.update_master_grads` copies the half grads to the masters and unscales
every grad the optimizer will read, checking for overflow when the scale is dynamic (one host
sync); an overflow makes the next :meth:`FP16_Optimizer.step` a no-op that lowers the scale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from amp_core import MasterWeights

from ._deprecation import warn_deprecated
from ._fp16_checkpoint import CheckpointMixin
from ._loss_scaler import DynamicLossScaler, LossScaler, make_dynamic, make_static

__all__ = ["FP16_Optimizer"]

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


class FP16_Optimizer(CheckpointMixin):
    """Apex's ``apex.fp16_utils.FP16_Optimizer`` for fp16 or bf16 params, on CPU and CUDA.

    Build the model in half precision (``model.half()``, :func:`convert_network`), build any
    torch optimizer on its params, and wrap it. Call ``optimizer.backward(loss)`` instead of
    ``loss.backward()``.

    Args:
        init_optimizer: The optimizer to wrap; its param groups may mix half (fp16/bf16) and
            fp32 params, with any hyperparameters per group.
        static_loss_scale: The constant scale when ``dynamic_loss_scale`` is ``False``.
        dynamic_loss_scale: Use a :class:`DynamicLossScaler`.
        dynamic_loss_args: Keyword arguments for the :class:`DynamicLossScaler`
            (``init_scale``, ``scale_factor``, ``scale_window``).
        verbose: Log (INFO) every param it ingests.

    Raises:
        TypeError: when ``init_optimizer`` is not a torch optimizer, or holds params that are
            neither fp16, bf16 nor fp32.
        ValueError: for unknown keys in ``dynamic_loss_args``.

    Example:
        >>> model = convert_network(Net(), torch.float16)
        >>> optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            dynamic_loss_scale=True)
        >>> optimizer.zero_grad()
        >>> optimizer.backward(loss_fn(model(x.half()).float(), y))
        >>> optimizer.step()

    .. note:: With a static scale there is no overflow check (as in Apex): an inf gradient
        is stepped. Use ``dynamic_loss_scale=True`` to skip such steps.
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        warn_deprecated(
            "FP16_Optimizer", 'amp_core.amp.initialize(model, optimizer, opt_level="O2")'
        )
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"FP16_Optimizer wraps a torch.optim.Optimizer, got "
                f"{type(init_optimizer).__name__}. Build the optimizer on the model's params "
                "first: FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=...))."
            )
        self.verbose = verbose
        self.optimizer = init_optimizer
        # The masters, the fp32 params stepped directly, and the step (amp-core's rules).
        self._weights = MasterWeights()
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for index, group in enumerate(init_optimizer.param_groups):
            self._ingest_group(index, group)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]

        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.loss_scaler: LossScaler | DynamicLossScaler
        if self.dynamic_loss_scale:
            self.loss_scaler = make_dynamic(dynamic_loss_args)
        else:
            if dynamic_loss_args is not None:
                logger.warning(
                    "FP16_Optimizer: dynamic_loss_args is ignored because dynamic_loss_scale "
                    "is False; pass dynamic_loss_scale=True to use it."
                )
            self.loss_scaler = make_static(static_loss_scale)
        self.overflow = False
        self.first_closure_call_this_step = True
        # A backward ran since the last update_master_grads: the fp32 params' grads from before
        # it are set aside in _weights, so that only the new ones are unscaled (Apex unscaled
        # the older ones twice).
        self._fp32_grads_scaled = False

    def _ingest_group(self, index: int, group: dict[str, Any]) -> None:
        if self.verbose:
            logger.info("FP16_Optimizer processing param group %d:", index)
        fp16_params: list[torch.Tensor] = []
        fp32_from_fp16: list[torch.Tensor] = []
        fp32_params: list[torch.Tensor] = []
        state = self.optimizer.state
        for i, param in enumerate(group["params"]):
            if not param.requires_grad:
                continue
            if param.dtype in _HALF:
                if self.verbose:
                    logger.info(
                        "FP16_Optimizer received %s param of shape %s (fp32 master made)",
                        param.dtype,
                        tuple(param.shape),
                    )
                # In the group in place of the param; its state moves along, in fp32.
                master = self._weights.adopt_param(group, i, state)
                fp16_params.append(param)
                fp32_from_fp16.append(master)
            elif param.dtype == torch.float32:
                if self.verbose:
                    logger.info(
                        "FP16_Optimizer received torch.float32 param of shape %s (stepped "
                        "directly)",
                        tuple(param.shape),
                    )
                fp32_params.append(param)
                self._weights.direct_params.append(param)
            else:
                raise TypeError(
                    f"Wrapped parameters must be torch.float16, torch.bfloat16 or "
                    f"torch.float32; param {i} of group {index} is {param.dtype} with shape "
                    f"{tuple(param.shape)}. Cast the model first, e.g. "
                    "convert_network(model, torch.float16)."
                )
        self.fp16_groups.append(fp16_params)
        self.fp32_from_fp16_groups.append(fp32_from_fp16)
        self.fp32_from_fp32_groups.append(fp32_params)

    # -- pickling ------------------------------------------------------------------------------

    def __getstate__(self) -> NoReturn:
        raise RuntimeError(
            "FP16_Optimizer should be serialized using state_dict(): save "
            "optimizer.state_dict() and restore it with load_state_dict()."
        )

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(
            "FP16_Optimizer should be deserialized using load_state_dict() on a newly built "
            "FP16_Optimizer."
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale; assign to set it."""
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state`` (keyed by the fp32 masters for half params)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (holding the fp32 masters)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    # -- gradients -----------------------------------------------------------------------------

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or drop) the grads of the masters, the fp32 params and the half params.

        Args:
            set_grads_to_None: Set ``.grad`` to ``None`` instead of zeroing it.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for p in params + self.all_fp16_params:
            if p.grad is None:
                continue
            if set_grads_to_None:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
        self._weights.drop_set_aside_grads()
        self._fp32_grads_scaled = False

    def backward(
        self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False
    ) -> None:
        """Backward of ``loss * loss_scale`` (in fp32), then :meth:`update_master_grads`.

        Args:
            loss: The loss.
            update_master_grads: Copy and unscale the grads now. Pass ``False`` for all but the
                last of several losses, then call :meth:`update_master_grads` once (cheaper;
                same result as one summed loss).
            retain_graph: Passed to ``backward``.
        """
        if not self._fp32_grads_scaled:
            self._weights.set_aside_grads()
            self._fp32_grads_scaled = True
        scaled = loss.float() * self.loss_scaler.scale_tensor(loss.device)
        scaled.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Copy the half grads to the masters and unscale the grads the optimizer steps.

        With a dynamic scale, sets :attr:`overflow` when any grad holds an inf or nan.

        .. note:: Reads the overflow flag on the host (dynamic scale only).
        """
        fresh_fp32 = self._fp32_grads_scaled
        grads = [p.grad for p in self.all_fp16_params if p.grad is not None]
        fp32_grads = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
        check = self.dynamic_loss_scale
        probe = grads or (fp32_grads if fresh_fp32 else [])
        device = probe[0].device if probe else torch.device("cpu")
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # The masters' grads are replaced (the half grads accumulate between steps instead).
        self._weights.unscale_into_masters(
            self.loss_scaler, found_inf, check=check, accumulate=False
        )
        if fresh_fp32:
            self._weights.unscale_direct_grads(self.loss_scaler, found_inf, check=check)
            self._fp32_grads_scaled = False
        self.overflow = bool(found_inf.item()) if check and probe else False

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """The unscaled grads the optimizer will step, per param group (``None`` on overflow).

        Call it after ``backward`` (or :meth:`update_master_grads`).
        """
        if self.overflow:
            logger.warning(
                "Calling FP16_Optimizer.inspect_master_grad_data while in an overflow state: "
                "gradients are invalid (may be inf, nan, or stale). Returning None."
            )
            return None
        return [
            [None if p.grad is None else p.grad.detach() for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the grads the optimizer steps (masters and fp32 params) to ``max_norm``.

        Args:
            max_norm: The largest total norm allowed.
            norm_type: The p of the p-norm (``float("inf")`` for the max norm).

        Returns:
            The total norm before clipping, or -1 when the last backward overflowed (nothing
            is clipped then).

        .. note:: Returns a Python float: a host sync.
        """
        if self.overflow:
            return -1.0
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))

    # -- step ----------------------------------------------------------------------------------

    def _master_params_to_model_params(self) -> None:
        self._weights.copy_to_model()

    def _update_scale(self, overflow: bool) -> None:
        self.loss_scaler.update_scale(overflow)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the scale, then step the masters and the fp32 params and refresh the model.

        After an overflow the step is skipped (every param and the optimizer state stay as
        they were) and the scale is lowered.

        Args:
            closure: Optional; it must zero the grads, compute the loss, call
                ``optimizer.backward(loss)`` and return the loss. It may run several times
                (``LBFGS``); between runs the half params are refreshed from the masters.

        Returns:
            What the wrapped optimizer's ``step`` returns (``None`` for a skipped step).
        """
        scale = self.loss_scale
        self._update_scale(self.overflow)
        skip = self.overflow and closure is None
        if self.overflow:
            logger.warning(
                "OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s",
                scale,
                self.loss_scale,
            )
            # With a closure, the overflow came from a backward outside it. Apex skipped and,
            # as no closure ran to clear the flag, skipped every later step too; the closure
            # re-evaluates the loss at the lowered scale instead.
            if closure is not None:
                self.overflow = False

        def run() -> Any:
            return self.optimizer.step() if closure is None else self._step_with_closure(closure)

        return self._weights.step(run, overflow=skip)

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The optimizer moved the masters (LBFGS line search): evaluate at them.
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                scale = self.loss_scale
                self._update_scale(self.overflow)
                logger.warning(
                    "OVERFLOW within closure! Skipping step. Attempted loss scale: %s, "
                    "reducing to %s",
                    scale,
                    self.loss_scale,
                )
                loss = closure()
            return loss

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic_loss_scale else "static"
        return (
            f"FP16_Optimizer({type(self.optimizer).__name__}, {kind} loss scale "
            f"{self.loss_scale}, {len(self.all_fp16_params)} half params, "
            f"{len(self.all_fp32_from_fp32_params)} fp32 params)"
        )
