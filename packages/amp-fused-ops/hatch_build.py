"""Hatchling build hook: ship the C++/CUDA sources, and compile the extensions when asked.

Every regular wheel gets ``csrc/`` as ``amp_fused_ops/csrc`` (the loader compiles it just in
time; editable installs find it next to ``src/``). The compile step is a no-op unless
``AMP_FUSED_OPS_BUILD_EXT=1`` (so ``nox -s build`` and plain ``pip install`` make a
pure-Python wheel that compiles just in time on first use). With the variable set,
the wheel target compiles ``csrc/cpu`` through the loader (``amp_fused_ops/extensions``: the
same ``torch.utils.cpp_extension`` build as just in time), ships the module in
``amp_fused_ops/_prebuilt/`` with a JSON note of the torch and Python it was built for and of
the module's size and SHA-256 (checked before it is loaded), and marks the wheel
platform-specific. The loader uses that module only when torch and Python
match; otherwise it compiles as usual. The build needs torch importable, so build with
``python -m build --no-isolation`` (or put torch in the build requirements)::

    AMP_FUSED_OPS_BUILD_EXT=1 python -m build --no-isolation --wheel packages/amp-fused-ops

The variable names the kinds: ``1`` or ``cpu`` (the CPU extension), ``cuda``, or
``cpu,cuda`` / ``all``. The CUDA extension needs a CUDA build of torch and nvcc, and is
compiled for ``TORCH_CUDA_ARCH_LIST`` (no GPU needed; set it to every architecture the wheel
must serve, e.g. ``8.0;9.0;10.0+PTX``); the loader uses it only on a GPU of one of those
architectures::

    AMP_FUSED_OPS_BUILD_EXT=cpu,cuda TORCH_CUDA_ARCH_LIST="8.0;9.0" \\
        python -m build --no-isolation --wheel packages/amp-fused-ops
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

BUILD_ENV = "AMP_FUSED_OPS_BUILD_EXT"
_KIND_VALUES = {"1": ("cpu",), "all": ("cpu", "cuda")}


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
            return
        try:
            loader = _load_loader(Path(self.root))
        except ImportError as error:
            raise RuntimeError(
                f"{BUILD_ENV} needs torch in the build environment ({error}); build with "
                "`python -m build --no-isolation` in an environment that has torch"
            ) from error
        # The notes shipped with the modules are written here; finalize() removes the folder.
        self._build_dir = Path(tempfile.mkdtemp(prefix="amp_fused_ops_ext_"))
        # A shipped wheel must run on any CPU of its architecture: no host-specific flags.
        os.environ[loader._settings.PORTABLE_ENV] = "1"
        torch_versions = {self._build_kind(loader, kind, build_data) for kind in kinds}
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        # The modules load only with the torch they were built for (the loader checks the
        # version, local label included): the wheel requires exactly that torch.
        build_data["dependencies"].extend(f"torch=={version}" for version in sorted(torch_versions))

    def _build_kind(self, loader: ModuleType, kind: str, build_data: dict[str, Any]) -> str:
        """Compile ``kind`` (or reuse its build) and add the module and its note to the wheel.

        The build goes into the loader's cache folder (``AMP_FUSED_OPS_CACHE``, else
        ``~/.cache/amp_fused_ops``) under the key of a portable build: a verified build of the
        same sources, flags, torch and Python is reused instead of compiled again.

        Returns:
            The torch version the module was built for.
        """
        build_dir = loader._cache.build_directory(kind)
        try:
            module_path = loader._api.build_extension(kind, force=False, build_dir=build_dir)
        except loader._settings.ExtensionUnavailableError as error:
            if not (build_dir / loader._settings.FAILED).exists():
                raise RuntimeError(
                    f"{BUILD_ENV}: cannot build the {kind} extension: {error}"
                ) from error
            try:  # an earlier failure is remembered by the cache; a wheel build tries again
                module_path = loader._api.build_extension(kind, force=True, build_dir=build_dir)
            except loader._settings.ExtensionUnavailableError as again:
                raise RuntimeError(
                    f"{BUILD_ENV}: cannot build the {kind} extension: {again}"
                ) from again
        name = loader._settings.MODULE_NAMES[kind]
        note = self._build_dir / f"{name}.json"
        # The build record (torch, Python, arch, size, SHA-256) is the note of the wheel.
        record = json.loads((build_dir / loader._settings.MARKER).read_text())
        keys = ("file", "torch", "python", "arch", "size", "sha256")
        note.write_text(json.dumps({key: record[key] for key in keys if key in record}))
        prebuilt = "amp_fused_ops/_prebuilt"
        build_data["force_include"][str(module_path)] = f"{prebuilt}/{module_path.name}"
        build_data["force_include"][str(note)] = f"{prebuilt}/{note.name}"
        self.app.display_info(
            f"{BUILD_ENV}: shipping the {kind} extension {module_path.name} (from {build_dir})"
        )
        return str(record["torch"])

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
