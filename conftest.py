"""Repository-wide pytest configuration: tests marked ``gpu`` need a CUDA device.

Tests also marked ``cuda_emulation`` run without one when ``AMP_FUSED_OPS_EMULATION`` names a
build of the emulated CUDA kernels (``nox -s cuda_emulation``).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``gpu`` when CUDA is not available (and not emulated)."""
    if torch.cuda.is_available():
        return
    emulated = bool(os.environ.get("AMP_FUSED_OPS_EMULATION"))
    skip_gpu = pytest.mark.skip(reason="CUDA not available")
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if emulated and item.get_closest_marker("cuda_emulation") is not None:
            continue
        item.add_marker(skip_gpu)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """After a failed emulated run: the schedule seed of its warps and lanes, to repeat it."""
    if not os.environ.get("AMP_FUSED_OPS_EMULATION") or not terminalreporter.stats.get("failed"):
        return
    seed = os.environ.get("AMP_EMULATION_SEED") or "0"
    terminalreporter.write_line(
        f"emulated CUDA kernels ran with schedule seed {seed}: AMP_EMULATION_SEED={seed} "
        "repeats their order of warps and lanes, another seed tries another order"
    )
