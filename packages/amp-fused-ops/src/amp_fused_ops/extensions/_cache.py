"""Where builds live: the cache root, the folder of each kind (the cache key) and its sources."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from . import _flags as flags
from . import _toolkit as toolkit
from ._settings import ARCH_ENV, CACHE_ENV, PACKAGE_DIR, PORTABLE_ENV, check_kind

# Files of csrc/<kind> that make the extension (hashed) and that are compiled.
SOURCE_SUFFIXES = {"cpu": (".cpp", ".h"), "cuda": (".cu", ".cpp", ".h", ".cuh")}
COMPILED_SUFFIXES = {"cpu": (".cpp",), "cuda": (".cu", ".cpp")}
# csrc/common: the element math both extensions include (its headers) and the translation units
# both compile (the C++ runtime definitions of csrc/common/libstdcxx_compat.cpp); in both
# cache keys.
SHARED_DIR = "common"
SHARED_SUFFIXES = (".h", ".cpp")


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
    check_kind(kind)
    env = os.environ
    return _build_directory(
        kind,
        env.get(CACHE_ENV),
        env.get("XDG_CACHE_HOME"),
        env.get("CXX"),
        env.get(ARCH_ENV),
        env.get("CUDA_HOME"),
        env.get(PORTABLE_ENV),
    )


@functools.lru_cache(maxsize=32)
def _build_directory(
    kind: str,
    cache: str | None,
    xdg: str | None,
    cxx: str | None,
    arch_list: str | None,
    cuda_home: str | None,
    portable: str | None,
) -> Path:
    # Memoized on the environment it depends on (hashing the sources reads every file).
    del cache, xdg, cxx, arch_list, cuda_home, portable  # read again by the helpers
    cuda = f"cu{torch.version.cuda}" if torch.version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    archs = f"-sm{toolkit.arch_tag(toolkit.cuda_arch_list())}" if kind == "cuda" else ""
    key = f"{kind}-torch{torch.__version__}-{cuda}{archs}-{python}-{platform.machine()}"
    return cache_root() / f"{key}-{source_hash(kind)[:16]}"


def forget() -> None:
    """Drop the memoized build folders (the environment or the sources changed)."""
    _build_directory.cache_clear()


def source_dir() -> Path | None:
    """The ``csrc`` folder: inside the installed package, or next to ``src/`` in a checkout.

    Returns:
        The folder, or ``None`` when the sources are not shipped.
    """
    for candidate in (PACKAGE_DIR / "csrc", PACKAGE_DIR.parents[1] / "csrc"):
        if (candidate / "cpu").is_dir():
            return candidate
    return None


def sources(kind: str) -> list[Path]:
    """Every file that goes into extension ``kind``: ``csrc/<kind>`` and ``csrc/common``.

    The files of ``csrc/common`` (the element math of the CPU loops and the CUDA functors, and
    the sources both extensions compile) come first; an edit of one of them changes the cache
    key of both extensions.
    """
    root = source_dir()
    if root is None or not (root / kind).is_dir():
        return []
    suffixes = SOURCE_SUFFIXES[kind]
    own = sorted(path for path in (root / kind).iterdir() if path.suffix in suffixes)
    shared_dir = root / SHARED_DIR
    shared = (
        sorted(path for path in shared_dir.iterdir() if path.suffix in SHARED_SUFFIXES)
        if shared_dir.is_dir()
        else []
    )
    return shared + own


def compiled_sources(kind: str) -> list[Path]:
    """The translation units of ``kind``: every ``.cpp`` (and for CUDA ``.cu``) file."""
    return [path for path in sources(kind) if path.suffix in COMPILED_SUFFIXES[kind]]


def source_hash(kind: str) -> str:
    """SHA-256 of the sources of ``kind`` and the flags and tools it is compiled with."""
    digest = hashlib.sha256()
    root = source_dir()
    for path in sources(kind):
        # The path under csrc/, so that a header moved between folders changes the key too.
        name = path.relative_to(root).as_posix() if root is not None else path.name
        digest.update(name.encode())
        digest.update(path.read_bytes())
    used = (*flags.extra_cflags(), toolkit.compiler_command()[0])
    if kind == "cuda":
        home = toolkit.cuda_home()
        includes = toolkit.extra_cuda_include_paths(home) if home is not None else []
        used = (
            *flags.CUDA_CFLAGS,
            *flags.CUDA_NVCC_FLAGS,
            *toolkit.after_toolkit_flags(includes),  # the headers of torch's nvidia-* packages
            toolkit.compiler_command()[0],
            str(home),
        )
    used = (*used, *flags.extra_ldflags())
    digest.update(" ".join(used).encode())
    return digest.hexdigest()


def unwritable_reason(build_dir: Path, *, create: bool) -> str | None:
    """Why nothing can be built in ``build_dir`` (it cannot be created or written), or None.

    Args:
        build_dir: The build folder.
        create: Create the folder (a build needs it anyway); otherwise probe the nearest
            folder that exists, so that asking changes nothing on disk.
    """
    try:
        if create:
            build_dir.mkdir(parents=True, exist_ok=True)
        probe = build_dir
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        with tempfile.TemporaryFile(dir=probe):  # an unnamed file: nothing is left behind
            pass
    except OSError as error:
        return cache_unwritable_message(build_dir, error)
    return None


def cache_unwritable_message(build_dir: Path, error: OSError) -> str:
    """The fix for a cache folder that cannot be written: which variable moves the cache."""
    configured = os.environ.get(CACHE_ENV)
    origin = (
        f"set by {CACHE_ENV}={configured}" if configured else f"the default; {CACHE_ENV} is unset"
    )
    return (
        f"the cache folder {build_dir} cannot be written ({type(error).__name__}: "
        f"{error.strerror or error}); its root {cache_root()} is {origin}. Set {CACHE_ENV} "
        "to a writable folder (or make this one writable), then run "
        "`python -m amp_fused_ops build`"
    )
