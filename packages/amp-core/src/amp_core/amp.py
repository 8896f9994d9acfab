"""Apex's Amp API: ``from amp_core import amp`` replaces ``from apex import amp``.

Groups:
    * setup: :func:`initialize`
    * per step: :func:`scale_loss`, :func:`master_params`
    * checkpoints: :func:`state_dict`, :func:`load_state_dict`
    * O1 casting: :func:`register_half_function`, :func:`register_float_function`,
      :func:`register_promote_function`, :func:`half_function`, :func:`float_function`,
      :func:`promote_function`, :func:`disable_casts`
    * toolkit additions: :func:`skipped_steps`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._casting import UserCast, disable_casts, make_cast_wrapper, registrations
from ._frontend import initialize
from ._handle import load_state_dict, master_params, scale_loss, skipped_steps, state_dict

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
]

F = TypeVar("F", bound=Callable[..., Any])


def register_half_function(module: Any, function_name: str) -> None:
    """Run ``module.function_name`` on half inputs under O1.

    While O1 casting is on, the attribute is replaced by a wrapper that casts the floating
    tensor arguments to the half dtype and runs the function with the O1 policy suspended
    inside it. Only that attribute is wrapped; the wrap is undone when casting is switched off
    (by the next ``amp.initialize``). Register before or after ``amp.initialize``.

    Raises:
        ValueError: if ``module`` has no attribute ``function_name``.

    Example:
        >>> amp.register_half_function(my_cuda_ext, "fused_matmul")
    """
    registrations.add(module, function_name, UserCast.HALF)


def register_float_function(module: Any, function_name: str) -> None:
    """Run ``module.function_name`` on fp32 inputs under O1 (see
    :func:`register_half_function`).

    Example:
        >>> amp.register_float_function(torch, "sigmoid")
    """
    registrations.add(module, function_name, UserCast.FLOAT)


def register_promote_function(module: Any, function_name: str) -> None:
    """Run ``module.function_name`` on inputs cast to their widest floating dtype under O1
    (see :func:`register_half_function`)."""
    registrations.add(module, function_name, UserCast.PROMOTE)


def half_function(fn: F) -> F:
    """Decorator: under O1, ``fn`` runs on half inputs with casting suspended inside."""
    return make_cast_wrapper(fn, UserCast.HALF)


def float_function(fn: F) -> F:
    """Decorator: under O1, ``fn`` runs on fp32 inputs with casting suspended inside."""
    return make_cast_wrapper(fn, UserCast.FLOAT)


def promote_function(fn: F) -> F:
    """Decorator: under O1, ``fn`` runs on inputs cast to their widest floating dtype."""
    return make_cast_wrapper(fn, UserCast.PROMOTE)
