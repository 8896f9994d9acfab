"""What callers use: ``get_extension`` and friends, and the per-process memo behind them.

``get_extension`` resolves a kind once per process (reading the environment, looking at the
cache, maybe building) and remembers the module, or ``None`` with its reason. Every later call
is one dictionary lookup: no environment variable is read and no lock is taken on the path of
an op call. :func:`clear_cache` forgets, so that the next call looks again (after changing
``AMP_FUSED_OPS_*`` variables in a running process, for instance).

Loading an extension registers its kernels with the dispatcher for the rest of the process (a
C++ registration cannot be undone): once a kind is loaded, a later answer of "unavailable"
(``AMP_FUSED_OPS_DISABLE`` set, then :func:`clear_cache`) would be false, so the loaded module
stays the answer and one WARNING line says so and points to
:func:`amp_fused_ops.extensions.use_reference`, which does run the reference in a process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from amp_fused_ops.ops import _registry

from . import _build as build
from . import _cache as cache
from . import _flags as flags
from . import _lock as lock
from . import _lookup as lookup
from . import _prebuilt as prebuilt
from . import _record as record
from ._settings import (
    DISABLE_ENV,
    PACKAGE_DIR,
    PORTABLE_ENV,
    PREBUILT_DIR,
    ExtensionStatus,
    ExtensionUnavailableError,
    check_kind,
    lock_timeout,
)

logger = logging.getLogger(__name__)

# Per-process memo: kind -> module (or None), kind -> reason, and the lines already logged.
_resolved: dict[str, ModuleType | None] = {}
_reasons: dict[str, str] = {}
_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()
# Kind -> the module loaded in this process: its kernels stay registered, so clear_cache()
# keeps it.
_loaded: dict[str, ModuleType] = {}

_STAY_REGISTERED = (
    "but it was loaded earlier in this process and its kernels stay registered with the "
    "dispatcher, so the ops keep running them; use `with "
    "amp_fused_ops.extensions.use_reference():` to run the PyTorch reference path in this "
    f"process, or set {DISABLE_ENV} before the first op"
)


def _still_loaded(reason: str) -> str:
    """``reason`` (its first clause: the fix it gives is moot) and why it does not apply."""
    return f"{reason.split('; ')[0]}, {_STAY_REGISTERED}"


def get_extension(kind: str) -> ModuleType | None:
    """Return the compiled extension ``kind``, building it just in time on first use.

    Never raises for a missing compiler, ninja, a damaged cache or a failed build: it returns
    ``None`` and logs one WARNING line (once per process and reason) saying why and how to
    fix it. The answer is remembered for the process (see :func:`clear_cache`). Once loaded,
    the module stays the answer for the process, since its kernels stay registered: a later
    ``AMP_FUSED_OPS_DISABLE`` cannot unload them, and says so in a WARNING line
    (:func:`amp_fused_ops.extensions.use_reference` runs the reference in a running process).

    Args:
        kind: ``"cpu"`` (C++ CPU kernels) or ``"cuda"`` (CUDA kernels).

    Returns:
        The extension module, whose functions have Apex's ``amp_C`` signatures, or ``None``.

    Raises:
        ValueError: If ``kind`` is not ``"cpu"`` or ``"cuda"`` (a programming error).

    Example:
        >>> ext = get_extension("cpu")
        >>> if ext is not None:
        ...     ext.multi_tensor_scale(2048 * 32, flag, [ins, outs], 0.5)
    """
    try:
        return _resolved[kind]
    except KeyError:
        return _resolve(kind)


def _resolve(kind: str) -> ModuleType | None:
    check_kind(kind)
    with _lock:
        if kind in _resolved:  # another thread resolved it while this one waited
            return _resolved[kind]
        module = None
        reason = lookup.static_reason(kind)
        if reason is None:
            try:
                module = lookup.load_or_build(kind, cache.build_directory(kind), force=False)
            except ExtensionUnavailableError as error:
                reason = str(error)
            except Exception as error:  # never let the loader crash the caller
                reason = f"unexpected error while loading it: {type(error).__name__}: {error}"
        if module is None and kind in _loaded:
            assert reason is not None  # every path that gets here set it
            if (kind, reason) not in _logged:
                _logged.add((kind, reason))
                logger.warning(
                    "amp_fused_ops %s extension: %s", kind.upper(), _still_loaded(reason)
                )
            module = _loaded[kind]
        if module is not None:
            _loaded[kind] = module
        else:
            assert reason is not None  # every path that gets here set it
            _reasons[kind] = reason
            if (kind, reason) not in _logged:
                _logged.add((kind, reason))
                logger.warning(
                    "amp_fused_ops %s extension unavailable, using the PyTorch reference path: %s",
                    kind.upper(),
                    reason,
                )
        _resolved[kind] = module
        return module


def unavailable_reason(kind: str) -> str | None:
    """Why ``get_extension(kind)`` returns (or would return) ``None``, without building.

    Args:
        kind: ``"cpu"`` or ``"cuda"``.

    Returns:
        The reason with its fix, or ``None`` when the extension is loaded, prebuilt, cached,
        or can be compiled on this machine.

    Raises:
        ValueError: If ``kind`` is not ``"cpu"`` or ``"cuda"``.
    """
    check_kind(kind)
    if kind in _resolved:
        return _reasons.get(kind) if _resolved[kind] is None else None
    status = extension_status(kind)
    return status.detail if status.state == "unavailable" else None


def build_extension(kind: str, *, force: bool = False, build_dir: Path | None = None) -> Path:
    """Build extension ``kind`` now (used by ``python -m amp_fused_ops build`` and the hook).

    Args:
        kind: ``"cpu"`` or ``"cuda"`` (needs ``TORCH_CUDA_ARCH_LIST`` where no GPU is visible).
        force: Compile again from scratch, even when the cache holds a build or a failed
            attempt.
        build_dir: Folder to build in; defaults to :func:`build_directory`.

    Returns:
        The path of the compiled module.

    Raises:
        ValueError: If ``kind`` is unknown.
        ExtensionUnavailableError: If the extension is disabled, cannot be built here (no
            compiler, an unwritable cache, another build holding the lock too long), or the
            build failed (the message names the log file).
    """
    check_kind(kind)
    reason = lookup.static_reason(kind)
    if reason is not None:
        raise ExtensionUnavailableError(reason)
    target = build_dir if build_dir is not None else cache.build_directory(kind)
    with _lock:
        module = lookup.load_or_build(kind, target, force=force, allow_prebuilt=False)
        _loaded[kind] = module
        if build_dir is None:
            _resolved[kind] = module
            _reasons.pop(kind, None)
    return Path(str(module.__file__))


def build_for_wheel(kind: str, out_dir: Path, *, isas: Sequence[str] | None = None) -> list[Path]:
    """Compile the portable modules of ``kind`` that a wheel ships, and write them into ``out_dir``.

    For this torch: ``cpu``, one module per instruction set of ``isas`` (default
    :data:`~amp_fused_ops.extensions._flags.WHEEL_CPU_ISAS` on x86-64, elsewhere the
    baseline); ``cuda``, one for ``TORCH_CUDA_ARCH_LIST``. Each is compiled (or taken from
    the cache, where a verified build of the same sources, flags and torch is) by a child
    process, since two modules of one kind cannot be loaded into one process; then copied
    under its wheel name with its note (:mod:`~amp_fused_ops.extensions._prebuilt`).
    ``python -m amp_fused_ops build KIND --wheel-dir DIR [--isa ISA ...]`` and the wheel's
    build hook call this.

    Returns:
        The modules written.

    Raises:
        ValueError: If ``kind`` is unknown, or ``isas`` names an unknown instruction set or is
            given for the CUDA kind.
        ExtensionUnavailableError: If a module cannot be built (with the child's output).
    """
    check_kind(kind)
    if isas is not None:
        unknown = [isa for isa in isas if isa not in flags.CPU_ISAS]
        if kind != "cpu" or unknown or not isas:
            raise ValueError(
                f"instruction sets {list(isas)} for the {kind} kind: name some of "
                f"{flags.CPU_ISAS}, for the cpu kind only"
            )
    variants = (tuple(isas) if isas else flags.wheel_isas()) if kind == "cpu" else ("1",)
    written = []
    for variant in variants:
        if kind == "cpu" and variant not in flags.host_isas():
            written.append(_build_for_another_cpu(variant, out_dir))
            continue
        env = dict(os.environ)
        env[PORTABLE_ENV] = variant
        # The child imports this package from where this process did (a checkout's src/ too).
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PACKAGE_DIR.parent), env.get("PYTHONPATH", "")) if p
        )
        command = [sys.executable, "-m", "amp_fused_ops", "build", kind]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ExtensionUnavailableError(
                f"the portable {kind} module ({PORTABLE_ENV}={variant}) did not build: "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        with build.environment(**{PORTABLE_ENV: variant}):
            build_dir = cache.build_directory(kind)
        isa = variant if kind == "cpu" else None
        written.append(prebuilt.stage(kind, build_dir, out_dir, isa=isa))
        logger.info("portable %s module (%s) for the wheel: %s", kind, variant, written[-1])
    return written


def _build_for_another_cpu(isa: str, out_dir: Path) -> Path:
    """The portable CPU module of ``isa``, an instruction set this CPU does not run, staged in
    ``out_dir``: compiled here without being loaded (or taken from the cache's finished build)."""
    with build.environment(**{PORTABLE_ENV: isa}):
        build_dir = cache.build_directory("cpu")
        reason = lookup.missing_tools_reason("cpu") or cache.unwritable_reason(
            build_dir, create=True
        )
        if reason is not None:
            raise ExtensionUnavailableError(reason)
        with lock.build_lock(build_dir, "cpu", timeout=lock_timeout()):
            try:
                finished = record.verified_module(build_dir)
            except record.DamagedBuildError:
                finished = None
            if finished is None:
                build.compile_without_loading(build_dir)
    written = prebuilt.stage("cpu", build_dir, out_dir, isa=isa)
    logger.info("portable cpu module (%s, not loaded on this CPU) for the wheel: %s", isa, written)
    return written


def extension_status(kind: str) -> ExtensionStatus:
    """Say whether extension ``kind`` is prebuilt, built, buildable or unavailable.

    Loads nothing and builds nothing; cheap enough for ``python -m amp_fused_ops info``.

    Args:
        kind: ``"cpu"`` or ``"cuda"``.

    Returns:
        The :class:`ExtensionStatus` of ``kind``.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    check_kind(kind)
    status = lookup.extension_status(kind)
    loaded = _loaded.get(kind)
    if loaded is None or status.state != "unavailable":
        return status
    # Loaded in this process before it became unavailable (AMP_FUSED_OPS_DISABLE set since):
    # its kernels still run here.
    path = Path(str(loaded.__file__))
    state = "prebuilt" if path.parent == PREBUILT_DIR else "built"
    return ExtensionStatus(kind, state, f"{path}: {_still_loaded(status.detail)}", path)


def build_directory(kind: str) -> Path:
    """The cache folder of extension ``kind`` (see :func:`cache.build_directory`)."""
    return cache.build_directory(kind)


def clear_cache() -> None:
    """Forget the modules, reasons and logged lines of this process.

    Compiled modules stay loaded by Python, and their kernels registered with the dispatcher:
    the next :func:`get_extension` looks again and reads the environment again, but a kind
    loaded earlier stays the answer (a WARNING line says why). To run the PyTorch reference
    path after an extension was loaded, use :func:`amp_fused_ops.extensions.use_reference`.
    """
    with _lock:
        _resolved.clear()
        _reasons.clear()
        _logged.clear()
        cache.forget()


# A dispatcher op called without amp_C (from a compiled graph) loads the extension itself.
_registry.set_kernel_loader(get_extension)
