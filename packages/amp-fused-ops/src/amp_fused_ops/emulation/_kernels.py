"""The CUDA kernels of ``csrc/cuda`` compiled for the CPU through the emulation layer.

docs/design.rst, decision 9: no GPU is available to this project's CI, so every ``.cu`` file
of ``csrc/cuda`` is also compiled as C++ for the CPU, against the CPU build of torch, with
``csrc/emulation/amp_emu.h`` force-included (CUDA's keywords, threads of a block as fibers,
warp shuffles, ``__syncthreads``, launch checks). The sources are not changed: the build only
rewrites each launch ``kernel<<<config>>>(args)`` into ``kernel % LaunchConfig(config)(args)``
and each ``extern __shared__ T name[];`` into a pointer to the emulator's dynamic shared memory.

The result is an extension whose ops take CPU tensors and run the GPU's code, thread by
thread: the multi-tensor ops of the CUDA extension under ``torch.ops.amp_fused_ops_emu``
(registered for the CPU dispatch key; :func:`load` returns them as a module with Apex's
``amp_C`` signatures, as ``get_extension("cuda")`` does), with the norm and SyncBN ops beside
them (``torch.ops.amp_fused_ops_emu.norm_forward`` ...). Two builds:

* ``"counting"`` (the default): every global-memory access of a kernel is counted (bytes
  read and written, and those that went through aligned 16-byte vector accesses), and
  misaligned vector accesses raise (``-fsanitize=alignment`` reported through the emulator);
* ``"asan"``: AddressSanitizer and UBSan; the Python process must preload ``libasan``
  (:func:`asan_environment` gives the variables).

:class:`~amp_fused_ops.emulation._graph.Graph` captures a sequence of emulated launches and the
ATen ops between them and replays it, as a CUDA graph does.

This is a development tool (the ``cuda_emulation`` nox session and ``benchmarks/``), not a
path for users' tensors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch

from amp_fused_ops.extensions import _flags
from amp_fused_ops.ops import _apex_convention, _kernel_ops
from amp_fused_ops.ops._reference_mode import override_kernels
from amp_fused_ops.ops._registry import OPS_NAMESPACE as OPS_NAMESPACE_MAIN
from amp_fused_ops.ops._registry import REGISTRY

__all__ = [
    "BUILDS",
    "Counters",
    "asan_environment",
    "build_directory",
    "count_launches_only",
    "counters",
    "load",
    "multiprocessors",
    "reset_counters",
    "shared_memory_per_block",
]

logger = logging.getLogger(__name__)

BUILDS = ("counting", "asan")
OPS_NAMESPACE = "amp_fused_ops_emu"
"""Namespace of the emulated multi-tensor ops (``AMP_FUSED_OPS_NS`` in csrc/emulation/amp_emu.h)."""
CACHE_ENV = "AMP_FUSED_OPS_CACHE"
_CSRC = Path(__file__).resolve().parents[3] / "csrc"
_LAUNCH = re.compile(r"<<<(.*?)>>>", re.DOTALL)
# `extern __shared__ [alignas(N)] T name[];`: dynamic shared memory, a pointer to the emulator's.
_DYNAMIC_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:alignas\(\s*\d+\s*\)\s+)?((?:[A-Za-z_][\w:]*\s+)+?)(\w+)\s*\[\s*\]\s*;"
)
# Sources of csrc/cuda with no kernel in them, left out of the emulated builds: the norm op's
# autograd kernel (the emulated ops are called below autograd, by the tests and the routing).
_NOT_EMULATED = frozenset({"norm_autograd.cpp"})
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")

# -ffp-contract=off: every product is rounded on its own (no fused multiply-add), whatever the
# host; the kernels that depend on it say so with __fmul_rn, which nvcc never contracts.
_COMMON_CFLAGS = (
    "-g0",
    "-ffp-contract=off",
    "-Wno-unknown-pragmas",
    "-Wno-unused-function",
    "-Wno-unused-variable",
)
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
    blocks: int
    """Thread blocks of all launches (each launch adds its grid's x * y * z)."""
    threads: int
    """Threads of all launches (each launch adds its blocks times its threads per block)."""


def source_dirs() -> tuple[Path, Path]:
    """(``csrc/cuda``, ``csrc/emulation``) of this checkout or installed wheel."""
    return _CSRC / "cuda", _CSRC / "emulation"


def build_directory(build: str) -> Path:
    """Where ``build`` is compiled: ``$AMP_FUSED_OPS_CACHE/emulation/<build>`` by default."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "amp_fused_ops"
    return base / "emulation" / build


def _kernel_before(text: str, end: int) -> str:
    """The kernel expression that ends at ``end`` (``name`` or ``name<args>``), one line."""
    i = end
    while i > 0 and text[i - 1].isspace():
        i -= 1
    stop = i
    if i > 0 and text[i - 1] == ">":  # template arguments, nested brackets included
        depth = 0
        while i > 0:
            i -= 1
            depth += {">": 1, "<": -1}.get(text[i], 0)
            if depth == 0:
                break
    while i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_:"):
        i -= 1
    return " ".join(text[i:stop].split()).replace("\\", "\\\\").replace('"', '\\"')


def _rewrite(text: str, file: str) -> str:
    """Each ``kernel<<<config>>>(args)`` of ``text`` as a call of the emulator's launch, and
    each ``extern __shared__ T name[];`` as a pointer to the emulator's dynamic shared memory.

    The launch gets the kernel's name and source line (``file``: the source's name) for its
    error messages; the line count stays the same.
    """

    def launch(m: re.Match[str]) -> str:
        name = _kernel_before(text, m.start())
        line = text.count("\n", 0, m.start()) + 1
        return f' % ::amp_emu::LaunchConfig({m.group(1)}).named("{name}", "{file}", {line})'

    def dynamic(m: re.Match[str]) -> str:
        kind = " ".join(m.group(1).split())
        return f"{kind}* const {m.group(2)} = ::amp_emu::dynamic_shared<{kind}>();"

    text = _DYNAMIC_SHARED.sub(dynamic, text)
    return _LAUNCH.sub(launch, text)


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
        if path.suffix not in _SOURCE_SUFFIXES or path.name in _NOT_EMULATED:
            continue
        # .cu files become .cu.cpp so that they are compiled by the C++ compiler.
        target = out / (path.name + ".cpp" if path.suffix == ".cu" else path.name)
        _write_if_changed(target, _rewrite(path.read_text(), path.name))
        if path.suffix in (".cu", ".cpp"):
            sources.append(str(target))
    # Kernels that make the mistakes the checks must catch (tests/test_emulation.py).
    selftest = out / "amp_emu_selftest.cu.cpp"
    _write_if_changed(selftest, _rewrite((emulation / "selftest.cu").read_text(), "selftest.cu"))
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
            "amp_fused_ops.emulation._kernels.asan_environment()"
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
        # The libstdc++ the process uses, as for the extensions (extensions/_flags.py): a
        # toolchain that links its own copy statically crashes on the first error message.
        extra_ldflags=[*ldflags, *_flags.extra_ldflags()],
        build_directory=str(build_directory(build)),
        is_python_module=False,
        verbose=verbose,
    )
    _kernel_ops.define_kernel_ops(OPS_NAMESPACE)  # the norm and SyncBN ops' schemas
    # The "CUDA" kernels run on the CPU: Python numbers become float32 tensors, as for CUDA.
    module = _apex_convention.compiled_ops(OPS_NAMESPACE, "CPU", path, cpu_scalars=False)
    if verbose:
        logger.info("emulated extension (%s) ready in %.1f s", build, time.perf_counter() - start)
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
        # libasan clears the shadow of a fiber's whole stack at every swapcontext into it; at
        # the default threshold (64 KiB of shadow) it does so by remapping the shadow pages, a
        # system call and page faults per switch, which made the emulated kernels' system time
        # most of their run. memset clears the same bytes with no call (the checks are the same).
        "ASAN_OPTIONS": (
            "detect_leaks=0:halt_on_error=1:abort_on_error=0:clear_shadow_mmap_threshold=1073741824"
        ),
        "UBSAN_OPTIONS": "print_stacktrace=1",
    }


def _runtime() -> Any:
    """``torch.ops.amp_emu``: the emulator's own ops, which a loaded emulated build registers."""
    ops = torch.ops.amp_emu
    if not hasattr(ops, "counters"):
        raise RuntimeError(
            "no emulated build of the CUDA kernels is loaded in this process: call "
            "amp_fused_ops.emulation.load() first"
        )
    return ops


