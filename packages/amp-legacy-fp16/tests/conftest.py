"""Shared fixtures for the amp_legacy_fp16 tests.

Every test starts and ends with no O1 casting on (neither an ``amp.init`` handle nor an
``amp_core.amp.initialize`` session), and with the deprecation warnings of the legacy API
silenced unless a test asks for them with ``pytest.warns``.
"""

from __future__ import annotations

import warnings

import pytest

from amp_core import amp as core_amp


def pytest_configure(config: pytest.Config) -> None:
    # Registered here as well as in the root conftest so this package's tests run alone.
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "distributed: starts several processes")


def _switch_off() -> None:
    core_amp.close()  # also switches off an amp.init handle's casting


@pytest.fixture(autouse=True)
def _clean_state():
    _switch_off()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield
    _switch_off()
