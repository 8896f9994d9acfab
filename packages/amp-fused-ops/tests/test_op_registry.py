"""Every op of the registry as a PyTorch op: schema, fake kernel, meta tensors, opcheck.

The op registry (:data:`amp_fused_ops.ops._registry.REGISTRY`) is the one list of ``amp_C`` ops;
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

from amp_fused_ops import amp_C, extensions
from amp_fused_ops.ops._registry import REGISTRY


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
