"""The CUDA kernels of ``csrc/cuda`` compiled for the CPU through the emulation layer.

DESIGN decision 9: no GPU is available to this project in practice, so every ``.cu`` file
of ``csrc/cuda`` is also compiled as C++ for the CPU, against the CPU build of torch, with
``csrc/emulation/amp_emu.h`` force-included (CUDA's keywords, threads of a block as fibers,
warp shuffles, ``__syncthreads``, launch checks). The sources are not changed: the build only
rewrites each launch ``kernel<<<config>>>(args)`` into ``kernel % LaunchConfig(config)(args)``.

The result is an extension whose ops take CPU tensors and run the GPU's code, thread by
thread: the multi-tensor ops of the CUDA extension under ``torch.ops.amp_fused_ops_emu``
(registered for the CPU dispatch key; :func:`load` returns them as a module with Apex's
``amp_C`` signatures, as ``get_extension("cuda")`` does), and the norm and SyncBN ops under
``torch.ops.amp_fused_ops_emu_ops``. Two builds:

* ``"counting"`` (the default): every global-memory access of a kernel is counted (bytes
  read and written, and those that went through aligned 16-byte vector accesses), and
  misaligned vector accesses raise (``-fsanitize=alignment`` reported through the emulator);
* ``"asan"``: AddressSanitizer and UBSan; the Python process must preload ``libasan``
  (:func:`asan_environment` gives the variables).

This is a development tool (the ``cuda_emulation`` nox session and ``benchmarks/``), not a
path for users' tensors.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from amp_fused_ops import _amp_C

__all__ = [
    "BUILDS",
    "Counters",
    "asan_environment",
    "build_directory",
    "counters",
    "load",
    "reset_counters",
]

BUILDS = ("counting", "asan")
OPS_NAMESPACE = "amp_fused_ops_emu"
"""Namespace of the emulated multi-tensor ops (``AMP_FUSED_OPS_NS`` in csrc/emulation/amp_emu.h)."""
CACHE_ENV = "AMP_FUSED_OPS_CACHE"
_CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
_LAUNCH = re.compile(r"<<<(.*?)>>>", re.DOTALL)
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")

_COMMON_CFLAGS = ("-g0", "-Wno-unknown-pragmas", "-Wno-unused-function", "-Wno-unused-variable")
_BUILD_FLAGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # (compile flags, link flags)
    "counting": (
        (
            "-O2",
            "-DAMP_EMU_COUNTING",
            "-fsanitize=alignment",
            # ThreadSanitizer's instrumentation without its runtime: a call before every
            # load and store, to the emulator's hooks (csrc/emulation/amp_emu_runtime.cpp).
            # Not AddressSanitizer's, which leaves out a store to an address that a load of
            # the same basic block already checked (in-place kernels counted no writes).
            "-fsanitize=thread",
            "--param=tsan-instrument-func-entry-exit=0",
        ),
        (),
    ),
    "asan": (
        (
            "-O1",
            "-fno-omit-frame-pointer",
            "-fsanitize=address,undefined",
            "-fno-sanitize=vptr",
        ),
        ("-fsanitize=address,undefined",),
    ),
}


class Counters(NamedTuple):
    """Kernel launches and global-memory traffic since the last :func:`reset_counters`."""

    launches: int
    bytes_read: int
    bytes_written: int
    vector_bytes_read: int
    vector_bytes_written: int


def source_dirs() -> tuple[Path, Path]:
    """(``csrc/cuda``, ``csrc/emulation``) of this checkout or installed wheel."""
    return _CSRC / "cuda", _CSRC / "emulation"


def build_directory(build: str) -> Path:
    """Where ``build`` is compiled: ``$AMP_FUSED_OPS_CACHE/emulation/<build>`` by default."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "amp_fused_ops"
    return base / "emulation" / build


