"""Find, build (just in time), check and load the compiled extensions of ``amp_fused_ops``.

Two kinds exist: ``"cpu"`` (C++ kernels in ``csrc/cpu``) and ``"cuda"`` (CUDA kernels: every
``.cu`` and ``.cpp`` file of ``csrc/cuda`` compiled into one module, ``amp_fused_ops_cuda``).
``get_extension(kind)`` returns the extension, in this order of preference:

1. a prebuilt module shipped in the wheel (``_prebuilt/``, made by ``hatch_build.py`` when
   ``AMP_FUSED_OPS_BUILD_EXT=1``), if one was built for this torch release (and, for the CPU
   kind, for an instruction set this CPU has; the best one wins): see
   :mod:`~amp_fused_ops.extensions._prebuilt`; one that does not load is skipped with a warning;
2. a module already compiled into the cache (``$AMP_FUSED_OPS_CACHE`` or
   ``~/.cache/amp_fused_ops``), in a folder keyed by torch version, CUDA version (or
   ``cpu``), the GPU architectures (CUDA kind: ``TORCH_CUDA_ARCH_LIST``, else the current
   device's compute capability), Python version, machine and a hash of the sources and flags;
3. a fresh just-in-time build into that folder with ``torch.utils.cpp_extension`` and ninja,
   from scratch, under a file lock so that when many ranks start at once one compiles and the
   others wait (logging who holds the lock, for at most ``$AMP_FUSED_OPS_LOCK_TIMEOUT``
   seconds).

A module is loaded only when its size and SHA-256 match the build record written beside it;
a damaged one is compiled again (or, where that is impossible, skipped). When nothing works
``get_extension`` returns ``None`` and logs one WARNING line that says why and how to fix
it; callers then use the PyTorch reference path. The first call per kind decides for the
process; later calls are one dictionary lookup (``clear_cache()`` starts over).

The CUDA kind needs a CUDA build of torch, ``nvcc`` of the same CUDA major version
(``$CUDA_HOME``, else found on ``PATH`` or in ``/usr/local/cuda``), ninja, and a GPU or
``TORCH_CUDA_ARCH_LIST`` (which lets a machine without a GPU build it, e.g. for a compile
check). ``AMP_FUSED_OPS_DISABLE=1`` (or a comma-separated list of kinds, e.g. ``cpu``) makes
the extensions unavailable on purpose.

The work is done in :mod:`amp_fused_ops.extensions` (one module per job); this module
re-exports its names for reading (the ``as _name`` imports are private ones that tests and
tools read through this module). To replace one (in a test), assign it in the module that
owns and uses it, e.g. ``amp_fused_ops.extensions._build.compile_extension``.
"""

from __future__ import annotations

from ._api import (
    build_directory,
    build_extension,
    build_for_wheel,
    clear_cache,
    extension_status,
    get_extension,
    unavailable_reason,
)
from ._build import compile_extension as _compile  # noqa: F401
from ._cache import cache_root, source_dir
from ._flags import extra_cflags as _extra_cflags  # noqa: F401
from ._flags import host_isas as _host_isas  # noqa: F401
from ._lookup import import_compiled as _import_compiled  # noqa: F401
from ._lookup import missing_tools_reason as _missing_tools_reason  # noqa: F401
from ._record import python_tag as _python_tag  # noqa: F401
from ._settings import (
    ARCH_ENV,
    CACHE_ENV,
    DISABLE_ENV,
    KINDS,
    LOCK_TIMEOUT_ENV,
    PORTABLE_ENV,
    ExtensionStatus,
    ExtensionUnavailableError,
)
from ._settings import MODULE_NAMES as _MODULE_NAMES  # noqa: F401
from ._settings import PREBUILT_DIR as _PREBUILT_DIR  # noqa: F401
from ._toolkit import arch_covers as _arch_covers  # noqa: F401
from ._toolkit import (
    compiler_path,
    cuda_arch_list,
    cuda_home,
    ninja_path,
    nvcc_path,
    nvcc_version,
)

__all__ = [
    # Loading
    "get_extension",
    "unavailable_reason",
    "build_extension",
    "build_for_wheel",
    "extension_status",
    "clear_cache",
    "ExtensionStatus",
    "ExtensionUnavailableError",
    # Where builds live
    "KINDS",
    "cache_root",
    "build_directory",
    "source_dir",
    # Tools
    "compiler_path",
    "ninja_path",
    "cuda_home",
    "nvcc_path",
    "nvcc_version",
    "cuda_arch_list",
    # Environment variables
    "ARCH_ENV",
    "CACHE_ENV",
    "DISABLE_ENV",
    "LOCK_TIMEOUT_ENV",
    "PORTABLE_ENV",
]
