"""Every ``amp_C`` op bumps the autograd version counter of each tensor it writes in place.

ATen's in-place ops bump a tensor's version whenever they write it (whether or not the values
change); autograd compares versions to refuse a backward through a saved tensor that was
modified since, and amp O1's weight-cast cache re-casts a weight whose version moved. The
compiled kernels write through raw pointers, so their dispatcher wrappers must bump versions
themselves.
Checked here on the reference path and on the compiled CPU path, for every op that has both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from amp_fused_ops.reference import _ops as _reference

PATHS = ("reference", "compiled")


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


def _op(path: str, name: str, request: pytest.FixtureRequest) -> Callable[..., Any]:
    if path == "reference":
        return getattr(_reference, name)  # type: ignore[no-any-return]
    ext = request.getfixturevalue("ext")
    if not hasattr(ext, name):
        pytest.skip(f"{name} has no compiled CPU kernel")
    return getattr(ext, name)  # type: ignore[no-any-return]


def _lists(count: int, dtypes: tuple[torch.dtype, ...] | None = None) -> list[list[Tensor]]:
    g = torch.Generator().manual_seed(0)
    dtypes = dtypes or (torch.float32,) * count
    return [[torch.rand(n, generator=g).to(d) + 0.5 for n in (5, 300)] for d in dtypes]


def _t(value: float, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.tensor([value], dtype=dtype)


# name -> (make tensor lists, extra args, lists written in place)
CASES: dict[
    str, tuple[Callable[[], list[list[Tensor]]], Callable[[], tuple[Any, ...]], tuple[int, ...]]
] = {
    "multi_tensor_scale": (lambda: _lists(2), lambda: (0.5,), (1,)),
    "multi_tensor_axpby": (lambda: _lists(3), lambda: (2.0, 3.0, -1), (2,)),
    "multi_tensor_l2norm_scale": (lambda: _lists(2), lambda: (0.5, True), (1,)),
    "multi_tensor_sgd": (
        lambda: _lists(3),
        lambda: (0.0, 0.9, 0.0, 0.1, False, False, False, 1.0),
        (1, 2),
    ),
    "multi_tensor_adam": (
        lambda: _lists(4),
        lambda: (1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0),
        (1, 2, 3),
    ),
    "multi_tensor_adam_capturable": (
        lambda: _lists(4),
        lambda: (_t(1e-3), 0.9, 0.999, 1e-8, _t(1, torch.int32), 1, 1, 0.0, _t(0.5)),
        (0, 1, 2, 3),
    ),
    "multi_tensor_adam_capturable_master": (
        lambda: _lists(5, (torch.bfloat16,) * 2 + (torch.float32,) * 3),
        lambda: (_t(1e-3), 0.9, 0.999, 1e-8, _t(1), 1, 1, 0.0, _t(1.0)),
        (1, 2, 3, 4),
    ),
    "multi_tensor_adagrad": (lambda: _lists(3), lambda: (0.1, 1e-10, 0, 0.0), (1, 2)),
    "multi_tensor_lamb": (
        lambda: _lists(4),
        lambda: (1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, _t(1.0), 1.0, False),
        (1, 2, 3),
    ),
    "multi_tensor_lamb_mp": (
        lambda: _lists(4),
        lambda: (
            _t(1e-3),
            0.9,
            0.999,
            1e-6,
            _t(1),
            1,
            0.01,
            1,
            1,
            _t(1.0),
            _t(1.0),
            False,
            _t(0.0),
            _t(1.0),
        ),
        (1, 2, 3),
    ),
    "multi_tensor_novograd": (
        lambda: _lists(3),
        lambda: (torch.ones(2), 1e-3, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 0, 2),
        (1, 2),
    ),
    "multi_tensor_lamb_stage1_cuda": (
        lambda: _lists(5),
        lambda: (torch.zeros(2), 0, 0.9, 0.999, 1e-6, _t(1.0), 1.0),
        (2, 3, 4),
    ),
    "multi_tensor_lamb_stage2_cuda": (
        lambda: _lists(2),
        lambda: (torch.ones(2), torch.ones(2), 0.1, 0.01, None),
        (0,),
    ),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_in_place_op_bumps_the_versions_of_what_it_writes(
    path: str, name: str, request: pytest.FixtureRequest
) -> None:
    op = _op(path, name, request)
    make_lists, make_args, written = CASES[name]
    lists = make_lists()
    args = make_args()
    before = [[t._version for t in tensors] for tensors in lists]
    op(2048, torch.zeros(1, dtype=torch.int32), lists, *args)
    for index, tensors in enumerate(lists):
        for position, t in enumerate(tensors):
            bumped = t._version > before[index][position]
            assert bumped == (index in written), (name, index, position)


@pytest.mark.parametrize("path", PATHS)
def test_a_skipped_step_still_bumps_like_an_aten_in_place_op(
    path: str, request: pytest.FixtureRequest
) -> None:
    op = _op(path, "multi_tensor_sgd", request)
    lists = _lists(3)
    before = [t._version for t in lists[1]]
    op(2048, torch.ones(1, dtype=torch.int32), lists, 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)
    assert all(t._version > v for t, v in zip(lists[1], before, strict=True))


@pytest.mark.parametrize("path", PATHS)
def test_update_scale_hysteresis_bumps_the_scaler_state(
    path: str, request: pytest.FixtureRequest
) -> None:
    op = _op(path, "update_scale_hysteresis", request)
    state = [_t(4.0), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)]
    before = [t._version for t in state]
    op(*state, _t(0.0), 2.0, 0.5, 10, 1)
    assert all(t._version > v for t, v in zip(state, before, strict=True))


@pytest.mark.parametrize("path", PATHS)
def test_backward_through_a_tensor_an_op_modified_raises(
    path: str, request: pytest.FixtureRequest
) -> None:
    op = _op(path, "multi_tensor_scale", request)
    w = torch.rand(8, requires_grad=True)
    loss = (w * w).sum()  # saves w for backward
    with torch.no_grad():
        op(2048, torch.zeros(1, dtype=torch.int32), [[w], [w]], 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
