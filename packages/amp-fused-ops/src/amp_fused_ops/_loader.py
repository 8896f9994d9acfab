"""Find, build (just in time) and load the compiled extensions of ``amp_fused_ops``.

Two kinds exist: ``"cpu"`` (C++ kernels in ``csrc/cpu``) and ``"cuda"`` (CUDA kernels: every
``.cu`` and ``.cpp`` file of ``csrc/cuda`` compiled into one module, ``amp_fused_ops_cuda``).
``get_extension(kind)`` returns the extension, in this order of preference:

1. a prebuilt module shipped in the wheel (``_prebuilt/``, made by ``hatch_build.py`` when
   ``AMP_FUSED_OPS_BUILD_EXT=1``), if it was built for this torch and Python;
2. a module already compiled into the cache (``$AMP_FUSED_OPS_CACHE`` or
   ``~/.cache/amp_fused_ops``), in a folder keyed by torch version, CUDA version (or
   ``cpu``), the GPU architectures (CUDA kind: ``TORCH_CUDA_ARCH_LIST``, else the current
   device's compute capability), Python version, machine and a hash of the sources and flags;
3. a fresh just-in-time build into that folder with ``torch.utils.cpp_extension`` and ninja,
   under a file lock so that when many ranks start at once one compiles and the others wait.

When none of these works it returns ``None`` and logs one WARNING line that says why and how
to fix it; callers then use the PyTorch reference path. The CUDA kind needs a CUDA build of
torch, ``nvcc`` of the same CUDA major version (``$CUDA_HOME``, else found on ``PATH`` or in
``/usr/local/cuda``), ninja, and a GPU or ``TORCH_CUDA_ARCH_LIST`` (which lets a machine
without a GPU build it, e.g. for a compile check). ``AMP_FUSED_OPS_DISABLE=1`` (or a
comma-separated list of kinds, e.g. ``cpu``) makes the extensions unavailable on purpose.

This module imports nothing from the rest of the package (``hatch_build.py`` loads it by
path to build the prebuilt module) and imports ``torch.utils.cpp_extension`` only to build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

KINDS = ("cpu", "cuda")
"""The extension kinds ``get_extension`` knows."""

CACHE_ENV = "AMP_FUSED_OPS_CACHE"
DISABLE_ENV = "AMP_FUSED_OPS_DISABLE"

_MODULE_NAMES = {"cpu": "amp_fused_ops_cpu", "cuda": "amp_fused_ops_cuda"}
# -fno-math-errno lets sqrt vectorize (the kernels never read errno). No -march=native: the
# AVX2 flags are added only where torch reports AVX2 on this host (the cache key includes the
# flags), and never for a wheel built ahead of time (PORTABLE_ENV, set by hatch_build.py).
_BASE_CFLAGS = ("-O3", "-fno-math-errno")
_AVX2_CFLAGS = ("-mavx2", "-mfma", "-mf16c")
# Where torch runs its own AVX-512 kernels, the same vector width.
_AVX512_CFLAGS = (
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mprefer-vector-width=512",
)
PORTABLE_ENV = "AMP_FUSED_OPS_PORTABLE"


def _openmp_cflags() -> tuple[str, ...]:
    """``-fopenmp`` where torch runs on OpenMP (Linux builds).

    ``at::parallel_for`` is a header template whose OpenMP backend is a ``#pragma omp
    parallel``: compiled without ``-fopenmp`` it runs every loop on one thread. The GOMP
    symbols then resolve to the OpenMP runtime torch has loaded (torch loads its libraries
    globally on Linux), so the kernels share torch's threads and ``torch.set_num_threads``.
    """
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        return ("-fopenmp",)
    return ()


def _extra_cflags() -> tuple[str, ...]:
    base = (*_BASE_CFLAGS, *_openmp_cflags())
    if os.environ.get(PORTABLE_ENV, "").strip() == "1":
        return base
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return base
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return (*base, *_AVX2_CFLAGS, *_AVX512_CFLAGS)
    if capability == "AVX2":
        return (*base, *_AVX2_CFLAGS)
    return base


_BUILD_SECONDS = {"cpu": 45}  # measured: 40 s on 2 cores (gcc 12, torch 2.13)
# CUDA: seconds per translation unit on one core (nvcc 13.0, torch 2.14, one architecture);
# the units compile MAX_JOBS at a time.
_CUDA_SECONDS_PER_UNIT = 100
_CUDA_CFLAGS = ("-O3",)
# No --use_fast_math: the kernels match the reference's IEEE float32 division and sqrt.
_CUDA_NVCC_FLAGS = ("-O3",)
ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
_MARKER = "amp_fused_ops_build.json"  # written once a build has finished
_FAILED = "amp_fused_ops_build_failed.log"  # written when a build failed
_LOCK = "amp_fused_ops.lock"  # flock'ed while building (torch's own baton is "lock")
_PACKAGE_DIR = Path(__file__).resolve().parent
_PREBUILT_DIR = _PACKAGE_DIR / "_prebuilt"


class ExtensionUnavailableError(RuntimeError):
    """Raised by :func:`build_extension` when an extension cannot be built or loaded."""


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    """What :func:`extension_status` found out about one extension kind.

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


