"""Start-up hook of the processes ``amp_legacy_fp16.apex_run`` starts: the Apex aliases.

``apex_run`` puts this folder first on ``PYTHONPATH`` and sets ``AMP_APEX_RUN=1``, so that every
Python process started under it (``multiprocessing`` with ``spawn`` or ``forkserver``,
``torch.multiprocessing.spawn``, a ``subprocess`` running ``python``) imports this module at
start-up (Python's ``site`` imports ``sitecustomize``) and resolves ``import apex`` as the
parent does. Start-up stays cheap: a small finder waits for the first import of an Apex name and
only then imports the toolkit and installs the real hook. A ``sitecustomize`` that this folder
shadows is run afterwards, so an environment's own start-up hook keeps working.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

_HERE = os.path.dirname(os.path.abspath(__file__))
_NAMES = ("apex", "amp_C", "apex_C", "syncbn")


class _LazyApexAliases(importlib.abc.MetaPathFinder):
    """Installs the toolkit's alias hook when an Apex name is first imported."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in _NAMES:
            return None
        sys.meta_path.remove(self)
        from amp_legacy_fp16._apex_alias import install

        return install().find_spec(fullname, path, target)


def _run_shadowed_sitecustomize() -> None:
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


if os.environ.get("AMP_APEX_RUN") == "1":
    sys.meta_path.insert(0, _LazyApexAliases())
_run_shadowed_sitecustomize()
