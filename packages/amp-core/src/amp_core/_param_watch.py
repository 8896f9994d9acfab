"""Which half params were edited in place since the masters were written into them.

A half param that has a float32 master is the master's rounded copy: an in-place edit of the
param (``fill_``, ``copy_``, ``nn.init``, ``param.data = ...``, an edit through ``param.data``)
must reach the master before it is read or stepped
(:meth:`~amp_core._master_weights.MasterWeights.take_model_edits`). :func:`stamp` is what such an
edit changes; :func:`watch` makes an edit through ``param.data``, which moves no version counter
of the param, change it too, by giving the param a subclass of its own class that counts every
access to ``.data``; :func:`unwatch` gives the class back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["Stamp", "stamp", "stamps", "unwatch", "watch"]

Stamp = tuple[int, int, torch.dtype, int]

# How many times a watched param's ``.data`` was taken (in the param's ``__dict__``).
_DATA_TAKEN = "_amp_data_taken"
_get_data = torch._C.TensorBase.data.__get__  # type: ignore[attr-defined]
_set_data = torch._C.TensorBase.data.__set__  # type: ignore[attr-defined]


def stamp(param: Tensor) -> Stamp:
    """What changes when a tensor is written in place, its ``.data`` is replaced or taken
    (``p.data`` is a tensor with a version counter of its own: an edit through it moves no
    counter of the param), and the dtype it had then."""
    return param._version, param.data_ptr(), param.dtype, param.__dict__.get(_DATA_TAKEN, 0)


def stamps(params: Iterable[Tensor]) -> list[Stamp]:
    """:func:`stamp` of each of ``params``, read with tensor subclasses' ``__torch_function__``
    off: a watched param is an instance of a Python subclass, and each attribute read would
    otherwise check for an override first (half the time of the list, which amp O2 takes
    twice a step)."""
    with torch._C.DisableTorchFunctionSubclass():
        return [stamp(p) for p in params]


class _WatchedData:
    """Mixed into the class of a half param that has a master: ``.data`` is counted, so that
    an edit through it (``p.data.fill_(0)``, ``nn.init.normal_(p.data)``, a weight clip
    ``p.data.clamp_(-c, c)``) is seen by
    :meth:`~amp_core._master_weights.MasterWeights.take_model_edits`, which then compares that
    param's values with its master."""

    @property
    def data(self) -> Tensor:
        self.__dict__[_DATA_TAKEN] = self.__dict__.get(_DATA_TAKEN, 0) + 1
        return _get_data(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        self.__dict__[_DATA_TAKEN] = self.__dict__.get(_DATA_TAKEN, 0) + 1
        _set_data(self, value)

    def __repr__(self) -> str:
        watched = type(self)
        self.__class__ = _unwatched_class(watched)
        try:
            return repr(self)
        finally:
            self.__class__ = watched


_watched_classes: dict[type, type] = {}


def watch(param: Tensor) -> None:
    """Count ``param.data`` (an ``nn.Parameter`` of any class; other tensors are left)."""
    cls = type(param)
    if not isinstance(param, torch.nn.Parameter) or issubclass(cls, _WatchedData):
        return
    watched = _watched_classes.get(cls)
    if watched is None:
        # Named as the class it watches: `type(p).__name__` and the repr stay the same.
        watched = type(cls.__name__, (_WatchedData, cls), {"__module__": cls.__module__})
        _watched_classes[cls] = watched
    param.__class__ = watched


def _unwatched_class(cls: type) -> type:
    return next(c for c in cls.__mro__[1:] if not issubclass(c, _WatchedData))


def unwatch(param: Tensor) -> None:
    """Give ``param`` its class back (``amp.close()``)."""
    cls = type(param)
    if issubclass(cls, _WatchedData):
        param.__class__ = _unwatched_class(cls)
        param.__dict__.pop(_DATA_TAKEN, None)
