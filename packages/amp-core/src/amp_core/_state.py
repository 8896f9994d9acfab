"""The one module-level registry: the ``amp.initialize`` calls whose objects are alive.

Everything a training step needs is on the objects the user holds (``optimizer._amp_state``
points at its :class:`AmpSession`, which owns the loss scalers). The registry exists only for
Apex's module-level functions that take no optimizer: ``amp.state_dict()``,
``amp.load_state_dict()`` and, before the first ``initialize``, the error of ``scale_loss``.

Lifecycle: ``amp.initialize`` makes a new session current and switches off the O1 casting of the
previous one; objects returned by an earlier call keep working with their own session. The
registry holds the current session and weak references to the earlier ones: an earlier session
is *live* while an optimizer it prepared is, and ``amp.state_dict()`` covers every live session
in call order (see :meth:`_Registry.live_sessions`).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

from ._casting import O1Casting, switch_off_casting
from ._opt_levels import Properties
from ._scaler import LossScaler

__all__ = ["AmpSession", "registry"]


@dataclass(eq=False)
class AmpSession:
    """The outcome of one ``amp.initialize`` call."""

    props: Properties
    scalers: list[LossScaler] = field(default_factory=list)
    casting: O1Casting | None = None
    verbosity: int = 1

    @property
    def props_verbosity(self) -> int:
        return self.verbosity

    def close(self) -> None:
        """Switch off what is process-wide (O1 casting); the objects keep their state."""
        if self.casting is not None:
            self.casting.deactivate()
            self.casting = None


class _Registry:
    def __init__(self) -> None:
        self.current: AmpSession | None = None
        self._sessions: list[weakref.ref[AmpSession]] = []

    def replace(self, session: AmpSession | None) -> None:
        if self.current is not None:
            self.current.close()
        switch_off_casting()  # also one switched on outside a session (the legacy handle)
        self.current = session
        self._sessions = [ref for ref in self._sessions if ref() is not None]
        if session is not None:
            self._sessions.append(weakref.ref(session))

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


registry = _Registry()
