"""Compiler flags of the extensions (part of the cache key)."""

from __future__ import annotations

import os
import platform
import sys

import torch

from .settings import PORTABLE_ENV

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
