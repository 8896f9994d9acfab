"""O1 casting: autocast switched on for the calling thread, Apex's policy, user registrations.

:class:`O1Casting` is the one object that changes global behaviour for O1. It turns PyTorch's
autocast on for the thread that called ``amp.initialize`` (so losses computed outside
``forward`` are cast too, as in Apex), registers the policy kernels of :mod:`._policy`, applies
the user's function registrations, and clears the weight-cast cache after every optimizer step.
:meth:`O1Casting.deactivate` undoes all of it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from ._policy import FP32_TENSOR_METHODS, PolicyKernels, cast_args, widest_dtype
from ._state import Registration, UserCast, registry

__all__ = [
    "O1Casting",
    "Registration",
    "UserCast",
    "active_casting",
    "disable_casts",
    "make_cast_wrapper",
    "o1_casting",
    "o1_casting_active",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def o1_casting() -> O1Casting | None:
    """The O1 casting switched on in this process (at most one), whoever switched it on and
    whichever thread it is on; ``None`` when none is."""
    return registry.casting


def o1_casting_active() -> bool:
    """Whether O1 casting is on for the calling thread and not suspended (by
    ``amp.disable_casts`` or inside a registered function)."""
    return active_casting() is not None


def active_casting() -> O1Casting | None:
    """The O1 casting that is on for the current thread and not suspended, if any."""
    casting = registry.casting
    if casting is None or not casting.is_active():
        return None
    return casting


def _cast_call(
    casting: O1Casting,
    fn: Callable[..., Any],
    cast: UserCast,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if cast is UserCast.HALF:
        args, kwargs = cast_args(args, kwargs, casting.half_dtype, only=_FLOATING)
    elif cast is UserCast.FLOAT:
        args, kwargs = cast_args(args, kwargs, torch.float32, only=_FLOATING)
    else:
        widest = widest_dtype([*args, *kwargs.values()])
        if widest is not None:
            args, kwargs = cast_args(args, kwargs, widest, only=_FLOATING)
    # The function runs on the inputs as asked, with the O1 policy suspended inside it.
    with casting.suspended():
        return fn(*args, **kwargs)


def make_cast_wrapper(fn: F, cast: UserCast) -> F:
    """Wrap ``fn`` so that, while O1 casting is active, it runs on inputs cast per ``cast``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        casting = active_casting()
        if casting is None:
            return fn(*args, **kwargs)
        return _cast_call(casting, fn, cast, args, kwargs)

    wrapper.__amp_cast__ = cast  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _make_fp32_method(method: F) -> F:
    """Wrap a Tensor method so that, under O1, a half ``self`` is widened to fp32 first."""

    @functools.wraps(method)
    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.dtype in _LOW_PRECISION and active_casting() is not None:
            self = self.float()
        return method(self, *args, **kwargs)

    wrapper.__amp_cast__ = UserCast.FLOAT  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


