"""The warning every legacy entry point emits: Apex's ``DeprecatedFeatureWarning``."""

from __future__ import annotations

import warnings

import torch

__all__ = ["DeprecatedFeatureWarning", "warn_deprecated"]


class DeprecatedFeatureWarning(FutureWarning):
    """Emitted by the deprecated legacy API, as ``apex.DeprecatedFeatureWarning`` was.

    A :class:`FutureWarning`, so filters on either class apply. Filter it to silence the
    legacy API's warnings alone::

        warnings.filterwarnings("ignore", category=DeprecatedFeatureWarning)
    """


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def warn_deprecated(name: str, replacement: str, *, stacklevel: int = 3) -> None:
    """Warn that ``name`` is deprecated and say what replaces it in amp-core.

    Under ``torch.distributed`` only rank 0 warns, as in Apex.

    Args:
        name: The legacy entry point, as the user wrote it (``"FP16_Optimizer"``).
        replacement: The amp-core (or PyTorch) call to use instead.
        stacklevel: Frames between the user's call and this function (3: the user's line when
            called from the entry point itself).
    """
    if not _is_rank_zero():
        return
    warnings.warn(
        f"amp_legacy_fp16.{name} is deprecated (Apex removed it); use {replacement} instead.",
        DeprecatedFeatureWarning,
        stacklevel=stacklevel,
    )
