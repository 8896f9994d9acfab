"""Hatchling build hook: ship the C++/CUDA sources, and compile the extensions when asked.

Every regular wheel gets ``csrc/`` as ``amp_fused_ops/csrc`` (the loader compiles it just in
time; editable installs find it next to ``src/``). The compile step is a no-op unless
``AMP_FUSED_OPS_BUILD_EXT=1`` (so ``nox -s build`` and plain ``pip install`` make a
pure-Python wheel that compiles just in time on first use). With the variable set, the wheel
target compiles the portable modules of the torch in the build environment through the loader
(``amp_fused_ops/extensions``: the same ``torch.utils.cpp_extension`` build as just in time;
the CPU kind once per instruction set, AVX2 and AVX-512 on x86-64), ships them in
``amp_fused_ops/_prebuilt/``, each with a JSON note of the torch, Python and instruction set it
was built for and of its size and SHA-256 (checked before it is loaded), and marks the wheel
platform-specific. The build needs torch importable, so build with
``python -m build --no-isolation`` (or put torch in the build requirements)::

    AMP_FUSED_OPS_BUILD_EXT=1 python -m build --no-isolation --wheel packages/amp-fused-ops

A module built with ATen's C++ API runs only under the torch release it was built against. To
serve several releases with one wheel, build their modules first, each in an environment with
that torch (``python -m amp_fused_ops build cpu --wheel-dir DIR``), and name the folders in
``AMP_FUSED_OPS_PREBUILT_DIRS`` (separated by ``os.pathsep``): the wheel ships them too. The
loader takes the module of the running torch release and the best instruction set of the CPU,
and compiles just in time under any other torch. The wheel does not pin torch.

The variable names the kinds: ``1`` or ``cpu`` (the CPU extension), ``cuda``, or
``cpu,cuda`` / ``all``. The CUDA extension needs a CUDA build of torch and nvcc, and is
compiled for ``TORCH_CUDA_ARCH_LIST`` (no GPU needed; set it to every architecture the wheel
must serve, e.g. ``8.0;9.0;10.0+PTX``); the loader uses it only with the exact torch version it
was built against (its CUDA runtime is part of that) and on a GPU of one of those
architectures::

    AMP_FUSED_OPS_BUILD_EXT=cpu,cuda TORCH_CUDA_ARCH_LIST="8.0;9.0" \\
        python -m build --no-isolation --wheel packages/amp-fused-ops
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

BUILD_ENV = "AMP_FUSED_OPS_BUILD_EXT"
PREBUILT_DIRS_ENV = "AMP_FUSED_OPS_PREBUILT_DIRS"
_KIND_VALUES = {"1": ("cpu",), "all": ("cpu", "cuda")}


def prebuilt_dirs(value: str) -> list[Path]:
    """The folders ``AMP_FUSED_OPS_PREBUILT_DIRS=value`` names (``os.pathsep``-separated).

    Raises:
        RuntimeError: If one is not a folder.
    """
    folders = [Path(part) for part in value.split(os.pathsep) if part.strip()]
    missing = [str(folder) for folder in folders if not folder.is_dir()]
    if missing:
        raise RuntimeError(f"{PREBUILT_DIRS_ENV} names folders that do not exist: {missing}")
    return folders


def requested_kinds(value: str) -> tuple[str, ...]:
    """The extension kinds ``AMP_FUSED_OPS_BUILD_EXT=value`` asks for (empty: none).

    Raises:
        ValueError: If the value names an unknown kind.
    """
    value = value.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return ()
    if value in _KIND_VALUES:
        return _KIND_VALUES[value]
    kinds = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [kind for kind in kinds if kind not in ("cpu", "cuda")]
    if unknown:
        raise ValueError(
            f"{BUILD_ENV}={value!r} names unknown kinds {unknown}; "
            "use 1, cpu, cuda, cpu,cuda or all"
        )
    return kinds


def _load_loader(root: Path) -> ModuleType:
    """Import ``src/amp_fused_ops/extensions`` by path (without the package's __init__).

    Its modules import each other relatively, so the folder loads as a package of its own.
    Loading a compiled module imports ``amp_fused_ops.ops._registry`` (the op registry):
    ``src/`` goes first on ``sys.path`` so that this tree's package is the one imported, even
    where none (or another version) is installed in the build environment.
    """
    sys.path.insert(0, str(root / "src"))
    folder = root / "src" / "amp_fused_ops" / "extensions"
    name = "_amp_fused_ops_extension_for_build"
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import the extension loader from {folder}")
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package  # the relative imports look the package up by name
    spec.loader.exec_module(package)
    importlib.import_module(f"{name}._api")  # imports the other modules, which it uses
    return package


class CustomBuildHook(BuildHookInterface):
    """Compile the extensions named by ``AMP_FUSED_OPS_BUILD_EXT`` into the wheel."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Add csrc/ to a regular wheel; with the variable set, also the compiled extension.

        Args:
            version: ``"standard"`` or ``"editable"``; editable installs compile just in time.
            build_data: Hatchling's build data; gets the module, its note and the wheel tag.

        Raises:
            RuntimeError: If torch cannot be imported or the extension fails to compile.
        """
        if self.target_name != "wheel" or version == "editable":
            return  # editable installs find csrc/ next to src/
        csrc = Path(self.root) / "csrc"
        if csrc.is_dir():
            build_data["force_include"][str(csrc)] = "amp_fused_ops/csrc"
        kinds = requested_kinds(os.environ.get(BUILD_ENV, ""))
        if not kinds:
            if os.environ.get(PREBUILT_DIRS_ENV, "").strip():
                raise RuntimeError(
                    f"{PREBUILT_DIRS_ENV} is set but {BUILD_ENV} is not: set {BUILD_ENV}=cpu "
                    "(or cpu,cuda) to build a wheel with prebuilt modules"
                )
            return
        try:
            loader = _load_loader(Path(self.root))
        except ImportError as error:
            raise RuntimeError(
                f"{BUILD_ENV} needs torch in the build environment ({error}); build with "
                "`python -m build --no-isolation` in an environment that has torch"
            ) from error
        # The modules and notes are gathered here; finalize() removes the folder.
        self._build_dir = Path(tempfile.mkdtemp(prefix="amp_fused_ops_ext_"))
        staged = self._build_dir / "_prebuilt"
        for kind in kinds:
            try:
                written = loader._api.build_for_wheel(kind, staged)
            except loader._settings.ExtensionUnavailableError as error:
                raise RuntimeError(
                    f"{BUILD_ENV}: cannot build the {kind} extension: {error}"
                ) from error
            for path in written:
                self.app.display_info(f"{BUILD_ENV}: shipping {path.name}")
        for folder in prebuilt_dirs(os.environ.get(PREBUILT_DIRS_ENV, "")):
            gathered = []
            for kind in loader._settings.KINDS:
                try:
                    gathered += loader._prebuilt.gather(kind, folder, staged)
                except loader._settings.ExtensionUnavailableError as error:
                    raise RuntimeError(f"{PREBUILT_DIRS_ENV}: {error}") from error
            if not gathered:
                raise RuntimeError(f"{PREBUILT_DIRS_ENV}: {folder} holds no prebuilt module")
            for path in gathered:
                self.app.display_info(f"{PREBUILT_DIRS_ENV}: shipping {path.name} (from {folder})")
        for path in sorted(staged.iterdir()):
            build_data["force_include"][str(path)] = f"amp_fused_ops/_prebuilt/{path.name}"
        build_data["pure_python"] = False
        # One wheel for every Python: the modules link torch's C++ libraries, no Python API.
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"
        # No pin on torch: the loader takes the module built for the running torch release and
        # compiles just in time under any other (the package's own torch range applies).

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        """Remove the temporary build folder once the wheel is written.

        Args:
            version: ``"standard"`` or ``"editable"``.
            build_data: Hatchling's build data (unused).
            artifact_path: The wheel that was written (unused).
        """
        build_dir = getattr(self, "_build_dir", None)
        if build_dir is not None:
            shutil.rmtree(build_dir, ignore_errors=True)
