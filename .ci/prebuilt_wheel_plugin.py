"""pytest plugin of `nox -s wheel_prebuilt`: the tests must run on a module the wheel ships.

Loaded with ``-p prebuilt_wheel_plugin`` (this folder on ``PYTHONPATH``) in a virtualenv that has
the amp-fused-ops wheel with prebuilt modules installed and ``AMP_FUSED_OPS_CACHE`` pointing at
an empty folder. Before the first test of each process, the CPU extension is loaded: it must be
the wheel's module for this torch release and for the best instruction set torch's CPU
capability allows, else every test fails (a test would otherwise pass on a just-in-time build
or skip for want of kernels). Where a GPU is present (benchmarks/gpu_run.sh), the CUDA extension
must also be the wheel's module for this exact torch version. The cases of the PyTorch reference
path are left out. The caller checks afterwards that the cache folder is still empty (nothing
was compiled).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_sessionstart(session: pytest.Session) -> None:
    """Say which CPU kernels the tests will run on (also under ``-q``)."""
    from amp_fused_ops import extensions

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        for kind in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            status = extensions.extension_status(kind)
            reporter.write_line(
                f"amp_fused_ops {kind.upper()} kernels, torch {torch.__version__}: "
                f"{status.state}, {status.detail}"
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the cases of the PyTorch reference path (a ``reference`` parameter): they run
    no kernel of the wheel, and the package's own test runs cover them."""
    kept, left_out = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_reference = callspec is not None and "reference" in callspec.id.split("-")
        (left_out if on_reference else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


def _check_wheels_module(kind: str, name: str, why: str = "") -> None:
    """Load extension ``kind``; it must be the wheel's module ``name``."""
    from amp_fused_ops import extensions

    module = extensions.get_extension(kind)
    path = Path(str(module.__file__)) if module is not None else None
    if path is None or path.parent.name != "_prebuilt" or path.name != name:
        reason = extensions.unavailable_reason(kind)
        raise AssertionError(
            f"the {kind} extension under torch {torch.__version__} is {path} ({reason}), not "
            f"the wheel's {name}{why}"
        )


@pytest.fixture(scope="session", autouse=True)
def _runs_on_the_wheels_module() -> None:
    release = torch.__version__.split("+", 1)[0]
    # The wheel ships AVX2 and AVX-512 modules of every release: the best one this CPU runs.
    capability = torch.backends.cpu.get_cpu_capability()
    isa = {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "baseline")
    name = f"amp_fused_ops_cpu.torch-{release}.{isa}.so"
    _check_wheels_module("cpu", name, f" (torch's CPU capability: {capability})")
    if torch.cuda.is_available():
        _check_wheels_module("cuda", f"amp_fused_ops_cuda.torch-{release}.so")