def _rewrite(text: str) -> str:
    return _LAUNCH.sub(lambda m: f" % ::amp_emu::LaunchConfig({m.group(1)})", text)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _prepare_sources(build: str) -> list[str]:
    """Rewritten copies of csrc/cuda (launches only) in the build folder; the sources to compile."""
    cuda, emulation = source_dirs()
    if not cuda.is_dir():
        raise RuntimeError(f"no CUDA sources to emulate: {cuda} is not a folder")
    out = build_directory(build) / "src"
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    for path in sorted(cuda.iterdir()):
        if path.suffix not in _SOURCE_SUFFIXES:
            continue
        # .cu files become .cu.cpp so that they are compiled by the C++ compiler.
        target = out / (path.name + ".cpp" if path.suffix == ".cu" else path.name)
        _write_if_changed(target, _rewrite(path.read_text()))
        if path.suffix in (".cu", ".cpp"):
            sources.append(str(target))
    # Kernels that make the mistakes the checks must catch (tests/test_emulation.py).
    selftest = out / "amp_emu_selftest.cu.cpp"
    _write_if_changed(selftest, _rewrite((emulation / "selftest.cu").read_text()))
    sources += [str(selftest), str(emulation / "amp_emu_runtime.cpp")]
    return sources


@functools.cache
def load(build: str = "counting", *, verbose: bool = False) -> ModuleType:
    """Compile (if needed) and import the emulated extension ``build`` (one of :data:`BUILDS`).

    Raises:
        ValueError: ``build`` is not one of :data:`BUILDS`.
        RuntimeError: the build is ``"asan"`` and ``libasan`` is not preloaded.
    """
    from torch.utils import cpp_extension

    if build not in BUILDS:
        raise ValueError(f"build must be one of {BUILDS}, got {build!r}")
    if build == "asan" and "libasan" not in os.environ.get("LD_PRELOAD", ""):
        raise RuntimeError(
            "the asan build needs libasan preloaded: run Python with the variables of "
            "amp_fused_ops._emulation.asan_environment()"
        )
    _, emulation = source_dirs()
    cflags, ldflags = _BUILD_FLAGS[build]
    start = time.perf_counter()
    path = cpp_extension.load(
        name=f"amp_fused_ops_emulated_{build}",
        sources=_prepare_sources(build),
        extra_cflags=[
            *_COMMON_CFLAGS,
            *cflags,
            "-include",
            str(emulation / "amp_emu.h"),
            f"-I{emulation / 'include'}",
            f"-I{emulation}",
        ],
        extra_ldflags=list(ldflags),
        build_directory=str(build_directory(build)),
        is_python_module=False,
        verbose=verbose,
    )
    # The "CUDA" kernels run on the CPU: Python numbers become float32 tensors, as for CUDA.
    module = _amp_C.compiled_ops(OPS_NAMESPACE, "CPU", path, cpu_scalars=False)
    if verbose:
        print(f"emulated extension ({build}) ready in {time.perf_counter() - start:.1f} s")
    return module


def asan_environment() -> dict[str, str]:
    """Environment variables for a Python process that loads the ``"asan"`` build.

    Raises:
        RuntimeError: the compiler has no AddressSanitizer runtime (``libasan.so``).
    """

    def find(name: str) -> str:
        return subprocess.run(
            [os.environ.get("CXX", "c++"), f"-print-file-name={name}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    library = find("libasan.so")
    if not os.path.isabs(library) or not os.path.exists(library):
        raise RuntimeError(
            f"the asan build needs the compiler's AddressSanitizer runtime, but "
            f"`c++ -print-file-name=libasan.so` gives {library!r}: install it (libasan of "
            "the compiler's version, e.g. the Debian / Ubuntu package libasan8 for gcc 12)"
        )
    # libstdc++ right after libasan: the Python binary does not link it, and libasan, loaded
    # first, must find the real __cxa_throw when it starts (an exception thrown in the
    # extension otherwise stops the process on an internal CHECK).
    cxx_library = find("libstdc++.so.6")
    preload = [str(Path(library).resolve())]
    if os.path.isabs(cxx_library) and os.path.exists(cxx_library):
        preload.append(str(Path(cxx_library).resolve()))
    return {
        "LD_PRELOAD": " ".join(preload),
        # Python and torch keep memory until exit by design; the leak check would only see them.
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
        "UBSAN_OPTIONS": "print_stacktrace=1",
    }


def counters(module: ModuleType | None = None) -> Counters:
    """The counters of the emulated extension (loaded by :func:`load`)."""
    import torch

    del module
    return Counters(*torch.ops.amp_emu.counters())


def reset_counters() -> None:
    """Set every counter to zero."""
    import torch

    torch.ops.amp_emu.reset_counters()