# Per-process memory: build folder -> module, kind -> reason, and the lines already logged.
_modules: dict[Path, ModuleType] = {}
_failures: dict[Path, str] = {}
_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def get_extension(kind: str) -> ModuleType | None:
    """Return the compiled extension ``kind``, building it just in time on first use.

    Never raises for a missing compiler, ninja or a failed build: it returns ``None`` and logs
    one WARNING line (once per process and reason) saying why and how to fix it.

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
    _check_kind(kind)
    with _lock:
        reason = _static_reason(kind)
        build_dir = build_directory(kind) if reason is None else None
        if build_dir is not None:
            reason = _failures.get(build_dir)
        if build_dir is not None and reason is None:
            if build_dir in _modules:
                return _modules[build_dir]
            try:
                module = _load_or_build(kind, build_dir, force=False)
            except ExtensionUnavailableError as error:
                reason = str(error)
            except Exception as error:  # never let the loader crash the caller
                reason = f"unexpected error while loading it: {type(error).__name__}: {error}"
            else:
                _modules[build_dir] = module
                return module
            _failures[build_dir] = reason
        assert reason is not None  # every path that gets here set it
        if (kind, reason) not in _logged:
            _logged.add((kind, reason))
            logger.warning(
                "amp_fused_ops %s extension unavailable, using the PyTorch reference path: %s",
                kind.upper(),
                reason,
            )
        return None


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
    _check_kind(kind)
    reason = _static_reason(kind) or _failures.get(build_directory(kind))
    if reason is not None:
        return reason
    status = extension_status(kind)
    return status.detail if status.state == "unavailable" else None


def build_extension(kind: str, *, force: bool = False, build_dir: Path | None = None) -> Path:
    """Build extension ``kind`` now (used by ``python -m amp_fused_ops build`` and the hook).

    Args:
        kind: ``"cpu"`` or ``"cuda"`` (needs ``TORCH_CUDA_ARCH_LIST`` where no GPU is visible).
        force: Compile again even when the cache holds a build or a failed attempt.
        build_dir: Folder to build in; defaults to :func:`build_directory`.

    Returns:
        The path of the compiled module.

    Raises:
        ValueError: If ``kind`` is unknown.
        ExtensionUnavailableError: If the extension is disabled, cannot be built here, or the
            build failed (the message names the log file).
    """
    _check_kind(kind)
    reason = _static_reason(kind)
    if reason is not None:
        raise ExtensionUnavailableError(reason)
    target = build_dir if build_dir is not None else build_directory(kind)
    with _lock:
        module = _load_or_build(kind, target, force=force, allow_prebuilt=False)
        _modules[target] = module
        _failures.pop(target, None)
    return Path(str(module.__file__))


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
    _check_kind(kind)
    reason = _static_reason(kind)
    if reason is not None:
        return ExtensionStatus(kind, "unavailable", reason)
    prebuilt = _prebuilt_module_path(kind)
    if prebuilt is not None:
        return ExtensionStatus(kind, "prebuilt", f"shipped in the wheel: {prebuilt}", prebuilt)
    build_dir = build_directory(kind)
    cached = _cached_module_path(build_dir)
    if cached is not None:
        return ExtensionStatus(kind, "built", f"cached: {cached}", cached)
    failed = build_dir / _FAILED
    if failed.exists():
        return ExtensionStatus(kind, "unavailable", _failed_reason(kind, failed))
    missing = _missing_tools_reason(kind)
    if missing is not None:
        return ExtensionStatus(kind, "unavailable", missing)
    return ExtensionStatus(
        kind, "not built", f"compiles on first use (about {_build_seconds(kind)} s) in {build_dir}"
    )


def cache_root() -> Path:
    """The folder that holds every build: ``$AMP_FUSED_OPS_CACHE`` or ``~/.cache/amp_fused_ops``.

    Returns:
        The cache root (not created).
    """
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return (base / "amp_fused_ops").resolve()


def build_directory(kind: str) -> Path:
    """The cache folder of extension ``kind`` for this torch, CUDA, Python and source version.

    Args:
        kind: ``"cpu"`` or ``"cuda"``.

    Returns:
        ``cache_root() / "<kind>-torch<version>-<cuda or cpu>[-sm<archs>]-py<XY>-<machine>-<hash>"``
        (the architectures only for ``"cuda"``).
    """
    _check_kind(kind)
    env = os.environ
    return _build_directory(
        kind,
        env.get(CACHE_ENV),
        env.get("XDG_CACHE_HOME"),
        env.get("CXX"),
        env.get(ARCH_ENV),
        env.get("CUDA_HOME"),
    )


@functools.lru_cache(maxsize=32)
def _build_directory(
    kind: str,
    cache: str | None,
    xdg: str | None,
    cxx: str | None,
    arch_list: str | None,
    cuda_home: str | None,
) -> Path:
    # Memoized on the environment it depends on: get_extension runs on every op call.
    del cache, xdg, cxx, arch_list, cuda_home  # read again through os.environ by the helpers
    cuda = f"cu{torch.version.cuda}" if torch.version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    archs = f"-sm{_arch_tag(cuda_arch_list())}" if kind == "cuda" else ""
    key = f"{kind}-torch{torch.__version__}-{cuda}{archs}-{python}-{platform.machine()}"
    return cache_root() / f"{key}-{_source_hash(kind)[:16]}"


def source_dir() -> Path | None:
    """The ``csrc`` folder: inside the installed package, or next to ``src/`` in a checkout.

    Returns:
        The folder, or ``None`` when the sources are not shipped.
    """
    for candidate in (_PACKAGE_DIR / "csrc", _PACKAGE_DIR.parents[1] / "csrc"):
        if (candidate / "cpu").is_dir():
            return candidate
    return None


def clear_cache() -> None:
    """Forget the modules, failures and logged lines of this process (for tests).

    Compiled modules stay loaded by Python; the next :func:`get_extension` looks again.
    """
    with _lock:
        _modules.clear()
        _failures.clear()
        _logged.clear()
        _build_directory.cache_clear()


# --- helpers -----------------------------------------------------------------------------


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown extension kind {kind!r}; expected one of {KINDS}")


def _disabled_kinds() -> set[str]:
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return set()
    if value in ("1", "true", "yes", "on", "all"):
        return set(KINDS)
    return {part.strip() for part in value.split(",") if part.strip()}


def _static_reason(kind: str) -> str | None:
    """Reasons that hold whatever is on disk: disabled by the user, or no sources for kind."""
    if kind in _disabled_kinds():
        value = os.environ.get(DISABLE_ENV)
        return f"disabled by {DISABLE_ENV}={value}; unset it to use the compiled kernels"
    if kind == "cuda" and not torch.version.cuda:
        return (
            f"torch {torch.__version__} is a CPU build (torch.version.cuda is None); install a "
            "CUDA build of torch to use the CUDA kernels"
        )
    return None


# Files of csrc/<kind> that make the extension (hashed) and that are compiled.
_SOURCE_SUFFIXES = {"cpu": (".cpp", ".h"), "cuda": (".cu", ".cpp", ".h", ".cuh")}
_COMPILED_SUFFIXES = {"cpu": (".cpp",), "cuda": (".cu", ".cpp")}


def _sources(kind: str) -> list[Path]:
    root = source_dir()
    if root is None or not (root / kind).is_dir():
        return []
    suffixes = _SOURCE_SUFFIXES[kind]
    return sorted(path for path in (root / kind).iterdir() if path.suffix in suffixes)


def _compiled_sources(kind: str) -> list[Path]:
    return [path for path in _sources(kind) if path.suffix in _COMPILED_SUFFIXES[kind]]


def _source_hash(kind: str) -> str:
    digest = hashlib.sha256()
    for path in _sources(kind):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    flags = (*_extra_cflags(), _compiler_command()[0])
    if kind == "cuda":
        flags = (*_CUDA_CFLAGS, *_CUDA_NVCC_FLAGS, _compiler_command()[0], str(cuda_home()))
    digest.update(" ".join(flags).encode())
    return digest.hexdigest()


def _build_seconds(kind: str) -> int:
    """Rough compile time of ``kind`` on this machine, for the "compiling ..." line."""
    if kind == "cpu":
        return _BUILD_SECONDS["cpu"]
    units = max(1, len(_compiled_sources(kind)))
    cores = os.cpu_count() or 1
    try:
        jobs = int(os.environ.get("MAX_JOBS", "") or cores)
    except ValueError:
        jobs = cores
    jobs = max(1, min(jobs, cores, units))
    return _CUDA_SECONDS_PER_UNIT * -(-units // jobs)


# --- CUDA toolkit -------------------------------------------------------------------------


def cuda_home() -> Path | None:
    """The CUDA toolkit the CUDA extension is compiled with.

    ``$CUDA_HOME`` (or ``$CUDA_PATH``) when set; otherwise the toolkit of the ``nvcc`` on
    ``PATH`` (symbolic links resolved), then ``/usr/local/cuda``. A folder counts as a toolkit
    only when it has ``bin/nvcc`` and ``include/cuda_runtime.h`` (a wrapper script's folder,
    such as ``/usr/local/bin``, does not).

    Returns:
        The toolkit folder, or ``None`` when none is found.
    """
    configured = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if configured:
        return Path(configured)
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(Path(nvcc).resolve().parents[1])
    candidates.append(Path("/usr/local/cuda"))
    for candidate in candidates:
        if (candidate / "bin" / "nvcc").exists() and (
            candidate / "include" / "cuda_runtime.h"
        ).exists():
            return candidate
    return None


def nvcc_path() -> str | None:
    """The ``nvcc`` of :func:`cuda_home`, or ``None``."""
    home = cuda_home()
    if home is None:
        return None
    nvcc = home / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")
    return str(nvcc) if nvcc.exists() else None


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    """``(major, minor)`` of the CUDA release ``nvcc --version`` reports, or ``None``."""
    try:
        output = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", output)
    return (int(match.group(1)), int(match.group(2))) if match else None


def cuda_arch_list() -> str | None:
    """The GPU architectures to compile for: ``$TORCH_CUDA_ARCH_LIST``, else the current device's.

    Returns:
        An arch list as ``TORCH_CUDA_ARCH_LIST`` spells it (``"9.0"``, ``"8.0;9.0+PTX"``), or
        ``None`` when the variable is unset and no GPU is visible.
    """
    configured = os.environ.get(ARCH_ENV, "").strip()
    if configured:
        return configured
    if torch.version.cuda and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return None


def _arch_tag(arch_list: str | None) -> str:
    """``"8.0;9.0+PTX"`` -> ``"80-90+PTX"``: a folder-name-safe form of an arch list."""
    if not arch_list:
        return "none"
    parts = [p for p in re.split(r"[;\s,]+", arch_list) if p]
    return "-".join(re.sub(r"[^0-9A-Za-z+]", "", p) for p in parts) or "none"


def _arch_covers(arch_list: str, capability: str) -> bool:
    """Whether code built for ``arch_list`` runs on a device of ``capability`` (``"9.0"``)."""
    parts = [p for p in re.split(r"[;\s,]+", arch_list) if p]
    return any(p.removesuffix("+PTX") == capability for p in parts)


def _extra_cuda_include_paths(home: Path) -> list[str]:
    """Headers PyTorch's CUDA headers need that the toolkit may lack (``cusparse.h``).

    pip's ``nvidia-*`` packages ship them under ``site-packages/nvidia/cu<major>/include``;
    they are added only when the toolkit has no ``cusparse.h`` of its own.
    """
    if (home / "include" / "cusparse.h").exists():
        return []
    spec = importlib.util.find_spec("nvidia")
    bases = list(spec.submodule_search_locations or []) if spec is not None else []
    major = (torch.version.cuda or "").split(".")[0]
    found = []
    for base in bases:
        include = Path(base) / f"cu{major}" / "include"
        if (include / "cusparse.h").exists():
            found.append(str(include))
    return found


def _compiler_command() -> list[str]:
    return shlex.split(os.environ.get("CXX", "c++")) or ["c++"]


def compiler_path() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` would use (``$CXX`` or ``c++``).

    Returns:
        Its full path, or ``None`` when it is not on ``PATH``.
    """
    return shutil.which(_compiler_command()[0])


