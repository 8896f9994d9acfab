"""SyncBatchNorm in one process (no process group): a plain batch norm, with Apex's extras."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_parallel import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group


def _pair(c: int = 4) -> tuple[nn.BatchNorm2d, SyncBatchNorm]:
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(c)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
    bn = SyncBatchNorm(c)
    bn.load_state_dict(ref.state_dict())
    return ref, bn


@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("fuse_relu", [False, True])
def test_matches_batchnorm(channel_last, fuse_relu):
    ref, bn = _pair()
    bn.channel_last, bn.fuse_relu = channel_last, fuse_relu
    x = torch.randn(6, 4, 3, 3, requires_grad=True)
    z = torch.randn(6, 4, 3, 3, requires_grad=True)
    expected = ref(x) + z
    expected = torch.relu(expected) if fuse_relu else expected
    gy = torch.randn_like(expected)
    gx_ref, gz_ref, gw_ref = torch.autograd.grad((expected * gy).sum(), [x, z, ref.weight])
    xin = x.movedim(1, -1) if channel_last else x
    zin = z.movedim(1, -1) if channel_last else z
    out = bn(xin, zin)
    out = out.movedim(-1, 1) if channel_last else out
    gx, gz, gw = torch.autograd.grad((out * gy).sum(), [x, z, bn.weight])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gz, gz_ref)
    torch.testing.assert_close(gw, gw_ref)
    torch.testing.assert_close(bn.running_var, ref.running_var)


def test_channels_last_memory_format_and_eval():
    ref, bn = _pair()
    x = torch.randn(5, 4, 2, 3).to(memory_format=torch.channels_last)
    torch.testing.assert_close(bn(x), ref(x))
    bn.eval()
    ref.eval()
    torch.testing.assert_close(bn(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_fp32_statistics(dtype):
    ref, bn = _pair()
    x = torch.randn(8, 4, 3, 3) * 3 + 2
    out = bn(x.to(dtype))
    assert out.dtype == dtype and bn.running_mean.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref(x.to(dtype).float()), rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)


def test_input_checks():
    bn = SyncBatchNorm(4)
    with pytest.raises(ValueError, match=r"3 channels.*channel_last=True"):
        bn(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        bn(torch.randn(4))
    with pytest.raises(ValueError, match="z must have the input's shape"):
        bn(torch.randn(2, 4), torch.randn(2, 5))


def test_convert_keeps_weights_buffers_devices_and_mode():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    model[1].running_mean.fill_(3.0)
    model.eval()
    weight = model[1].weight
    converted = convert_syncbn_model(model, channel_last=True)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][0], SyncBatchNorm)
    assert model[1].weight is weight and model[1].channel_last
    assert torch.all(model[1].running_mean == 3.0)
    assert not model[1].training
    bn = convert_syncbn_model(nn.BatchNorm1d(3).to(torch.float64))
    assert isinstance(bn, SyncBatchNorm) and bn.weight.dtype == torch.float64


def test_group_size_zero_is_world():
    assert create_syncbn_process_group(0) is None
    with pytest.raises(RuntimeError, match="init_process_group"):
        create_syncbn_process_group(2)


def test_empty_batch_leaves_running_stats_like_batchnorm():
    ref, bn = nn.BatchNorm1d(3), SyncBatchNorm(3)
    with torch.no_grad():
        for m in (ref, bn):
            m.running_mean.fill_(1.5)
            m.running_var.fill_(2.5)
    for _ in range(2):
        x = torch.randn(0, 3, requires_grad=True)
        out = bn(x)
        assert out.shape == (0, 3)
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == (0, 3)
        ref(torch.randn(0, 3))
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=0, atol=0)
    assert torch.equal(bn.running_var, torch.full((3,), 2.5))
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 2


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1, 1)])
@pytest.mark.parametrize("track_running_stats", [True, False])
def test_one_value_per_channel_raises_like_batchnorm(shape, track_running_stats):
    bn = SyncBatchNorm(3, track_running_stats=track_running_stats)
    ref = nn.BatchNorm1d(3) if len(shape) == 2 else nn.BatchNorm2d(3)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        ref(torch.randn(shape))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        bn(torch.randn(shape))
    if track_running_stats:
        assert torch.equal(bn.running_var, torch.ones(3))  # nothing decayed
        bn.eval()
        assert bn(torch.randn(shape)).shape == shape  # running statistics: fine


def test_backward_uses_per_rank_int32_counts(monkeypatch):
    from amp_parallel import _syncbn_function

    kernels = _syncbn_function.fused_syncbn()
    if kernels is None:
        pytest.skip("amp-fused-ops not installed")
    seen = []
    real = kernels.batchnorm_backward

    def spy(*args, **kwargs):
        seen.append(args[7])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "batchnorm_backward", spy)
    ref, bn = _pair()
    x = torch.randn(6, 4, 3, 3, requires_grad=True)
    gx = torch.autograd.grad(bn(x).square().sum(), x)[0]
    gx_ref = torch.autograd.grad(ref(x).square().sum(), x)[0]
    torch.testing.assert_close(gx, gx_ref)
    [count] = seen
    assert count.dtype == torch.int32 and count.tolist() == [6 * 3 * 3]
