"""The one module-level registry: the current ``amp.initialize`` call.

Everything a training step needs is on the objects the user holds (``optimizer._amp_state``
points at its :class:`AmpSession`, which owns the loss scalers). The registry exists only for
Apex's module-level functions that take no optimizer: ``amp.state_dict()``,
``amp.load_state_dict()`` and, before the first ``initialize``, the error of ``scale_loss``.

Lifecycle: ``amp.initialize`` makes a new session current and switches off the O1 casting of the
previous one; objects returned by an earlier call keep working with their own session.
"""

from __future__ import annotations

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

    def replace(self, session: AmpSession | None) -> None:
        if self.current is not None:
            self.current.close()
        switch_off_casting()  # also one switched on outside a session (the legacy handle)
        self.current = session


registry = _Registry()
