"""Apex's Amp API: ``from amp_core import amp`` replaces ``from apex import amp``.

Groups:
    * setup: :func:`initialize`
    * per step: :func:`scale_loss`, :func:`master_params`
    * checkpoints: :func:`state_dict`, :func:`load_state_dict`
    * O1 casting: :func:`register_half_function`, :func:`register_float_function`,
      :func:`register_promote_function`, :func:`half_function`, :func:`float_function`,
      :func:`promote_function`, :func:`disable_casts`
    * toolkit additions: :func:`skipped_steps`, :func:`close`
    * Apex compatibility: ``_amp_state``, a view of Apex's module-level state object (the
      loss scalers, ``opt_properties`` ...) answered from the latest ``initialize`` call
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._apex_state import apex_state
from ._casting import UserCast, disable_casts, make_cast_wrapper
from ._frontend import initialize
from ._handle import load_state_dict, master_params, scale_loss, skipped_steps, state_dict
from ._state import registry

__all__ = [
    # setup
    "initialize",
    # per step
    "scale_loss",
    "master_params",
    # checkpoints
    "state_dict",
    "load_state_dict",
    # O1 casting
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "disable_casts",
    # additions
    "skipped_steps",
    "close",
]

F = TypeVar("F", bound=Callable[..., Any])

# Apex scripts read ``amp._amp_state`` (and ``from apex.amp import _amp_state``).
_amp_state = apex_state


def register_half_function(module: Any, function_name: str) -> None:
    """Run ``module.function_name`` on half inputs under O1.

    While O1 casting is on, the attribute is replaced by a wrapper that casts the floating
    tensor arguments to the half dtype and runs the function with the O1 policy suspended
    inside it. Only that attribute is wrapped; the wrap is undone when casting is switched off
    (by the next ``amp.initialize``, or :func:`close`). Register before or after
    ``amp.initialize``. The registration lasts for the process; the module is held by a weak
    reference (where it allows one), so registering never keeps it alive.

    Raises:
        ValueError: if ``module`` has no attribute ``function_name``.

    Example:
        >>> amp.register_half_function(my_cuda_ext, "fused_matmul")
    """
    registry.registrations.add(module, function_name, UserCast.HALF)


def register_float_function(module: Any, function_name: str) -> None:
    """Run ``module.function_name`` on fp32 inputs under O1 (see
    :func:`register_half_function`).

    Example:
        >>> amp.register_float_function(torch, "sigmoid")
    """
    registry.registrations.add(module, function_name, UserCast.FLOAT)


def register_promote_function(module: Any, function_name: str) -> None:
    """Run ``module.function_name`` on inputs cast to their widest floating dtype under O1
    (see :func:`register_half_function`)."""
    registry.registrations.add(module, function_name, UserCast.PROMOTE)


def half_function(fn: F) -> F:
    """Decorator: under O1, ``fn`` runs on half inputs with casting suspended inside."""
    return make_cast_wrapper(fn, UserCast.HALF)


def float_function(fn: F) -> F:
    """Decorator: under O1, ``fn`` runs on fp32 inputs with casting suspended inside."""
    return make_cast_wrapper(fn, UserCast.FLOAT)


def promote_function(fn: F) -> F:
    """Decorator: under O1, ``fn`` runs on inputs cast to their widest floating dtype."""
    return make_cast_wrapper(fn, UserCast.PROMOTE)


def close() -> None:
    """Undo everything ``amp.initialize`` did to the process and to the objects it returned.

    A toolkit addition (Apex had none). Switches O1 casting off (autocast state, the policy
    kernels, the ``Tensor.cpu`` and user-function wraps, the optimizer step hook), restores the
    ``step``, ``zero_grad`` and ``add_param_group`` of every optimizer of every live
    ``initialize`` call, removes the hooks of their models (input and output casting, cast-cache
    guards, state-dict hooks) and their ``_amp_state`` records. What was cast goes back to its
    dtype from before ``amp.initialize``, holding the truth amp kept: an O2 model's half params
    take their fp32 masters' values, an O3 model's are widened; each optimizer gets the model's
    params back in its param groups in place of the masters, with their state (half state
    widened with its param). The model and optimizer then train in a plain PyTorch loop, or can
    be passed to ``amp.initialize`` again (docs: "What is true of the weights").

    Afterwards ``amp.scale_loss`` raises as before the first ``initialize``, and
    ``amp.state_dict`` says that the session was closed; function registrations
    (``register_*_function``) are kept. Calling it twice is harmless.

    Example:
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        >>> ...
        >>> amp.close()  # plain PyTorch again
    """
    registry.close()
