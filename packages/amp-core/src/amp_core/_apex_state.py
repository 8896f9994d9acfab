"""``amp._amp_state``: a compatibility view of Apex's module-level state object.

Apex kept its state in one global object, ``apex.amp._amp_state``, and scripts read it
directly: NVIDIA's BERT and other pretraining scripts log or set
``_amp_state.loss_scalers[0]._loss_scale`` and branch on
``_amp_state.opt_properties.master_weights``; libraries test
``hasattr(_amp_state, "opt_properties")`` to learn whether amp is on; Apex's own tests call
``_amp_state.handle._deactivate()`` and set ``_amp_state.allow_incoming_model_not_fp32``.

amp-core keeps no such object (its state lives on the objects ``amp.initialize`` returned,
and the latest call is ``registry.current``). :data:`apex_state` answers those reads from the
latest ``amp.initialize`` call at the moment they are made. It is a view, not a store:

* ``loss_scalers``: one :class:`ApexScalerView` per loss of the latest call (``[]`` before
  the first call or after ``amp.close()``); ``loss_scale()``, ``_loss_scale``, ``dynamic``,
  ``_unskipped``, ``_min_loss_scale``, ``_max_loss_scale``, ``_scale_seq_len`` read the real
  scaler. Setting ``_loss_scale`` sets the real scale (as the scripts that set it expect);
  every other attribute is read-only.
* ``opt_properties``: the latest call's :class:`~amp_core.Properties`; missing (``hasattr`` is
  false) when no call is current, as in Apex before ``amp.initialize``.
* ``handle``: ``_deactivate()`` switches the O1 casting off (what Apex's tests call it for),
  ``is_active()`` says whether it is on.
* ``verbosity``, ``min_loss_scale``, ``max_loss_scale``: the latest call's values.
* ``allow_incoming_model_not_fp32`` and ``hard_override`` may be set (Apex's tests do).
  ``amp.initialize`` accepts a model with half params either way (Apex refused one unless
  ``allow_incoming_model_not_fp32``); the flag declares them intended and silences the warning
  about them (docs/opt_levels.rst, "Models that arrive in half precision").
  ``hard_override`` changes nothing: amp_core raises on every real error.

Anything else raises ``AttributeError`` that names what to use instead.
"""

from __future__ import annotations

from typing import Any

from ._opt_levels import Properties
from ._scaler import LossScaler
from ._state import AmpSession, registry

__all__ = ["ApexScalerView", "ApexStateView", "apex_state"]

_USE_INSTEAD = (
    "amp_core keeps its state on the objects amp.initialize returned: use amp.state_dict(), "
    "amp.master_params(optimizer) and the options you passed to amp.initialize"
)


class ApexScalerView:
    """One loss scaler as Apex's ``_amp_state.loss_scalers[i]`` showed it."""

    __slots__ = ("_scaler",)

    def __init__(self, scaler: LossScaler) -> None:
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        """The current scale (a host sync for a dynamic scale, as in Apex)."""
        return self._scaler.loss_scale()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _unskipped(self) -> int:
        return self._scaler.unskipped()

    @property
    def _min_loss_scale(self) -> float | None:
        return self._scaler.min_loss_scale

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.scale_window

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "_loss_scale":
            raise AttributeError(
                f"_amp_state.loss_scalers[i].{name} is read-only in amp_core (only _loss_scale "
                "can be set); the scaler follows the loss_scale options of amp.initialize"
            )
        scaler = self._scaler
        scale, unskipped = scaler.check_state_dict(
            {"loss_scale": value, "unskipped": scaler.unskipped()}, "_amp_state.loss_scalers[i]"
        )
        scaler.load_checked(scale, unskipped)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"_amp_state.loss_scalers[i] has no attribute {name!r} in amp_core: amp.scale_loss "
            "and optimizer.step() unscale, check and update the scale; read it with "
            "loss_scale() or amp.state_dict()"
        )

    def __repr__(self) -> str:
        return f"ApexScalerView({self._scaler!r})"


class _HandleView:
    """Apex's ``_amp_state.handle``: the O1 casting switch."""

    def _deactivate(self) -> None:
        registry.switch_off_casting()

    def is_active(self) -> bool:
        return registry.casting is not None


class ApexStateView:
    """Apex's ``apex.amp._amp_state``, answered from the latest ``amp.initialize`` call."""

    _SETTABLE = frozenset({"allow_incoming_model_not_fp32", "hard_override"})

    def __init__(self) -> None:
        object.__setattr__(self, "_flags", {name: False for name in self._SETTABLE})

    @staticmethod
    def _session() -> AmpSession | None:
        return registry.current

    @property
    def loss_scalers(self) -> list[ApexScalerView]:
        session = self._session()
        return [] if session is None else [ApexScalerView(s) for s in session.scalers]

    @property
    def opt_properties(self) -> Properties:
        session = self._session()
        if session is None:
            raise AttributeError(
                "_amp_state.opt_properties exists once amp.initialize has been called (and "
                "until amp.close())"
            )
        return session.props

    @property
    def verbosity(self) -> int:
        session = self._session()
        return 1 if session is None else session.verbosity

    @property
    def min_loss_scale(self) -> float | None:
        return self.opt_properties.min_loss_scale

    @property
    def max_loss_scale(self) -> float:
        return self.opt_properties.max_loss_scale

    @property
    def handle(self) -> _HandleView:
        return _HandleView()

    def __getattr__(self, name: str) -> Any:
        flags = object.__getattribute__(self, "_flags")
        if name in flags:
            return flags[name]
        raise AttributeError(f"_amp_state has no attribute {name!r} in amp_core; {_USE_INSTEAD}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._SETTABLE:
            raise AttributeError(
                f"_amp_state.{name} cannot be set in amp_core (a read-only view of the latest "
                f"amp.initialize call); {_USE_INSTEAD}"
            )
        self._flags[name] = bool(value)

    def __repr__(self) -> str:
        session = self._session()
        where = "no amp.initialize call" if session is None else session.props.opt_level.value
        return f"<amp_core _amp_state view: {where}>"


apex_state = ApexStateView()
"""The view ``amp._amp_state`` (and, under ``apex_run``, ``apex.amp._amp_state``) returns."""
