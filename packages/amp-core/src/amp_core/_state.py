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
* ``amp.close()`` (:meth:`AmpRegistry.close`) undoes every patch of every ``initialize`` call
  whose objects are alive: the O1 casting, the ``step`` / ``zero_grad`` / ``add_param_group``
  wrappers of the optimizers, the hooks of the models, and their ``_amp_state`` records (the
  registry holds them by weak references); the models' cast tensors go back to their dtypes
  and the optimizers step the models' params again. Afterwards no session is current
  (``closed`` says why), and the same model and optimizer may be passed to ``amp.initialize``
  again.
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

__all__ = [
    "AmpRegistry",
    "AmpSession",
    "Registration",
    "UserCast",
    "class_method",
    "registry",
    "restore_method",
]

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


def restore_method(obj: Any, name: str, wrapper: object, original: Any) -> None:
    """Undo ``obj.name = MethodType(wrapper, obj)``: back to the class's method, or to the
    instance attribute ``original`` that was there before. Left alone when something else
    replaced the wrapper since (it then still reaches ``wrapper``, which must cope)."""
    own = obj.__dict__
    if getattr(own.get(name), "__func__", None) is not wrapper:
        return
    if getattr(original, "__func__", None) is getattr(type(obj), name, None):
        del own[name]
    else:
        own[name] = original


def class_method(obj: Any, name: str) -> Callable[..., Any]:
    """``obj.name`` as the class defines it, bound to ``obj`` (whatever the instance holds).

    amp's optimizer wrappers call it once ``amp.close()`` removed their state: a wrapper held
    elsewhere (an LR scheduler's) still reaches them and must step as the class does.
    """
    method: Callable[..., Any] = getattr(type(obj), name).__get__(obj, type(obj))
    return method


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


@dataclass(eq=False)
class AmpSession:
    """The outcome of one ``amp.initialize`` call: its properties, loss scalers, O1 casting."""

    props: Properties
    scalers: list[LossScaler] = field(default_factory=list)
    casting: O1Casting | None = None
    verbosity: int = 1

    def flush_scale_updates(self) -> None:
        """Apply the scale updates the session's ``scale_loss`` blocks left pending (at a
        step: see :meth:`LossScaler.note_update_`)."""
        for scaler in self.scalers:
            scaler.flush_update_()

    def casting_off(self) -> None:
        """Told by the session's O1 casting that it was switched off."""
        self.casting = None

    def switch_off_casting(self) -> None:
        """Switch off what is process-wide (O1 casting); the objects keep their state."""
        if self.casting is not None:
            self.casting.deactivate()
            self.casting = None


class AmpRegistry:
    """amp-core's process-wide state (see the module docstring for its lifecycle)."""

    def __init__(self) -> None:
        self.current: AmpSession | None = None
        self.closed = False  # amp.close() ran, and no initialize since
        self.casting: O1Casting | None = None
        self.registrations = _Registrations(self)
        self._sessions: list[weakref.ref[AmpSession]] = []
        # (record, object) of every amp state put on a model or an optimizer, held weakly
        self._records: list[tuple[weakref.ref[Any], weakref.ref[Any]]] = []

    def track(self, records: list[tuple[ModelAmpState | OptimizerAmpState, Any]]) -> None:
        """Record the amp states ``initialize`` put on objects (``obj._amp_state``), for
        :meth:`close`; objects that are gone are forgotten."""
        self._records = [(r, o) for r, o in self._records if r() is not None]
        self._records.extend((weakref.ref(r), weakref.ref(o)) for r, o in records)

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
        self.closed = False
        self._sessions = [ref for ref in self._sessions if ref() is not None]
        if session is not None:
            self._sessions.append(weakref.ref(session))

    def close(self) -> None:
        """Undo every patch: the O1 casting, and the amp states of every model and optimizer
        still alive (their wrappers and hooks, then ``_amp_state``); no session remains.

        Raises:
            RuntimeError: inside a ``scale_loss`` block (nothing is changed then).
        """
        from ._optimizer import OptimizerAmpState  # (imports this module)

        records: list[Any] = [r() for r, _ in self._records]
        optimizers = [r for r in records if isinstance(r, OptimizerAmpState)]
        for optimizer in optimizers:  # every refusal before any change
            optimizer.check_closable()
        for optimizer in optimizers:
            optimizer.settle_for_close()
        self.switch_off_casting()  # tells its owner (a session, a legacy handle)
        for record_ref, obj_ref in self._records:
            record, obj = record_ref(), obj_ref()
            if record is None or obj is None:
                continue
            record.remove()
            if obj.__dict__.get("_amp_state") is record:  # not a later call's
                del obj.__dict__["_amp_state"]
        self._records = []
        self.current = None
        self.closed = True
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
