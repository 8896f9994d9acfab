"""Compiler flags of the extensions (part of the cache key)."""

from __future__ import annotations

import os
import platform
import sys

import torch

from ._settings import PORTABLE_ENV, ExtensionUnavailableError

# -fno-math-errno lets sqrt vectorize (the kernels never read errno). No -march=native: the
# AVX2 flags are added only where torch reports AVX2 on this host (the cache key includes the
# flags); a module built ahead of time for a wheel (PORTABLE_ENV, set by hatch_build.py) is
# compiled for a named instruction set instead, and loaded only where the CPU has it.
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
CPU_ISAS = ("baseline", "avx2", "avx512")
"""The instruction sets a portable CPU module can be compiled for, from the most widely runnable:
``baseline`` (the architecture's defaults: SSE2 on x86-64), ``avx2`` (AVX2, FMA, F16C: the x86-64
CPUs of the last ten years) and ``avx512`` (the AVX-512 subset torch's own AVX512 kernels use)."""
WHEEL_CPU_ISAS = ("avx2", "avx512")
"""The CPU modules a wheel ships for each torch release: torch picks its kernels the same way."""
_ISA_CFLAGS = {"baseline": (), "avx2": AVX2_CFLAGS, "avx512": (*AVX2_CFLAGS, *AVX512_CFLAGS)}
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


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def wheel_isas() -> tuple[str, ...]:
    """The instruction sets of a wheel's CPU modules, on this machine's architecture."""
    return WHEEL_CPU_ISAS if _is_x86_64() else ("baseline",)


def portable_isa() -> str | None:
    """The instruction set ``AMP_FUSED_OPS_PORTABLE`` asks a portable build for, or ``None``.

    ``1`` means ``baseline``; ``avx2`` and ``avx512`` (x86-64 only) name the others; unset or
    ``0``: a build for this host.

    Raises:
        ExtensionUnavailableError: If the value names no instruction set this machine's
            compiler targets.
    """
    value = os.environ.get(PORTABLE_ENV, "").strip().lower()
    if value in ("", "0"):
        return None
    isa = "baseline" if value == "1" else value
    if isa not in CPU_ISAS or (isa != "baseline" and not _is_x86_64()):
        allowed = ", ".join(CPU_ISAS if _is_x86_64() else ("baseline",))
        raise ExtensionUnavailableError(
            f"{PORTABLE_ENV}={value!r} names no instruction set a portable build of this "
            f"{platform.machine()} machine can target; use 1 or one of: {allowed}"
        )
    return isa


def host_isas() -> tuple[str, ...]:
    """The instruction sets this CPU runs, best first, as torch sees it.

    Read from ``torch.backends.cpu.get_cpu_capability()``, so ``ATEN_CPU_CAPABILITY=avx2``
    (which holds torch's own kernels to AVX2) holds a prebuilt module to AVX2 too.
    """
    if not _is_x86_64():
        return ("baseline",)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return ("avx512", "avx2", "baseline")
    if capability == "AVX2":
        return ("avx2", "baseline")
    return ("baseline",)


def extra_cflags() -> tuple[str, ...]:
    """The C++ flags of the CPU extension on this host (those of the named instruction set for a
    portable build)."""
    base = (*BASE_CFLAGS, *openmp_cflags())
    isa = portable_isa()
    if isa is None:
        isa = host_isas()[0]
    return (*base, *_ISA_CFLAGS[isa])


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
