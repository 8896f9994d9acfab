"""Compiler flags of the extensions (part of the cache key)."""

from __future__ import annotations

import os
import platform
import sys

import torch

from ._settings import PORTABLE_ENV

# -fno-math-errno lets sqrt vectorize (the kernels never read errno). No -march=native: the
# AVX2 flags are added only where torch reports AVX2 on this host (the cache key includes the
# flags), and never for a wheel built ahead of time (PORTABLE_ENV, set by hatch_build.py).
BASE_CFLAGS = ("-O3", "-fno-math-errno")
AVX2_CFLAGS = ("-mavx2", "-mfma", "-mf16c")
# Where torch runs its own AVX-512 kernels, the same vector width.
AVX512_CFLAGS = (
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mprefer-vector-width=512",
)
CUDA_CFLAGS = ("-O3",)
# No --use_fast_math: the kernels match the reference's IEEE float32 division and sqrt.
CUDA_NVCC_FLAGS = ("-O3",)


def openmp_cflags() -> tuple[str, ...]:
    """``-fopenmp`` where torch runs on OpenMP (Linux builds).

    ``at::parallel_for`` is a header template whose OpenMP backend is a ``#pragma omp
    parallel``: compiled without ``-fopenmp`` it runs every loop on one thread. The GOMP
    symbols then resolve to the OpenMP runtime torch has loaded (torch loads its libraries
    globally on Linux), so the kernels share torch's threads and ``torch.set_num_threads``.
    """
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        return ("-fopenmp",)
    return ()


def extra_cflags() -> tuple[str, ...]:
    """The C++ flags of the CPU extension on this host (portable ones for a wheel)."""
    base = (*BASE_CFLAGS, *openmp_cflags())
    if os.environ.get(PORTABLE_ENV, "").strip() == "1":
        return base
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return base
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return (*base, *AVX2_CFLAGS, *AVX512_CFLAGS)
    if capability == "AVX2":
        return (*base, *AVX2_CFLAGS)
    return base


def loaded_libstdcxx() -> str | None:
    """The path of the ``libstdc++`` shared object this process has loaded (torch's), if any.

    Linux only (read from ``/proc/self/maps``); ``None`` elsewhere or when none is mapped.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(
                    "libstdc++.so"
                ):
                    return fields[5].strip()
    except OSError:
        return None
    return None


def extra_ldflags() -> tuple[str, ...]:
    """Link flags of both extensions: the libstdc++ that torch uses, named by its path.

    Some toolchains link ``libstdc++`` statically into a shared library (a compiler with only
    ``libstdc++.a`` in its search path, or ``-static-libstdc++`` in its specs). The extension
    then holds a second copy of the C++ runtime whose iostream locale was never initialised:
    formatting a number into an error message (``TORCH_CHECK(..., n)``) crashed the process
    with a segmentation fault instead of raising. Naming the shared object that the process
    already uses, before the toolchain's own ``-lstdc++``, resolves every C++ runtime symbol
    from it, so no archive member is linked in (the library records the soname
    ``libstdc++.so.6``, as it would anyway).
    """
    path = loaded_libstdcxx()
    return (path,) if path else ()
