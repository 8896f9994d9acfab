"""``extensions.use_reference()``: every op runs its reference inside the block, and only there.

Proof by two witnesses besides the block's own counter: a profile of the reference function
(its Python frames) and a dispatch mode entered outside the block that sees every op reaching
the kernels below it. Inside the block the reference runs and the op never reaches a kernel;
after it the op reaches the kernels and, where the CPU extension has one, no reference runs:
the compiled kernel served it. The loaded extension is the point, so those tests skip where it
cannot be built.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from _kernel_target import DEVICE as KERNEL_DEVICE
from _kernel_target import EMULATED, extension, norm_ops
from _op_cases import OP_CASES, noop_flag
from _profiled import profiled
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm, amp_C, extensions, multi_tensor_applier
from amp_fused_ops.ops import _reference_mode as reference_mode
from amp_fused_ops.ops._kernel_ops import KERNEL_OPS
from amp_fused_ops.ops._registry import OPS_NAMESPACE, REGISTRY, reference_kernel
from amp_fused_ops.reference import _norm as norm_reference
from amp_fused_ops.reference import _syncbn as syncbn_reference
from amp_fused_ops.syncbn import _kernels as syncbn_kernels

OPS = sorted(REGISTRY)


def _op(name: str, namespace: str = OPS_NAMESPACE) -> Any:
    return getattr(getattr(torch.ops, namespace), name).default


class ReachesKernels(TorchDispatchMode):
    """Entered outside ``use_reference()``: records the ops of this package that pass it on
    their way to the kernels (an op the block ran on its reference never does)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == OPS_NAMESPACE:
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _modes() -> int:
    """Dispatch modes on this thread's stack (PyTorch keeps them per thread)."""
    return int(torch._C._len_torch_dispatch_stack())


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize("name", OPS)
def test_every_op_runs_its_reference_inside_the_block_and_its_kernel_after(
    cpu_extension: object, name: str
) -> None:
    case, spec, qualified = OP_CASES[name], REGISTRY[name], f"{OPS_NAMESPACE}::{name}"
    with ReachesKernels() as kernels, profiled(spec.reference) as reference_runs:
        with extensions.use_reference() as calls:
            args = case.sample()
            got = _op(name)(*args)
        assert calls == {qualified: 1}
        assert reference_runs[spec.reference.__name__] == 1
        assert kernels.ops == [], "the op reached the kernels inside use_reference()"

        _op(name)(*case.sample())
        assert kernels.ops == [qualified]
        # Where the CPU extension has a kernel, it served the call: no reference ran.
        assert reference_runs[spec.reference.__name__] == (1 if "cpu" in case.paths else 2)
    want_args = case.sample()
    want = reference_kernel(spec)(*want_args)
    for g, w in zip(_tensors((got, args)), _tensors((want, want_args)), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("name", OPS)
def test_the_reference_bumps_the_version_of_every_tensor_it_writes(name: str) -> None:
    # As every kernel does: autograd and amp O1's weight-cast cache see the write.
    schema = _op(name)._schema
    args = OP_CASES[name].sample()
    written = [
        t
        for argument, value in zip(schema.arguments, args, strict=False)
        if argument.alias_info is not None and argument.alias_info.is_write
        for t in _tensors(value)
    ]
    assert written
    before = [t._version for t in written]
    with extensions.use_reference() as calls:
        _op(name)(*args)
    assert calls == {f"{OPS_NAMESPACE}::{name}": 1}
    assert all(t._version > v for t, v in zip(written, before, strict=True))


def test_amp_C_and_the_applier_run_the_reference(cpu_extension: object) -> None:
    src, dst = [torch.arange(4.0)], [torch.empty(4)]
    reference = REGISTRY["multi_tensor_scale"].reference
    with profiled(reference) as runs, extensions.use_reference() as calls:
        multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag(), [src, dst], 0.5)
        amp_C.multi_tensor_scale(64, noop_flag(), [src, dst], 0.5)
    assert calls["amp_fused_ops::multi_tensor_scale"] == 2
    assert runs[reference.__name__] == 2
    assert torch.equal(dst[0], src[0] / 2)


@pytest.mark.parametrize("module", [FusedLayerNorm, FusedRMSNorm])
def test_fused_norms_run_the_reference_forward_and_backward(module: type) -> None:
    torch.manual_seed(0)
    norm = module(8)
    x = torch.randn(3, 8, requires_grad=True)
    functions = (norm_reference.norm_forward_reference, norm_reference.norm_backward_reference)
    with profiled(*functions) as runs, extensions.use_reference() as calls:
        y = norm(x)
        y.backward(torch.ones_like(y))
    assert calls == {"amp_fused_ops::norm_forward": 1, "amp_fused_ops::norm_backward": 1}
    assert runs == {"norm_forward_reference": 1, "norm_backward_reference": 1}
    rms = module is FusedRMSNorm
    want, _, _ = norm_reference.norm_forward_reference(
        x.detach(), norm.weight.detach(), getattr(norm, "bias", None), norm.eps, rms, False
    )
    torch.testing.assert_close(y.detach(), want, rtol=0, atol=0)
    assert x.grad is not None and norm.weight.grad is not None


