"""Shared fixtures: one spawned Gloo world per world size runs every multi-process scenario."""

from __future__ import annotations

from typing import Any

import pytest

from _parallel_launch import run_world
from _parallel_scenarios import DDP_CASES, SYNCBN_CASES

ALL_SCENARIOS = (
    [f"ddp:{case}" for case in DDP_CASES]
    + ["accumulate", "no_sync_local", "amp_o2_bf16", "amp_o2_masters_from_rank0", "reducer"]
    + ["ddp_wrap_twice"]
    + [f"syncbn:{case}" for case in SYNCBN_CASES]
    + ["syncbn_group_of_one", "syncbn_bad_group_size"]
    + ["syncbn_empty_everywhere", "syncbn_one_value_in_total"]
)


def pytest_configure(config: pytest.Config) -> None:
    # Registered here as well as in the root pyproject so this package's tests run alone.
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "distributed: starts several processes")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


_cache: dict[int, dict[str, dict[int, dict[str, Any]]]] = {}


def world_results(world: int) -> dict[str, dict[int, dict[str, Any]]]:
    """Every scenario's per-rank outcome on ``world`` ranks (launched once per session)."""
    if world not in _cache:
        # A hang guard for the whole world, not a speed check: generous so that a loaded
        # machine cannot fail it (all scenarios take well under a minute on 2 idle cores).
        _cache[world] = run_world(world, ALL_SCENARIOS, timeout_s=900, pg_timeout_s=300)
    return _cache[world]


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def results(world: int) -> dict[str, dict[int, dict[str, Any]]]:
    return world_results(world)
