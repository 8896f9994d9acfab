"""The pre-1.0 Amp API: ``amp.init()`` returns a handle that switches O1 casting on.

The casting is amp-core's :class:`amp_core.O1Casting` (the same policy tables and kernels as
``amp.initialize(opt_level="O1")``), and the loss scalers are amp-core's
:class:`amp_core.LossScaler` with Apex amp's defaults (the ``"amp"`` scaler preset). The
handle owns both; :meth:`AmpHandle._deactivate` undoes everything it switched on.

At most one O1 casting is on at a time: amp-core's registry records the handle's casting (with
the handle as its ``owner``), so that the next ``amp.init`` or ``amp_core.amp.initialize``
switches it off, and with it the handle's pending step skips, as Apex's re-patching did.

A step after an overflow is skipped by a :class:`_SkippableStep` that the handle binds to the
optimizer itself on its first ``handle.scale_loss(loss, optimizer)`` (as amp-core binds its step),
so that it works with PyTorch's LR schedulers, which wrap ``optimizer.step`` on the instance: one
built before wraps the class's step and is wrapped in turn (keeping its mark, so torch does not
warn that the step was overridden); one built after re-binds ``optimizer.step.__func__``, which
is the handle's. A skipped step still counts as a call of ``optimizer.step()`` for the schedulers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional

import amp_core
from amp_core import LossScaler as _CoreScaler
from amp_core import MasterWeights, O1Casting, ScalerConfig

from ._deprecation import warn_deprecated

__all__ = ["AmpHandle", "NoOpHandle", "OptimWrapper", "init"]

logger = logging.getLogger(__name__)


def _amp_scaler(loss_scale: float | str) -> _CoreScaler:
    """A scaler with Apex amp's defaults (its pre-1.0 handle used amp's scaler)."""
    return _CoreScaler.from_config(ScalerConfig.preset("amp", loss_scale=loss_scale))


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _skip_step(optimizer: Any) -> None:
    """Skip one ``optimizer.step()`` for an overflow: log it, and record the call as an LR
    scheduler's wrapper of ``step`` would have (torch warns at the scheduler's first step that
    ``lr_scheduler.step()`` came before ``optimizer.step()`` when it finds no call)."""
    logger.warning("Gradient overflow, skipping update")
    optimizer._opt_called = True


class _SkippableStep:
    """The ``step`` a handle binds to an optimizer: the step it replaced, or an overflow skip.

    Installed on the optimizer instance (``optimizer.step.__func__`` is :attr:`function`, so an
    LR scheduler built later wraps it); the step found there before (an LR scheduler's wrapper,
    or the class's step) is called for the steps that are taken. It carries the attributes of
    the step it replaced (an LR scheduler's mark among them). :meth:`remove` puts that step back;
    where something wrapped this one since, it stays and passes every step through.

    Args:
        optimizer: The optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.previous: Callable[..., Any] | None = optimizer.__dict__.get("step")
        self.skip_next = False
        self.active = True

        def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            return self.call(opt, *args, **kwargs)

        if self.previous is not None:
            functools.update_wrapper(step, self.previous)
        self.function = step
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    def call(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)``, unless an overflow asked to skip it (once)."""
        if self.active and self.skip_next:
            self.skip_next = False
            _skip_step(optimizer)
            return None
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(optimizer).step(optimizer, *args, **kwargs)

    def remove(self, optimizer: Any) -> None:
        """Drop a pending skip and put the replaced step back (if this one is still there)."""
        self.active = False
        self.skip_next = False
        if getattr(optimizer.__dict__.get("step"), "__func__", None) is not self.function:
            return  # wrapped since (an LR scheduler built later): passes steps through
        if self.previous is None:
            del optimizer.__dict__["step"]
        else:
            optimizer.step = self.previous


class _ScaledBackward:
    """One scaled backward into ``params``: set old grads aside, unscale the new, add back.

    Setting the old grads aside makes gradient accumulation over several scaled backward
    passes exact (Apex unscaled the already unscaled grads again).
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.weights = MasterWeights(direct_params=params)  # no masters: O1 steps the params
        self.weights.set_aside_grads()

    def finish(self, scaler: _CoreScaler) -> bool:
        """Unscale the new grads, restore the old ones; return whether the new overflowed.

        .. note:: Reads the overflow flag on the host (dynamic scale only).
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.weights.unscale_direct_grads(scaler, found_inf, check=scaler.dynamic)
        scaler.update_(found_inf)
        return scaler.dynamic and bool(found_inf.item())


class OptimWrapper:
    """An optimizer wrapped by :meth:`AmpHandle.wrap_optimizer`: one loss scaler per loss.

    Use ``with optimizer.scale_loss(loss) as scaled: scaled.backward()`` once per loss (at most
    ``num_loss`` times between steps), then ``optimizer.step()``; a step after an overflow of
    any loss is skipped. Other attributes are the wrapped optimizer's.

    Args:
        optimizer: The optimizer.
        amp_handle: The handle that wrapped it.
        num_loss: How many losses are scaled (each with its own dynamic scale) per step.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, amp_handle: AmpHandle | NoOpHandle, num_loss: int
    ) -> None:
        if not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss must be a positive int, got {num_loss!r}.")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._skip_next = [False] * num_loss
        self._loss_scaler = [_amp_scaler(amp_handle.loss_scale_arg) for _ in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yield ``loss * loss_scale`` of the current loss; unscale the grads on exit.

        Raises:
            RuntimeError: when called more than ``num_loss`` times between two steps.
        """
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(
                f"scale_loss was called {self._loss_idx + 1} times since the last step, but "
                f"wrap_optimizer(optimizer, num_loss={self._num_loss}) was asked for "
                f"{self._num_loss}; pass num_loss={self._loss_idx + 1}."
            )
        scaler = self._loss_scaler[self._loss_idx]
        backward = _ScaledBackward(_params(self._optimizer))
        yield loss.float() * scaler.scale_tensor(loss.device)
        self._skip_next[self._loss_idx] = backward.finish(scaler)
        self._loss_idx += 1
        self._amp_handle._clear_cache()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the optimizer, unless a loss overflowed since the last step.

        Raises:
            NotImplementedError: for a ``closure`` (as Apex).
        """
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        if closure is not None:
            raise NotImplementedError(
                "The `closure` argument is unsupported by the amp optimizer wrapper; call "
                "step() without one, or use FP16_Optimizer, which supports closures."
            )
        self._loss_idx = 0
        overflow = any(self._skip_next)
        if overflow:
            _skip_step(self._optimizer)
            self._skip_next = [False] * self._num_loss
        # No masters (O1 steps the model's params): the step, or its skip, alone.
        return MasterWeights().step(self._optimizer.step, overflow=overflow)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict``."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``."""
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``."""
        self._optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"OptimWrapper({self._optimizer!r}, num_loss={self._num_loss})"


class AmpHandle:
    """What ``amp.init()`` returns: O1 casting on, a default loss scaler, optimizer wrapping.

    Args:
        loss_scale: ``"dynamic"`` or a positive number.
        enable_caching: Keep the half copies of weights between the forward passes of a step.
        verbose: Log (DEBUG) what is switched on.
        allow_banned: Let ``F.binary_cross_entropy`` run (in fp32) instead of refusing it.
        half_dtype: The low-precision dtype.
    """

    def __init__(
        self,
        loss_scale: float | str = "dynamic",
        enable_caching: bool = True,
        verbose: bool = False,
        allow_banned: bool = False,
        *,
        half_dtype: torch.dtype,
    ) -> None:
        self.loss_scale_arg = loss_scale
        self._enable_caching = enable_caching
        self._verbose = verbose
        self._default_scaler: _CoreScaler | None = _amp_scaler(loss_scale)
        # The optimizers whose step this handle replaced, each with its _SkippableStep.
        self._steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, _SkippableStep] = (
            weakref.WeakKeyDictionary()
        )
        device_types = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        self._casting: O1Casting | None = O1Casting(
            device_types, half_dtype, verbose=verbose, owner=self, on_deactivate=self._casting_off
        )
        if not enable_caching:
            # O1Casting restores the caller's setting when it is switched off.
            torch.set_autocast_cache_enabled(False)
        if allow_banned:
            # Run binary_cross_entropy in fp32 with casting suspended inside, so the banned
            # kernel is never reached; recorded on this casting and undone with it.
            self._casting.register_function(torch.nn.functional, "binary_cross_entropy", "float")

    @property
    def verbose(self) -> bool:
        return self._verbose

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    def is_active(self) -> bool:
        """Whether casting is on (for this thread, and not suspended by ``_disable_casts``)."""
        return self._casting is not None and self._casting.is_active()

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        if self._casting is None:
            yield
            return
        with self._casting.suspended():
            yield

    def _clear_cache(self) -> None:
        if self._casting is not None:
            self._casting.clear_cache()

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        """Wrap ``optimizer`` for ``optimizer.scale_loss(loss)``, one scaler per loss.

        After this, the handle's own :meth:`scale_loss` is refused (as in Apex).
        """
        warn_deprecated(
            "AmpHandle.wrap_optimizer",
            'amp_core.amp.initialize(model, optimizer, opt_level="O1", num_losses=...)',
        )
        self._default_scaler = None
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(
        self, loss: torch.Tensor, optimizer: torch.optim.Optimizer
    ) -> Iterator[torch.Tensor]:
        """Yield ``loss * loss_scale``; unscale the grads of ``optimizer``'s params on exit.

        After an overflow, the next ``optimizer.step()`` is skipped (once), also when an LR
        scheduler wraps it: the first call binds the handle's step to ``optimizer`` (until the
        handle is switched off), and a scheduler built before or after it keeps counting.

        Raises:
            RuntimeError: after :meth:`wrap_optimizer` (use the wrapper's ``scale_loss``).
        """
        if not self.is_active():
            yield loss
            return
        scaler = self._default_scaler
        if scaler is None:
            raise RuntimeError(
                "After calling `handle.wrap_optimizer()`, you must explicitly use "
                "`optimizer.scale_loss(loss)` on the optimizer it returned."
            )
        backward = _ScaledBackward(_params(optimizer))
        yield loss.float() * scaler.scale_tensor(loss.device)
        overflow = backward.finish(scaler)
        step = self._steps.get(optimizer)
        if step is None:
            step = self._steps[optimizer] = _SkippableStep(optimizer)
        if overflow:
            step.skip_next = True  # the next optimizer.step(), however it is reached
        self._clear_cache()

    def _deactivate(self) -> None:
        """Undo everything this handle switched on (casting, wraps, pending step skips)."""
        if self._casting is not None:
            self._casting.deactivate()  # calls _casting_off
        else:
            self._casting_off()

    def _casting_off(self) -> None:
        """The handle's casting was switched off (by the handle, or by the next ``amp.init`` or
        ``amp.initialize``): drop the pending step skips too."""
        for optimizer, step in list(self._steps.items()):
            step.remove(optimizer)
        self._steps = weakref.WeakKeyDictionary()
        self._casting = None


class NoOpHandle:
    """What ``amp.init(enabled=False)`` returns: every method is a no-op."""

    loss_scale_arg: float | str = 1.0

    def is_active(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    @property
    def has_cache(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def _clear_cache(self) -> None:
        pass

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        """A wrapper whose ``scale_loss`` yields the loss unchanged."""
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(
        self, loss: torch.Tensor, optimizer: torch.optim.Optimizer
    ) -> Iterator[torch.Tensor]:
        yield loss

    def _deactivate(self) -> None:
        pass


def init(
    enabled: bool = True,
    loss_scale: float | str = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    *,
    half_dtype: torch.dtype | None = None,
) -> AmpHandle | NoOpHandle:
    """Apex's pre-1.0 ``amp.init``: switch O1 casting on and return its handle.

    A previous handle is switched off first, and so is the O1 casting of an earlier
    ``amp_core.amp.initialize(opt_level="O1")`` call.

    Args:
        enabled: ``False`` returns a :class:`NoOpHandle`.
        loss_scale: ``"dynamic"`` (amp's defaults: 2**16, window 2000) or a positive number.
        enable_caching: Cache the half copies of weights within a step.
        verbose: Log (DEBUG) what is switched on.
        allow_banned: Run ``F.binary_cross_entropy`` in fp32 instead of refusing it.
        half_dtype: The low-precision dtype (keyword-only): ``torch.float16`` when CUDA is
            available, else ``torch.bfloat16``.

    Returns:
        The handle.

    Example:
        >>> handle = amp.init()
        >>> with handle.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    warn_deprecated("amp.init", 'amp_core.amp.initialize(model, optimizer, opt_level="O1")')
    casting = amp_core.o1_casting()
    if casting is not None and isinstance(casting.owner, AmpHandle):
        casting.deactivate()  # the previous handle's
    if not enabled:
        return NoOpHandle()
    casting = amp_core.o1_casting()
    if casting is not None:
        logger.warning("amp.init switches off the O1 casting of the earlier amp.initialize call.")
        casting.deactivate()
    if half_dtype is None:
        half_dtype = torch.float16 if torch.cuda.is_available() else torch.bfloat16
    if half_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"half_dtype must be torch.float16 or torch.bfloat16, got {half_dtype}.")
    return AmpHandle(loss_scale, enable_caching, verbose, allow_banned, half_dtype=half_dtype)
