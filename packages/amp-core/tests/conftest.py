"""Shared fixtures for the amp_core tests.

Every test starts and ends with amp switched off (O0), so O1's thread-wide casting
and the module-level loss-scaler registry never leak from one test into the next.
"""

from __future__ import annotations

import pytest
import torch

from amp_core import amp


def pytest_configure(config: pytest.Config) -> None:
    # Registered here as well as in the root conftest so this package's tests run alone.
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def _reset_amp() -> None:
    reset = getattr(amp, "_reset", None)
    if callable(reset):
        reset()
    else:
        amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)


@pytest.fixture(autouse=True)
def _amp_off_around_each_test():
    _reset_amp()
    yield
    _reset_amp()
