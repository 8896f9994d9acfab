"""The CUDA kernels of the newer ``amp_C`` ops against the reference, on the GPU (GPU only).

Same conventions as ``test_cuda_kernels.py``: identical inputs through the kernel and the
pure-PyTorch reference (the oracle), results within the rounding of the output dtype, the noop
flag exactly equal; every written tensor's autograd version bumped. They also run on the
emulated kernels (``nox -s cuda_emulation``, see ``_kernel_target.py``), where the CUDA graph is
the emulator's recording of the launches, replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from _kernel_target import DEVICE, EMULATED, SMALL_SIZES, Graph, extension
from _op_cases import TWO_ROUNDINGS as TOL
from _op_cases import noop_flag
from amp_fused_ops.reference import _ops as _reference

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emulation]

# AMP_EMULATION_SIZES=small: the small sizes and chunk only (see _kernel_target.py).
if SMALL_SIZES:
    SIZES: tuple[int, ...] = (1, 7, 555)
elif EMULATED:
    SIZES = (1, 7, 555, 33333)
else:
    SIZES = (1, 7, 555, 33333, 2048 * 32 + 1)
CHUNKS = (333,) if SMALL_SIZES else (333, 2048 * 32)
# Where inf/nan goes: past the first chunk of 333 of the last tensor.
INJECT_AT = (2, 444) if SMALL_SIZES else (3, 1234)
INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module")
def ext() -> Any:
    return extension()


def _flag(value: int = 0) -> Tensor:
    return noop_flag(value, DEVICE)


def _tensors(
    dtype: torch.dtype, seed: int, scale: float = 1.0, positive: bool = False
) -> list[Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = [torch.randn(n, generator=g, device=DEVICE) * scale for n in SIZES]
    return [(t.abs() if positive else t).to(dtype) for t in out]


def _t(value: float, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.tensor([value], dtype=dtype, device=DEVICE)


def _run_both(
    ext: Any,
    name: str,
    chunk: int,
    make: Callable[[], tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]],
) -> tuple[tuple[Any, Tensor, list[list[Tensor]]], tuple[Any, Tensor, list[list[Tensor]]]]:
    """Op ``name`` of the kernel and of the reference on identical fresh inputs; checks that the
    kernel bumps the versions of exactly the tensors the reference (through ATen) bumps."""
    runs = []
    for impl in (getattr(ext, name), getattr(_reference, name)):
        flag, lists, args = make()
        before = [[t._version for t in ts] for ts in lists]
        result = impl(chunk, flag, lists, *args)
        bumped = [
            [t._version > v for t, v in zip(ts, vs, strict=True)]
            for ts, vs in zip(lists, before, strict=True)
        ]
        runs.append((result, flag, lists, bumped))
    assert runs[0][3] == runs[1][3]
    return runs[0][:3], runs[1][:3]


def _close_lists(got: list[list[Tensor]], want: list[list[Tensor]]) -> None:
    for i, (ts, ws) in enumerate(zip(got, want, strict=True)):
        for j, (a, b) in enumerate(zip(ts, ws, strict=True)):
            torch.testing.assert_close(
                a, b, equal_nan=True, msg=f"list {i} tensor {j}", **TOL[a.dtype]
            )


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("inv_scale", [1.0, 2.0**-10])
def test_adam_capturable(
    ext: Any, chunk: int, dtype: torch.dtype, mode: int, inv_scale: float
) -> None:
    def make() -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
        lists = [
            _tensors(dtype, 1, scale=1.0 / inv_scale),
            _tensors(dtype, 2),
            _tensors(torch.float32, 3, 0.1),
            _tensors(torch.float32, 4, 0.01, positive=True),
        ]
        args = (_t(1e-3), 0.9, 0.999, 1e-8, _t(3, torch.int32), mode, 1, 0.01, _t(inv_scale))
        return _flag(), lists, args

    (_, f0, l0), (_, f1, l1) = _run_both(ext, "multi_tensor_adam_capturable", chunk, make)
    _close_lists(l0, l1)
    assert f0.item() == f1.item() == 0


@pytest.mark.parametrize(("entry", "inject"), [(1, None), (0, INF), (0, NAN)])
def test_adam_capturable_skips(ext: Any, entry: int, inject: float | None) -> None:
    lists = [
        _tensors(torch.float16, 1),
        _tensors(torch.float16, 2),
        _tensors(torch.float32, 3),
        _tensors(torch.float32, 4, positive=True),
    ]
    if inject is not None:
        lists[0][INJECT_AT[0]][INJECT_AT[1]] = inject
    before = [[t.clone() for t in ts] for ts in lists]
    flag = _flag(entry)
    ext.multi_tensor_adam_capturable(
        2048 * 32, flag, lists, _t(1e-3), 0.9, 0.999, 1e-8, _t(1), 1, 1, 0.0, _t(0.5)
    )
    assert flag.item() == 1
    for ts, bs in zip(lists, before, strict=True):
        for a, b in zip(ts, bs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_adam_capturable_runs_in_a_cuda_graph(ext: Any) -> None:
    def lists() -> list[list[Tensor]]:
        return [
            _tensors(torch.bfloat16, 1, 1024.0),
            _tensors(torch.bfloat16, 2),
            _tensors(torch.float32, 3),
            _tensors(torch.float32, 4, positive=True),
        ]

    args = (_t(1e-3), 0.9, 0.999, 1e-8, _t(2), 0, 1, 0.01, _t(1.0 / 1024))
    got, want, flag = lists(), lists(), _flag()
    if not EMULATED:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (lazy inits)
            ext.multi_tensor_adam_capturable(2048 * 32, _flag(), lists(), *args)
        torch.cuda.current_stream().wait_stream(stream)
    before = [[t.clone() for t in ts] for ts in got]
    graph = Graph()
    with graph:
        ext.multi_tensor_adam_capturable(2048 * 32, flag, got, *args)
    if EMULATED:  # nothing runs while the emulator records
        for ts, bs in zip(got, before, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(ts, bs, strict=True))
    graph.replay()
    _reference.multi_tensor_adam_capturable(2048 * 32, _flag(), want, *args)
    if not EMULATED:
        torch.cuda.synchronize()
    _close_lists(got, want)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(
    ("grad_dtype", "param_dtype", "state_dtype", "update_dtype"),
    [
        (torch.float32,) * 4,
        (torch.float16, torch.float32, torch.float32, torch.float32),
        (torch.float16, torch.float16, torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("global_norm", [0.5, 8.0])
def test_lamb_stages(
    ext: Any,
    chunk: int,
    grad_dtype: torch.dtype,
    param_dtype: torch.dtype,
    state_dtype: torch.dtype,
    update_dtype: torch.dtype,
    global_norm: float,
) -> None:
    decay = torch.linspace(0.0, 0.1, len(SIZES), device=DEVICE)

    def make1() -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
        lists = [
            _tensors(grad_dtype, 1),
            _tensors(param_dtype, 2),
            _tensors(state_dtype, 3, 0.1),
            _tensors(state_dtype, 4, 0.01, positive=True),
            [torch.zeros(n, dtype=update_dtype, device=DEVICE) for n in SIZES],
        ]
        return _flag(), lists, (decay, 3, 0.9, 0.999, 1e-6, _t(global_norm), 2.0)

    (_, f0, l0), (_, f1, l1) = _run_both(ext, "multi_tensor_lamb_stage1_cuda", chunk, make1)
    _close_lists(l0, l1)
    assert f0.item() == f1.item() == 0

    param_norms = torch.stack([p.float().norm() for p in l1[1]])
    param_norms[1] = 0.0
    update_norms = torch.stack([u.float().norm() for u in l1[4]])

    def make2() -> tuple[Tensor, list[list[Tensor]], tuple[Any, ...]]:
        lists = [[p.clone() for p in l1[1]], [u.clone() for u in l1[4]]]
        return _flag(), lists, (param_norms, update_norms, 0.01, 0.01, None)

    (_, f0, l0), (_, f1, l1) = _run_both(ext, "multi_tensor_lamb_stage2_cuda", chunk, make2)
    _close_lists(l0, l1)
    assert f0.item() == f1.item() == 0


@pytest.mark.parametrize("entry", [0, 1])
@pytest.mark.parametrize("inject", [None, INF])
def test_l2norm_mp(ext: Any, entry: int, inject: float | None) -> None:
    xs = _tensors(torch.bfloat16, 5)
    if inject is not None:
        xs[INJECT_AT[0]][7] = inject
    got_flag, want_flag = _flag(entry), _flag(entry)
    got = ext.multi_tensor_l2norm_mp(333, got_flag, [xs], True)
    want = _reference.multi_tensor_l2norm_mp(333, want_flag, [xs], True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert got_flag.item() == want_flag.item()


def test_update_scale_hysteresis(ext: Any) -> None:
    def state() -> list[Tensor]:
        return [
            _t(2.0**16),
            torch.zeros(1, dtype=torch.int32, device=DEVICE),
            torch.full((1,), 3, dtype=torch.int32, device=DEVICE),
        ]

    got, want = state(), state()
    found = _t(0.0)
    for value in [1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, -1, 0]:
        found.fill_(value)
        versions = [t._version for t in got]
        assert ext.update_scale_hysteresis(*got, found, 2.0, 0.5, 4, 3) is got[0]
        _reference.update_scale_hysteresis(*want, found, 2.0, 0.5, 4, 3)
        assert [t.item() for t in got] == [t.item() for t in want], value
        assert all(t._version > v for t, v in zip(got, versions, strict=True))


def test_cuda_ops_bump_versions_of_what_they_write(ext: Any) -> None:
    w = torch.rand(64, device=DEVICE, requires_grad=True)
    loss = (w * w).sum()
    with torch.no_grad():
        ext.multi_tensor_scale(2048, _flag(), [[w], [w]], 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
