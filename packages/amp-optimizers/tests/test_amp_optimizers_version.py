"""The package imports and reports the version its distribution metadata declares."""

from importlib.metadata import version

import amp_optimizers


def test_version_matches_distribution_metadata() -> None:
    assert amp_optimizers.__version__ == version("amp-optimizers")
