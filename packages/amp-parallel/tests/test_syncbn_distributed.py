"""SyncBatchNorm on 2 and 3 Gloo ranks vs BatchNorm on the concatenated batch."""

from __future__ import annotations

import pytest

from _parallel_launch import values
from _parallel_scenarios import SYNCBN_CASES

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(SYNCBN_CASES))
def test_matches_batchnorm_on_concatenated_batch(results, case):
    # bf16: the output is rounded to bf16 (rel. 2**-8 of values up to ~4); stats stay fp32
    tol = 2e-2 if case == "bf16" else 2e-6
    for errs in values(results[f"syncbn:{case}"]):
        for key in ("out", "dx", "dw", "eval") + (("dz",) if "dz" in errs else ()):
            assert errs[key] < tol, (key, errs)
        assert errs["running_mean"] < 1e-6 and errs["running_var"] < 1e-6, errs


def test_group_of_one_is_local(results):
    assert all(err < 1e-6 for err in values(results["syncbn_group_of_one"]))


def test_bad_group_size(results):
    assert all(
        "must divide the world size" in msg for msg in values(results["syncbn_bad_group_size"])
    )


def test_empty_batch_on_every_rank_leaves_running_stats(results):
    for out in values(results["syncbn_empty_everywhere"]):
        assert out["shape"] == [0, 3] and out["dx_shape"] == [0, 3]
        assert out["running_mean"] == [1.5] * 3 and out["running_var"] == [2.5] * 3
        assert out["tracked"] == 1  # counted, as torch counts it


def test_one_value_per_channel_in_total_raises_on_every_rank(results):
    for out in values(results["syncbn_one_value_in_total"]):
        assert out["message"].startswith("Expected more than 1 value per channel when training")
        assert out["unchanged"] and out["next_shape"] == [2, 3]