class O1Casting:
    """Apex's O1 policy, switched on for one thread until :meth:`deactivate`.

    At most one is on in the process at a time; it is recorded in amp-core's registry (see
    :func:`o1_casting`), so that the next ``amp.initialize`` can switch it off.

    Args:
        device_types: The autocast device types to switch on ("cpu", "cuda").
        half_dtype: The low-precision dtype of the run.
        verbose: Log (at DEBUG) what was switched on.
        owner: Who switched it on (an ``amp.initialize`` session, a legacy ``amp.init``
            handle...), for :func:`o1_casting` callers to tell.
        on_deactivate: Called once when the casting is switched off, by whoever does it, so
            that the owner can undo its own patches too.

    Raises:
        RuntimeError: when an O1 casting is on already (switch it off first:
            :meth:`deactivate`, or ``amp.close()``).
    """

    def __init__(
        self,
        device_types: list[str],
        half_dtype: torch.dtype,
        *,
        verbose: bool = True,
        owner: object = None,
        on_deactivate: Callable[[], None] | None = None,
    ) -> None:
        if registry.casting is not None:
            raise RuntimeError(
                "O1 casting is already active; deactivate it first (amp.close() switches off "
                "everything amp switched on)."
            )
        self.owner = owner
        self._on_deactivate = on_deactivate
        self.device_types = device_types
        self.half_dtype = half_dtype
        self.thread_id = threading.get_ident()
        self._suspended = 0
        self._saved: dict[str, tuple[bool, torch.dtype]] = {}
        self._saved_cache_enabled = torch.is_autocast_cache_enabled()
        # (entry, original, wrapper, whether the original was the module's own attribute)
        self._wraps: list[tuple[Registration, Any, Any, bool]] = []
        for device_type in device_types:
            self._saved[device_type] = (
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
            )
            torch.set_autocast_enabled(device_type, True)
            torch.set_autocast_dtype(device_type, half_dtype)
        torch.set_autocast_cache_enabled(True)
        # Nesting > 0 keeps the weight-cast cache alive between forward passes of one step.
        torch.autocast_increment_nesting()
        self._kernels: PolicyKernels | None = None
        self._step_hook: RemovableHandle | None = None
        registry.casting = self
        try:
            self._kernels = PolicyKernels(device_types)
            self._step_hook = register_optimizer_step_post_hook(self._after_step)
            for name in FP32_TENSOR_METHODS:
                entry = Registration(torch.Tensor, name, UserCast.FLOAT)
                self._install(entry, _make_fp32_method(getattr(torch.Tensor, name)))
            for entry in registry.registrations.entries():
                self.apply_registration(entry)
        except BaseException:
            self.deactivate()
            raise
        if verbose:
            logger.debug(
                "O1 casting on for %s in %s; %d policy kernels registered",
                device_types,
                half_dtype,
                len(self._kernels.registered),
            )

    def is_active(self) -> bool:
        return (
            registry.casting is self
            and self._suspended == 0
            and threading.get_ident() == self.thread_id
        )

    @staticmethod
    def clear_cache() -> None:
        """Drop cached low-precision copies of the weights (stale once the weights change)."""
        torch.clear_autocast_cache()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.clear_cache()

    def register_function(self, module: Any, name: str, cast: str) -> None:
        """Wrap ``module.name`` as ``amp.register_<cast>_function`` would, for as long as this
        casting is on (:meth:`deactivate` restores it); nothing is added to the registrations
        that later castings apply.

        Args:
            module: The module (or class) holding the function.
            name: The attribute name.
            cast: ``"half"``, ``"float"`` or ``"promote"``.
        """
        self.apply_registration(Registration(module, name, UserCast(cast)))

    def apply_registration(self, entry: Registration) -> None:
        self._install(entry, make_cast_wrapper(getattr(entry.module, entry.name), entry.cast))

    def _install(self, entry: Registration, wrapper: Any) -> None:
        original = getattr(entry.module, entry.name)
        # A class attribute found on a base class (Tensor.cpu lives on TensorBase) is
        # restored by deleting the wrapper, not by copying the base's attribute down.
        own = not isinstance(entry.module, type) or entry.name in vars(entry.module)
        setattr(entry.module, entry.name, wrapper)
        self._wraps.append((entry, original, wrapper, own))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Suspend casting (the policy and the user registrations) inside the block."""
        with contextlib.ExitStack() as stack:
            for device_type in self.device_types:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            self._suspended += 1
            try:
                yield
            finally:
                self._suspended -= 1

    @contextlib.contextmanager
    def autocast_off(self) -> Iterator[None]:
        """Switch PyTorch's autocast off inside the block, for the backward of a step.

        Unlike :meth:`suspended`, the user's function registrations stay in force (Apex's
        patches were always on), so a forward recomputed during the backward (activation
        checkpointing, which restores the autocast state of the original forward) is cast as
        the original forward was.
        """
        with contextlib.ExitStack() as stack:
            for device_type in self.device_types:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            yield

    def deactivate(self) -> None:
        """Undo everything: autocast state, policy kernels, user wraps, the step hook."""
        if registry.casting is not self:
            return
        for entry, original, wrapper, own in reversed(self._wraps):
            if getattr(entry.module, entry.name, None) is wrapper:
                if own:
                    setattr(entry.module, entry.name, original)
                else:
                    delattr(entry.module, entry.name)
            else:
                logger.warning(
                    "%s.%s was replaced after amp wrapped it; leaving the new value in place.",
                    getattr(entry.module, "__name__", entry.module),
                    entry.name,
                )
        self._wraps = []
        if self._step_hook is not None:
            self._step_hook.remove()
        if self._kernels is not None:
            self._kernels.remove()
        if threading.get_ident() == self.thread_id:
            torch.autocast_decrement_nesting()
            for device_type, (enabled, dtype) in self._saved.items():
                torch.set_autocast_enabled(device_type, enabled)
                torch.set_autocast_dtype(device_type, dtype)
            torch.set_autocast_cache_enabled(self._saved_cache_enabled)
            torch.clear_autocast_cache()
        else:
            logger.warning(
                "O1 casting was switched off from another thread than the one that switched it "
                "on; autocast stays enabled on that thread."
            )
        registry.casting = None
        if self._on_deactivate is not None:
            callback, self._on_deactivate = self._on_deactivate, None
            callback()


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Suspend O1 casting inside the block (a no-op when O1 is not active).

    Example:
        >>> with amp.disable_casts():
        ...     y = model.head(x.float())  # runs in fp32 under O1
    """
    casting = active_casting()
    if casting is None:
        yield
        return
    with casting.suspended():
        yield
