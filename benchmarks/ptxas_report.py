"""Registers, shared memory and spills of every CUDA kernel, per GPU architecture (ptxas -v).

Compiles each ``.cu`` file of ``packages/amp-fused-ops/csrc/cuda`` device side only
(``nvcc -cubin -Xptxas -v``, the CUDA extension's own flags) once per architecture, for
``-gencode arch=compute_XY,code=sm_XY``: the cubin a wheel built for that architecture holds.
The architectures are every real one the installed nvcc lists (``nvcc --list-gpu-arch``;
CUDA 13 starts at sm_75: sm_70 / sm_72 were dropped), or ``--arch``.

ptxas reports each kernel instantiation; the table groups them by kernel and, for the
multi-tensor kernels, by functor (the first template argument), and gives per architecture
the most registers, static shared memory and spill bytes (stores + loads) of the group. The
full list goes to ``benchmarks/out/ptxas_report.json``.

Exits with status 1 when a kernel of an optimizer source (``OPTIMIZER_SOURCES``) spills
registers to local memory on any architecture compiled: an optimizer step is memory-bound,
and a spill adds local-memory traffic to every element.

Needs nvcc and a CUDA build of torch (its headers); no GPU. ``nox -s cuda_ptxas`` runs it.

Usage:
    python benchmarks/ptxas_report.py [--arch 80 90] [--files multi_tensor_adam.cu] [--jobs N]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "packages" / "amp-fused-ops" / "csrc"
OUT = ROOT / "benchmarks" / "out" / "ptxas_report.json"
# TORCH_CUDA_ARCH_LIST of a prebuilt wheel (noxfile.py, PREBUILT_CUDA_ARCHS: 8.0;9.0;10.0+PTX).
WHEEL_ARCHS = ("80", "90", "100")
# One file of ptxas's figures per (source, arch, sources' and flags' hash): a rerun compiles
# only what changed.
CACHE = ROOT / "benchmarks" / "out" / "ptxas_cache"

# The sources of the optimizer kernels: a spill in any of their kernels fails the report.
OPTIMIZER_SOURCES = ("multi_tensor_adam.cu", "multi_tensor_optim.cu", "multi_tensor_lamb_stages.cu")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


@dataclass(frozen=True)
class Kernel:
    """One kernel instantiation on one architecture, as ptxas reports it."""

    source: str
    arch: str
    mangled: str
    name: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def nvcc_path() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home) / "bin" / "nvcc" if home else None
    if candidate is not None and candidate.exists():
        return str(candidate)
    found = shutil.which("nvcc")
    if found is None:
        raise RuntimeError("nvcc not found in $CUDA_HOME/bin or on PATH: install a CUDA toolkit")
    return found


def real_archs(nvcc: str) -> list[str]:
    """The architectures nvcc compiles for (``75``, ``80``, ...), from ``--list-gpu-arch``."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True)
    archs = {m.group(1) for m in re.finditer(r"compute_(\d+)\b", out.stdout)}
    return sorted(archs, key=int)


def compile_flags(nvcc: str) -> list[str]:
    """The CUDA extension's device flags and include paths (a CUDA build of torch's headers)."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        raise RuntimeError(
            f"torch {torch.__version__} is a CPU build: its headers lack ATen/cuda; run with a "
            "CUDA build of torch (nox -s cuda_ptxas installs one)"
        )
    sys.path.insert(0, str(ROOT / "packages" / "amp-fused-ops" / "src"))
    from amp_fused_ops.extensions import cuda_compile_settings

    nvcc_flags, toolkit_includes = cuda_compile_settings(Path(nvcc).resolve().parents[1])
    includes = [
        *cpp_extension.include_paths(device_type="cuda"),
        *toolkit_includes,
        sysconfig.get_paths()["include"],
        str(CSRC),
        str(CSRC / "cuda"),
    ]
    return [
        *cpp_extension.COMMON_NVCC_FLAGS,
        *nvcc_flags,
        "-std=c++20",
        "-DTORCH_EXTENSION_NAME=amp_fused_ops_cuda",
        *(f"-I{path}" for path in includes),
    ]


def demangle(names: list[str], nvcc: str) -> dict[str, str]:
    filt = Path(nvcc).with_name("cu++filt")
    tool = str(filt) if filt.exists() else shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if len(lines) != len(names):
        return {n: n for n in names}
    return dict(zip(names, lines, strict=True))


def _cache_key(nvcc: str, flags: list[str], source: Path, arch: str) -> str:
    digest = hashlib.sha256("\0".join([nvcc, *flags, arch, source.name]).encode())
    for path in sorted(CSRC.rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h") and "emulation" not in path.parts:
            digest.update(path.read_bytes())
    return f"{source.stem}-sm{arch}-{digest.hexdigest()[:16]}"


def compile_one(nvcc: str, flags: list[str], source: Path, arch: str) -> list[dict[str, object]]:
    """Compiles ``source`` for sm_``arch``; ptxas's figures of each kernel entry (cached)."""
    cached = CACHE / f"{_cache_key(nvcc, flags, source, arch)}.json"
    if cached.exists():
        return list(json.loads(cached.read_text()))
    kernels = _compile(nvcc, flags, source, arch)
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(kernels))
    return kernels


