"""The package imports and reports the version its distribution metadata declares."""

from importlib.metadata import PackageNotFoundError, version

import pytest

import amp_parallel


def test_version_matches_distribution_metadata() -> None:
    try:
        installed = version("amp-parallel")
    except PackageNotFoundError:
        pytest.skip("amp-parallel is not installed (running from src/ on PYTHONPATH)")
    assert amp_parallel.__version__ == installed


def test_public_api() -> None:
    assert amp_parallel.__version__ == "0.1.0"
    for name in amp_parallel.__all__:
        assert hasattr(amp_parallel, name), name
