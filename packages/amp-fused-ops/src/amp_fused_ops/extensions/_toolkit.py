"""The tools a build needs: a C++ compiler, ninja, and for CUDA the toolkit and an arch list."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

from ._settings import ARCH_ENV


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


def arch_tag(arch_list: str | None) -> str:
    """``"8.0;9.0+PTX"`` -> ``"80-90+PTX"``: a folder-name-safe form of an arch list."""
    if not arch_list:
        return "none"
    parts = [p for p in re.split(r"[;\s,]+", arch_list) if p]
    return "-".join(re.sub(r"[^0-9A-Za-z+]", "", p) for p in parts) or "none"


def _capability_numbers(text: str) -> tuple[int, int] | None:
    """``(9, 0)`` for ``"9.0"`` (a trailing architecture letter aside), or None."""
    match = re.fullmatch(r"(\d+)\.(\d+)[af]?", text)
    return (int(match[1]), int(match[2])) if match else None


def arch_covers(arch_list: str, capability: str) -> bool:
    """Whether code built for ``arch_list`` runs on a device of ``capability`` (``"9.0"``).

    CUDA's compatibility rules: the machine code of ``X.Y`` runs on every device ``X.Z`` with
    ``Z >= Y`` (``8.0`` serves ``8.6`` and ``8.9``; ``9.0a``, specific to its architecture,
    serves ``9.0`` only); the PTX of ``X.Y`` (``X.Y+PTX``) is compiled by the driver for any
    device of ``X.Y`` or newer.
    """
    device = _capability_numbers(capability)
    if device is None:
        return False
    for part in (p for p in re.split(r"[;\s,]+", arch_list) if p):
        ptx = part.endswith("+PTX")
        base = part.removesuffix("+PTX")
        built = _capability_numbers(base)
        if built is None:
            continue
        if ptx and device >= built:
            return True
        if base.endswith("a"):
            if device == built:
                return True
        elif device[0] == built[0] and device[1] >= built[1]:
            return True
    return False


def extra_cuda_include_paths(home: Path) -> list[str]:
    """Headers PyTorch's CUDA headers need that the toolkit may lack (``cusparse.h``).

    pip's ``nvidia-*`` packages ship them under ``site-packages/nvidia/cu<major>/include``;
    they are added only when the toolkit has no ``cusparse.h`` of its own, and they are
    searched after the toolkit's own headers (:func:`after_toolkit_flags`): that folder also
    holds the CUDA runtime's headers of torch's CUDA release, which nvcc accepts only from its
    own release (torch 2.15 for CUDA 13.2 with an nvcc of CUDA 13.0 stops at CCCL's "CUDA
    compiler and CUDA toolkit headers are incompatible").
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


def after_toolkit_flags(paths: list[str]) -> list[str]:
    """Compiler flags that search ``paths`` after the toolkit's headers.

    ``torch.utils.cpp_extension`` passes ``extra_include_paths`` as ``-I`` (before everything)
    and the toolkit's ``include`` as ``-isystem``, ahead of the extra flags: ``-isystem`` in the
    extra flags comes after it, for nvcc and the host compiler alike.
    """
    return [flag for path in paths for flag in ("-isystem", path)]


def compiler_command() -> list[str]:
    """``$CXX`` split into words, else ``["c++"]`` (what torch.utils.cpp_extension runs)."""
    return shlex.split(os.environ.get("CXX", "c++")) or ["c++"]


def compiler_path() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` would use (``$CXX`` or ``c++``).

    Returns:
        Its full path, or ``None`` when it is not on ``PATH``.
    """
    return shutil.which(compiler_command()[0])


def ninja_path() -> str | None:
    """The ninja executable ``torch.utils.cpp_extension`` would use.

    Returns:
        Its full path, or ``None`` when ninja is not installed.
    """
    return shutil.which("ninja")


def missing_cuda_reason() -> str | None:
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