def _compile(nvcc: str, flags: list[str], source: Path, arch: str) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            nvcc, "-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
            *flags, "-o", str(Path(tmp) / "out.cubin"), str(source),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source.name} for sm_{arch}:\n{result.stderr[-4000:]}")
    kernels: list[dict[str, object]] = []
    current: dict[str, object] | None = None
    for line in result.stderr.splitlines():
        if m := _ENTRY.search(line):
            current = {"mangled": m.group(1), "arch": m.group(2)}
            kernels.append(current)
        elif current is not None and (m := _SPILLS.search(line)):
            current["stack_bytes"], current["spill_store_bytes"], current["spill_load_bytes"] = (
                int(g) for g in m.groups()
            )
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m.group(1))
            current["shared_bytes"] = int(m.group(2) or 0)
    return kernels


def group_name(name: str) -> str:
    """``ns::kernel<ns::AdamOp<float, 2>, float>(...)`` -> ``kernel<AdamOp>``."""
    base = name.replace("(anonymous namespace)::", "").split("(")[0]
    head, _, args = base.partition("<")
    head = head.split()[-1].split("::")[-1]
    if not args:
        return head
    first = re.split(r"[<,>]", args, maxsplit=1)[0].strip().split("::")[-1]
    return f"{head}<{first}>"


def table(kernels: list[Kernel], archs: list[str]) -> str:
    groups: dict[tuple[str, str], dict[str, list[Kernel]]] = {}
    for k in kernels:
        groups.setdefault((k.source, group_name(k.name)), {}).setdefault(k.arch, []).append(k)
    header = "| source | kernel (instantiations) | " + " | ".join(f"sm_{a}" for a in archs) + " |"
    lines = [header, "|---|---|" + "---:|" * len(archs)]
    for (source, name), by_arch in sorted(groups.items()):
        count = max(len(v) for v in by_arch.values())
        cells = []
        for arch in archs:
            ks = by_arch.get(f"sm_{arch}", [])
            if not ks:
                cells.append("-")
                continue
            regs = max(k.registers for k in ks)
            smem = max(k.shared_bytes for k in ks)
            spill = max(k.spill_bytes for k in ks)
            cells.append(f"{regs} / {smem} / {spill}")
        lines.append(f"| {source} | `{name}` ({count}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--arch", nargs="+", help="e.g. 80 90 (default: every arch nvcc lists)")
    parser.add_argument("--files", nargs="+", help="e.g. multi_tensor_adam.cu (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    nvcc = nvcc_path()
    archs = args.arch or real_archs(nvcc)
    # The optimizer sources first: the ones whose spills fail the report.
    sources = sorted(
        (CSRC / "cuda").glob("*.cu"), key=lambda s: (s.name not in OPTIMIZER_SOURCES, s.name)
    )
    if args.files:
        sources = [s for s in sources if s.name in args.files]
        missing = sorted(set(args.files) - {s.name for s in sources})
        if missing:
            raise SystemExit(f"--files: no such source(s) under {CSRC / 'cuda'}: {missing}")
    flags = compile_flags(nvcc)
    raw: list[tuple[str, dict[str, object]]] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        # The architectures a wheel is built for first (then the others), each over every
        # source: a partial run (interrupted, or cut with --arch) covers those first.
        order = sorted(archs, key=lambda a: (a not in WHEEL_ARCHS, int(a)))
        jobs = {
            pool.submit(compile_one, nvcc, flags, source, arch): source.name
            for arch in order
            for source in sources
        }
        for job in concurrent.futures.as_completed(jobs):
            raw += [(jobs[job], entry) for entry in job.result()]
    names = demangle(sorted({str(e["mangled"]) for _, e in raw}), nvcc)
    kernels = [
        Kernel(
            source=source,
            arch=str(e["arch"]),
            mangled=str(e["mangled"]),
            name=names[str(e["mangled"])],
            registers=int(e.get("registers", 0)),  # type: ignore[call-overload]
            shared_bytes=int(e.get("shared_bytes", 0)),  # type: ignore[call-overload]
            stack_bytes=int(e.get("stack_bytes", 0)),  # type: ignore[call-overload]
            spill_store_bytes=int(e.get("spill_store_bytes", 0)),  # type: ignore[call-overload]
            spill_load_bytes=int(e.get("spill_load_bytes", 0)),  # type: ignore[call-overload]
        )
        for source, e in raw
    ]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release [\d.]+, V[\d.]+", version)
    print(f"nvcc {release.group(0) if release else '?'}, {datetime.date.today()}")
    print("cells: registers / static shared bytes / spill bytes (stores + loads), max over the")
    print("kernel's instantiations\n")
    print(table(kernels, archs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "nvcc": release.group(0) if release else None,
                "date": str(datetime.date.today()),
                "archs": archs,
                "kernels": [asdict(k) for k in kernels],
            },
            indent=1,
        )
    )
    spills = [k for k in kernels if k.spill_bytes > 0]
    for k in spills:
        print(f"spill: {k.source} {k.arch} {k.spill_bytes} bytes: {k.name}", file=sys.stderr)
    bad = [k for k in spills if k.source in OPTIMIZER_SOURCES]
    if bad:
        print(
            f"{len(bad)} optimizer kernel instantiation(s) spill registers (listed above): "
            "an optimizer step is memory-bound and a spill adds local-memory traffic per "
            "element; reduce the live values (fewer elements per thread, fewer lists) or "
            "raise the register budget (__launch_bounds__)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
