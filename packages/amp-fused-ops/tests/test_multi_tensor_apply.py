"""MultiTensorApply, the amp_C namespace, and its dispatch between kernels and the reference."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fused_ops
from _op_cases import noop_flag as _flag
from amp_fused_ops import MultiTensorApply, amp_C, multi_tensor_applier
from amp_fused_ops.extensions import _api as extension_api
from amp_fused_ops.reference import _ops as _reference

OPS = list(_reference.__all__)


# --- MultiTensorApply ------------------------------------------------------------------------


def test_applier_passes_chunk_size_and_args_and_returns_result() -> None:
    calls: list[tuple[Any, ...]] = []

    def op(*args: Any) -> str:
        calls.append(args)
        return "result"

    flag, lists = _flag(), [[torch.ones(2)]]
    assert MultiTensorApply(333)(op, flag, lists, 1.5, True) == "result"
    assert calls == [(333, flag, lists, 1.5, True)]


def test_shared_applier_matches_apex_defaults() -> None:
    assert multi_tensor_applier.chunk_size == 2048 * 32
    assert MultiTensorApply.available is True
    multi_tensor_applier.check_avail()  # never raises
    assert "65536" in repr(multi_tensor_applier)


@pytest.mark.parametrize("bad", [0, -5, 2**30 + 1, 1.5, True, "64"])
def test_applier_rejects_bad_chunk_size(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"chunk_size must be an int in \[1, 2\*\*30\]"):
        MultiTensorApply(bad)


def test_applier_runs_a_real_op() -> None:
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, _flag(), [[torch.ones(4)]], True)
    torch.testing.assert_close(total, torch.tensor([2.0]))
    torch.testing.assert_close(per, torch.tensor([2.0]))


# --- amp_C namespace -------------------------------------------------------------------------


def test_amp_c_is_importable_as_submodule_and_attribute() -> None:
    import amp_fused_ops.amp_C as imported

    assert imported is amp_C is amp_fused_ops.amp_C
    assert isinstance(amp_C, types.ModuleType)
    assert sorted(amp_C.__all__) == sorted(OPS)
    for name in OPS:
        assert callable(getattr(amp_C, name))
        assert getattr(amp_C, name).__doc__ == getattr(_reference, name).__doc__


def test_package_exports() -> None:
    assert {"MultiTensorApply", "multi_tensor_applier", "amp_C", "__version__"} <= set(
        amp_fused_ops.__all__
    )


# --- dispatch --------------------------------------------------------------------------------


class _OpCalls(TorchDispatchMode):
    """Records every call of an op of torch.ops.amp_fused_ops (then runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "amp_fused_ops":
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def _scale_args() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    return _flag(), [[torch.full((3,), 2.0)], [torch.zeros(3)]]


def test_an_amp_C_call_crosses_the_dispatcher_once_with_the_lists_unpacked() -> None:
    flag, (ins, outs) = _scale_args()
    with _OpCalls() as seen:
        multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ins, outs], 0.5)
    assert len(seen.calls) == 1
    func, args = seen.calls[0]
    assert func is torch.ops.amp_fused_ops.multi_tensor_scale.default
    assert args[0] == 2048 * 32 and args[1] is flag
    assert list(args[2]) == ins and list(args[3]) == outs and args[4] == 0.5
    assert torch.equal(outs[0], torch.ones(3))


def test_every_amp_C_op_is_a_dispatcher_op() -> None:
    for name in OPS:
        assert hasattr(torch.ops.amp_fused_ops, name), name
        assert getattr(amp_C, name).__name__ == name


def test_numbers_become_tensors_for_tensor_scalars() -> None:
    flag = _flag()
    grads, params = [torch.ones(4)], [torch.zeros(4)]
    m, v = [torch.zeros(4)], [torch.zeros(4)]
    with _OpCalls() as seen:
        amp_C.multi_tensor_adam_capturable(
            64, flag, [grads, params, m, v], 0.1, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0, 1.0
        )
    ((_, args),) = seen.calls
    lr, step, inv_scale = args[6], args[10], args[14]
    assert all(isinstance(t, torch.Tensor) for t in (lr, step, inv_scale))
    assert lr.item() == pytest.approx(0.1) and step.item() == 1 and inv_scale.item() == 1.0
    assert not torch.equal(params[0], torch.zeros(4))


def test_ops_without_a_compiled_kernel_run_the_reference() -> None:
    # multi_tensor_l2norm_scale has no C++ kernel: the dispatcher runs the reference, which
    # is registered for every device.
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(
        "amp_fused_ops::multi_tensor_l2norm_scale", "CPU"
    )
    xs, outs = [torch.full((4,), 3.0)], [torch.zeros(4)]
    total, per = amp_C.multi_tensor_l2norm_scale(64, _flag(), [xs, outs], 0.5, True)
    assert torch.equal(outs[0], torch.full((4,), 1.5))
    assert total.item() == pytest.approx(6.0) and per.tolist() == pytest.approx([6.0])


def test_meta_tensors_take_the_fake_kernels_and_load_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(extension_api, "get_extension", lambda kind: asked.append(kind))
    meta = [torch.empty(3, device="meta")]
    flag = torch.zeros(1, dtype=torch.int32, device="meta")
    amp_C.multi_tensor_scale(64, flag, [meta, meta], 1.0)
    total, per = amp_C.multi_tensor_l2norm(64, flag, [meta * 2], True)
    assert total.device.type == "meta" and total.shape == (1,) and per.shape == (2,)
    assert asked == []


def test_disabled_extensions_leave_the_reference_everywhere() -> None:
    code = (
        "import torch\n"
        "from amp_fused_ops import amp_C\n"
        "x = [torch.full((3,), 2.0)]; out = [torch.zeros(3)]\n"
        "amp_C.multi_tensor_scale(64, torch.zeros(1, dtype=torch.int32), [x, out], 0.5)\n"
        "assert torch.equal(out[0], torch.ones(3))\n"
        "print(torch._C._dispatch_has_kernel_for_dispatch_key("
        "'amp_fused_ops::multi_tensor_scale', 'CPU'))\n"
    )
    env = {**os.environ, "AMP_FUSED_OPS_DISABLE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"
