"""Spawn a Gloo world on loopback, run a list of scenarios on every rank, collect results.

One launch per world size amortizes the ~3 s each process spends importing torch: every
scenario runs inside the same processes and reports ``{rank: outcome}`` to the parent.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch.multiprocessing as mp

Outcome = dict[str, Any]  # {"ok": bool, "value": ..., "error": str}


class FatalError(Exception):
    """Raised by a scenario to make its rank die (the exception leaves the process)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world: int,
    init_file: str,
    module: str,
    scenarios: list[str],
    results: Any,
    pg_timeout_s: float,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    mod = importlib.import_module(module)
    for name in scenarios:
        try:
            value = mod.run(name)
            results.put((name, rank, {"ok": True, "value": value}))
        except BaseException as exc:
            results.put((name, rank, {"ok": False, "error": traceback.format_exc()}))
            if isinstance(exc, SystemExit | KeyboardInterrupt | FatalError):
                raise  # the process dies, as a real rank would
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # a scenario broke the group on purpose (a rank died)
        pass


def run_world(
    world: int,
    scenarios: list[str],
    module: str = "_parallel_scenarios",
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
) -> dict[str, dict[int, Outcome]]:
    """Run ``scenarios`` (names understood by ``module.run``) on ``world`` Gloo ranks.

    Returns:
        ``{scenario: {rank: outcome}}``; ranks that died or hung report ``ok=False``.
    """
    with tempfile.TemporaryDirectory(prefix="amp_parallel_") as folder:
        return _run_ranks(world, scenarios, module, timeout_s, pg_timeout_s, folder)


def _run_ranks(
    world: int,
    scenarios: list[str],
    module: str,
    timeout_s: float,
    pg_timeout_s: float,
    folder: str,
) -> dict[str, dict[int, Outcome]]:
    """:func:`run_world` with the rendezvous file in ``folder`` (removed by the caller)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(folder, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world, init_file, module, scenarios, results, pg_timeout_s),
            daemon=True,
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[str, dict[int, Outcome]] = {name: {} for name in scenarios}
    expected = world * len(scenarios)
    got = 0
    import time

    deadline = time.monotonic() + timeout_s
    while got < expected and time.monotonic() < deadline:
        try:
            name, rank, outcome = results.get(timeout=0.5)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        out[name][rank] = outcome
        got += 1
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    for name in scenarios:
        for rank in range(world):
            out[name].setdefault(rank, {"ok": False, "error": "rank died or timed out"})
    return out


def values(outcomes: dict[int, dict[str, Any]]) -> list[Any]:
    """The value of every rank, failing the test with the rank's traceback if one failed."""
    out = []
    for rank, outcome in sorted(outcomes.items()):
        if not outcome["ok"]:
            pytest.fail(f"rank {rank} failed:\n{outcome['error']}")
        out.append(outcome["value"])
    return out
