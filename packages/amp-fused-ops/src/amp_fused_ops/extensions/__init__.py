"""The compiled extensions of amp-fused-ops: load them, check them, say why one is missing.

Two kinds exist, ``"cpu"`` (the C++ kernels) and ``"cuda"`` (the CUDA kernels). The ops of
:data:`amp_fused_ops.amp_C` and the fused norms use them on their own; these functions are for
tools, benchmarks and checks that need to know which path runs::

    from amp_fused_ops import extensions

    module = extensions.get_extension("cpu")   # None: the PyTorch reference path runs
    why = extensions.unavailable_reason("cpu") if module is None else None
    status = extensions.extension_status("cuda")  # what `python -m amp_fused_ops info` shows

``AMP_FUSED_OPS_DISABLE=1`` (or a comma-separated list of kinds, :data:`DISABLE_ENV`) makes
the extensions unavailable on purpose, when it is set before the first op of the process;
:func:`clear_cache` makes the next :func:`get_extension` decide again. A loaded extension's
kernels stay registered with the dispatcher for the rest of the process, so to run the
PyTorch reference path in a process that has loaded one (a test comparing both paths, say),
use :func:`use_reference`::

    with extensions.use_reference() as calls:
        optimizer.step()                        # every op runs its PyTorch reference
    assert calls["amp_fused_ops::multi_tensor_adam"] == 1

One job per module here; they import each other relatively and nothing else of the package
but the op registry, so that ``hatch_build.py`` can load this folder by path to build an
extension into a wheel:

- ``_settings``: the kinds, environment variables, file names and error type;
- ``_flags``: the compiler flags;
- ``_toolkit``: the compiler, ninja and the CUDA toolkit;
- ``_cache``: where builds live (the cache key) and which sources make a kind;
- ``_record``: the build record beside each compiled module (size, SHA-256) and its checks;
- ``_lock``: the build lock, who holds it, and how long others wait for it;
- ``_progress``: the compile-time estimate and the progress lines while compiling;
- ``_build``: compiling and importing a build;
- ``_prebuilt``: the modules a wheel ships (one per torch release and instruction set): which
  one serves this process, and writing them for a wheel;
- ``_lookup``: why a kind cannot be built, and choosing prebuilt / cached / fresh;
- ``_api``: what callers use (``get_extension`` and friends) and the per-process memo;
- ``_loader``: every name of the above that the rest of the package and its tests read.
"""

from __future__ import annotations

from pathlib import Path

from amp_fused_ops.ops._reference_mode import ReferenceCalls, use_reference

from . import _flags, _toolkit
from ._loader import (
    DISABLE_ENV,
    KINDS,
    ExtensionStatus,
    build_extension,
    build_for_wheel,
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
    "build_for_wheel",
    "clear_cache",
    "use_reference",
    "ReferenceCalls",
    "cuda_compile_settings",
]


def cuda_compile_settings(cuda_home: str | Path) -> tuple[list[str], list[str]]:
    """The nvcc flags and the toolkit include paths the CUDA extension is compiled with.

    For tools that compile the extension's ``.cu`` sources as the build does (e.g. a report of
    registers and spills per kernel); PyTorch's own flags and include paths come on top.

    Args:
        cuda_home: The CUDA toolkit's root (the folder above ``bin/nvcc``).

    Returns:
        ``(nvcc_flags, include_paths)``.
    """
    home = Path(cuda_home)
    return list(_flags.CUDA_NVCC_FLAGS), [str(p) for p in _toolkit.extra_cuda_include_paths(home)]
