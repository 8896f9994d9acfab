"""Repository-wide pytest configuration: tests marked ``gpu`` need a CUDA device.

Tests also marked ``cuda_emulation`` run without one when ``AMP_FUSED_OPS_EMULATION`` names a
build of the emulated CUDA kernels (``nox -s cuda_emulation``).
"""

from __future__ import annotations

import os

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
