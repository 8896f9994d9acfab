"""The package imports and reports the version its distribution metadata declares."""

from importlib.metadata import version

import amp_fused_ops


def test_version_matches_distribution_metadata() -> None:
    assert amp_fused_ops.__version__ == version("amp-fused-ops")
