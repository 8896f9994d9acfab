"""pytest plugin of `nox -s wheel_prebuilt`: the tests must run on a module the wheel ships.

Loaded with ``-p prebuilt_wheel_plugin`` (this folder on ``PYTHONPATH``) in a virtualenv that has
the amp-fused-ops wheel with prebuilt modules installed and ``AMP_FUSED_OPS_CACHE`` pointing at
an empty folder. Before the first test of each process, the CPU extension is loaded: it must be
the wheel's module for this torch release, else every test fails (a test would otherwise pass
on a just-in-time build or skip for want of kernels). The session checks afterwards that the
cache folder is still empty (nothing was compiled).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _runs_on_the_wheels_module() -> None:
    from amp_fused_ops import extensions

    module = extensions.get_extension("cpu")
    path = Path(str(module.__file__)) if module is not None else None
    release = torch.__version__.split("+", 1)[0]
    if path is None or path.parent.name != "_prebuilt" or f".torch-{release}." not in path.name:
        reason = extensions.unavailable_reason("cpu")
        raise AssertionError(
            f"the CPU extension under torch {torch.__version__} is {path} ({reason}), not the "
            f"wheel's module for torch {release}"
        )
