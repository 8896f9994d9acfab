"""Say which of the CPU features that decide CI's speed this machine has.

Usage: python3 .ci/cpu_features.py            # one line: the CPU, its features, torch's view
       python3 .ci/cpu_features.py --kind     # only whether bfloat16 is native here

PyTorch's bfloat16 arithmetic (matmuls, convolutions above all) runs on native instructions
only where the CPU has AMX or AVX512-BF16; on an AVX2-only CPU it is several times slower,
and so is every test that trains in bfloat16. ``.ci/run`` prints this line first, so that a
step's time can be read against the kind of machine that ran it. The flags come from
``/proc/cpuinfo``; what PyTorch uses comes from ``torch.backends.cpu.get_cpu_capability()``
(``ATEN_CPU_CAPABILITY`` lowers it) and oneDNN's bfloat16 support (``ONEDNN_MAX_CPU_ISA``
lowers it), when this Python has torch (the nox sessions may install their own).
Only the standard library is needed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
from pathlib import Path

# (name printed, /proc/cpuinfo flags that must all be present)
FEATURES = (
    ("AMX", ("amx_tile", "amx_bf16")),
    ("AVX512-BF16", ("avx512_bf16",)),
    ("AVX512", ("avx512f",)),
    ("AVX2", ("avx2",)),
)
# Environment variables that hold PyTorch's kernels below what the CPU has.
LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and flags, from the first processor of /proc/cpuinfo."""
    model, flags = "", set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), flags


def found(flags: set[str]) -> list[str]:
    """The names of FEATURES whose flags are all in ``flags``."""
    return [name for name, needed in FEATURES if set(needed) <= flags]


def kind(flags: set[str], onednn_bf16: bool | None = None) -> str:
    """Whether PyTorch's bfloat16 runs on native instructions here, in a few words.

    ``onednn_bf16`` (what torch reports, when known) tells a CPU with native bfloat16 that
    ``ONEDNN_MAX_CPU_ISA`` holds to AVX2 from one that runs it natively.
    """
    native = [name for name in found(flags) if name in ("AMX", "AVX512-BF16")]
    if not native:
        return "bfloat16 without native instructions"
    if onednn_bf16 is None:  # no torch here: judge the limit by its name
        limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
        onednn_bf16 = limit == "ALL" or "BF16" in limit or "AMX" in limit or "AVX10" in limit
    if not onednn_bf16:
        return f"bfloat16 without native instructions (the CPU's {native[0]} held back)"
    return f"native bfloat16 ({native[0]})"


def torch_view() -> tuple[str, bool | None]:
    """What PyTorch uses on this machine (or why that is not known), and oneDNN's bfloat16."""
    if importlib.util.find_spec("torch") is None:
        return "torch: not installed in this Python (the nox sessions install their own)", None
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    try:
        onednn_bf16: bool | None = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn_bf16 = None
    bf16 = {True: "yes", False: "no", None: "unknown"}[onednn_bf16]
    view = f"torch {torch.__version__}: CPU capability {capability}, oneDNN bfloat16 {bf16}"
    return view, onednn_bf16


def cores() -> str:
    """The machine's cores, and how many this process may run on when that is fewer.

    ``taskset`` or a container's CPU set narrows the second, and the nox sessions size their
    pytest-xdist workers and compile jobs by it (one per usable core).
    """
    total = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        usable = total
    if usable < total:
        return f"{total} cores ({usable} usable by this process)"
    return f"{total} cores"


def describe() -> str:
    """One line: the CPU, its cores, the features found, the limits set, and torch's view."""
    model, flags = cpuinfo()
    names = found(flags) or ["none of " + ", ".join(name for name, _ in FEATURES)]
    limits = [f"{name}={os.environ[name]}" for name in LIMITS if os.environ.get(name)]
    view, onednn_bf16 = torch_view()
    parts = [
        f"{cores()} of {model}",
        f"features {' '.join(names)}",
        kind(flags, onednn_bf16),
        *([f"limited by {' '.join(limits)}"] if limits else []),
        view,
    ]
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--kind", action="store_true", help="only whether bfloat16 is native, in a few words"
    )
    args = parser.parse_args(argv)
    if args.kind:
        print(kind(cpuinfo()[1]))  # without importing torch (seconds on a loaded machine)
    else:
        print(f"CPU: {describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
