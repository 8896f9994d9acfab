"""The fp16 helpers: casting networks (batchnorm stays fp32), master params and grads."""

from __future__ import annotations

import pytest
import torch
from amp_test_support import HALF_DTYPES

from _legacy_helpers import tiny_mlp
from amp_legacy_fp16 import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6),
        torch.nn.BatchNorm1d(6),
        torch.nn.BatchNorm1d(6, affine=False),
        torch.nn.Linear(6, 2),
    )


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_convert_network_keeps_affine_batchnorm_fp32(half):
    net = convert_network(_bn_net(), half)
    assert net[0].weight.dtype == half and net[3].bias.dtype == half
    assert net[1].weight.dtype == torch.float32
    assert net[1].running_mean.dtype == torch.float32
    assert net[2].running_var.dtype == half  # no affine params: cast like the rest
    assert net[1].num_batches_tracked.dtype == torch.int64  # integers untouched


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_network_to_half_casts_input_and_model(half):
    net = network_to_half(_bn_net(), dtype=half)
    assert isinstance(net[0], tofp16)
    assert net[1][0].weight.dtype == half and net[1][1].weight.dtype == torch.float32
    seen = {}

    def record(module, args):
        seen["dtype"] = args[0].dtype

    net[1][0].register_forward_pre_hook(record)
    net.eval()
    net(torch.randn(3, 4))
    assert seen["dtype"] == half


def test_network_to_half_defaults_to_fp16_and_warns():
    with pytest.warns(FutureWarning, match='opt_level="O2"'):
        net = network_to_half(torch.nn.Linear(2, 2))
    assert net[1].weight.dtype == torch.float16


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_fp16model_casts_floating_inputs_only(half):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, idx, x):
            return self.lin(self.emb(idx) + x)

    model = FP16Model(Net(), dtype=half)
    out = model(torch.tensor([1, 2, 3]), torch.randn(3, 4))
    assert out.dtype == half
    assert model.network.emb.weight.dtype == half


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_bn_convert_float_and_convert_module(half):
    net = _bn_net().to(half)
    BN_convert_float(net)
    assert net[1].weight.dtype == torch.float32 and net[0].weight.dtype == half
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2))
    outer.register_parameter("own", torch.nn.Parameter(torch.ones(2)))
    convert_module(outer, half)
    assert outer.own.dtype == half and outer[0].weight.dtype == torch.float32


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_prep_param_lists_and_copies(half):
    model = tiny_mlp(half)
    model_params, masters = prep_param_lists(model)
    assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)
    for p, m in zip(model_params, masters, strict=True):
        assert torch.equal(m, p.float())  # half -> fp32 is exact
        assert m.data_ptr() != p.data_ptr()
    model(torch.randn(5, 4, dtype=half)).sum().backward()
    model_grads_to_master_grads(model_params, masters)
    for p, m in zip(model_params, masters, strict=True):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, p.grad.float())
    with torch.no_grad():
        for m in masters:
            m.add_(0.01)
    master_params_to_model_params(model_params, masters)
    for p, m in zip(model_params, masters, strict=True):
        assert torch.equal(p, m.to(half))


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_flat_master(half):
    model = tiny_mlp(half)
    model_params, (flat,) = prep_param_lists(model, flat_master=True)
    assert flat.dim() == 1 and flat.numel() == sum(p.numel() for p in model_params)
    assert torch.equal(flat.grad, torch.zeros_like(flat))
    model(torch.randn(5, 4, dtype=half)).sum().backward()
    model_grads_to_master_grads(model_params, [flat], flat_master=True)
    assert torch.equal(flat.grad, torch.cat([p.grad.float().flatten() for p in model_params]))
    with torch.no_grad():
        flat.mul_(2.0)
    master_params_to_model_params(model_params, [flat], flat_master=True)
    assert torch.equal(torch.cat([p.float().flatten() for p in model_params]), flat.detach())


def test_flat_master_refuses_mixed_dtypes():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).half())
    with pytest.raises(TypeError, match="flat_master=False"):
        prep_param_lists(model, flat_master=True)


def test_clip_grad_norm_and_to_python_float():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    total = clip_grad_norm([p], max_norm=1.0)
    assert to_python_float(total) == pytest.approx(5.0)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)
    assert to_python_float([2.5]) == 2.5
