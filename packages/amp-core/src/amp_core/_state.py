"""The one module-level registry of amp-core, and its lifecycle.

Everything a training step needs is on the objects the user holds (``optimizer._amp_state``
points at its :class:`AmpSession`, which owns the loss scalers). :data:`registry` holds only
what is process-wide by nature:

* ``registry.current`` and the earlier *live* sessions: for Apex's module-level functions that
  take no optimizer (``amp.state_dict()``, ``amp.load_state_dict()``, and the error of
  ``scale_loss`` before the first ``initialize``);
* ``registry.casting``: the one :class:`~amp_core.O1Casting` switched on, whoever switched it on
  (``amp.initialize(opt_level="O1")`` or the legacy ``amp.init()`` handle, its ``owner``);
* ``registry.registrations``: the user's ``amp.register_*_function`` calls.

Lifecycle:

* ``amp.initialize`` makes a new session current and switches off the O1 casting that is on
  (every patch it made: autocast state, policy kernels, Tensor method and user-function wraps,
  the optimizer step hook). The objects an earlier call returned keep their own patches and keep
  working with their own session: several ``initialize`` calls, one per model, are allowed. The
  registry holds the current session strongly and the earlier ones weakly; an earlier session
  is *live* while an optimizer it prepared is, and ``amp.state_dict()`` covers every live
  session in call order (:meth:`AmpRegistry.live_sessions`).
* ``amp.close()`` (:meth:`AmpRegistry.close`) undoes every patch of every live session: the O1
  casting, the ``step`` / ``zero_grad`` / ``add_param_group`` wrappers of its optimizers, the
  hooks of its models, and their ``_amp_state`` records. Afterwards no session is current, and
  the same model and optimizer may be passed to ``amp.initialize`` again.
* Function registrations last for the process. A registered module is held by a weak reference
  (a strong one for objects that cannot be weakly referenced), so that registering a function
  never keeps a module alive; a registration whose module is gone is dropped.
"""

from __future__ import annotations

import enum
import gc
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._casting import O1Casting
    from ._model import ModelAmpState
    from ._opt_levels import Properties
    from ._optimizer import OptimizerAmpState
    from ._scaler import LossScaler

__all__ = ["AmpRegistry", "AmpSession", "Registration", "UserCast", "registry"]

logger = logging.getLogger(__name__)


class UserCast(enum.Enum):
    """How a registered user function's floating inputs are cast under O1."""

    HALF = "half"
    FLOAT = "float"
    PROMOTE = "promote"


@dataclass(frozen=True)
class Registration:
    """One wrapped attribute: ``module.name`` runs with its inputs cast per ``cast``."""

    module: Any
    name: str
    cast: UserCast


