"""amp's wrappers of an optimizer's ``step``, ``zero_grad`` and ``add_param_group``.

Apex's contract needs a step that can be skipped, which no PyTorch hook offers, and a param
group added after ``amp.initialize`` needs the treatment the first ones had: so the three methods
are replaced on the optimizer instance (:func:`wrap_optimizer`) by wrappers that hand each call
to the optimizer's amp record (``optimizer._amp_state``, an :class:`AmpCalls`), and put back by
:func:`unwrap_optimizer`. A wrapper held elsewhere after that (an LR scheduler's) calls the
class's method.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

from ._state import class_method, restore_method

__all__ = ["AmpCalls", "Originals", "unwrap_optimizer", "wrap_optimizer"]


class AmpCalls:
    """What the wrappers hand an optimizer's calls to: its amp record."""

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        raise NotImplementedError

    def _zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError


class Originals(NamedTuple):
    """The methods the wrappers replaced (``add_param_group``: ``None`` where there was none)."""

    step: Callable[..., Any]
    zero_grad: Callable[..., Any]
    add_param_group: Callable[[dict[str, Any]], None] | None


def _calls(optimizer: Any) -> AmpCalls | None:
    state = getattr(optimizer, "_amp_state", None)
    return state if isinstance(state, AmpCalls) else None


def _amp_step(optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
    # What the wrapper of a torch LR scheduler records (a skipped step is a step to it).
    optimizer._opt_called = True
    state = _calls(optimizer)
    return state._step(closure) if state else class_method(optimizer, "step")(closure)


# torch's LR schedulers wrap `optimizer.step` to see whether it ran before their own step(),
# and warn when `optimizer.step` lacks their mark (it was replaced after the scheduler was
# built: amp.initialize after the scheduler, the usual order of Apex scripts). amp's step
# records the call itself (`_opt_called` above), so it carries the mark: a scheduler built
# before or after amp.initialize then warns only when it would without amp.
_amp_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def _amp_zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    state = _calls(optimizer)
    state._zero_grad(set_to_none) if state else class_method(optimizer, "zero_grad")(set_to_none)


def _amp_add_param_group(optimizer: Any, param_group: dict[str, Any]) -> None:
    state = _calls(optimizer)
    (state.add_param_group if state else class_method(optimizer, "add_param_group"))(param_group)


_WRAPPERS = dict(step=_amp_step, zero_grad=_amp_zero_grad, add_param_group=_amp_add_param_group)


def wrap_optimizer(optimizer: Any) -> Originals:
    """Replace the optimizer's three methods by amp's wrappers; returns the replaced ones."""
    # Wrappers such as LARC may lack add_param_group: then there is nothing to wrap.
    originals = Originals(
        optimizer.step, optimizer.zero_grad, getattr(optimizer, "add_param_group", None)
    )
    # Bound to the optimizer itself: LR schedulers re-bind `optimizer.step.__func__` to it.
    optimizer.step = types.MethodType(_amp_step, optimizer)
    optimizer.zero_grad = types.MethodType(_amp_zero_grad, optimizer)
    if originals.add_param_group is not None:
        optimizer.add_param_group = types.MethodType(_amp_add_param_group, optimizer)
    return originals


def unwrap_optimizer(optimizer: Any, originals: Originals) -> None:
    """Put back what :func:`wrap_optimizer` replaced (a wrapper replaced since is left)."""
    for (name, wrapper), original in zip(_WRAPPERS.items(), originals, strict=True):
        restore_method(optimizer, name, wrapper, original)
