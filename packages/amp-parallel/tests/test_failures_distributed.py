"""A rank that dies or stops mid-step makes the others fail with a clear error, not hang."""

from __future__ import annotations

import time

import pytest

from _launch import run_world

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("scenario", ["rank_dies", "rank_stalls"])
def test_survivor_fails_within_the_timeout(scenario):
    start = time.monotonic()
    results = run_world(2, [scenario], timeout_s=60, pg_timeout_s=3)
    assert time.monotonic() - start < 60
    survivor = results[scenario][0]
    assert survivor["ok"], survivor.get("error")
    value = survivor["value"]
    assert value["error"] is not None
    assert "amp_parallel.DistributedDataParallel: the gradient all-reduce" in value["error"]
    assert "Another rank probably crashed" in value["error"]
    assert value["seconds"] < 3 + 10
    if scenario == "rank_dies":
        assert not results[scenario][1]["ok"]  # rank 1 really died with its exception
