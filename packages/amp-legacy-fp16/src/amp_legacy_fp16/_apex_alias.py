"""Make ``import apex`` (and ``import amp_C``) resolve to the amp toolkit, without an ``apex``.

:func:`install` puts an import hook (a :class:`importlib.abc.MetaPathFinder`) at the front of
``sys.meta_path``. It answers for the names of :data:`ALIASES` only: each becomes a small alias
module (``apex.optimizers`` ...) whose attributes are read from the toolkit modules that hold
them (``amp_optimizers`` ...), so the objects are the toolkit's own (``apex.optimizers.FusedAdam
is amp_optimizers.FusedAdam``) and pickles name the toolkit, never ``apex``. A name whose toolkit
package is not installed raises ``ModuleNotFoundError`` naming the pip package to install; an
Apex module the toolkit does not provide (``apex.contrib`` ...) is not found, as when Apex was
built without it.

While installed, the hook also reports a distribution ``apex`` to ``importlib.metadata``, so
libraries that probe for Apex before using it (``importlib.util.find_spec("apex")`` and
``importlib.metadata.version("apex")``, as transformers does) find it.

Used by ``python -m amp_legacy_fp16.apex_run`` (see :mod:`amp_legacy_fp16.apex_run`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from amp_core import amp as _core_amp

from ._deprecation import DeprecatedFeatureWarning, _is_rank_zero
from ._version import __version__

__all__ = [
    "ALIASES",
    "APEX_VERSION",
    "Alias",
    "apex_initialize",
    "deprecated_warning",
    "install",
    "installed",
    "uninstall",
]


@dataclass(frozen=True)
class Alias:
    """One Apex module name and where its names live in the toolkit.

    Args:
        targets: Toolkit modules searched in order for each attribute.
        dist: The pip package that provides the first target.
        extras: ``(name, module, attribute)`` triples for names Apex defined that no target
            module holds (e.g. ``apex.parallel.ReduceOp``).
        exclude: Names of the targets not exposed (the toolkit's own extras).
        only: When given, the only names of the targets exposed (Apex's module held fewer).
    """

    targets: tuple[str, ...]
    dist: str
    extras: tuple[tuple[str, str, str], ...] = ()
    exclude: tuple[str, ...] = ()
    only: tuple[str, ...] = ()


_AMP = Alias(
    ("amp_core.amp", "amp_legacy_fp16.amp"),
    "amp-core",
    extras=(("initialize", "amp_legacy_fp16._apex_alias", "apex_initialize"),),
)
_OPTIMIZERS = Alias(("amp_optimizers",), "amp-optimizers")
_PARALLEL = Alias(
    ("amp_parallel",),
    "amp-parallel",
    extras=(("ReduceOp", "torch.distributed", "ReduceOp"),),
)
_FP16_UTILS = Alias(("amp_legacy_fp16",), "amp-legacy-fp16", exclude=("amp",))
_MTA = Alias(("amp_fused_ops",), "amp-fused-ops", only=("MultiTensorApply", "multi_tensor_applier"))
# Apex's later home of the cut-down FP16_Optimizer and the FusedAdam it drives.
_CONTRIB_OPTIMIZERS = Alias(
    ("amp_optimizers",), "amp-optimizers", only=("FP16_Optimizer", "FusedAdam")
)

# Every Apex module name the hook answers for (the last Apex release with amp, 24.04).
ALIASES: dict[str, Alias] = {
    "apex.amp": _AMP,
    "apex.optimizers": _OPTIMIZERS,
    "apex.optimizers.fused_adam": _OPTIMIZERS,
    "apex.optimizers.fused_sgd": _OPTIMIZERS,
    "apex.optimizers.fused_lamb": _OPTIMIZERS,
    "apex.optimizers.fused_novograd": _OPTIMIZERS,
    "apex.optimizers.fused_adagrad": _OPTIMIZERS,
    "apex.optimizers.fused_mixed_precision_lamb": _OPTIMIZERS,
    "apex.normalization": Alias(("amp_fused_ops.normalization",), "amp-fused-ops"),
    "apex.normalization.fused_layer_norm": Alias(
        ("amp_fused_ops.normalization.fused_layer_norm",), "amp-fused-ops"
    ),
    "apex.multi_tensor_apply": _MTA,
    "apex.multi_tensor_apply.multi_tensor_apply": _MTA,
    "apex.parallel": _PARALLEL,
    "apex.parallel.distributed": _PARALLEL,
    "apex.parallel.LARC": _PARALLEL,
    "apex.parallel.sync_batchnorm": _PARALLEL,
    "apex.parallel.optimized_sync_batchnorm": _PARALLEL,
    "apex.fp16_utils": _FP16_UTILS,
    "apex.fp16_utils.fp16_optimizer": _FP16_UTILS,
    "apex.fp16_utils.fp16util": _FP16_UTILS,
    "apex.fp16_utils.loss_scaler": _FP16_UTILS,
    "amp_C": Alias(("amp_fused_ops.amp_C",), "amp-fused-ops"),
    "apex_C": Alias(("amp_fused_ops",), "amp-fused-ops", only=("flatten", "unflatten")),
    # Apex's SyncBatchNorm kernel extension, top-level as Apex built it.
    "syncbn": Alias(("amp_fused_ops.syncbn",), "amp-fused-ops"),
    "apex.contrib": Alias((), "amp-optimizers"),
    "apex.contrib.optimizers": _CONTRIB_OPTIMIZERS,
    "apex.contrib.optimizers.fp16_optimizer": _CONTRIB_OPTIMIZERS,
    "apex.contrib.optimizers.fused_adam": _CONTRIB_OPTIMIZERS,
}

# (``apex_C``, Apex's flatten / unflatten extension, and ``syncbn`` are top-level too.)

# The subpackages ``apex`` exposes as attributes, as Apex's ``apex/__init__.py`` imported them.
_APEX_SUBPACKAGES = (
    "amp",
    "fp16_utils",
    "optimizers",
    "normalization",
    "multi_tensor_apply",
    "parallel",
)

# The version the ``apex`` distribution reports: Apex's own (0.1), tagged with ours.
APEX_VERSION = f"0.1+amptoolkit.{__version__}"


def deprecated_warning(msg: str, *, stacklevel: int = 2) -> None:
    """Apex's ``apex.deprecated_warning``: warn ``msg`` as a :class:`DeprecatedFeatureWarning`
    (on rank 0 only under ``torch.distributed``)."""
    if _is_rank_zero():
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=stacklevel)


@functools.wraps(_core_amp.initialize)
def apex_initialize(*args: Any, **kwargs: Any) -> Any:
    # ``apex.amp.initialize`` under the aliases: amp-core's, with the warning Apex gave at every
    # call (Apex's own tests expect it), which here names the one-line migration.
    deprecated_warning(
        "apex.amp is deprecated (Apex removed it); this run uses the amp toolkit's amp_core.amp: "
        "replace `from apex import amp` with `from amp_core import amp`.",
        stacklevel=3,
    )
    return _core_amp.initialize(*args, **kwargs)


def _missing(name: str, dist: str, exc: ImportError) -> ModuleNotFoundError:
    # The install commands README.md documents: nothing is on PyPI yet, where a bare
    # `pip install <dist>` fails (or could fetch an unrelated package of that name).
    err = ModuleNotFoundError(
        f"{name} is provided by the amp toolkit's {dist} package, which could not be imported "
        f"({exc}). It is not on PyPI yet; install it from the toolkit's wheelhouse (`nox -s "
        f"build` in a checkout writes dist/): pip install --find-links dist {dist}  or from "
        f'git: pip install "{dist} @ git+$REPO#subdirectory=packages/{dist}" (README.md, '
        '"Install")',
        name=name,
    )
    err.__cause__ = exc
    return err


class _AliasModule(types.ModuleType):
    """An Apex module name whose attributes are read from toolkit modules."""

    _amp_alias_targets: tuple[types.ModuleType, ...]
    _amp_alias_extras: dict[str, Any]
    _amp_alias_exclude: frozenset[str]
    _amp_alias_only: frozenset[str] | None

    def _amp_alias_hides(self, attr: str) -> bool:
        only = self._amp_alias_only
        return attr in self._amp_alias_exclude or (only is not None and attr not in only)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_amp_alias_"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        if attr not in self._amp_alias_extras and self._amp_alias_hides(attr):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        if attr in self._amp_alias_extras:
            return self._amp_alias_extras[attr]
        for target in self._amp_alias_targets:
            try:
                return getattr(target, attr)
            except AttributeError:
                continue
        raise AttributeError(
            f"module {self.__name__!r} (the amp toolkit's "
            f"{', '.join(t.__name__ for t in self._amp_alias_targets)}) has no attribute "
            f"{attr!r}; see the migration guide for where Apex's names live"
        )

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self._amp_alias_targets:
            names |= {n for n in dir(target) if not self._amp_alias_hides(n)}
        return sorted(names | set(super().__dir__()) | set(self._amp_alias_extras))


class _ApexPackage(types.ModuleType):
    """``apex`` itself: its subpackages are imported when first read, as attributes."""

    def __getattr__(self, attr: str) -> Any:
        if attr in _APEX_SUBPACKAGES:
            return importlib.import_module(f"apex.{attr}")
        raise AttributeError(f"module 'apex' (the amp toolkit's aliases) has no attribute {attr!r}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        name = spec.name
        if name == "apex":
            module: types.ModuleType = _ApexPackage(name)
            module.__version__ = APEX_VERSION  # type: ignore[attr-defined]
            module.DeprecatedFeatureWarning = DeprecatedFeatureWarning  # type: ignore[attr-defined]
            module.deprecated_warning = deprecated_warning  # type: ignore[attr-defined]
            module.__all__ = list(_APEX_SUBPACKAGES)  # type: ignore[attr-defined]
            return module
        alias = ALIASES[name]
        targets: list[types.ModuleType] = []
        for target in alias.targets:
            try:
                targets.append(importlib.import_module(target))
            except ImportError as exc:
                raise _missing(name, alias.dist, exc) from exc
        extras: dict[str, Any] = {}
        for extra, module_name, attr in alias.extras:
            extras[extra] = getattr(importlib.import_module(module_name), attr)
        alias_module = _AliasModule(name, targets[0].__doc__ if targets else None)
        alias_module._amp_alias_targets = tuple(targets)
        alias_module._amp_alias_extras = extras
        alias_module._amp_alias_exclude = frozenset(alias.exclude)
        alias_module._amp_alias_only = frozenset(alias.only) if alias.only else None
        exported: list[str] = list(extras)
        for module in targets:
            exported += [n for n in getattr(module, "__all__", ()) if n not in exported]
        alias_module.__all__ = [  # type: ignore[attr-defined]
            n for n in exported if n in extras or not alias_module._amp_alias_hides(n)
        ]
        return alias_module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _ApexDistribution(importlib.metadata.Distribution):
    """The ``apex`` distribution ``importlib.metadata`` reports while the hook is installed."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\n"
                "Name: apex\n"
                f"Version: {APEX_VERSION}\n"
                "Summary: Aliases of Apex's module names to the amp toolkit "
                "(amp_legacy_fp16.apex_run); no package named apex is installed.\n"
            )
        if filename == "top_level.txt":
            return "apex\namp_C\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return os.path.join(os.path.dirname(__file__), str(path))


class ApexAliasFinder(importlib.abc.MetaPathFinder):
    """The import hook: Apex's module names -> alias modules over the toolkit."""

    _loader = _Loader()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "apex" or fullname in ALIASES:
            # Every alias is a package (a __path__ that holds no files), so that its submodules
            # (apex.optimizers.fused_adam ...) are looked up here too.
            spec = importlib.machinery.ModuleSpec(fullname, self._loader, is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("-", "_") == "apex":
            yield _ApexDistribution()


def _installed_finder() -> ApexAliasFinder | None:
    for finder in sys.meta_path:
        if isinstance(finder, ApexAliasFinder):
            return finder
    return None


def install() -> ApexAliasFinder:
    """Put the hook first on ``sys.meta_path`` (once; later calls return the same hook).

    Raises:
        RuntimeError: A real ``apex`` module is imported already (the aliases would be mixed
            with it).
    """
    finder = _installed_finder()
    if finder is not None:
        return finder
    loaded = sys.modules.get("apex")
    if loaded is not None and not isinstance(loaded, _ApexPackage):
        raise RuntimeError(
            f"a module named apex is imported already (from {getattr(loaded, '__file__', '?')}); "
            "the amp toolkit's aliases cannot replace it: run without that apex on sys.path"
        )
    finder = ApexAliasFinder()
    sys.meta_path.insert(0, finder)
    importlib.invalidate_caches()
    return finder


def installed() -> bool:
    """Whether the hook is on ``sys.meta_path``."""
    return _installed_finder() is not None


def uninstall() -> None:
    """Remove the hook and forget the alias modules imported through it."""
    while (finder := _installed_finder()) is not None:
        sys.meta_path.remove(finder)
    for name in list(sys.modules):
        if isinstance(sys.modules[name], (_AliasModule, _ApexPackage)):
            del sys.modules[name]