def test_the_block_ends_when_its_body_raises(cpu_extension: object) -> None:
    with pytest.raises(ValueError, match="boom"), extensions.use_reference():
        raise ValueError("boom")
    assert _modes() == 0
    with ReachesKernels() as kernels, profiled(REGISTRY["multi_tensor_scale"].reference) as runs:
        amp_C.multi_tensor_scale(64, noop_flag(), [[torch.ones(3)], [torch.empty(3)]], 2.0)
    assert kernels.ops == ["amp_fused_ops::multi_tensor_scale"]
    assert runs == {"multi_tensor_scale": 0}


def test_meta_tensors_keep_the_fake_kernel() -> None:
    ins, outs = [torch.empty(3, device="meta")], [torch.empty(3, device="meta")]
    flag = torch.zeros(1, dtype=torch.int32, device="meta")
    with extensions.use_reference() as calls:
        total, per_tensor = _op("multi_tensor_l2norm")(64, flag, ins, True)
        _op("multi_tensor_scale")(64, flag, ins, outs, 2.0)
    assert calls == {}
    assert (total.device.type, tuple(per_tensor.shape)) == ("meta", (1,))


def test_blocks_nest_and_count_their_own_calls() -> None:
    lists = [[torch.ones(3)], [torch.empty(3)]]
    with extensions.use_reference() as outer:
        amp_C.multi_tensor_scale(64, noop_flag(), lists, 2.0)
        with extensions.use_reference() as inner:
            amp_C.multi_tensor_l2norm(64, noop_flag(), lists[:1], False)
        amp_C.multi_tensor_axpby(64, noop_flag(), [*lists, lists[1]], 1.0, 1.0, -1)
        assert _modes() == 1  # the inner block left the outer one's override
    assert inner == {"amp_fused_ops::multi_tensor_l2norm": 1}
    assert outer == {
        "amp_fused_ops::multi_tensor_scale": 1,
        "amp_fused_ops::multi_tensor_l2norm": 1,
        "amp_fused_ops::multi_tensor_axpby": 1,
    }
    assert _modes() == 0


def test_other_threads_keep_the_normal_dispatch() -> None:
    seen: list[bool] = []

    def other() -> None:
        seen.append(_modes() > 0)
        amp_C.multi_tensor_scale(64, noop_flag(), [[torch.ones(3)], [torch.empty(3)]], 2.0)

    with extensions.use_reference() as calls:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen == [False]
    assert calls == {}


@pytest.mark.parametrize("compiled_first", [False, True], ids=["traced-inside", "compiled-before"])
def test_a_compiled_function_runs_the_reference_inside_the_block(compiled_first: bool) -> None:
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def scale(src: list[Tensor], dst: list[Tensor]) -> Tensor:
        multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag(), [src, dst], 0.5)
        return dst[0] + 1

    src, dst = [torch.arange(4.0)], [torch.empty(4)]
    if compiled_first:
        scale(src, dst)
    with extensions.use_reference() as calls:
        out = scale(src, dst)
    assert calls == {"amp_fused_ops::multi_tensor_scale": 1}
    assert torch.equal(out, src[0] / 2 + 1)
    with extensions.use_reference() as calls_after:
        pass
    scale(src, dst)
    assert calls_after == {}


def test_fullgraph_compile_inside_the_block_raises_torchs_error() -> None:
    torch._dynamo.reset()

    @torch.compile(backend="eager", fullgraph=True)
    def scale(src: list[Tensor], dst: list[Tensor]) -> None:
        multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag(), [src, dst], 0.5)

    with pytest.raises(RuntimeError, match="dispatch mode"), extensions.use_reference():
        scale([torch.ones(2)], [torch.empty(2)])


def test_every_op_of_the_package_has_a_reference_in_every_namespace() -> None:
    table = reference_mode._references()
    for namespace in (OPS_NAMESPACE, "amp_fused_ops_emu"):
        assert {f"{namespace}::{name}" for name in REGISTRY} <= set(table)
        assert {f"{namespace}::{name}" for name in KERNEL_OPS} <= set(table)
    assert {"amp_fused_ops::norm_forward", "amp_fused_ops::norm_backward"} <= set(table)


