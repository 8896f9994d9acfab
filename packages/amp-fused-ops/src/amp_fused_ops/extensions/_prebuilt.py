"""The modules a wheel ships (``_prebuilt/``): which one this process loads, and writing them.

A module compiled with ATen's C++ API runs only under the torch release it was compiled
against. A wheel therefore ships one module per torch release it serves and, for the CPU kind,
per instruction set (:data:`_flags.WHEEL_CPU_ISAS`), each with a note beside it::

    amp_fused_ops_cpu.torch-2.13.0.avx512.so
    amp_fused_ops_cpu.torch-2.13.0.avx512.json  {"file", "torch", "python", "isa", "size", ...}

A CPU module is chosen when its torch release equals this torch's without the local label
(``2.13.0`` serves ``2.13.0+cpu`` and the CUDA builds of 2.13.0: the CPU kernels link only
torch's CPU libraries) and this CPU has its instruction set; the best such set wins. A CUDA
module needs the exact torch version (its CUDA runtime is part of it) and a GPU its
architectures cover. The Python version does not matter: the modules are libraries of
dispatcher ops that link torch's C++ libraries and no Python API, so the module built under one
Python serves torch's builds for every other (the wheel is tagged ``py3-none``). Under any other
torch, nothing matches and the loader compiles just in time, as it would without a wheel;
:func:`mismatch_reason` says why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from . import _flags as flags
from . import _record as record
from . import _toolkit as toolkit
from ._record import DamagedBuildError
from ._settings import MARKER, MODULE_NAMES, PREBUILT_DIR

logger = logging.getLogger(__name__)

NOTE_KEYS = ("file", "torch", "python", "isa", "arch", "size", "sha256")
"""What a note keeps of its module's build record."""


@dataclasses.dataclass(frozen=True)
class Prebuilt:
    """One module of the wheel and its note."""

    kind: str
    note: Path
    meta: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.note.parent / str(self.meta.get("file", ""))

    @property
    def torch(self) -> str:
        return str(self.meta.get("torch", ""))

    @property
    def isa(self) -> str:
        # A note written before modules were compiled per instruction set: the x86-64 baseline.
        return str(self.meta.get("isa", "baseline"))


def release(version: str) -> str:
    """``"2.13.0"`` for ``"2.13.0+cpu"``: a torch version without its local label."""
    return version.split("+", 1)[0]


def module_name(kind: str, meta: dict[str, Any]) -> str:
    """The file name a module has in a wheel: ``amp_fused_ops_cpu.torch-2.13.0.avx512.so``.

    The part before the first dot is the extension's name (:func:`_lookup.import_compiled`
    reads the kind from it).
    """
    variant = f".{meta['isa']}" if kind == "cpu" else ""
    return f"{MODULE_NAMES[kind]}.torch-{release(str(meta['torch']))}{variant}.so"


def shipped(kind: str, folder: Path | None = None) -> list[Prebuilt]:
    """Every module of ``kind`` in ``folder`` (default: the wheel's ``_prebuilt/``).

    Raises:
        DamagedBuildError: If a note cannot be read.
    """
    folder = PREBUILT_DIR if folder is None else folder
    if not folder.is_dir():
        return []
    notes = sorted(folder.glob(f"{MODULE_NAMES[kind]}.*json"))
    return [Prebuilt(kind, note, record.read_json(note)) for note in notes]


def _serves(module: Prebuilt) -> bool:
    """Whether ``module`` was built for this torch (not yet: this CPU or GPU)."""
    if module.kind == "cpu":
        return release(module.torch) == release(torch.__version__)
    return module.torch == torch.__version__


def _runs_here(module: Prebuilt) -> bool:
    """Whether this machine runs ``module``'s code: its CPU instructions, its GPU architecture."""
    if module.kind == "cpu":
        return module.isa in flags.host_isas()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return toolkit.arch_covers(str(module.meta.get("arch", "")), f"{major}.{minor}")
    return True