def _reference(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # e.g. a SimpleNamespace: held strongly
        return lambda: obj


class _Registrations:
    """The user's ``register_*_function`` calls, applied while O1 casting is on."""

    def __init__(self, owner: AmpRegistry) -> None:
        self._owner = owner
        self._entries: list[tuple[Callable[[], Any], str, UserCast]] = []

    def add(self, module: Any, name: str, cast: UserCast) -> None:
        if not hasattr(module, name):
            raise ValueError(f"No function named {name} in module {module}.")
        if not callable(getattr(module, name)):
            raise TypeError(f"{module}.{name} is not callable, so it cannot be registered.")
        entry = Registration(module, name, cast)
        if any(e.module is module and (e.name, e.cast) == (name, cast) for e in self.entries()):
            return  # registered before (and applied, if casting is on)
        self._entries.append((_reference(module), name, cast))
        casting = self._owner.casting
        if casting is not None:
            casting.apply_registration(entry)

    def entries(self) -> list[Registration]:
        """The registrations whose module is alive, in registration order."""
        live = []
        kept = []
        for ref, name, cast in self._entries:
            module = ref()
            if module is not None:
                live.append(Registration(module, name, cast))
                kept.append((ref, name, cast))
        self._entries = kept
        return live


def _drop_record(obj: Any, record: object) -> None:
    """Delete ``obj._amp_state`` when it is ``record`` (not a later call's)."""
    if obj.__dict__.get("_amp_state") is record:
        del obj.__dict__["_amp_state"]


@dataclass(eq=False)
class AmpSession:
    """The outcome of one ``amp.initialize`` call: its properties, loss scalers, O1 casting,
    and (weakly) the models and optimizers it patched."""

    props: Properties
    scalers: list[LossScaler] = field(default_factory=list)
    casting: O1Casting | None = None
    verbosity: int = 1
    _models: list[weakref.ref[ModelAmpState]] = field(default_factory=list)
    _optimizers: list[weakref.ref[OptimizerAmpState]] = field(default_factory=list)

    def track(self, models: list[ModelAmpState], optimizers: list[OptimizerAmpState]) -> None:
        """Record the amp states this call put on models and optimizers, for :meth:`close`."""
        self._models.extend(weakref.ref(m) for m in models)
        self._optimizers.extend(weakref.ref(o) for o in optimizers)

    def casting_off(self) -> None:
        """Told by the session's O1 casting that it was switched off."""
        self.casting = None

    def switch_off_casting(self) -> None:
        """Switch off what is process-wide (O1 casting); the objects keep their state."""
        if self.casting is not None:
            self.casting.deactivate()
            self.casting = None

    def close(self) -> None:
        """Undo every patch of this session; its objects go back to their plain behaviour
        (an O2 model keeps its cast weights, and its optimizer the fp32 masters)."""
        self.switch_off_casting()
        for opt_ref in self._optimizers:
            opt_state = opt_ref()
            if opt_state is not None:
                opt_state.remove()
                _drop_record(opt_state.optimizer, opt_state)
        for model_ref in self._models:
            model_state = model_ref()
            if model_state is not None:
                model_state.remove()
                _drop_record(model_state.model, model_state)
        self._models = []
        self._optimizers = []


class AmpRegistry:
    """amp-core's process-wide state (see the module docstring for its lifecycle)."""

    def __init__(self) -> None:
        self.current: AmpSession | None = None
        self.casting: O1Casting | None = None
        self.registrations = _Registrations(self)
        self._sessions: list[weakref.ref[AmpSession]] = []

    def switch_off_casting(self) -> None:
        """Switch off the O1 casting that is on, whoever switched it on."""
        if self.casting is not None:
            self.casting.deactivate()

    def replace(self, session: AmpSession | None) -> None:
        """Make ``session`` current (``amp.initialize``), switching O1 casting off first."""
        if self.current is not None:
            self.current.switch_off_casting()
        if self.casting is not None:  # one switched on outside a session (the legacy handle)
            logger.info("Switching off the O1 casting that was active before amp.initialize.")
            self.switch_off_casting()
        self.current = session
        self._sessions = [ref for ref in self._sessions if ref() is not None]
        if session is not None:
            self._sessions.append(weakref.ref(session))

    def close(self) -> None:
        """Undo every patch of every live session and of the O1 casting; no session remains."""
        for session in self.live_sessions():
            session.close()
        self.switch_off_casting()
        self.current = None
        self._sessions = []

    def _alive(self) -> list[AmpSession]:
        alive = [s for s in (ref() for ref in self._sessions) if s is not None]
        self._sessions = [weakref.ref(s) for s in alive]
        return alive

    def live_sessions(self) -> list[AmpSession]:
        """The sessions still in use, in the order of their ``amp.initialize`` calls.

        The current session, and every earlier one that an optimizer it prepared still refers
        to. Objects that point at each other (an amp optimizer does) are freed only by Python's
        cycle collector: when more than one session is registered, a collection runs first, so
        that the answer does not depend on when the collector last ran.
        """
        if len(self._alive()) > 1:
            gc.collect()  # (holding no session meanwhile)
        return self._alive()


registry = AmpRegistry()
"""The registry (one per process)."""