def test_the_syncbn_references_are_the_cpu_path() -> None:
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(4, 3, 5, generator=gen), torch.randn(4, 3, 5, generator=gen)
    mean, var = syncbn_kernels.welford_mean_var(x)
    invstd = torch.rsqrt(var + 1e-5)
    ref_mean, ref_var = syncbn_reference.REFERENCES["syncbn_welford_mean_var"](x, False)
    assert torch.equal(mean, ref_mean) and torch.equal(var, ref_var)
    y = syncbn_kernels.batchnorm_forward(x, mean, invstd, None, None)
    ref_y = syncbn_reference.REFERENCES["syncbn_forward"](
        x, mean, invstd, None, None, None, False, False
    )
    assert torch.equal(y, ref_y)
    sum_dy, sum_dy_xmu, _, _ = syncbn_kernels.reduce_bn(dy, x, mean, invstd, None)
    ref_sums = syncbn_reference.REFERENCES["syncbn_reduce"](dy, x, mean, False)
    assert torch.equal(sum_dy, ref_sums[0]) and torch.equal(sum_dy_xmu, ref_sums[1])


# --- the ops on the CUDA kernels (a GPU, or the emulated build on the CPU) ----------


def _kernel_op_sample(name: str, device: str) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen).to(device)

    x, dy, mean, invstd = randn(4, 3, 5), randn(4, 3, 5), randn(3), randn(3).abs() + 0.5
    rows = randn(4, 8)
    out, row_mean, row_invvar = norm_reference.norm_forward_reference(
        rows, None, None, 1e-5, False, False
    )
    samples: dict[str, tuple[Any, ...]] = {
        "syncbn_welford_mean_var": (x, False),
        "syncbn_welford_parallel": (randn(2, 3), randn(2, 3).abs(), randn(2).abs() + 1, 1e-5),
        "syncbn_forward": (x, mean, invstd, None, None, None, True, False),
        "syncbn_reduce": (dy, x, mean, False),
        "syncbn_backward": (dy, x, mean, invstd, None, randn(3), randn(3), 60, False),
        "norm_forward": (rows, None, None, 1e-5, False, False, False),
        "norm_backward": (
            randn(4, 8), rows, row_mean, row_invvar, None, None, False, False, torch.float32,
        ),
    }  # fmt: skip
    del out
    return samples[name]


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.parametrize("name", sorted(KERNEL_OPS))
def test_the_norm_and_syncbn_ops_on_cuda_kernels_run_their_reference(name: str) -> None:
    ops = norm_ops()  # torch.ops.amp_fused_ops on CUDA, or the emulated build's ops
    namespace = "amp_fused_ops_emu" if EMULATED else OPS_NAMESPACE
    args = _kernel_op_sample(name, KERNEL_DEVICE)
    before = _launches()
    with extensions.use_reference() as calls:
        got = getattr(ops, name).default(*args)
    assert calls == {f"{namespace}::{name}": 1}
    assert _launches() == before, "an emulated kernel was launched inside use_reference()"
    want = reference_mode._references()[f"{namespace}::{name}"](*args)
    for g, w in zip(_tensors(got), _tensors(want), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.skipif(not EMULATED, reason="the emulated build's amp_C ops")
def test_amp_C_on_the_emulated_kernels_runs_the_reference() -> None:
    from amp_fused_ops import emulation

    module = extension()
    src, dst = [torch.arange(4.0)], [torch.empty(4)]
    emulation.reset_counters()
    # Both are overrides at the dispatcher; the one opened last sees the call first.
    with emulation.amp_C_on_emulated_kernels(module), extensions.use_reference() as calls:
        amp_C.multi_tensor_scale(64, noop_flag(), [src, dst], 0.5)
    assert calls == {"amp_fused_ops::multi_tensor_scale": 1}
    assert emulation.counters().launches == 0
    assert torch.equal(dst[0], src[0] / 2)
    dst[0].zero_()
    with extensions.use_reference() as calls, emulation.amp_C_on_emulated_kernels(module):
        amp_C.multi_tensor_scale(64, noop_flag(), [src, dst], 0.5)
    assert calls == {"amp_fused_ops_emu::multi_tensor_scale": 1}  # routed, then the reference
    assert emulation.counters().launches == 0
    assert torch.equal(dst[0], src[0] / 2)
    with emulation.amp_C_on_emulated_kernels(module):
        amp_C.multi_tensor_scale(64, noop_flag(), [src, dst], 0.25)
    assert emulation.counters().launches > 0  # the emulated kernel again, after the block


def _launches() -> int:
    """Kernel launches so far: the emulator's counter (a real GPU: not counted, 0)."""
    if not EMULATED:
        return 0
    from amp_fused_ops import emulation

    return emulation.counters().launches
