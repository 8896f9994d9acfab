"""``emulation.amp_C_on_emulated_kernels`` routes amp_C's CPU ops to a module's kernels, then back.

The routing does not depend on the emulated build itself, so a stand-in module (a kernel that
records its call and writes a value no real op would) shows which path ran, without the
minutes of compiling the emulator.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from amp_fused_ops import amp_C, emulation, multi_tensor_applier


def _stand_in() -> tuple[types.ModuleType, list[tuple[Any, ...]]]:
    calls: list[tuple[Any, ...]] = []

    def multi_tensor_scale(
        chunk_size: int, flag: torch.Tensor, lists: list[list[torch.Tensor]], scale: float
    ) -> None:
        calls.append((chunk_size, scale))
        for out in lists[1]:
            out.fill_(-7.0)

    module = types.ModuleType("stand_in_kernels")
    module.multi_tensor_scale = multi_tensor_scale  # type: ignore[attr-defined]
    return module, calls


def _scale(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    flag = torch.zeros(1, dtype=torch.int32)
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [[x], [out]], 0.5)
    return out


def test_cpu_ops_run_the_modules_kernels_inside_the_block_only() -> None:
    module, calls = _stand_in()
    x = torch.arange(1.0, 6.0)
    with emulation.amp_C_on_emulated_kernels(module):
        inside = _scale(x)
    after = _scale(x)
    assert calls == [(2048 * 32, 0.5)]
    assert torch.equal(inside, torch.full_like(x, -7.0))
    torch.testing.assert_close(after, x * 0.5, rtol=0, atol=0)


def test_an_op_the_module_lacks_takes_the_usual_path() -> None:
    module, calls = _stand_in()
    x, y = torch.arange(1.0, 4.0), torch.ones(3)
    out = torch.empty(3)
    flag = torch.zeros(1, dtype=torch.int32)
    with emulation.amp_C_on_emulated_kernels(module):
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [[x], [y], [out]], 2.0, 3.0, -1)
    assert calls == []
    torch.testing.assert_close(out, 2.0 * x + 3.0 * y, rtol=0, atol=0)


def test_the_routing_is_undone_when_the_block_raises() -> None:
    module, calls = _stand_in()
    x = torch.arange(1.0, 6.0)
    with pytest.raises(KeyError, match="leave"), emulation.amp_C_on_emulated_kernels(module):
        raise KeyError("leave")
    torch.testing.assert_close(_scale(x), x * 0.5, rtol=0, atol=0)
    assert calls == []


def test_calls_that_bypass_amp_C_are_routed_too() -> None:
    # The fused optimizers and torch.ops.amp_fused_ops.<op> reach the dispatcher without amp_C.
    module, calls = _stand_in()
    x = torch.arange(1.0, 6.0)
    out = torch.empty_like(x)
    flag = torch.zeros(1, dtype=torch.int32)
    with emulation.amp_C_on_emulated_kernels(module):
        torch.ops.amp_fused_ops.multi_tensor_scale(333, flag, [x], [out], 0.25)
    assert calls == [(333, 0.25)]
    assert torch.equal(out, torch.full_like(x, -7.0))
