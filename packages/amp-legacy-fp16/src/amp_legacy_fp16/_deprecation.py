"""One helper for the ``FutureWarning`` every legacy entry point emits."""

from __future__ import annotations

import warnings

__all__ = ["warn_deprecated"]


def warn_deprecated(name: str, replacement: str, *, stacklevel: int = 3) -> None:
    """Warn that ``name`` is deprecated and say what replaces it in amp-core.

    Args:
        name: The legacy entry point, as the user wrote it (``"FP16_Optimizer"``).
        replacement: The amp-core (or PyTorch) call to use instead.
        stacklevel: Frames between the user's call and this function (3: the user's line when
            called from the entry point itself).
    """
    warnings.warn(
        f"amp_legacy_fp16.{name} is deprecated (Apex removed it); use {replacement} instead.",
        FutureWarning,
        stacklevel=stacklevel,
    )
