"""What the digits demo runs on, and what that hardware does with half precision.

Mixed precision pays only where the device computes in the half type natively: an NVIDIA
GPU's tensor cores, or a CPU with AMX or AVX512-BF16 that PyTorch is allowed to use. Elsewhere
PyTorch converts every bfloat16 value to float32 and back around each operation, so the
low-precision levels save memory but cost time. The demo says which case it is in, before it
starts and again in its table and figure, so that nobody reads a slow O1 on such a CPU as a
fault of mixed precision.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# CPU features that decide how fast bf16 / fp16 run, in the order the title lists them.
CPU_FEATURES = ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")
# Where PyTorch reports a feature itself (torch.cpu's capability report); avx512_fp16 has no
# such report, so /proc/cpuinfo answers for it.
_TORCH_REPORTS = {
    "amx_bf16": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "avx512f": "_is_avx512_supported",
    "avx2": "_is_avx2_supported",
}
# ONEDNN_MAX_CPU_ISA values that keep oneDNN (PyTorch's CPU convolutions and matmuls) below
# AVX512-BF16: bfloat16 is then converted, not computed natively.
_ONEDNN_BELOW_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE"}
_ONEDNN_BELOW_BF16 |= {"AVX512_CORE_VNNI"}
NICE = {
    "amx_bf16": "AMX-BF16",
    "amx_fp16": "AMX-FP16",
    "avx512_bf16": "AVX512-BF16",
    "avx512_fp16": "AVX512-FP16",
    "avx512f": "AVX-512",
    "avx2": "AVX2",
}


@dataclass(frozen=True)
class Machine:
    """What the numbers were measured on, and whether it computes the half type natively.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        name: the CPU model name or the GPU name.
        features: the CPU features of :data:`CPU_FEATURES` the CPU has.
        capability: ``torch.backends.cpu.get_cpu_capability()`` (the kernels ATen picked), or
            the CUDA compute capability as ``"9.0"``.
        held_to: the environment variables that hold PyTorch below the CPU's own features
            (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``), as ``NAME=value``.
        native_half: whether this process computes ``half_dtype`` natively.
        half_dtype: ``"bfloat16"`` or ``"float16"``.
    """

    device: str
    name: str
    features: tuple[str, ...]
    capability: str
    held_to: tuple[str, ...]
    native_half: bool
    half_dtype: str
    threads: int
    cores: int
    torch_version: str

    @property
    def kind(self) -> str:
        """A short name of the case: ``cuda``, ``cpu-native-bf16``, ``cpu-no-native-bf16`` ...."""
        if self.device == "cuda":
            return "cuda"
        short = "bf16" if self.half_dtype == "bfloat16" else "fp16"
        return f"cpu-{'native' if self.native_half else 'no-native'}-{short}"

    def describe(self) -> str:
        if self.device == "cuda":
            return f"{self.name} (compute capability {self.capability}), torch {self.torch_version}"
        flags = ", ".join(NICE[f] for f in self.features) if self.features else "no AVX2"
        held = f", held to {' '.join(self.held_to)}" if self.held_to else ""
        return (
            f"{self.name} [{flags}; torch kernels {self.capability}{held}], "
            f"{self.threads} of {self.cores} threads, torch {self.torch_version}"
        )

    def verdict(self) -> str:
        """One line: native half precision or not (the title's second line)."""
        if self.device == "cuda":
            what = "tensor cores" if self.native_half else "no tensor cores for it"
            return f"{self.half_dtype} on the GPU: {what}"
        native = "native" if self.native_half else "NOT native (converted to float32)"
        return f"{self.half_dtype} arithmetic on this CPU: {native}"

    def expectation(self) -> str:
        """What to expect from the step-time column on this hardware, in plain words."""
        if self.device == "cuda":
            if self.native_half:
                return (
                    f"This GPU (compute capability {self.capability}) runs {self.half_dtype} "
                    "matrix products and convolutions on its tensor cores: expect O1-O3 to "
                    "use less memory and, where the step is large enough to keep the GPU "
                    "busy, to run faster than O0. This CNN is small, so kernel launches may "
                    "dominate and the levels may run at about the same speed."
                )
            return (
                f"This GPU (compute capability {self.capability}) has no tensor cores for "
                f"{self.half_dtype} (float16 needs 7.0, bfloat16 8.0): expect memory savings "
                "but little or no speed-up."
            )
        wanted = ("amx_bf16", "avx512_bf16") if self.half_dtype == "bfloat16" else ()
        wanted = wanted or ("amx_fp16", "avx512_fp16")
        have = [NICE[f] for f in self.features if f in wanted]
        if self.half_dtype == "float16":
            return (
                "PyTorch's float16 convolutions on the CPU are slow on every CPU "
                f"({', '.join(have) or 'no AMX-FP16 or AVX512-FP16 here'}): expect O1-O3 "
                "to be many times slower than O0. float16 is for GPUs; use bfloat16 on CPUs."
            )
        if self.native_half:
            return (
                f"This CPU computes bfloat16 natively ({', '.join(have)}), and PyTorch uses "
                "it: expect O1-O3 steps faster than O0 (the convolutions and matrix products "
                "run in bfloat16) and less memory for activations."
            )
        why = (
            f"this CPU has {', '.join(have)}, but this process holds PyTorch to "
            f"{' '.join(self.held_to)}, so it runs as a CPU without them would"
            if have and self.held_to
            else "this CPU has neither AMX nor AVX512-BF16"
        )
        return (
            f"No native bfloat16 arithmetic here ({why}). PyTorch then converts bfloat16 to "
            "float32 and back around every operation, so expect O1-O3 to be SLOWER than O0, "
            "often several times, while they still save memory. That is this hardware, not "
            "mixed precision: on a CPU with AMX or AVX512-BF16, or on a GPU, the same levels "
            "are faster than O0. The accuracy and memory columns hold everywhere."
        )


def _cpuinfo_field(name: str) -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return None
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_features() -> tuple[str, ...]:
    """The features of :data:`CPU_FEATURES` this CPU has, as PyTorch reports them."""
    flags = set((_cpuinfo_field("flags") or "").split())
    found = []
    for feature in CPU_FEATURES:
        report = getattr(torch.cpu, _TORCH_REPORTS.get(feature, ""), None)
        has = bool(report()) if callable(report) else feature in flags
        if has:
            found.append(feature)
    return tuple(found)


def held_below(capability: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The environment settings that keep PyTorch from native bfloat16 on this CPU."""
    environ = dict(os.environ) if environ is None else environ
    held = []
    aten = environ.get("ATEN_CPU_CAPABILITY")
    if aten and not capability.upper().startswith("AVX512"):
        held.append(f"ATEN_CPU_CAPABILITY={aten}")
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        isa = environ.get(name, "")
        if isa.upper() in _ONEDNN_BELOW_BF16:
            held.append(f"{name}={isa}")
    return tuple(held)


def native_cpu_half(
    features: tuple[str, ...], capability: str, held: tuple[str, ...], half_dtype: str
) -> bool:
    """Whether PyTorch computes ``half_dtype`` natively on this CPU in this process."""
    if held or not capability.upper().startswith("AVX512"):
        return False
    wanted = ("amx_bf16", "avx512_bf16") if half_dtype == "bfloat16" else ("amx_fp16",)
    return any(f in features for f in wanted)


def describe_machine(device: torch.device, threads: int, half_dtype: str) -> Machine:
    """The CPU (or GPU), what it accelerates, threads and torch version."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        needed = (8, 0) if half_dtype == "bfloat16" else (7, 0)
        return Machine(
            "cuda",
            torch.cuda.get_device_name(device),
            (),
            f"{major}.{minor}",
            (),
            (major, minor) >= needed,
            half_dtype,
            threads,
            os.cpu_count() or 1,
            torch.__version__,
        )
    features = cpu_features()
    capability = torch.backends.cpu.get_cpu_capability()
    held = held_below(capability)
    return Machine(
        "cpu",
        _cpuinfo_field("model name") or platform.processor() or platform.machine(),
        features,
        capability,
        held,
        native_cpu_half(features, capability, held, half_dtype),
        half_dtype,
        threads,
        os.cpu_count() or 1,
        torch.__version__,
    )
