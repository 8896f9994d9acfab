"""DDP on 2 and 3 Gloo ranks: gradients equal a single-process full-batch run, per option."""

from __future__ import annotations

import pytest

from _parallel_launch import values
from _parallel_scenarios import DDP_CASES

pytestmark = pytest.mark.distributed

FP32_TOL = 1e-6


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_gradients_match_full_batch(results, case):
    for value in values(results[f"ddp:{case}"]):
        assert value["broadcast_err"] == 0.0  # rank 0's weights everywhere after construction
        assert value["grad_err"] < FP32_TOL
        assert value["param_err"] < FP32_TOL
        assert value["identical"]
        if "buffers" in value:
            assert value["buffers"] >= 1


def test_disable_enable_allreduce_accumulates(results):
    assert all(err < FP32_TOL for err in values(results["accumulate"]))


def test_disabled_allreduce_keeps_local_gradients(results):
    assert all(err == 0.0 for err in values(results["no_sync_local"]))


def test_amp_o2_bf16_half_gradients(results):
    for value in values(results["amp_o2_bf16"]):
        for variant in value.values():
            assert variant["master_dtype"] == "torch.float32"
            assert variant["identical"]  # every rank holds the same masters
            assert variant["err"] < 1.6e-2 * 2  # bf16 rounding, three steps


def test_amp_o2_masters_come_from_rank0(results):
    for value in values(results["amp_o2_masters_from_rank0"]):
        assert value["identical"]
        assert value["err"] == 0.0  # rank 0's fp32 initialization, not a half-rounded copy
        assert value["model_from_masters"]


def test_reducer(results):
    for value in values(results["reducer"]):
        assert value["broadcast"] == 0.0
        assert value["module"] < FP32_TOL
        assert value["list"] == 0.0


def test_wrapping_twice_is_refused(results):
    for msgs in values(results["ddp_wrap_twice"]):
        assert len(msgs) == 2
        assert "already a DistributedDataParallel" in msgs[0]
        assert "already wrapped" in msgs[1]
