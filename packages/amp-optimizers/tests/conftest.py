"""Shared setup for the amp_optimizers tests: helper imports, markers, amp switched off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from amp_core import amp


def pytest_configure(config: pytest.Config) -> None:
    # Registered here as well as in the root configuration so this package's tests run alone.
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


@pytest.fixture(autouse=True)
def _amp_off_around_each_test() -> Iterator[None]:
    # amp.initialize replaces the current session (and switches O1 casting off): every test
    # starts and ends without one of its own.
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    yield
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
