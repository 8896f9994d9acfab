"""The package imports and reports the version its distribution metadata declares."""

from importlib.metadata import version

import amp_parallel


def test_version_matches_distribution_metadata() -> None:
    assert amp_parallel.__version__ == version("amp-parallel")