def select(kind: str) -> Path | None:
    """The module of the wheel this process should load for ``kind``, or ``None``.

    Raises:
        DamagedBuildError: If a note is unreadable, or the chosen module does not match it.
    """
    usable = [m for m in shipped(kind) if _serves(m) and _runs_here(m)]
    if not usable:
        return None
    if kind == "cpu":
        order = flags.host_isas()
        usable.sort(key=lambda m: order.index(m.isa))
    chosen = usable[0]
    problem = record.mismatch(chosen.path, chosen.meta)
    if problem is not None:
        raise DamagedBuildError(f"the prebuilt module of this wheel is damaged: {problem}")
    return chosen.path


def mismatch_reason(kind: str) -> str | None:
    """Why the wheel's modules of ``kind`` do not serve this process, or ``None``.

    ``None`` also when the wheel ships no module of ``kind`` (a pure-Python wheel, a checkout).
    """
    try:
        modules = shipped(kind)
        if not modules or select(kind) is not None:
            return None
    except DamagedBuildError as error:  # a note unreadable, or the chosen module damaged
        return str(error)
    here = f"torch {torch.__version__}"
    built = sorted({f"torch {m.torch}" for m in modules})
    serving = [m for m in modules if _serves(m)]
    if not serving:
        return f"the wheel's prebuilt {kind} modules are for {', '.join(built)}; this is {here}"
    if kind == "cpu":
        isas = ", ".join(sorted({m.isa for m in serving}))
        return (
            f"the wheel's prebuilt cpu modules for {here} need {isas}; this CPU runs "
            f"{', '.join(flags.host_isas())} (torch's CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()})"
        )
    archs = ", ".join(sorted({str(m.meta.get("arch")) for m in serving}))
    major, minor = torch.cuda.get_device_capability()
    return (
        f"the wheel's prebuilt cuda module is for architectures {archs}; this GPU is "
        f"sm_{major}{minor}"
    )


def stage(kind: str, build_dir: Path, out_dir: Path, *, isa: str | None = None) -> Path:
    """Copy the finished build in ``build_dir`` into ``out_dir`` (wheel name, with its note).

    ``isa``: the instruction set of a CPU module. The folder's key covers the compiler flags,
    so a folder filled by a just-in-time build whose host flags are those of ``isa`` (the
    AVX-512 flags on a CPU with AVX-512) holds exactly that module; its own record says
    ``host``.

    Returns:
        The copied module.

    Raises:
        DamagedBuildError: If the build is unfinished or does not match its record.
        ValueError: If a CPU module's instruction set is unknown (a host build, no ``isa``).
    """
    module = record.verified_module(build_dir)
    if module is None:
        raise DamagedBuildError(f"{build_dir} holds no finished build of the {kind} extension")
    built = record.read_json(build_dir / MARKER)
    meta = {key: built[key] for key in NOTE_KEYS if key in built}
    if isa is not None:
        meta["isa"] = isa
    if kind == "cpu" and meta.get("isa") not in flags.CPU_ISAS:
        raise ValueError(
            f"the CPU module in {build_dir} was built for {meta.get('isa')!r}, not for one of "
            f"{flags.CPU_ISAS}: name the instruction set its flags are those of"
        )
    name = module_name(kind, meta)
    meta["file"] = name
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(module, out_dir / name)
    (out_dir / f"{name.removesuffix('.so')}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out_dir / name


def gather(kind: str, source: Path, out_dir: Path) -> list[Path]:
    """Copy every module of ``kind`` that ``source`` holds (written by :func:`stage`) into
    ``out_dir``, checked against its note.

    Returns:
        The copied modules.

    Raises:
        DamagedBuildError: If a module does not match its note, or ``out_dir`` already holds a
            different module of the same name.
    """
    copied = []
    for module in shipped(kind, source):
        problem = record.mismatch(module.path, module.meta)
        if problem is not None:
            raise DamagedBuildError(f"{module.note}: {problem}")
        target = out_dir / module.path.name
        if target.exists() and record.mismatch(target, module.meta) is not None:
            raise DamagedBuildError(
                f"two different modules named {target.name}: {module.path} and {target}"
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(module.path, target)
        shutil.copyfile(module.note, out_dir / module.note.name)
        copied.append(target)
    return copied
