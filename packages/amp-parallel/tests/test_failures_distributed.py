"""A rank that dies or stops mid-step makes the others fail with a clear error, not hang."""

from __future__ import annotations

import pytest

from _parallel_launch import run_world

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # spawns its own worlds
PG_TIMEOUT_S = 3


@pytest.mark.parametrize("scenario", ["rank_dies", "rank_stalls"])
def test_survivor_fails_within_the_timeout(scenario):
    # A survivor that hung instead of failing would be killed by run_world after timeout_s
    # and reported as not ok, so the test fails on a hang without a bound on its own time.
    results = run_world(2, [scenario], timeout_s=600, pg_timeout_s=PG_TIMEOUT_S)
    survivor = results[scenario][0]
    assert survivor["ok"], survivor.get("error")
    value = survivor["value"]
    assert value["error"] is not None
    assert "amp_parallel.DistributedDataParallel: the gradient all-reduce" in value["error"]
    assert "Another rank probably crashed" in value["error"]
    # The error came from the group's timeout (3 s), not from torch's default (30 minutes):
    # the bound leaves room for a loaded machine and is far below the default.
    assert value["seconds"] < 40 * PG_TIMEOUT_S
    if scenario == "rank_dies":
        assert not results[scenario][1]["ok"]  # rank 1 really died with its exception
