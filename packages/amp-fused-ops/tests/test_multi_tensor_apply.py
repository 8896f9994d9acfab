"""MultiTensorApply, the amp_C namespace, and its dispatch between kernels and the reference."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import amp_fused_ops
from amp_fused_ops import MultiTensorApply, _reference, amp_C, multi_tensor_applier
from amp_fused_ops import _amp_C as amp_c_module

OPS = list(_reference.__all__)


def _flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32)


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


def test_applier_runs_a_real_op(fake_loader: types.ModuleType) -> None:
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, _flag(), [[torch.ones(4)]], True)
    torch.testing.assert_close(total, torch.tensor([2.0]))
    torch.testing.assert_close(per, torch.tensor([2.0]))


# --- amp_C namespace -------------------------------------------------------------------------


def test_amp_c_is_importable_as_submodule_and_attribute() -> None:
    import amp_fused_ops.amp_C as imported  # type: ignore[import-not-found]

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


@pytest.fixture
def fake_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """Install a fake ``amp_fused_ops._loader`` whose ``get_extension`` is recorded."""
    loader = types.ModuleType("amp_fused_ops._loader")
    loader.requested = []  # type: ignore[attr-defined]
    loader.extension = None  # type: ignore[attr-defined]

    def get_extension(kind: str) -> types.ModuleType | None:
        loader.requested.append(kind)
        return loader.extension

    loader.get_extension = get_extension  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "amp_fused_ops._loader", loader)
    amp_c_module._loader_get_extension.cache_clear()
    yield loader
    amp_c_module._loader_get_extension.cache_clear()


def _scale_args() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    return _flag(), [[torch.full((3,), 2.0)], [torch.zeros(3)]]


def test_dispatch_calls_kernel_with_identical_arguments(fake_loader: types.ModuleType) -> None:
    calls: list[tuple[Any, ...]] = []
    extension = types.ModuleType("fake_ext")
    extension.multi_tensor_scale = lambda *args: calls.append(args)  # type: ignore[attr-defined]
    fake_loader.extension = extension  # type: ignore[attr-defined]
    flag, lists = _scale_args()
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, lists, 0.5)
    assert fake_loader.requested == ["cpu"]
    assert len(calls) == 1
    assert calls[0][0] == 2048 * 32 and calls[0][1] is flag and calls[0][2] is lists
    assert calls[0][3:] == (0.5,)
    assert torch.equal(lists[1][0], torch.zeros(3))  # the reference did not run


def test_dispatch_falls_back_when_extension_lacks_the_op(fake_loader: types.ModuleType) -> None:
    fake_loader.extension = types.ModuleType("fake_ext")  # type: ignore[attr-defined]
    flag, lists = _scale_args()
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, lists, 0.5)
    assert torch.equal(lists[1][0], torch.ones(3))


def test_dispatch_falls_back_when_no_extension(fake_loader: types.ModuleType) -> None:
    flag, lists = _scale_args()
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, lists, 0.5)
    assert fake_loader.requested == ["cpu"]
    assert torch.equal(lists[1][0], torch.ones(3))


def test_dispatch_skips_loader_for_other_devices_and_empty_lists(
    fake_loader: types.ModuleType,
) -> None:
    meta = torch.empty(3, device="meta")
    amp_C.multi_tensor_scale(64, torch.zeros(1, dtype=torch.int32, device="meta"), [[meta]] * 2, 1)
    amp_C.multi_tensor_scale(64, _flag(), [[], []], 1.0)
    assert fake_loader.requested == []


@pytest.mark.parametrize("broken", ["missing", "no_get_extension"])
def test_dispatch_without_usable_loader_uses_reference(
    monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    loader = None if broken == "missing" else types.ModuleType("amp_fused_ops._loader")
    monkeypatch.setitem(sys.modules, "amp_fused_ops._loader", loader)  # None: ImportError
    amp_c_module._loader_get_extension.cache_clear()
    try:
        flag, lists = _scale_args()
        amp_C.multi_tensor_scale(64, flag, lists, 0.5)
        assert torch.equal(lists[1][0], torch.ones(3))
    finally:
        amp_c_module._loader_get_extension.cache_clear()
