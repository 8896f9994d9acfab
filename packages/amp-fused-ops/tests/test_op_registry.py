"""Every op of the registry as a PyTorch op: schema, fake kernel, meta tensors, opcheck.

The op registry (:data:`amp_fused_ops._library.REGISTRY`) is the one list of ``amp_C`` ops;
these tests take their op list from it, so an op added there without sample inputs here fails
``test_every_registered_op_has_samples``, and one without a working fake kernel fails the
opcheck and meta tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE as KERNEL_DEVICE
from _kernel_target import norm_ops
from amp_fused_ops import _kernel_op_fakes, amp_C, extensions
from amp_fused_ops._library import REGISTRY


def _flag() -> Tensor:
    return torch.zeros(1, dtype=torch.int32)


def _lists(seed: int, dtype: torch.dtype = torch.float32, positive: bool = False) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(size, generator=gen) for size in (5, 3)]
    return [(t.abs() if positive else t).to(dtype) for t in tensors]


def _zeros() -> list[Tensor]:
    return [torch.zeros(5), torch.zeros(3)]


def _one(value: float) -> Tensor:
    return torch.tensor([value])


# One call per op, with the schema's arguments (the lists as separate arguments).
SAMPLES: dict[str, Callable[[], tuple[Any, ...]]] = {
    "multi_tensor_scale": lambda: (64, _flag(), _lists(0), _zeros(), 0.5),
    "multi_tensor_sgd": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2), None, 0.0, 0.9, 0.0, 0.1, False, False,
        False, 1.0,
    ),
    "multi_tensor_axpby": lambda: (64, _flag(), _lists(0), _lists(1), _zeros(), 2.0, 3.0, -1),
    "multi_tensor_l2norm": lambda: (64, _flag(), _lists(0), True),
    "multi_tensor_l2norm_mp": lambda: (64, _flag(), _lists(0), True),
    "multi_tensor_l2norm_scale": lambda: (64, _flag(), _lists(0), _zeros(), 0.5, True),
    "multi_tensor_unscale_l2norm": lambda: (64, _flag(), _lists(0), _one(0.5), True),
    "multi_tensor_lamb_stage1_cuda": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), _zeros(),
        torch.tensor([0.01, 0.01]), 1, 0.9, 0.999, 1e-6, _one(1.0), 1.0,
    ),
    "multi_tensor_lamb_stage2_cuda": lambda: (
        64, _flag(), _lists(0), _lists(1), torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.7]),
        0.01, 0.01, False,
    ),
    "multi_tensor_adam": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), 1e-3, 0.9,
        0.999, 1e-8, 1, 1, 1, 0.01,
    ),
    "multi_tensor_adam_capturable": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), _one(1e-3),
        0.9, 0.999, 1e-8, _one(1), 1, 1, 0.01, _one(1.0),
    ),
    "multi_tensor_adam_capturable_master": lambda: (
        64, _flag(), _lists(0, torch.bfloat16), _lists(1, torch.bfloat16), _lists(2),
        _lists(3, positive=True), _lists(1), _one(1e-3), 0.9, 0.999, 1e-8, _one(1), 1, 1,
        0.01, _one(1.0),
    ),
    "multi_tensor_adagrad": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2, positive=True), 0.01, 1e-10, 1, 0.0,
    ),
    "multi_tensor_novograd": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2), torch.tensor([1.0, 2.0]), 0.01, 0.9,
        0.999, 1e-8, 1, 1, 0.0, 1, 0, 2,
    ),
    "multi_tensor_lamb": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), 1e-3, 0.9,
        0.999, 1e-6, 1, 1, 0.01, 1, 1, _one(1.0), 1.0, False,
    ),
    "multi_tensor_lamb_mp": lambda: (
        64, _flag(), _lists(0), _lists(1), _lists(2), _lists(3, positive=True), None,
        _one(1e-3), 0.9, 0.999, 1e-6, _one(1), 1, 0.01, 1, 1, _one(1.0), _one(1.0), False,
        _one(0.0), _one(1.0),
    ),
    "update_scale_hysteresis": lambda: (
        _one(1024.0), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
        _one(0.0), 2.0, 0.5, 2000, 2,
    ),
}  # fmt: skip

OPS = sorted(REGISTRY)


def _op(name: str) -> Any:
    return getattr(torch.ops.amp_fused_ops, name).default


def _to(value: Any, device: str) -> Any:
    """``value`` with every tensor moved to ``device`` (``meta``: same shapes, no data)."""
    if isinstance(value, Tensor):
        if device == "meta":
            return torch.empty_like(value, device="meta")
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device) for v in value)
    return value


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_every_registered_op_has_samples() -> None:
    assert set(SAMPLES) == set(REGISTRY)


def test_every_registered_op_is_in_amp_C() -> None:
    assert sorted(amp_C.__all__) == OPS
    for name in OPS:
        assert str(_op(name)._schema) == f"amp_fused_ops::{REGISTRY[name].schema}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name: str, device: str) -> None:
    """Schema (mutations declared), fake kernel, autograd registration, AOT dispatch."""
    extensions.get_extension(device)  # the compiled kernels, where they can be built
    torch.library.opcheck(_op(name), _to(SAMPLES[name](), device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_meta_tensors_get_the_shapes_of_real_outputs(name: str, device: str) -> None:
    args = _to(SAMPLES[name](), device)
    meta_args = _to(args, "meta")
    assert not any(isinstance(a, Tensor) and a.device.type != "meta" for a in meta_args)
    real = _op(name)(*args)
    fake = _op(name)(*meta_args)
    real_out = real if isinstance(real, tuple) else () if real is None else (real,)
    fake_out = fake if isinstance(fake, tuple) else () if fake is None else (fake,)
    assert len(fake_out) == len(real_out)
    for r, f in zip(real_out, fake_out, strict=True):
        assert f.device.type == "meta"
        assert (f.shape, f.dtype) == (r.shape, r.dtype)


def test_the_fake_kernels_check_devices_as_the_kernels_do() -> None:
    ins = [torch.empty(3, device="meta")]
    with pytest.raises(RuntimeError, match=r"tensor_lists\[0\]\[0\] is on meta but noop_flag"):
        _op("multi_tensor_scale")(64, _flag(), ins, [torch.empty(3)], 1.0)


# --- the norm ops (custom ops of their own, outside the amp_C registry) --------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_opcheck_norm_ops(rms: bool, memory_efficient: bool, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).to(device).requires_grad_()
    weight = (torch.rand(8, generator=gen) + 0.5).to(device).requires_grad_()
    bias = None if rms else torch.randn(8, generator=gen).to(device).requires_grad_()
    forward = torch.ops.amp_fused_ops.norm_forward.default
    args = (x, weight, bias, 1e-5, rms, False, memory_efficient)
    torch.library.opcheck(forward, args)
    y, mean, invvar = (t.detach() for t in forward(*args))
    saved = y if memory_efficient else x.detach()
    grad_out = torch.randn(4, 8, generator=gen).to(device)
    backward_args = (grad_out, saved, mean, invvar, weight.detach(),
                     None if bias is None else bias.detach(), rms, memory_efficient,
                     torch.float32)  # fmt: skip
    torch.library.opcheck(torch.ops.amp_fused_ops.norm_backward.default, backward_args)


# --- the CUDA extension's own norm and SyncBN ops (fake kernels: amp_fused_ops._kernel_op_fakes)


def _kernel_op_samples(device: str) -> dict[str, list[tuple[Any, ...]]]:
    """Sample arguments of every op of ``_kernel_op_fakes.FAKES`` (several per op)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(shape, generator=gen).to(device, dtype)

    def positive(*shape: int) -> Tensor:
        return (torch.rand(shape, generator=gen) + 0.5).to(device)

    samples: dict[str, list[tuple[Any, ...]]] = {name: [] for name in _kernel_op_fakes.FAKES}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape, channel_last in (((4, 3, 5), False), ((2, 3, 2, 3), False), ((6, 3), True)):
            channels = shape[-1] if channel_last else shape[1]
            x, dy, z = (
                randn(*shape, dtype=dtype),
                randn(*shape, dtype=dtype),
                randn(*shape, dtype=dtype),
            )
            mean, invstd, weight, bias = (randn(channels), positive(channels),
                                          positive(channels), randn(channels))  # fmt: skip
            count = x.numel() // channels
            samples["syncbn_welford_mean_var"].append((x, channel_last))
            samples["syncbn_forward"].append((x, mean, invstd, weight, bias, z, True, channel_last))
            samples["syncbn_forward"].append(
                (x, mean, invstd, None, None, None, False, channel_last)
            )
            samples["syncbn_reduce"].append((dy, x, mean, channel_last))
            sums = (randn(channels), randn(channels))
            samples["syncbn_backward"].append(
                (dy, x, mean, invstd, weight, *sums, count, channel_last)
            )
        for rms, mixed in ((False, False), (True, False), (False, True)):
            x = randn(4, 8, dtype=dtype)
            param_dtype = torch.float32 if mixed else dtype
            gamma = positive(8).to(param_dtype)
            beta = None if rms else randn(8, dtype=param_dtype)
            samples["layer_norm_fwd"].append((x, gamma, beta, 1e-5, rms, mixed))
            y, mean, invvar = norm_ops().layer_norm_fwd(x, gamma, beta, 1e-5, rms, mixed)
            dy = randn(4, 8, dtype=y.dtype)
            for memory_efficient in (False, True):
                saved = y if memory_efficient else x
                samples["layer_norm_bwd"].append(
                    (dy, saved, mean, invvar, gamma, beta, rms, memory_efficient, dtype)
                )
    samples["syncbn_welford_parallel"] = [
        (randn(2, 3), positive(2, 3), torch.tensor([4.0, 7.0], device=device), 1e-5),
        (randn(1, 5), positive(1, 5), torch.tensor([3.0], device=device), 1e-3),
    ]
    return samples


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.parametrize("name", sorted(_kernel_op_fakes.FAKES))
def test_opcheck_kernel_ops(name: str) -> None:
    """The norm and SyncBN ops the CUDA extension defines itself: fake kernels, schemas."""
    ops = norm_ops()  # the CUDA extension's ops, or the emulated build's on the CPU
    assert hasattr(ops, name), f"{name} is not an op of the CUDA extension"
    for args in _kernel_op_samples(KERNEL_DEVICE)[name]:
        torch.library.opcheck(getattr(ops, name).default, args)