def counters(module: ModuleType | None = None) -> Counters:
    """The counters of the emulated extension (loaded by :func:`load`)."""
    del module
    return Counters(*_runtime().counters())


def reset_counters() -> None:
    """Set every counter to zero."""
    _runtime().reset_counters()


@contextlib.contextmanager
def _device_property(setter: str, value: int) -> Iterator[None]:
    """Inside the block, the emulated device's property that ``setter`` sets is ``value``."""
    previous = int(getattr(_runtime(), setter)(value))
    try:
        yield
    finally:
        getattr(_runtime(), setter)(previous)


def multiprocessors(count: int) -> contextlib.AbstractContextManager[None]:
    """Inside the block, the emulated device reports ``count`` SMs (an H100's 132 outside).

    Kernels that size their grids by the SM count then launch as on a GPU of that many SMs.
    A scaled-down device runs a kernel's whole-grid behaviour (blocks that walk several rows,
    per-block partial sums) on few enough rows to emulate, with the rows per SM of a real
    workload: 248 rows on 2 SMs have the 124 rows per SM of 16384 rows on 132.

    Example:
        >>> with emulation.multiprocessors(2):  # doctest: +SKIP
        ...     kernels.norm_forward(x, weight, bias, 1e-5, False, False, False)
    """
    return _device_property("set_multiprocessor_count", count)


