"""Every op of the registry as a PyTorch op: schema, fake kernel, meta tensors, opcheck, paths.

The op registry (:data:`amp_fused_ops.ops._registry.REGISTRY`) is the one list of ``amp_C`` ops;
these tests take their op list from it and each op's sample call and tolerances from
``_op_cases.py``, so an op added there without a case fails
``test_every_registered_op_has_a_case``, one without a working fake kernel fails the opcheck
and meta tests, and one whose kernel disagrees with its reference fails
``test_every_path_agrees_with_the_reference``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from amp_test_support import DEVICES
from torch import Tensor

from _kernel_target import DEVICE as KERNEL_DEVICE
from _kernel_target import norm_ops
from _op_cases import OP_CASES, missing_cases, noop_flag
from _op_paths import apex_arguments, on_device
from amp_fused_ops import amp_C, extensions
from amp_fused_ops.ops import _kernel_ops
from amp_fused_ops.ops._registry import REGISTRY, OpSpec, reference_kernel

OPS = sorted(REGISTRY)


def _op(name: str) -> Any:
    return getattr(torch.ops.amp_fused_ops, name).default


def test_every_registered_op_has_a_case() -> None:
    assert missing_cases(REGISTRY) == ([], [])


def test_the_case_check_names_an_op_without_a_case() -> None:
    registered = {**REGISTRY, "multi_tensor_new": REGISTRY["multi_tensor_scale"]}
    del registered["multi_tensor_adam"]
    assert missing_cases(registered) == (["multi_tensor_new"], ["multi_tensor_adam"])


def test_an_entry_takes_its_preconditions_arguments_from_its_schema() -> None:
    spec = REGISTRY["multi_tensor_adagrad"]
    assert spec.preconditions is not None
    assert spec.preconditions.arguments == ("lr", "epsilon", "mode", "weight_decay", "lr_tensor")
    assert spec.preconditions.choices == (("mode", (0, 1)),)
    assert REGISTRY["update_scale_hysteresis"].preconditions is None  # no Apex lists


def test_an_entry_refuses_a_switch_its_schema_does_not_have() -> None:
    scale = REGISTRY["multi_tensor_scale"]
    with pytest.raises(ValueError, match="choice 'mode' is not an argument of the op"):
        OpSpec(scale.schema, scale.reference, list_counts=(2,), choices=(("mode", (0, 1)),))
    hysteresis = REGISTRY["update_scale_hysteresis"]
    with pytest.raises(ValueError, match="preconditions need Apex's convention"):
        OpSpec(hysteresis.schema, hysteresis.reference, step_at_least_one=True)


def test_the_autocast_kernels_follow_the_entries_rules() -> None:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for name, spec in _kernel_ops.KERNEL_OPS.items():
        for key in ("AutocastCPU", "AutocastCUDA"):
            registered = has_kernel(f"amp_fused_ops::{name}", key)
            assert registered == (spec.autocast == "lower_precision"), (name, key)
    assert _kernel_ops.KERNEL_OPS["norm_forward"].autocast == "lower_precision"
    for name in OPS:  # the multi-tensor ops run in their tensors' dtypes under autocast
        assert not has_kernel(f"amp_fused_ops::{name}", "AutocastCPU"), name


def test_an_entry_refuses_an_unknown_autocast_rule() -> None:
    spec = _kernel_ops.KERNEL_OPS["syncbn_forward"]
    with pytest.raises(ValueError, match="autocast must be one of"):
        _kernel_ops.KernelOpSpec(spec.schema, spec.reference, spec.fake, autocast="fp32")
    scale = REGISTRY["multi_tensor_scale"]
    with pytest.raises(ValueError, match="runs in its tensors' dtypes"):
        OpSpec(scale.schema, scale.reference, list_counts=(2,), autocast="lower_precision")  # type: ignore[arg-type]


def test_every_registered_op_is_in_amp_C() -> None:
    assert sorted(amp_C.__all__) == OPS
    for name in OPS:
        assert str(_op(name)._schema) == f"amp_fused_ops::{REGISTRY[name].schema}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name: str, device: str) -> None:
    """Schema (mutations declared), fake kernel, autograd registration, AOT dispatch."""
    extensions.get_extension(device)  # the compiled kernels, where they can be built
    torch.library.opcheck(_op(name), on_device(OP_CASES[name].sample(), device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_meta_tensors_get_the_shapes_of_real_outputs(name: str, device: str) -> None:
    args = on_device(OP_CASES[name].sample(), device)
    meta_args = on_device(args, "meta")
    assert not any(isinstance(a, Tensor) and a.device.type != "meta" for a in meta_args)
    real = _op(name)(*args)
    fake = _op(name)(*meta_args)
    real_out = real if isinstance(real, tuple) else () if real is None else (real,)
    fake_out = fake if isinstance(fake, tuple) else () if fake is None else (fake,)
    assert len(fake_out) == len(real_out)
    for r, f in zip(real_out, fake_out, strict=True):
        assert f.device.type == "meta"
        assert (f.shape, f.dtype) == (r.shape, r.dtype)


# The same sample through each way of running an op, against the reference called the same
# way: the dispatcher op (the compiled CPU kernel where the extension has one) with the
# schema's arguments, and amp_C with Apex's.
PATHS: dict[
    str, tuple[Callable[[str, tuple[Any, ...]], Any], Callable[[str, tuple[Any, ...]], Any]]
] = {
    "dispatcher": (
        lambda name, args: _op(name)(*args),
        lambda name, args: reference_kernel(REGISTRY[name])(*args),
    ),
    "amp_C": (
        lambda name, args: getattr(amp_C, name)(*apex_arguments(name, args)),
        lambda name, args: REGISTRY[name].reference(*apex_arguments(name, args)),
    ),
}


def _tensors_of(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors_of(v)]
    return []


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", OPS)
def test_every_path_agrees_with_the_reference(name: str, path: str) -> None:
    """Outputs and every argument written in place, within the op's tolerances, per dtype."""
    case = OP_CASES[name]
    extensions.get_extension("cpu")  # the compiled kernels, where they can be built
    want_args, got_args = case.sample(), case.sample()
    run, reference = PATHS[path]
    got, want = run(name, got_args), reference(name, want_args)
    pairs = list(zip(_tensors_of((got, got_args)), _tensors_of((want, want_args)), strict=True))
    assert pairs
    for got_tensor, want_tensor in pairs:
        assert (got_tensor.dtype, got_tensor.shape) == (want_tensor.dtype, want_tensor.shape)
        exact = {"rtol": 0.0, "atol": 0.0}  # flags, step counts, trackers
        tolerance = case.tolerances[want_tensor.dtype] if want_tensor.is_floating_point() else exact
        torch.testing.assert_close(got_tensor, want_tensor, **tolerance)


