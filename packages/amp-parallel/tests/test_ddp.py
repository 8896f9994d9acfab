"""Single-process checks of DDP's argument validation (a world of one Gloo rank)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from amp_parallel import DistributedDataParallel, Reducer


@pytest.fixture
def world_of_one(tmp_path):
    path = os.path.join(tmp_path, "store")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(model())
    with pytest.raises(RuntimeError, match="init_process_group"):
        Reducer(model())


def test_shared_param_is_refused(world_of_one):
    with pytest.raises(ValueError, match=r"shared_param is no longer supported.*delay_allreduce"):
        DistributedDataParallel(model(), shared_param=True)


def test_split_factor_is_deprecated(world_of_one):
    with pytest.warns(FutureWarning, match="renamed to gradient_predivide_factor"):
        ddp = DistributedDataParallel(model(), gradient_average_split_factor=2.0)
    assert ddp.gradient_predivide_factor == 2.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_allreduce_streams": 2, "allreduce_communicators": ([None], [None])},
            "holds 1 communicators",
        ),
        ({"num_allreduce_streams": 2, "delay_allreduce": True}, "delay_allreduce=False"),
        (
            {"allreduce_trigger_params": [], "delay_allreduce": True},
            "only valid with delay_allreduce=False",
        ),
        ({"allreduce_trigger_params": [nn.Parameter(torch.ones(1))]}, "not parameters of module"),
        ({"message_size": 0}, "message_size"),
        ({"gradient_predivide_factor": 0.0}, "must be positive"),
        ({"num_allreduce_streams": 0}, "num_allreduce_streams must be >= 1"),
    ],
)
def test_refused_combinations(world_of_one, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedDataParallel(model(), **kwargs)


def test_already_wrapped(world_of_one):
    m = model()
    ddp = DistributedDataParallel(m)
    with pytest.raises(ValueError, match="already a DistributedDataParallel"):
        DistributedDataParallel(ddp)
    with pytest.raises(ValueError, match="already wrapped"):
        DistributedDataParallel(m)
    with pytest.raises(ValueError, match="already a DistributedDataParallel"):
        DistributedDataParallel(nn.parallel.DistributedDataParallel(model()))


def test_mixed_devices(world_of_one):
    m = model()
    m[1].to("meta")
    with pytest.raises(ValueError, match=r"several devices.*model\.to\(device\)"):
        DistributedDataParallel(m)


def test_is_a_torch_ddp_with_apex_attributes(world_of_one):
    m = model()
    ddp = DistributedDataParallel(m, message_size=123, allreduce_always_fp32=True)
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    assert ddp.module is m
    assert ddp.message_size == 123 and ddp.allreduce_always_fp32
    assert all(k.startswith("module.") for k in ddp.state_dict())
    ddp.disable_allreduce()
    assert not ddp.require_backward_grad_sync
    ddp.enable_allreduce()
    assert ddp.require_backward_grad_sync
    ddp(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
