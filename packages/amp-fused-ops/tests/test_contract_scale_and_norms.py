"""The scaling and norm ops of ``amp_C`` on every path that implements them, against formulas.

Covers ``multi_tensor_scale``, ``multi_tensor_axpby``, ``multi_tensor_l2norm``,
``multi_tensor_l2norm_mp``, ``multi_tensor_l2norm_scale`` and ``multi_tensor_unscale_l2norm``:
their results, how each reads and raises the noop flag, in-place and strided inputs and the
memory layouts they keep. Each test runs on the paths of ``_op_paths.py`` (the reference, the C++
CPU kernels, the CUDA kernels or their emulated build), with the same inputs on each.

The oracle is float64 arithmetic written here, never the implementation under test. A product by
a power of two (or by 3, of a 16-bit float) is exact in float32, so ``scale`` must give the
float64 product rounded once to the output dtype, bit for bit; ``axpby`` is held to one rounding
of a 16-bit output dtype (``ONE_ROUNDING``) and to ``rtol=1e-6`` in float32, the norms to
``rtol=1e-5`` (float32 sums of squares, accumulated in any order).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor

from _op_cases import ONE_ROUNDING
from _op_paths import OpPath, paths

INF, NAN = math.inf, math.nan
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NORM_RTOL = 1e-5
# One rounding of the output dtype; float32 closer still (two float32 roundings at most).
AXPBY_TOL = {**ONE_ROUNDING, torch.float32: {"rtol": 1e-6, "atol": 1e-6}}
CHANNELS_LAST_SHAPES = ((2, 3, 5, 7), (4, 16, 9, 9), (1, 8, 1, 1))

SCALE = paths("multi_tensor_scale")
AXPBY = paths("multi_tensor_axpby")
L2NORM = paths("multi_tensor_l2norm")
L2NORM_MP = paths("multi_tensor_l2norm_mp")
L2NORM_SCALE = paths("multi_tensor_l2norm_scale")
UNSCALE_L2NORM = paths("multi_tensor_unscale_l2norm")


def _site(path: OpPath) -> tuple[int, int]:
    """Where a test puts an inf or a nan: element 444 of the tensor of 555 elements (every
    path's sizes have one), past its first chunk of 333, with more tensors after it on most
    paths."""
    return path.sizes.index(555), 444


def _exact(actual: Tensor, expected: Tensor) -> None:
    """``actual`` is ``expected`` (of the same dtype) bit for bit; nan where it has nan."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def _axpby_close(actual: Tensor, expected64: Tensor, dtype: torch.dtype) -> None:
    """``actual`` has ``dtype`` and is within ``AXPBY_TOL`` of the float64 ``expected64``."""
    tol = AXPBY_TOL[dtype]
    torch.testing.assert_close(
        actual, expected64.to(dtype), rtol=tol["rtol"], atol=tol["atol"], equal_nan=True
    )


def _norms64(xs: list[Tensor], factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """The float64 L2 norm of all of ``xs`` times ``factor`` (shape ``(1,)``) and of each."""
    per = torch.stack([torch.linalg.vector_norm(x.double() * factor) for x in xs])
    return torch.linalg.vector_norm(per).reshape(1), per


def _assert_norms(
    result: tuple[Tensor, Tensor], xs: list[Tensor], per_tensor: bool, factor: float = 1.0
) -> None:
    """``result`` is the op's ``(total, per_tensor_norms)`` of ``xs`` times ``factor``: float32,
    within ``NORM_RTOL`` of the float64 norms (inf and nan where those are), and no per-tensor
    norms unless asked for."""
    total, per = result
    want_total, want_per = _norms64(xs, factor)
    assert total.dtype == torch.float32 and total.shape == (1,)
    torch.testing.assert_close(total.double(), want_total, rtol=NORM_RTOL, atol=0, equal_nan=True)
    if per_tensor:
        assert per.dtype == torch.float32
        torch.testing.assert_close(per.double(), want_per, rtol=NORM_RTOL, atol=0, equal_nan=True)
    else:
        assert per.shape == (0,)


def _channels_last(path: OpPath, dtype: torch.dtype, seed: int, scale: float = 1.0) -> list[Tensor]:
    """One channels-last tensor of each of ``CHANNELS_LAST_SHAPES`` on the path's device."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(shape, generator=generator) * scale)
        .to(device=path.device, dtype=dtype)
        .contiguous(memory_format=torch.channels_last)
        for shape in CHANNELS_LAST_SHAPES
    ]


def _at_offset(tensors: list[Tensor], offset: int) -> list[Tensor]:
    """Copies of ``tensors`` that start ``offset`` elements into a nan-filled buffer of their
    own (the buffer is each view's ``_base``)."""
    out = []
    for t in tensors:
        buffer = torch.full((t.numel() + offset,), NAN, dtype=t.dtype, device=t.device)
        view = buffer[offset:]
        view.copy_(t)
        out.append(view)
    return out


# --- multi_tensor_scale ---------------------------------------------------------------------


@pytest.mark.parametrize("path", SCALE, indirect=True)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("inject", [None, INF, NAN])
def test_scale_is_the_product_rounded_once_and_flags_a_nonfinite_input(
    path: OpPath, in_dtype: torch.dtype, out_dtype: torch.dtype, inject: float | None
) -> None:
    op = path.op("multi_tensor_scale")
    xs = path.randn(in_dtype, seed=1)
    if inject is not None:
        tensor, element = _site(path)
        xs[tensor][element] = inject
    for chunk in path.chunks:
        outs = [torch.empty_like(x, dtype=out_dtype) for x in xs]
        flag = path.flag()
        op(chunk, flag, [xs, outs], 0.25)
        assert flag.item() == (0 if inject is None else 1)
        for x, out in zip(xs, outs, strict=True):  # written all the same, as Apex's kernel
            _exact(out, (x.double() * 0.25).to(out_dtype))


@pytest.mark.parametrize("path", SCALE, indirect=True)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_scale_flags_a_nonfinite_value_in_the_last_chunk_and_still_writes(
    path: OpPath, in_dtype: torch.dtype, bad: float
) -> None:
    op = path.op("multi_tensor_scale")
    xs = path.randn(in_dtype, seed=2)
    xs[-1][-1] = bad
    for chunk in path.chunks:
        outs = [torch.zeros(x.shape, device=path.device) for x in xs]
        flag = path.flag()
        op(chunk, flag, [xs, outs], 2.0)
        assert flag.item() == 1
        for x, out in zip(xs, outs, strict=True):
            _exact(out, (x.double() * 2.0).float())


@pytest.mark.parametrize("path", SCALE, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_in_place_keeps_a_raised_flag(path: OpPath, dtype: torch.dtype) -> None:
    op = path.op("multi_tensor_scale")
    for chunk in path.chunks:
        xs = path.randn(dtype, seed=3)
        want = [(x.double() / 1024).to(dtype) for x in xs]
        flag = path.flag(1)  # raised earlier: the op only ever raises it
        op(chunk, flag, [xs, xs], 1 / 1024)
        assert flag.item() == 1
        for x, expected in zip(xs, want, strict=True):
            _exact(x, expected)


@pytest.mark.parametrize("path", SCALE, indirect=True)
def test_scale_writes_in_place_and_into_another_shape(path: OpPath) -> None:
    op = path.op("multi_tensor_scale")
    xs = [torch.arange(16.0, device=path.device).reshape(4, 4)]
    expected = xs[0].clone() * 3
    op(64, path.flag(), [xs, xs], 3.0)
    _exact(xs[0], expected)
    flat = [torch.empty(16, device=path.device)]  # same numel, other shape: row-major order
    op(64, path.flag(), [xs, flat], 0.5)
    _exact(flat[0], expected.reshape(16) * 0.5)


@pytest.mark.parametrize("path", SCALE, indirect=True)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize(("in_offset", "out_offset"), [(1, 0), (0, 1), (3, 5)])
def test_scale_of_tensors_at_a_misaligned_storage_offset(
    path: OpPath, in_dtype: torch.dtype, out_dtype: torch.dtype, in_offset: int, out_offset: int
) -> None:
    # Views whose data pointer is not 16-byte aligned (storage offset 1, 3 or 5 elements): a
    # valid input everywhere, on which a kernel must not use 16-byte vector accesses (a GPU
    # faults, the emulator raises).
    xs = _at_offset(path.randn(in_dtype, seed=4), in_offset)
    outs = _at_offset([torch.zeros_like(x, dtype=out_dtype) for x in xs], out_offset)
    assert all(t.data_ptr() % 16 != 0 for t in (xs if in_offset else outs))
    path.op("multi_tensor_scale")(2048 * 32, path.flag(), [xs, outs], 0.25)
    for x, out in zip(xs, outs, strict=True):
        _exact(out, (x.double() * 0.25).to(out_dtype))
        assert out._base is not None and out._base[:out_offset].isnan().all()  # nothing before


# --- multi_tensor_axpby ---------------------------------------------------------------------

AXPBY_DTYPES = [
    (torch.float32, torch.float32, torch.float32),
    (torch.float16, torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32, torch.bfloat16),
]
MORE_AXPBY_DTYPES = [
    (torch.float16, torch.float32, torch.float32),
    (torch.float32, torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize("path", AXPBY, indirect=True)
@pytest.mark.parametrize(("x_dtype", "y_dtype", "out_dtype"), AXPBY_DTYPES + MORE_AXPBY_DTYPES)
def test_axpby_matches_the_formula(
    path: OpPath, x_dtype: torch.dtype, y_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    op = path.op("multi_tensor_axpby")
    xs, ys = path.randn(x_dtype, seed=5), path.randn(y_dtype, seed=6)
    for chunk in path.chunks:
        outs = [torch.empty_like(x, dtype=out_dtype) for x in xs]
        flag = path.flag()
        op(chunk, flag, [xs, ys, outs], 2.0, -0.5, -1)
        assert flag.item() == 0
        for x, y, out in zip(xs, ys, outs, strict=True):
            _axpby_close(out, 2.0 * x.double() - 0.5 * y.double(), out_dtype)


@pytest.mark.parametrize("path", AXPBY, indirect=True)
@pytest.mark.parametrize(("x_dtype", "y_dtype", "out_dtype"), AXPBY_DTYPES)
@pytest.mark.parametrize("arg_to_check", [-1, 0, 1])
@pytest.mark.parametrize("inject_into", ["x", "y"])
def test_axpby_flags_only_the_checked_argument_and_still_writes(
    path: OpPath,
    x_dtype: torch.dtype,
    y_dtype: torch.dtype,
    out_dtype: torch.dtype,
    arg_to_check: int,
    inject_into: str,
) -> None:
    xs, ys = path.randn(x_dtype, seed=7), path.randn(y_dtype, seed=8)
    tensor, element = _site(path)
    if inject_into == "x":
        xs[tensor][element] = INF
    else:
        ys[tensor][element] = NAN
    outs = [torch.empty_like(x, dtype=out_dtype) for x in xs]
    flag = path.flag()
    path.op("multi_tensor_axpby")(333, flag, [xs, ys, outs], 2.0, -0.5, arg_to_check)
    checked = arg_to_check == -1 or (arg_to_check == 0) == (inject_into == "x")
    assert flag.item() == int(checked)
    for x, y, out in zip(xs, ys, outs, strict=True):
        _axpby_close(out, 2.0 * x.double() - 0.5 * y.double(), out_dtype)
    assert not torch.isfinite(outs[tensor][element])


# --- layouts --------------------------------------------------------------------------------


def _is_channels_last(t: Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


@pytest.mark.parametrize("path", paths("multi_tensor_scale", "multi_tensor_axpby"), indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_and_axpby_keep_the_channels_last_layout(path: OpPath, dtype: torch.dtype) -> None:
    xs, ys = _channels_last(path, dtype, 70), _channels_last(path, dtype, 71)
    outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]  # channels-last too
    path.op("multi_tensor_scale")(333, path.flag(), [xs, outs], 3.0)
    for x, out in zip(xs, outs, strict=True):
        assert out.stride() == x.stride()
        _exact(out, (x.double() * 3.0).float())
    outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    path.op("multi_tensor_axpby")(333, path.flag(), [xs, ys, outs], 2.0, 3.0, -1)
    for x, y, out in zip(xs, ys, outs, strict=True):
        assert out.stride() == x.stride()
        _axpby_close(out, 2.0 * x.double() + 3.0 * y.double(), torch.float32)
    assert _is_channels_last(outs[0]) and _is_channels_last(outs[1])


@pytest.mark.parametrize("path", ["reference"], indirect=True)
def test_the_reference_scale_and_axpby_take_mixed_layouts(path: OpPath) -> None:
    # The reference writes with Tensor.copy_, so the tensors of one position may have different
    # memory layouts; the kernels visit elements in memory order and require the same one.
    x = _channels_last(path, torch.float32, 60)[0]
    y = _channels_last(path, torch.float32, 61)[0].contiguous()
    out = torch.empty_like(x)  # channels-last
    path.op("multi_tensor_axpby")(333, path.flag(), [[x], [y], [out]], 2.0, 3.0, -1)
    assert _is_channels_last(out)
    _axpby_close(out, 2.0 * x.double() + 3.0 * y.double(), torch.float32)
    scaled = torch.empty(x.shape)  # a contiguous output of a channels-last input
    path.op("multi_tensor_scale")(333, path.flag(), [[x], [scaled]], 0.5)
    assert scaled.is_contiguous()
    _exact(scaled, (x.double() * 0.5).float())


# --- multi_tensor_l2norm --------------------------------------------------------------------


@pytest.mark.parametrize("path", L2NORM, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [True, False, None])
def test_l2norm_matches_the_formula(
    path: OpPath, dtype: torch.dtype, per_tensor: bool | None
) -> None:
    op = path.op("multi_tensor_l2norm")
    xs = path.randn(dtype, seed=9)
    for chunk in path.chunks:
        flag = path.flag()
        _assert_norms(op(chunk, flag, [xs], per_tensor), xs, bool(per_tensor))
        assert flag.item() == 0


@pytest.mark.parametrize("path", L2NORM, indirect=True)
@pytest.mark.parametrize(("dtype", "bad"), [(torch.float16, INF), (torch.bfloat16, NAN)])
def test_l2norm_flags_a_nonfinite_norm(path: OpPath, dtype: torch.dtype, bad: float) -> None:
    op = path.op("multi_tensor_l2norm")
    xs = path.randn(dtype, seed=10)
    tensor, element = _site(path)
    xs[tensor][element] = bad
    flag = path.flag()
    total, per = op(333, flag, [xs], True)
    assert flag.item() == 1
    _assert_norms((total, per), xs, per_tensor=True)  # inf stays inf, nan nan
    assert not math.isfinite(total.item()) and torch.isfinite(per[0])
    flag = path.flag()
    total, per = op(path.chunks[-1], flag, [xs])  # per_tensor defaults to False
    assert flag.item() == 1 and per.shape == (0,)
    assert math.isnan(total.item()) if math.isnan(bad) else math.isinf(total.item())


@pytest.mark.parametrize("path", paths("multi_tensor_scale", "multi_tensor_l2norm"), indirect=True)
def test_empty_lists_are_a_no_op(path: OpPath) -> None:
    flag = path.flag()
    path.op("multi_tensor_scale")(333, flag, [[], []], 2.0)
    total, per = path.op("multi_tensor_l2norm")(333, flag, [[]], True)
    assert total.tolist() == [0.0] and per.shape == (0,)
    assert flag.item() == 0


# --- multi_tensor_l2norm_mp -----------------------------------------------------------------


@pytest.mark.parametrize("path", L2NORM_MP, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_mp_is_the_l2norm_when_the_flag_is_clear(path: OpPath, dtype: torch.dtype) -> None:
    op = path.op("multi_tensor_l2norm_mp")
    xs = path.randn(dtype, seed=11)
    for chunk in path.chunks:
        flag = path.flag()
        _assert_norms(op(chunk, flag, [xs], True), xs, per_tensor=True)
        assert flag.item() == 0


@pytest.mark.parametrize("path", L2NORM_MP, indirect=True)
@pytest.mark.parametrize(("dtype", "inject"), [(torch.float32, None), (torch.bfloat16, INF)])
def test_l2norm_mp_returns_zero_norms_when_the_flag_is_set(
    path: OpPath, dtype: torch.dtype, inject: float | None
) -> None:
    xs = path.randn(dtype, seed=12)
    if inject is not None:
        tensor, element = _site(path)
        xs[tensor][element] = inject
    flag = path.flag(1)
    total, per = path.op("multi_tensor_l2norm_mp")(path.chunks[-1], flag, [xs], True)
    assert total.tolist() == [0.0] and per.tolist() == [0.0] * len(xs)
    assert flag.item() == 1


@pytest.mark.parametrize("path", L2NORM_MP, indirect=True)
@pytest.mark.parametrize(("dtype", "per_tensor"), [(torch.float32, None), (torch.bfloat16, True)])
def test_l2norm_mp_raises_the_flag_on_inf(
    path: OpPath, dtype: torch.dtype, per_tensor: bool | None
) -> None:
    xs = path.randn(dtype, seed=13)
    tensor, element = _site(path)
    xs[tensor][element] = INF
    flag = path.flag()
    total, per = path.op("multi_tensor_l2norm_mp")(333, flag, [xs], per_tensor)
    assert flag.item() == 1 and math.isinf(total.item())
    _assert_norms((total, per), xs, bool(per_tensor))


# --- multi_tensor_l2norm_scale --------------------------------------------------------------


@pytest.mark.parametrize("path", L2NORM_SCALE, indirect=True)
@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_l2norm_scale_scales_and_returns_the_norm_of_the_inputs(
    path: OpPath, in_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    op = path.op("multi_tensor_l2norm_scale")
    ins = path.randn(in_dtype, seed=14)
    for chunk in path.chunks:
        outs = [torch.empty_like(x, dtype=out_dtype) for x in ins]
        flag = path.flag()
        result = op(chunk, flag, [ins, outs], 0.25, True)
        for x, out in zip(ins, outs, strict=True):
            _exact(out, (x.double() * 0.25).to(out_dtype))
        _assert_norms(result, ins, per_tensor=True)
        assert flag.item() == 0


@pytest.mark.parametrize("path", L2NORM_SCALE, indirect=True)
def test_l2norm_scale_writes_even_with_the_flag_set_and_flags_nan(path: OpPath) -> None:
    op = path.op("multi_tensor_l2norm_scale")
    ins = path.randn(torch.float32, seed=15)
    tensor, element = _site(path)
    ins[tensor][element] = NAN
    want = [(x.double() * 2.0).float() for x in ins]
    flag = path.flag(1)  # never read: Apex's kernel propagates infs and nans
    total, per = op(2048, flag, [ins, ins], 2.0, False)
    assert math.isnan(total.item()) and per.shape == (0,) and flag.item() == 1
    for x, expected in zip(ins, want, strict=True):
        _exact(x, expected)
    flag = path.flag()
    op(2048, flag, [ins, ins], 2.0, False)
    assert flag.item() == 1


# --- multi_tensor_unscale_l2norm ------------------------------------------------------------


@pytest.mark.parametrize("path", UNSCALE_L2NORM, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("inv_scale_kind", "per_tensor"), [("tensor", True), ("number", None)])
def test_unscale_l2norm_matches_the_formula_and_leaves_the_inputs_alone(
    path: OpPath, dtype: torch.dtype, inv_scale_kind: str, per_tensor: bool | None
) -> None:
    op = path.op("multi_tensor_unscale_l2norm")
    xs = path.randn(dtype, seed=16, scale=1024.0) + _channels_last(path, dtype, 17, 1024.0)
    originals = [x.clone() for x in xs]
    inv_scale: Tensor | float = 1 / 1024
    if inv_scale_kind == "tensor":
        inv_scale = path.tensor([1 / 1024])
    for chunk in path.chunks:
        flag = path.flag()
        result = op(chunk, flag, [xs], inv_scale, per_tensor)
        _assert_norms(result, xs, bool(per_tensor), factor=1 / 1024)
        assert flag.item() == 0
    for x, original in zip(xs, originals, strict=True):
        assert torch.equal(x, original) and x.stride() == original.stride()


@pytest.mark.parametrize("path", UNSCALE_L2NORM, indirect=True)
def test_unscale_l2norm_flags_a_nonfinite_norm(path: OpPath) -> None:
    op = path.op("multi_tensor_unscale_l2norm")
    tensor, element = _site(path)
    # Each dtype once, with the chunk sizes and the kinds of nonfinite values in turn.
    cases = zip(DTYPES, itertools.cycle(path.chunks), itertools.cycle([INF, NAN]))
    for dtype, chunk, bad in cases:
        xs = path.randn(dtype, seed=18)
        xs[tensor][element] = bad
        flag = path.flag()
        result = op(chunk, flag, [xs], path.tensor([2.0**-7]), True)
        assert flag.item() == 1
        _assert_norms(result, xs, per_tensor=True, factor=2.0**-7)  # inf stays inf, nan nan


@pytest.mark.parametrize("path", UNSCALE_L2NORM, indirect=True)
def test_unscale_l2norm_flags_a_sum_of_squares_that_overflows(path: OpPath) -> None:
    # Every element is finite, but the float32 sum of their squares is not.
    xs = [torch.full((4,), 3e19, device=path.device)]
    flag = path.flag()
    total, _ = path.op("multi_tensor_unscale_l2norm")(64, flag, [xs], 1.0)
    assert flag.item() == 1 and math.isinf(total.item())
