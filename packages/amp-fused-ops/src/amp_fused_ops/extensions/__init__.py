"""The compiled extensions of amp-fused-ops: load them, check them, say why one is missing.

Two kinds exist, ``"cpu"`` (the C++ kernels) and ``"cuda"`` (the CUDA kernels). The ops of
:data:`amp_fused_ops.amp_C` and the fused norms use them on their own; these functions are for
tools, benchmarks and checks that need to know which path runs::

    from amp_fused_ops import extensions

    module = extensions.get_extension("cpu")   # None: the PyTorch reference path runs
    why = extensions.unavailable_reason("cpu") if module is None else None
    status = extensions.extension_status("cuda")  # what `python -m amp_fused_ops info` shows

``AMP_FUSED_OPS_DISABLE=1`` (or a comma-separated list of kinds, :data:`DISABLE_ENV`) makes
the extensions unavailable on purpose; :func:`clear_cache` makes the next
:func:`get_extension` decide again.
"""

from __future__ import annotations

from ._loader import (
    DISABLE_ENV,
    KINDS,
    ExtensionStatus,
    build_extension,
    clear_cache,
    extension_status,
    get_extension,
    unavailable_reason,
)

__all__ = [
    "KINDS",
    "DISABLE_ENV",
    "get_extension",
    "unavailable_reason",
    "extension_status",
    "ExtensionStatus",
    "build_extension",
    "clear_cache",
]