def ninja_path() -> str | None:
    """The ninja executable ``torch.utils.cpp_extension`` would use.

    Returns:
        Its full path, or ``None`` when ninja is not installed.
    """
    return shutil.which("ninja")


def _missing_tools_reason(kind: str) -> str | None:
    if not _compiled_sources(kind):
        return (
            f"the C++ sources (csrc/{kind}) are not shipped with this installation "
            f"(looked next to {_PACKAGE_DIR}); reinstall amp-fused-ops from its wheel or sdist"
        )
    if kind == "cuda":
        missing = _missing_cuda_reason()
        if missing is not None:
            return missing
    if compiler_path() is None:
        return (
            f"no C++ compiler found ({_compiler_command()[0]!r} is not on PATH); install one "
            "(e.g. `apt install g++`) or set CXX, then run `python -m amp_fused_ops build`"
        )
    if ninja_path() is None:
        return (
            "ninja is not installed; run `pip install ninja`, then `python -m amp_fused_ops build`"
        )
    return None


def _missing_cuda_reason() -> str | None:
    """Why the CUDA extension cannot be compiled here (torch is a CUDA build), or None."""
    nvcc = nvcc_path()
    if nvcc is None:
        return (
            "nvcc not found (no CUDA toolkit in $CUDA_HOME, on PATH or in /usr/local/cuda); "
            f"install the CUDA {torch.version.cuda} toolkit and set CUDA_HOME to it, then run "
            "`python -m amp_fused_ops build cuda`"
        )
    version = nvcc_version(nvcc)
    torch_major = int(str(torch.version.cuda).split(".")[0])
    if version is None:
        return f"cannot read the CUDA version of {nvcc} (`nvcc --version`); check the toolkit"
    if version[0] != torch_major:
        return (
            f"CUDA version mismatch: nvcc ({nvcc}) is CUDA {version[0]}.{version[1]} but torch "
            f"{torch.__version__} was built with CUDA {torch.version.cuda}; set CUDA_HOME to a "
            f"CUDA {torch_major}.x toolkit (or install the torch build for your toolkit)"
        )
    if cuda_arch_list() is None:
        return (
            "no CUDA GPU is visible (torch.cuda.is_available() is False) and "
            f"{ARCH_ENV} is not set; set {ARCH_ENV} (e.g. 9.0) to compile without a GPU"
        )
    return None