def shared_memory_per_block(nbytes: int) -> contextlib.AbstractContextManager[None]:
    """Inside the block, the emulated device offers ``nbytes`` of shared memory per block with
    ``cudaFuncSetAttribute`` (an H100's 227 KiB outside; 99 KiB on an RTX-class GPU).

    Kernels that choose a layout by the device's shared memory then choose as on that GPU;
    ``cudaFuncSetAttribute`` asking for more raises, as it does there.
    """
    return _device_property("set_shared_memory_per_block_optin", nbytes)


@contextlib.contextmanager
def count_launches_only() -> Iterator[None]:
    """Inside the block, emulated launches are checked and counted but their threads do not run.

    The launch and block counters advance as in a full run; nothing is read or written, so the
    kernels' outputs are left as they were (not computed). For counting the launches of steps
    too large to emulate thread by thread; valid where the host's launch sequence does not
    depend on kernel results (no host read of a flag or a norm decides a later launch).

    Example:
        >>> with emulation.count_launches_only():  # doctest: +SKIP
        ...     optimizer.step()
        >>> emulation.counters().blocks  # doctest: +SKIP
    """
    previous = bool(_runtime().count_only())
    _runtime().set_count_only(True)
    try:
        yield
    finally:
        _runtime().set_count_only(previous)


@contextlib.contextmanager
def amp_C_on_emulated_kernels(module: ModuleType) -> Iterator[None]:
    """Inside the block, the ``amp_C`` ops on CPU tensors run the kernels of ``module``.

    For measuring whole steps on the emulated CUDA kernels: the counters then count the
    launches and bytes the CUDA kernels would have made. It covers every call of the ops
    (``amp_C`` and ``multi_tensor_applier``, the fused optimizers, amp's O2 step,
    ``torch.ops.amp_fused_ops.<op>``): the override sits at the dispatcher, as
    :func:`amp_fused_ops.extensions.use_reference` does (and, like it, applies to this thread).
    An op ``module`` lacks, and calls on tensors of other devices, run as usual.

    Args:
        module: Ops with Apex's ``amp_C`` signatures: the emulated extension, as :func:`load`
            returns it.
    """
    most = {name: max(spec.list_counts) for name, spec in REGISTRY.items() if spec.list_counts}

    def route(qualified: str, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        namespace, name = qualified.split("::", 1)
        kernel = getattr(module, name, None) if namespace == OPS_NAMESPACE_MAIN else None
        if kernel is None or name not in most:
            return None
        lists = args[2 : 2 + most[name]]
        first = next((part[0] for part in lists if part), args[1])
        if not isinstance(first, torch.Tensor) or not first.is_cpu:
            return None
        return functools.partial(_apex_call, kernel, most[name])

    with override_kernels("emulated", route):
        yield


def _apex_call(kernel: Callable[..., Any], most: int, *args: Any) -> Any:
    """``kernel`` (Apex's convention) called with an op's schema arguments ``args``."""
    lists = [list(part) for part in args[2 : 2 + most] if part is not None]
    return kernel(args[0], args[1], lists, *args[2 + most :])
