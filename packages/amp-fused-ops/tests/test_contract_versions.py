"""Every op bumps the autograd version counter of each tensor it writes, and of no other.

ATen's in-place ops bump a tensor's version whenever they write it (whether or not the values
change); autograd compares versions to refuse a backward through a saved tensor that was
modified since, and amp O1's weight-cast cache re-casts a weight whose version moved. The
compiled kernels write through raw pointers, so their dispatcher entries bump the versions
themselves. Checked on every path of every op (``_op_paths.py``), from the op's case: its
sample call and the arguments its schema marks as written (``OpCase.writes``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from _op_cases import OP_CASES
from _op_paths import OpPath, apex_arguments, on_device, paths


def _op_path_params() -> list[Any]:
    return [
        pytest.param(name, *param.values, marks=param.marks, id=f"{name}-{param.values[0]}")
        for name in sorted(OP_CASES)
        for param in paths(name)
    ]


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize(("name", "path"), _op_path_params(), indirect=["path"])
def test_an_op_bumps_the_versions_of_what_it_writes_and_only_those(name: str, path: OpPath) -> None:
    case = OP_CASES[name]
    args = on_device(case.sample(), path.device)
    schema = getattr(torch.ops.amp_fused_ops, name).default._schema
    arguments = dict(zip((a.name for a in schema.arguments), args, strict=False))
    before = {arg: [t._version for t in _tensors(value)] for arg, value in arguments.items()}
    path.op(name)(*apex_arguments(name, args))
    for arg, value in arguments.items():
        for t, version in zip(_tensors(value), before[arg], strict=True):
            assert (t._version > version) == (arg in case.writes), (arg, version, t._version)


@pytest.mark.parametrize("path", paths("multi_tensor_sgd"), indirect=True)
def test_a_skipped_step_still_bumps_like_an_aten_in_place_op(path: OpPath) -> None:
    lists = [path.randn(torch.float32, seed, (5, 300)) for seed in range(3)]
    before = [t._version for t in lists[1]]
    path.op("multi_tensor_sgd")(
        2048, path.flag(1), lists, 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0
    )
    assert all(t._version > v for t, v in zip(lists[1], before, strict=True))


@pytest.mark.parametrize("path", paths("multi_tensor_scale"), indirect=True)
def test_backward_through_a_tensor_an_op_modified_raises(path: OpPath) -> None:
    w = torch.rand(64, device=path.device, requires_grad=True)
    loss = (w * w).sum()  # saves w for backward
    with torch.no_grad():
        path.op("multi_tensor_scale")(2048, path.flag(), [[w], [w]], 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