def _failed_reason(kind: str, log: Path) -> str:
    return (
        f"the {kind.upper()} extension failed to compile, compiler output in {log}; fix the "
        "error (or report it), then run `python -m amp_fused_ops build` to retry"
    )


def _import_compiled(path: Path) -> ModuleType:
    """Import a compiled module by path (its init function is named after the file stem)."""
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}: not a Python extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prebuilt_module_path(kind: str) -> Path | None:
    """The module shipped in the wheel, if it was built for this torch, Python (and GPU)."""
    name = _MODULE_NAMES.get(kind)
    meta_path = _PREBUILT_DIR / f"{name}.json"
    if name is None or not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("torch") != torch.__version__ or meta.get("python") != _python_tag():
        logger.debug("ignoring prebuilt %s: built for %s", name, meta)
        return None
    if kind == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if not _arch_covers(str(meta.get("arch", "")), f"{major}.{minor}"):
            logger.debug("ignoring prebuilt %s: built for %s, device is sm_%d%d", name, meta,
                         major, minor)  # fmt: skip
            return None
    path = _PREBUILT_DIR / str(meta.get("file", ""))
    return path if path.is_file() else None


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _cached_module_path(build_dir: Path) -> Path | None:
    """The module of a finished build in ``build_dir`` (the marker is written last)."""
    marker = build_dir / _MARKER
    if not marker.is_file():
        return None
    path = build_dir / str(json.loads(marker.read_text()).get("file", ""))
    return path if path.is_file() else None


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the build folder's lock file (no-op where no fcntl)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: rely on torch's own lock file
        yield
        return
    with open(build_dir / _LOCK, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _load_or_build(
    kind: str, build_dir: Path, *, force: bool, allow_prebuilt: bool = True
) -> ModuleType:
    prebuilt = _prebuilt_module_path(kind) if allow_prebuilt and not force else None
    if prebuilt is not None:
        return _import_or_explain(prebuilt)
    cached = None if force else _cached_module_path(build_dir)
    if cached is not None:
        return _import_or_explain(cached)
    missing = _missing_tools_reason(kind)
    if missing is not None:
        raise ExtensionUnavailableError(missing)
    with _build_lock(build_dir):
        # Another process may have finished (or failed) the build while this one waited.
        cached = None if force else _cached_module_path(build_dir)
        if cached is not None:
            return _import_or_explain(cached)
        failed = build_dir / _FAILED
        if failed.exists() and not force:
            raise ExtensionUnavailableError(_failed_reason(kind, failed))
        return _compile(kind, build_dir)


def _import_or_explain(path: Path) -> ModuleType:
    try:
        return _import_compiled(path)
    except ImportError as error:
        raise ExtensionUnavailableError(
            f"the compiled module {path} cannot be imported ({error}); delete {path.parent} "
            "and run `python -m amp_fused_ops build`"
        ) from error


def _compile(kind: str, build_dir: Path) -> ModuleType:
    """Compile ``kind`` into ``build_dir`` (the caller holds the build lock)."""
    from torch.utils import cpp_extension

    for stale in (build_dir / "lock", build_dir / _MARKER, build_dir / _FAILED):
        # torch's own lock file can only be left over from a crashed build: we hold the lock.
        stale.unlink(missing_ok=True)
    logger.warning(
        "compiling amp_fused_ops %s extension (first use on this machine, about %d s) into %s",
        kind.upper(),
        _build_seconds(kind),
        build_dir,
    )
    start = time.perf_counter()
    sources = [str(path) for path in _compiled_sources(kind)]
    try:
        if kind == "cuda":
            module = _load_cuda(cpp_extension, sources, build_dir)
        else:
            module = cpp_extension.load(
                name=_MODULE_NAMES[kind],
                sources=sources,
                extra_cflags=list(_extra_cflags()),
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as error:
        log = build_dir / _FAILED
        log.write_text(f"{type(error).__name__}: {error}\n")
        raise ExtensionUnavailableError(_failed_reason(kind, log)) from error
    seconds = time.perf_counter() - start
    path = Path(str(module.__file__))
    meta = {"file": path.name, "torch": torch.__version__, "python": _python_tag()}
    if kind == "cuda":
        meta["arch"] = str(cuda_arch_list())
    meta["seconds"] = f"{seconds:.1f}"
    tmp = build_dir / f"{_MARKER}.tmp"
    tmp.write_text(json.dumps(meta))
    tmp.replace(build_dir / _MARKER)
    logger.info("compiled amp_fused_ops %s extension in %.1f s: %s", kind.upper(), seconds, path)
    return module


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a build, then restore them."""
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
    :func:`cuda_home`, which skips wrapper scripts.
    """
    home = cuda_home()
    arch_list = cuda_arch_list()
    assert home is not None and arch_list is not None  # checked by _missing_cuda_reason
    previous_home = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = str(home)
    try:
        with _environment(CUDA_HOME=str(home), **{ARCH_ENV: arch_list}):
            module: ModuleType = cpp_extension.load(
                name=_MODULE_NAMES["cuda"],
                sources=sources,
                extra_cflags=list(_CUDA_CFLAGS),
                extra_cuda_cflags=list(_CUDA_NVCC_FLAGS),
                extra_include_paths=_extra_cuda_include_paths(home),
                build_directory=str(build_dir),
                with_cuda=True,
                verbose=False,
            )
    finally:
        cpp_extension.CUDA_HOME = previous_home
    return module
