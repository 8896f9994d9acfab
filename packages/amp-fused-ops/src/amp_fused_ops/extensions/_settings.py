"""Names shared by the loader: extension kinds, environment variables, files, the error type."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

KINDS = ("cpu", "cuda")
"""The extension kinds ``get_extension`` knows."""

CACHE_ENV = "AMP_FUSED_OPS_CACHE"
DISABLE_ENV = "AMP_FUSED_OPS_DISABLE"
PORTABLE_ENV = "AMP_FUSED_OPS_PORTABLE"
LOCK_TIMEOUT_ENV = "AMP_FUSED_OPS_LOCK_TIMEOUT"
ARCH_ENV = "TORCH_CUDA_ARCH_LIST"

DEFAULT_LOCK_TIMEOUT = 1800.0
"""Seconds a process waits for another one's build before it uses the reference path."""

MODULE_NAMES = {"cpu": "amp_fused_ops_cpu", "cuda": "amp_fused_ops_cuda"}
"""The shared library of each kind (its kernels register with the dispatcher on load)."""
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
"""The dispatch key each kind registers its kernels for."""
MARKER = "amp_fused_ops_build.json"  # the build record, written once a build has finished
FAILED = "amp_fused_ops_build_failed.log"  # written when a build failed
LOCK = "amp_fused_ops.lock"  # flock'ed while building (torch's own baton is "lock")
LOCK_INFO = "amp_fused_ops.lock.json"  # who holds the lock, since when, how far it got
# Files a from-scratch rebuild keeps: the lock files are in use by the builder itself.
KEEP_ON_CLEAN = (LOCK, LOCK_INFO)

PACKAGE_DIR = Path(__file__).resolve().parents[1]
PREBUILT_DIR = PACKAGE_DIR / "_prebuilt"


class ExtensionUnavailableError(RuntimeError):
    """Raised by ``build_extension`` when an extension cannot be built or loaded."""


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    """What ``extension_status`` found out about one extension kind.

    Attributes:
        kind: ``"cpu"`` or ``"cuda"``.
        state: ``"prebuilt"`` (shipped in the wheel), ``"built"`` (in the cache),
            ``"not built"`` (will compile on first use) or ``"unavailable"``.
        detail: One line: where the module is, or why it is unavailable.
        path: The compiled module, when there is one.
    """

    kind: str
    state: str
    detail: str
    path: Path | None = None


def check_kind(kind: str) -> None:
    """Raise ``ValueError`` unless ``kind`` is one of :data:`KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"unknown extension kind {kind!r}; expected one of {KINDS}")


def disabled_kinds() -> set[str]:
    """The kinds ``AMP_FUSED_OPS_DISABLE`` switches off (``1``/``all``: every kind)."""
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return set()
    if value in ("1", "true", "yes", "on", "all"):
        return set(KINDS)
    return {part.strip() for part in value.split(",") if part.strip()}


def lock_timeout() -> float:
    """Seconds to wait for another process's build: ``$AMP_FUSED_OPS_LOCK_TIMEOUT``.

    Raises:
        ExtensionUnavailableError: If the variable is not a number of seconds (``0`` or a
            negative value: do not wait at all).
    """
    value = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_LOCK_TIMEOUT
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ExtensionUnavailableError(
            f"{LOCK_TIMEOUT_ENV}={value!r} is not a number of seconds; set it to e.g. 600, "
            f"or unset it for the default ({DEFAULT_LOCK_TIMEOUT:.0f} s)"
        ) from None
