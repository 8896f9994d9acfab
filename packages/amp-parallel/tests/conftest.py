"""Shared fixtures: one spawned Gloo world per world size runs every multi-process scenario."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _launch import run_world
from _scenarios import DDP_CASES, SYNCBN_CASES

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
        _cache[world] = run_world(world, ALL_SCENARIOS, timeout_s=150)
    return _cache[world]


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def results(world: int) -> dict[str, dict[int, dict[str, Any]]]:
    return world_results(world)


def values(outcomes: dict[int, dict[str, Any]]) -> list[Any]:
    """The value of every rank, failing the test with the rank's traceback if one failed."""
    out = []
    for rank, outcome in sorted(outcomes.items()):
        if not outcome["ok"]:
            pytest.fail(f"rank {rank} failed:\n{outcome['error']}")
        out.append(outcome["value"])
    return out
