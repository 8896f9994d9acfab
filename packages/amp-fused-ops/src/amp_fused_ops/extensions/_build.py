"""Compiling an extension with ``torch.utils.cpp_extension`` and ninja, always from scratch.

The caller holds the build lock. Everything in the build folder but the lock files is removed
first, so ninja never takes a truncated module or object for up to date, and torch's own lock
file (``lock``) cannot be left over from a killed build.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from amp_fused_ops.ops import _apex_convention
from amp_fused_ops.ops._registry import OPS_NAMESPACE

from . import _cache as cache
from . import _flags as flags
from . import _progress as progress
from . import _record as record
from . import _toolkit as toolkit
from ._settings import (
    ARCH_ENV,
    DISPATCH_KEYS,
    FAILED,
    KEEP_ON_CLEAN,
    LOCK_INFO,
    MARKER,
    MODULE_NAMES,
    ExtensionUnavailableError,
)

logger = logging.getLogger(__name__)


def failed_reason(kind: str, log: Path) -> str:
    """The message for a build that failed earlier: where the compiler output is, what next."""
    return (
        f"the {kind.upper()} extension failed to compile, compiler output in {log}; fix the "
        "error (or report it), then run `python -m amp_fused_ops build` to retry"
    )


def clean(build_dir: Path) -> None:
    """Remove everything in ``build_dir`` but the lock files (a build starts from scratch)."""
    for entry in build_dir.iterdir():
        if entry.name in KEEP_ON_CLEAN or entry.name.startswith(LOCK_INFO):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def compile_extension(kind: str, build_dir: Path) -> ModuleType:
    """Compile ``kind`` into ``build_dir`` from scratch, load it and write its build record.

    Raises:
        ExtensionUnavailableError: If the build failed (the compiler output is in a log file).
        OSError: If the build folder cannot be cleaned or written.
    """
    module = _compile(kind, build_dir, load=True)
    assert module is not None
    return module


def compile_without_loading(build_dir: Path) -> Path:
    """Compile the CPU extension into ``build_dir`` from scratch and write its build record,
    without loading it: a portable module for an instruction set this CPU does not run (a wheel
    built on a machine without AVX-512 still ships the AVX-512 module; loading it here would stop
    the process with an illegal instruction).

    Returns:
        The compiled module's path.

    Raises:
        ExtensionUnavailableError: If the build failed (the compiler output is in a log file).
        OSError: If the build folder cannot be cleaned or written.
    """
    _compile("cpu", build_dir, load=False)
    return build_dir / f"{MODULE_NAMES['cpu']}.so"


def _compile(kind: str, build_dir: Path, *, load: bool) -> ModuleType | None:
    """Compile ``kind`` into ``build_dir``; load it unless ``load`` is false (CPU only)."""
    from torch.utils import cpp_extension

    rebuild = (build_dir / MARKER).exists()
    clean(build_dir)
    sources = [str(path) for path in cache.compiled_sources(kind)]
    units = len(sources)
    estimate = progress.estimate_seconds(kind, units)
    logger.warning(
        "compiling amp_fused_ops %s extension (%s, %s) into %s",
        kind.upper(),
        "rebuilding from scratch" if rebuild else "first use on this machine",
        progress.describe_estimate(kind, units),
        build_dir,
    )
    _forget_torch_build(cpp_extension, MODULE_NAMES[kind])
    cores = progress.usable_cores()
    start = time.perf_counter()
    try:
        with progress.BuildProgress(kind, build_dir, units + 1, estimate):
            module = None
            if kind == "cuda":
                module = _load_cuda(cpp_extension, sources, build_dir)
            elif not load:
                _compile_cpu_only(cpp_extension, sources, build_dir)
            else:
                module = _as_module(
                    kind,
                    cpp_extension.load(
                        name=MODULE_NAMES[kind],
                        sources=sources,
                        extra_cflags=list(flags.extra_cflags()),
                        extra_ldflags=list(flags.extra_ldflags()),
                        build_directory=str(build_dir),
                        is_python_module=False,
                        verbose=False,
                    ),
                )
    except Exception as error:
        log = build_dir / FAILED
        log.write_text(f"{type(error).__name__}: {error}\n")
        raise ExtensionUnavailableError(failed_reason(kind, log)) from error
    seconds = time.perf_counter() - start
    path = build_dir / f"{MODULE_NAMES[kind]}.so" if module is None else Path(str(module.__file__))
    meta: dict[str, Any] = {"torch": torch.__version__, "python": record.python_tag()}
    if kind == "cuda":
        meta["arch"] = str(toolkit.cuda_arch_list())
    else:
        meta["isa"] = flags.portable_isa() or "host"
    # What the next estimate on this machine learns from.
    meta.update(
        seconds=round(seconds, 1),
        units=units,
        jobs=progress.parallel_jobs(units, cores),
        load=round(progress.load_factor(cores), 2),
    )
    record.write_record(build_dir, path, meta)
    logger.info("compiled amp_fused_ops %s extension in %.1f s: %s", kind.upper(), seconds, path)
    return module


def _compile_cpu_only(cpp_extension: Any, sources: list[str], build_dir: Path) -> None:
    """What ``cpp_extension.load`` does for the CPU extension, short of loading the module.

    torch has no public call for this; its helper (in every release from 2.11 on) is checked
    for, so a torch without it fails with a message rather than an ``AttributeError``.
    """
    helper = getattr(cpp_extension, "_write_ninja_file_and_build_library", None)
    if helper is None:
        raise ExtensionUnavailableError(
            f"torch {torch.__version__} cannot compile an extension without loading it; build "
            "the wheel on a CPU that runs every instruction set it ships"
        )
    helper(
        name=MODULE_NAMES["cpu"],
        sources=sources,
        extra_cflags=list(flags.extra_cflags()),
        extra_cuda_cflags=None,
        extra_sycl_cflags=None,
        extra_ldflags=list(flags.extra_ldflags()),
        extra_include_paths=None,
        build_directory=str(build_dir),
        verbose=False,
        with_cuda=False,
        with_sycl=False,
    )


def _forget_torch_build(cpp_extension: Any, name: str) -> None:
    """Make torch build ``name`` again in this process (its versioner skips known builds)."""
    entries = getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", None)
    if isinstance(entries, dict):
        entries.pop(name, None)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _load_cuda(cpp_extension: Any, sources: list[str], build_dir: Path) -> ModuleType:
    """Compile every CUDA/C++ source into ``amp_fused_ops_cuda`` with the toolkit found here.

    The arch list and toolkit are pinned for the build (they are part of the cache key), and
    torch's own guess of the toolkit (made at import, from ``PATH``) is replaced by
    :func:`toolkit.cuda_home`, which skips wrapper scripts.
    """
    home = toolkit.cuda_home()
    arch_list = toolkit.cuda_arch_list()
    assert home is not None and arch_list is not None  # checked by missing_cuda_reason
    previous_home = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = str(home)
    try:
        after = toolkit.after_toolkit_flags(toolkit.extra_cuda_include_paths(home))
        with environment(CUDA_HOME=str(home), **{ARCH_ENV: arch_list}):
            loaded = cpp_extension.load(
                name=MODULE_NAMES["cuda"],
                sources=sources,
                extra_cflags=[*flags.CUDA_CFLAGS, *after],
                extra_cuda_cflags=[*flags.CUDA_NVCC_FLAGS, *after],
                extra_ldflags=list(flags.extra_ldflags()),
                build_directory=str(build_dir),
                with_cuda=True,
                is_python_module=False,
                verbose=False,
            )
    finally:
        cpp_extension.CUDA_HOME = previous_home
    return _as_module("cuda", loaded)


def _as_module(kind: str, loaded: Any) -> ModuleType:
    """The module of ops of what ``cpp_extension.load`` returned.

    The extensions are libraries of dispatcher ops, not Python modules: ``load`` (with
    ``is_python_module=False``) loads the library, which registers its kernels, and returns
    its path. A module passed in is returned as it is.
    """
    if isinstance(loaded, ModuleType):
        return loaded
    return ops_module(kind, Path(str(loaded)))


def ops_module(kind: str, path: Path) -> ModuleType:
    """The module of the ops extension ``kind`` (loaded from ``path``) registered."""
    return _apex_convention.compiled_ops(OPS_NAMESPACE, DISPATCH_KEYS[kind], path)
