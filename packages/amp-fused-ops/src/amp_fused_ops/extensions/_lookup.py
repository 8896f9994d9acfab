"""Which module to load: a prebuilt one, a verified cached build, or a fresh build."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from . import _build as build
from . import _cache as cache
from . import _lock as lock
from . import _prebuilt as prebuilt
from . import _progress as progress
from . import _record as record
from . import _toolkit as toolkit
from ._record import DamagedBuildError
from ._settings import (
    DISABLE_ENV,
    FAILED,
    MODULE_NAMES,
    PACKAGE_DIR,
    ExtensionStatus,
    ExtensionUnavailableError,
    disabled_kinds,
    lock_timeout,
)

logger = logging.getLogger(__name__)


def static_reason(kind: str) -> str | None:
    """Reasons that hold whatever is on disk: disabled by the user, or a CPU build of torch."""
    if kind in disabled_kinds():
        value = os.environ.get(DISABLE_ENV)
        return f"disabled by {DISABLE_ENV}={value}; unset it to use the compiled kernels"
    if kind == "cuda" and not torch.version.cuda:
        return (
            f"torch {torch.__version__} is a CPU build (torch.version.cuda is None); install a "
            "CUDA build of torch to use the CUDA kernels"
        )
    return None


def import_compiled(path: Path) -> ModuleType:
    """Load a compiled extension by path; return the module of its ops.

    The library registers its kernels with the PyTorch dispatcher when it is loaded
    (``torch.ops.load_library``); the kind is the file's stem (``amp_fused_ops_cpu`` ...).

    Raises:
        ImportError: If the file is not one of the extensions, or cannot be loaded.
    """
    stem = path.name.split(".")[0]
    kinds = [kind for kind, name in MODULE_NAMES.items() if name == stem]
    if not kinds:
        raise ImportError(f"cannot load {path}: not an amp_fused_ops extension")
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        raise ImportError(f"cannot load {path}: {error}") from error
    return build.ops_module(kinds[0], path)


def import_or_explain(path: Path) -> ModuleType:
    """:func:`import_compiled`, with the fix in the error when it fails."""
    try:
        return import_compiled(path)
    except ImportError as error:
        raise ExtensionUnavailableError(
            f"the compiled module {path} cannot be imported ({error}); delete {path.parent} "
            "and run `python -m amp_fused_ops build`"
        ) from error


def prebuilt_module_path(kind: str) -> Path | None:
    """The module of the wheel built for this torch, Python and CPU (or GPU), if it ships one.

    Raises:
        DamagedBuildError: If a note is unreadable or the chosen module does not match it.
    """
    path = prebuilt.select(kind)
    if path is None and logger.isEnabledFor(logging.DEBUG):  # the reason reads the notes again
        reason = prebuilt.mismatch_reason(kind)
        if reason is not None:
            logger.debug("no prebuilt %s module: %s", kind, reason)
    return path


def missing_tools_reason(kind: str) -> str | None:
    """Why ``kind`` cannot be compiled on this machine (sources, compiler, ninja), or None."""
    if not cache.compiled_sources(kind):
        return (
            f"the C++ sources (csrc/{kind}) are not shipped with this installation "
            f"(looked next to {PACKAGE_DIR}); reinstall amp-fused-ops from its wheel or sdist"
        )
    if kind == "cuda":
        missing = toolkit.missing_cuda_reason()
        if missing is not None:
            return missing
    if toolkit.compiler_path() is None:
        compiler = toolkit.compiler_command()[0]
        return (
            f"no C++ compiler found ({compiler!r} is not on PATH); install one "
            "(e.g. `apt install g++`) or set CXX, then run `python -m amp_fused_ops build`"
        )
    if toolkit.ninja_path() is None:
        return (
            "ninja is not installed; run `pip install ninja` (or install "
            '"amp-fused-ops[compile]"), then `python -m amp_fused_ops build`'
        )
    return None


def load_or_build(
    kind: str, build_dir: Path, *, force: bool, allow_prebuilt: bool = True
) -> ModuleType:
    """Load ``kind``: prebuilt, else a verified build in ``build_dir``, else compile it there.

    Args:
        kind: The extension kind.
        build_dir: Its build folder.
        force: Compile from scratch whatever the folder holds (``build --force``).
        allow_prebuilt: Consider the module shipped in the wheel.

    Raises:
        ExtensionUnavailableError: With the reason and its fix, when nothing can be loaded.
    """
    if allow_prebuilt and not force:
        try:
            shipped = prebuilt_module_path(kind)
        except DamagedBuildError as error:
            shipped = None
            logger.warning("%s; ignoring it", error)
        else:
            if shipped is not None:
                try:
                    return import_or_explain(shipped)
                except ExtensionUnavailableError as error:
                    logger.warning("%s; using the cache or a just-in-time build instead", error)
    damaged = None
    if not force:
        try:
            cached = record.verified_module(build_dir)
        except DamagedBuildError as error:
            damaged = str(error)
        else:
            if cached is not None:
                return import_or_explain(cached)
    missing = missing_tools_reason(kind) or cache.unwritable_reason(build_dir, create=True)
    if missing is not None:
        raise ExtensionUnavailableError(
            missing if damaged is None else f"{damaged}; it cannot be compiled again: {missing}"
        )
    if damaged is not None:
        logger.warning("%s; compiling it again from scratch", damaged)
    try:
        with lock.build_lock(build_dir, kind, timeout=lock_timeout()):
            if not force:
                # Another process may have finished (or failed) the build while this one waited.
                try:
                    cached = record.verified_module(build_dir)
                except DamagedBuildError:
                    cached = None  # still damaged: rebuild
                if cached is not None:
                    return import_or_explain(cached)
                failed = build_dir / FAILED
                if failed.exists():
                    raise ExtensionUnavailableError(build.failed_reason(kind, failed))
            return build.compile_extension(kind, build_dir)
    except OSError as error:
        raise ExtensionUnavailableError(cache.cache_unwritable_message(build_dir, error)) from error


def extension_status(kind: str) -> ExtensionStatus:
    """Say whether extension ``kind`` is prebuilt, built, buildable or unavailable.

    Loads nothing and builds nothing; cheap enough for ``python -m amp_fused_ops info``.
    """
    reason = static_reason(kind)
    if reason is not None:
        return ExtensionStatus(kind, "unavailable", reason)
    try:
        shipped = prebuilt_module_path(kind)
    except DamagedBuildError:
        shipped = None  # the cache is used instead
    if shipped is not None:
        return ExtensionStatus(kind, "prebuilt", f"shipped in the wheel: {shipped}", shipped)
    not_shipped = prebuilt.mismatch_reason(kind)
    why = "" if not_shipped is None else f"; {not_shipped}"
    build_dir = cache.build_directory(kind)
    damaged = None
    try:
        cached = record.verified_module(build_dir)
    except DamagedBuildError as error:
        damaged, cached = str(error), None
    if cached is not None:
        return ExtensionStatus(kind, "built", f"cached: {cached}{why}", cached)
    failed = build_dir / FAILED
    if damaged is None and failed.exists():
        return ExtensionStatus(kind, "unavailable", build.failed_reason(kind, failed))
    missing = missing_tools_reason(kind) or cache.unwritable_reason(build_dir, create=False)
    if missing is not None:
        prefix = "" if damaged is None else f"{damaged}; it cannot be compiled again: "
        return ExtensionStatus(kind, "unavailable", prefix + missing + why)
    estimate = progress.describe_estimate(kind, len(cache.compiled_sources(kind)))
    if damaged is not None:
        detail = (
            f"{damaged}; compiled again on first use ({estimate}), or now by "
            "`python -m amp_fused_ops build --force`"
        )
        return ExtensionStatus(kind, "not built", detail)
    return ExtensionStatus(
        kind, "not built", f"compiles on first use ({estimate}) in {build_dir}{why}"
    )
