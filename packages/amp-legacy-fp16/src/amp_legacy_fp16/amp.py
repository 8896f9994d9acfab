"""Apex's pre-1.0 Amp API: ``from amp_legacy_fp16 import amp`` then ``handle = amp.init()``.

Groups:
    * setup: :func:`init` and the handles it returns
    * O1 registrations (shared with ``amp_core.amp``): :func:`register_half_function`,
      :func:`register_float_function`, :func:`register_promote_function`,
      :func:`half_function`, :func:`float_function`, :func:`promote_function`
"""

from __future__ import annotations

from amp_core.amp import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

from ._amp_handle import AmpHandle, NoOpHandle, OptimWrapper, init

__all__ = [
    # setup
    "init",
    "AmpHandle",
    "NoOpHandle",
    "OptimWrapper",
    # O1 registrations (amp-core's)
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
]