def test_the_fake_kernels_check_devices_as_the_kernels_do() -> None:
    ins = [torch.empty(3, device="meta")]
    with pytest.raises(RuntimeError, match=r"tensor_lists\[0\]\[0\] is on meta but noop_flag"):
        _op("multi_tensor_scale")(64, noop_flag(), ins, [torch.empty(3)], 1.0)


# --- the norm ops (amp_fused_ops.ops._kernel_ops, outside the amp_C registry) --------------------


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


# --- the norm and SyncBN ops on the CUDA sources' kernels (amp_fused_ops.ops._kernel_ops)


def _kernel_op_samples(device: str) -> dict[str, list[tuple[Any, ...]]]:
    """Sample arguments of every op of ``_kernel_ops.KERNEL_OPS`` (several per op)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(shape, generator=gen).to(device, dtype)

    def positive(*shape: int) -> Tensor:
        return (torch.rand(shape, generator=gen) + 0.5).to(device)

    samples: dict[str, list[tuple[Any, ...]]] = {name: [] for name in _kernel_ops.KERNEL_OPS}
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
            samples["norm_forward"].append((x, gamma, beta, 1e-5, rms, mixed, False))
            y, mean, invvar = norm_ops().norm_forward(x, gamma, beta, 1e-5, rms, mixed, False)
            dy = randn(4, 8, dtype=y.dtype)
            for memory_efficient in (False, True):
                saved = y if memory_efficient else x
                samples["norm_backward"].append(
                    (dy, saved, mean, invvar, gamma, beta, rms, memory_efficient, dtype)
                )
    samples["syncbn_welford_parallel"] = [
        (randn(2, 3), positive(2, 3), torch.tensor([4.0, 7.0], device=device), 1e-5),
        (randn(1, 5), positive(1, 5), torch.tensor([3.0], device=device), 1e-3),
    ]
    return samples


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.parametrize("name", sorted(_kernel_ops.KERNEL_OPS))
def test_opcheck_kernel_ops(name: str) -> None:
    """The norm and SyncBN ops on the CUDA sources' kernels: fake kernels, schemas, autograd."""
    ops = norm_ops()  # torch.ops.amp_fused_ops on CUDA, or the emulated build's on the CPU
    for args in _kernel_op_samples(KERNEL_DEVICE)[name]:
        torch.library.opcheck(getattr(ops, name).default, args)
