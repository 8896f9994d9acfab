"""The CUDA kernels compiled for the CPU through the emulation layer (a development tool).

The ``.cu`` sources of amp-fused-ops, unchanged, compiled as C++ for the CPU with a header
that emulates CUDA's threads, warps, barriers and launches (docs/design.rst, "Testing CUDA
code"). Two builds: ``"counting"`` counts every launch, thread block and global-memory byte
and raises on misaligned vector accesses; ``"asan"`` runs under AddressSanitizer and UBSan (the
process must preload libasan: :func:`asan_environment`). Not a path for users' tensors::

    from amp_fused_ops import emulation

    kernels = emulation.load("counting")      # compiles once (ninja), then cached
    emulation.reset_counters()
    kernels.multi_tensor_scale(2048, flag, [src, dst], 0.5)
    counts = emulation.counters()             # launches, bytes read and written
"""

from __future__ import annotations

from amp_fused_ops.emulation._graph import Graph
from amp_fused_ops.emulation._kernels import (
    Counters,
    amp_C_on_emulated_kernels,
    asan_environment,
    build_directory,
    count_launches_only,
    counters,
    load,
    multiprocessors,
    reset_counters,
    shared_memory_per_block,
)

__all__ = [
    "load",
    "asan_environment",
    "build_directory",
    "count_launches_only",
    "multiprocessors",
    "shared_memory_per_block",
    "counters",
    "reset_counters",
    "Counters",
    "Graph",
    "amp_C_on_emulated_kernels",
]
