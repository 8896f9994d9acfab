"""The C++ CPU kernels of the optimizer ops and the unscaled norm against the reference.

The pure-PyTorch reference (``amp_fused_ops.reference._ops``) is the oracle: both run on copies of
the same inputs and must agree within the rounding of each output's dtype. To cover every
dtype combination without one test per combination, the lists of a test hold, at each position,
their own combination of list dtypes, their own size (cycling through ``SIZES``) and, at some
positions, channels-last 4-D tensors; the ops take one dtype per list, so each op runs once
per dtype combination (:func:`call`) on those positions, in place. Each test runs with both
chunk sizes, so chunks cross tensor and tile boundaries.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from _op_cases import TWO_ROUNDINGS
from _op_cases import noop_flag as flag
from amp_fused_ops.reference import _ops as _reference

SIZES = (1, 7, 555, 33333, 2048 * 32 + 1, 2 * 2048 * 32)
CHUNKS = (333, 2048 * 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32 = (torch.float32,)
CHANNELS_LAST_SHAPE = (2, 6, 5, 7)  # 420 elements, channels-last strides differ from rows
# Two independent float32 computations (different order of operations and reductions);
# low-precision results may differ by a rounding tie (two ulps).
TOL = TWO_ROUNDINGS

Lists = list[list[Tensor]]


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


def make_lists(
    allowed: Sequence[Sequence[torch.dtype]],
    seed: int,
    init: Sequence[Callable[[Tensor], Tensor]] | None = None,
    keep: Callable[[tuple[torch.dtype, ...]], bool] | None = None,
) -> Lists:
    """One list per entry of ``allowed``; position k has the k-th dtype combination (of those
    ``keep`` accepts, all by default).

    There are at least 9 positions (combinations repeat); every third holds channels-last 4-D
    tensors, the others 1-D tensors of the sizes of ``SIZES`` in turn (so positions 0, 1, 3,
    4, 6, 7 have 1, 7, 555, 33333, 65537 and 131072 elements). ``init[l]`` maps standard
    normal values to list l's values (float32).
    """
    combos = [c for c in itertools.product(*allowed) if keep is None or keep(c)]
    generator = torch.Generator().manual_seed(seed)
    lists: Lists = [[] for _ in allowed]
    n_flat = 0
    for k in range(max(len(combos), 9)):  # at least every size once
        channels_last = k % 3 == 2
        if channels_last:
            shape: tuple[int, ...] = CHANNELS_LAST_SHAPE
        else:
            shape, n_flat = (SIZES[n_flat % len(SIZES)],), n_flat + 1
        for index, dtype in enumerate(combos[k % len(combos)]):
            values = torch.randn(shape, generator=generator)
            if init is not None:
                values = init[index](values)
            t = values.to(dtype)
            if channels_last:
                t = t.to(memory_format=torch.channels_last)
            lists[index].append(t)
    return lists


def poke(t: Tensor, value: float) -> None:
    """Set the last element of ``t`` (in logical order, any layout) to ``value``."""
    t[(-1,) * t.dim()] = value


def clone(lists: Lists) -> Lists:
    return [[t.clone() for t in ts] for ts in lists]


def assert_lists_close(got: Lists, want: Lists, equal_nan: bool = False) -> None:
    for ts_got, ts_want in zip(got, want, strict=True):
        for a, b in zip(ts_got, ts_want, strict=True):
            assert a.dtype == b.dtype and a.stride() == b.stride()
            torch.testing.assert_close(a, b, equal_nan=equal_nan, **TOL[a.dtype])


def by_dtypes(lists: Lists) -> list[list[int]]:
    """The positions of ``lists`` grouped by their combination of dtypes, in order."""
    groups: dict[tuple[torch.dtype, ...], list[int]] = {}
    for k in range(len(lists[0])):
        groups.setdefault(tuple(ts[k].dtype for ts in lists), []).append(k)
    return list(groups.values())


def pick(lists: Lists, positions: Sequence[int]) -> Lists:
    """The tensors of ``lists`` at ``positions`` (the same tensors, not copies)."""
    return [[ts[k] for k in positions] for ts in lists]


def call(impl: Any, name: str, chunk: int, noop_flag: Tensor, lists: Lists, *args: Any,
         per_tensor: int | None = None) -> list[Any]:  # fmt: skip
    """Op ``name`` of ``impl`` once per dtype combination of ``lists`` (each list of a call holds
    one dtype), in place, all with ``noop_flag``; the results, one per call.

    ``args[per_tensor]`` is a tensor of one value per position (NovoGrad's norms): each call
    takes the values of its positions, and what it writes there is copied back.
    """
    results = []
    for positions in by_dtypes(lists):
        call_args = list(args)
        if per_tensor is not None:
            call_args[per_tensor] = args[per_tensor][positions]
        results.append(getattr(impl, name)(chunk, noop_flag, pick(lists, positions), *call_args))
        if per_tensor is not None:
            args[per_tensor][positions] = call_args[per_tensor]
    return results


def run_both(ext: Any, name: str, lists: Lists, *args: Any, noop: int = 0) -> tuple[Any, ...]:
    """Run op ``name`` of the extension and of the reference on copies of ``lists``."""
    runs = []
    for impl in (ext, _reference):
        copies, noop_flag = clone(lists), flag(noop)
        result = call(impl, name, CHUNKS[0], noop_flag, copies, *args)
        runs.append((copies, noop_flag, result))
    return tuple(runs)


def positive(x: Tensor) -> Tensor:
    return x.square() + 0.1


def small(x: Tensor) -> Tensor:
    return x * 0.1


def identity(x: Tensor) -> Tensor:
    return x


# --- multi_tensor_unscale_l2norm ----------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("inject", [None, math.inf, math.nan])
def test_unscale_l2norm_matches_reference(ext: Any, chunk: int, inject: float | None) -> None:
    (xs,) = make_lists([DTYPES], seed=1)
    if inject is not None:
        poke(xs[4], inject)
    inv_scale = torch.tensor([2.0**-7])
    flags = [flag(), flag()]
    got = call(ext, "multi_tensor_unscale_l2norm", chunk, flags[0], [xs], inv_scale, True)
    want = call(_reference, "multi_tensor_unscale_l2norm", chunk, flags[1], [xs], inv_scale, True)
    assert flags[0].item() == flags[1].item() == (0 if inject is None else 1)
    assert len(got) == len(want) == len(DTYPES)
    for got_norms, want_norms in zip(got, want, strict=True):
        for a, b in zip(got_norms, want_norms, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, equal_nan=True)


def test_unscale_l2norm_takes_a_number_and_none(ext: Any) -> None:
    (xs,) = make_lists([DTYPES], seed=2)
    got = call(ext, "multi_tensor_unscale_l2norm", 2048, flag(), [xs], 0.5, None)
    want = call(_reference, "multi_tensor_unscale_l2norm", 2048, flag(), [xs], 0.5)
    for (total, per), (want_total, _) in zip(got, want, strict=True):
        torch.testing.assert_close(total, want_total, rtol=1e-5, atol=0.0)
        assert per.numel() == 0


def test_unscale_l2norm_overflowing_sum_flags(ext: Any) -> None:
    # Every element is finite but the float32 sum of squares is not (as in the reference).
    xs = [torch.full((4,), 3e19)]
    flags = [flag(), flag()]
    got, _ = ext.multi_tensor_unscale_l2norm(64, flags[0], [xs], 1.0)
    want, _ = _reference.multi_tensor_unscale_l2norm(64, flags[1], [xs], 1.0)
    assert flags[0].item() == flags[1].item() == 1
    assert math.isinf(got.item()) and math.isinf(want.item())


# --- multi_tensor_adam_capturable_master --------------------------------------------------

MASTER_DTYPES = [DTYPES, DTYPES, FP32, FP32, FP32]


def master_lists(seed: int) -> Lists:
    lists = make_lists(MASTER_DTYPES, seed, [lambda x: x * 128.0, identity, small, positive,
                                             identity])  # fmt: skip
    # The model params are the masters rounded to their dtype.
    lists[1] = [m.to(p.dtype) for p, m in zip(lists[1], lists[4], strict=True)]
    return lists


def master_args(mode: int, bias_correction: int = 1) -> tuple[Any, ...]:
    lr, step, inv_scale = torch.tensor([1e-2]), torch.tensor([3], dtype=torch.int32), 1 / 128.0
    return (lr, 0.9, 0.999, 1e-8, step, mode, bias_correction, 0.01, torch.tensor([inv_scale]))


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("mode", [0, 1])
def test_adam_capturable_master_matches_reference(ext: Any, chunk: int, mode: int) -> None:
    lists = master_lists(seed=3)
    got, want = clone(lists), clone(lists)
    flags = [flag(), flag()]
    name = "multi_tensor_adam_capturable_master"
    call(ext, name, chunk, flags[0], got, *master_args(mode))
    call(_reference, name, chunk, flags[1], want, *master_args(mode))
    assert flags[0].item() == flags[1].item() == 0
    assert_lists_close(got, want)
    # The model copy is the new master rounded once.
    for p, m in zip(got[1], got[4], strict=True):
        assert torch.equal(p, m.to(p.dtype))


def test_adam_capturable_master_number_arguments_no_bias_correction(ext: Any) -> None:
    lists = master_lists(seed=4)
    args = (1e-3, 0.8, 0.99, 1e-6, 2, 1, 0, 0.0, 0.25)
    (got, f0, _), (want, f1, _) = run_both(ext, "multi_tensor_adam_capturable_master", lists,
                                           *args)  # fmt: skip
    assert f0.item() == f1.item() == 0
    assert_lists_close(got, want)


@pytest.mark.parametrize(
    ("inject", "inv_scale", "noop"),
    [(math.inf, 1 / 128.0, 0), (math.nan, 1 / 128.0, 0), (None, 1e38, 0), (None, 1 / 128.0, 1)],
    ids=["inf-grad", "nan-grad", "overflowing-unscale", "flag-set-on-entry"],
)
def test_adam_capturable_master_skips(
    ext: Any, inject: float | None, inv_scale: float, noop: int
) -> None:
    # One call per dtype combination, each with its own flag: every call must skip.
    for positions in by_dtypes(master_lists(seed=5)):
        lists = pick(master_lists(seed=5), positions)
        if inject is not None:
            poke(lists[0][-1], inject)
        args = (*master_args(1)[:-1], torch.tensor([inv_scale]))
        (got, f0, _), (want, f1, _) = run_both(ext, "multi_tensor_adam_capturable_master",
                                               lists, *args, noop=noop)  # fmt: skip
        assert f0.item() == f1.item() == 1
        for tensors in (got, want):
            for ts, before in zip(tensors, lists, strict=True):
                for t, b in zip(ts, before, strict=True):
                    assert torch.equal(t, b) or (t.isnan() == b.isnan()).all()


# --- multi_tensor_sgd ---------------------------------------------------------------------

SGD_CASES = {
    # weight_decay, momentum, dampening, lr, nesterov, first_run, wd_after_momentum, scale
    "momentum": (1e-2, 0.9, 0.1, 0.05, False, False, False, 0.5),
    "nesterov-first-run": (1e-2, 0.9, 0.0, 0.05, True, True, False, 1.0),
    "nesterov-wd-after": (1e-2, 0.9, 0.0, 0.05, True, False, True, 0.25),
    "first-run-wd-after": (1e-2, 0.8, 0.2, 0.05, False, True, True, 1.0),
    "no-momentum": (1e-2, 0.0, 0.0, 0.1, False, False, False, 2.0),
    "no-decay": (0.0, 0.9, 0.0, 0.1, False, False, False, 1.0),
}


def state_lists(allowed: Sequence[Sequence[torch.dtype]], seed: int,
                init: Sequence[Callable[[Tensor], Tensor]] | None = None) -> Lists:  # fmt: skip
    """make_lists without the positions whose state (list 2) is neither float32 nor the
    dtype of its param (list 1): SGD's and Adagrad's state takes those two only."""
    lists = make_lists(allowed, seed, init)
    keep = [k for k, (p, s) in enumerate(zip(lists[1], lists[2], strict=True))
            if s.dtype in (torch.float32, p.dtype)]  # fmt: skip
    return [[ts[k] for k in keep] for ts in lists]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_with_model_copies_matches_reference(ext: Any, case: str, chunk: int) -> None:
    lists = state_lists([DTYPES] * 4, seed=6, init=[identity, identity, small, identity])
    got, want = clone(lists), clone(lists)
    flags = [flag(), flag()]
    call(ext, "multi_tensor_sgd", chunk, flags[0], got, *SGD_CASES[case])
    call(_reference, "multi_tensor_sgd", chunk, flags[1], want, *SGD_CASES[case])
    assert flags[0].item() == flags[1].item() == 0
    assert_lists_close(got, want)


@pytest.mark.parametrize("case", ["momentum", "no-decay"])
def test_sgd_three_lists_and_nan_propagates(ext: Any, case: str) -> None:
    lists = state_lists([DTYPES] * 3, seed=7, init=[identity, identity, small])
    lists[0][3][100] = math.nan
    lists[1][3][7] = math.inf  # an inf param: 0 * inf must not turn it into nan
    (got, f0, _), (want, f1, _) = run_both(ext, "multi_tensor_sgd", lists, *SGD_CASES[case])
    assert f0.item() == f1.item() == 0  # never set by SGD
    assert_lists_close(got, want, equal_nan=True)


def test_sgd_skips_when_flag_is_set(ext: Any) -> None:
    lists = state_lists([DTYPES] * 4, seed=8)
    (got, f0, _), (_, f1, _) = run_both(ext, "multi_tensor_sgd", lists,
                                        *SGD_CASES["momentum"], noop=1)  # fmt: skip
    assert f0.item() == f1.item() == 1
    for ts, before in zip(got, lists, strict=True):
        for t, b in zip(ts, before, strict=True):
            assert torch.equal(t, b)


# --- multi_tensor_adagrad -----------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(("mode", "weight_decay"), [(0, 0.01), (1, 0.01), (0, 0.0)])
def test_adagrad_matches_reference(ext: Any, chunk: int, mode: int, weight_decay: float) -> None:
    lists = state_lists([DTYPES] * 3, seed=9, init=[identity, identity, positive])
    got, want = clone(lists), clone(lists)
    flags = [flag(), flag()]
    call(ext, "multi_tensor_adagrad", chunk, flags[0], got, 0.1, 1e-10, mode, weight_decay)
    call(_reference, "multi_tensor_adagrad", chunk, flags[1], want, 0.1, 1e-10, mode,
         weight_decay)  # fmt: skip
    assert flags[0].item() == flags[1].item() == 0
    assert_lists_close(got, want)


def test_adagrad_ignores_and_keeps_the_flag(ext: Any) -> None:
    lists = state_lists([DTYPES] * 3, seed=10, init=[identity, identity, positive])
    lists[0][4][0] = math.inf
    (got, f0, _), (want, f1, _) = run_both(ext, "multi_tensor_adagrad", lists, 0.1, 1e-10, 1,
                                           0.01, noop=1)  # fmt: skip
    assert f0.item() == f1.item() == 1
    assert_lists_close(got, want, equal_nan=True)


# --- multi_tensor_lamb --------------------------------------------------------------------


def lamb_args(mode: int, weight_decay: float, nvlamb: bool | None, grad_norm: Any,
              max_grad_norm: float = 1.0, grad_averaging: int = 1) -> tuple[Any, ...]:  # fmt: skip
    return (1e-2, 0.9, 0.999, 1e-6, 4, 1, weight_decay, grad_averaging, mode, grad_norm,
            max_grad_norm, nvlamb)  # fmt: skip


def lamb_dtypes(combo: tuple[torch.dtype, ...]) -> bool:
    """The moments (lists 2 and 3) share one dtype, float32 or the param's (list 1)."""
    return combo[2] == combo[3] and combo[2] in (torch.float32, combo[1])


def novograd_dtypes(combo: tuple[torch.dtype, ...]) -> bool:
    """The first moment (list 2) is float32 or the param's dtype (list 1)."""
    return combo[2] in (torch.float32, combo[1])


LAMB_CASES = {
    "decoupled-clipped": lamb_args(1, 0.01, False, torch.tensor([5.0])),
    "l2-not-clipped": lamb_args(0, 0.01, None, torch.tensor([0.5]), grad_averaging=0),
    "nvlamb-no-decay": lamb_args(1, 0.0, True, 2.0),
    "no-ratio": lamb_args(0, 0.0, False, 0.5),
    "max-norm-zero": lamb_args(1, 0.01, False, torch.tensor([3.0]), max_grad_norm=0.0),
}


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_reference(ext: Any, case: str, chunk: int) -> None:
    lists = make_lists([DTYPES] * 4, seed=11, init=[identity, identity, small, positive],
                       keep=lamb_dtypes)  # fmt: skip
    got, want = clone(lists), clone(lists)
    flags = [flag(), flag()]
    call(ext, "multi_tensor_lamb", chunk, flags[0], got, *LAMB_CASES[case])
    call(_reference, "multi_tensor_lamb", chunk, flags[1], want, *LAMB_CASES[case])
    assert flags[0].item() == flags[1].item() == 0
    assert_lists_close(got, want)


def test_lamb_zero_param_keeps_ratio_one_and_nan_flags(ext: Any) -> None:
    lists = make_lists([DTYPES] * 4, seed=12, init=[identity, identity, small, positive],
                       keep=lamb_dtypes)  # fmt: skip
    lists[1][1].zero_()  # ||p|| = 0: ratio 1
    lists[0][4][3] = math.nan  # nan update norm: flag set, nan propagates
    (got, f0, _), (want, f1, _) = run_both(ext, "multi_tensor_lamb", lists,
                                           *LAMB_CASES["decoupled-clipped"])  # fmt: skip
    assert f0.item() == f1.item() == 1
    assert_lists_close(got, want, equal_nan=True)


# --- multi_tensor_novograd ----------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize(("mode", "norm_type"), [(0, 2), (1, 2), (0, 0), (1, 0)])
def test_novograd_matches_reference(ext: Any, chunk: int, mode: int, norm_type: int) -> None:
    lists = make_lists([DTYPES] * 3, seed=13, init=[identity, identity, small],
                       keep=novograd_dtypes)  # fmt: skip
    norms = torch.rand(len(lists[0]), generator=torch.Generator().manual_seed(0)) + 0.5
    got, want = clone(lists), clone(lists)
    got_norms, want_norms = norms.clone(), norms.clone()
    flags = [flag(), flag()]
    args = (1e-2, 0.95, 0.98, 1e-8, 3, 1, 0.001, 1, mode, norm_type)
    call(ext, "multi_tensor_novograd", chunk, flags[0], got, got_norms, *args, per_tensor=0)
    call(_reference, "multi_tensor_novograd", chunk, flags[1], want, want_norms, *args,
         per_tensor=0)  # fmt: skip
    assert flags[0].item() == flags[1].item() == 0
    torch.testing.assert_close(got_norms, want_norms, rtol=1e-5, atol=0.0)
    assert_lists_close(got, want)


@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_novograd_nonfinite_gradient_flags(ext: Any, norm_type: int, bad: float) -> None:
    lists = make_lists([DTYPES] * 3, seed=14, init=[identity, identity, small],
                       keep=novograd_dtypes)  # fmt: skip
    poke(lists[0][5], bad)
    norms = torch.ones(len(lists[0]))
    runs = []
    for impl in (ext, _reference):
        copies, noop, n = clone(lists), flag(), norms.clone()
        call(impl, "multi_tensor_novograd", CHUNKS[0], noop, copies, n, 1e-2, 0.95, 0.98, 1e-8,
             1, 0, 0.0, 0, 1, norm_type, per_tensor=0)  # fmt: skip
        runs.append((copies, noop, n))
    assert runs[0][1].item() == runs[1][1].item() == 1
    torch.testing.assert_close(runs[0][2], runs[1][2], equal_nan=True, rtol=1e-5, atol=0.0)
    assert_lists_close(runs[0][0], runs[1][0], equal_nan=True)


# --- preconditions ------------------------------------------------------------------------


def _lists(depth: int, n: int = 8) -> Lists:
    return [[torch.randn(n)] for _ in range(depth)]


PRECONDITIONS = [
    ("multi_tensor_unscale_l2norm", lambda: (_lists(1), torch.ones(2), False),
     "inv_scale must have one element, got 2"),
    ("multi_tensor_unscale_l2norm", lambda: (_lists(1), "x", False),
     "inv_scale must be a tensor or a number, got str"),
    ("multi_tensor_adam_capturable_master", lambda: (_lists(4), *master_args(1)),
     "expected 5 tensor lists, got 4"),
    ("multi_tensor_adam_capturable_master",
     lambda: ([*_lists(4), [torch.randn(8).half()]], *master_args(1)),
     r"tensor_lists\[4\]\[0\] has dtype torch.float16; this list accepts float32$"),
    ("multi_tensor_adam_capturable_master", lambda: (_lists(5), *master_args(2)),
     "mode must be 0"),
    ("multi_tensor_adam_capturable_master", lambda: (_lists(5), *master_args(1, 2)),
     "bias_correction must be 0 or 1, got 2"),
    ("multi_tensor_adam_capturable_master",
     lambda: (_lists(5), torch.ones(3), *master_args(1)[1:]), "lr must have one element"),
    ("multi_tensor_sgd", lambda: (_lists(5), *SGD_CASES["momentum"]),
     "expected 3 or 4 tensor lists, got 5"),
    ("multi_tensor_sgd",
     lambda: ([[torch.randn(8)], [torch.randn(9)], [torch.randn(8)]], *SGD_CASES["momentum"]),
     "same number of elements"),
    ("multi_tensor_adagrad", lambda: (_lists(3), 0.1, 1e-10, 3, 0.0), "mode must be 0"),
    ("multi_tensor_adagrad", lambda: ([[torch.randn(8, dtype=torch.float64)], *_lists(2)], 0.1,
                                      1e-10, 0, 0.0), "this list accepts float32, float16, "),
    ("multi_tensor_lamb", lambda: (_lists(4), *lamb_args(2, 0.0, False, 1.0)), "mode must be 0"),
    ("multi_tensor_lamb", lambda: (_lists(4), *lamb_args(0, 0.0, False, 1.0, grad_averaging=2)),
     "grad_averaging must be 0 or 1, got 2"),
    ("multi_tensor_lamb", lambda: (_lists(3), *lamb_args(0, 0.0, False, 1.0)),
     "expected 4 tensor lists, got 3"),
    ("multi_tensor_novograd",
     lambda: (_lists(3), torch.ones(2), 1e-2, 0.9, 0.9, 1e-8, 1, 1, 0.0, 1, 0, 2),
     "grad_norms must be a float32 tensor of 1 elements"),
    ("multi_tensor_novograd",
     lambda: (_lists(3), torch.ones(1), 1e-2, 0.9, 0.9, 1e-8, 1, 1, 0.0, 1, 0, 1),
     "norm_type must be 2"),
    ("multi_tensor_novograd",
     lambda: ([[torch.randn(4, 4)[:, ::2]], *_lists(2)], torch.ones(1), 1e-2, 0.9, 0.9, 1e-8,
              1, 1, 0.0, 1, 0, 2), "is not dense in any memory format"),
]  # fmt: skip


@pytest.mark.parametrize(("op", "make_args", "match"), PRECONDITIONS)
def test_preconditions_raise(ext: Any, op: str, make_args: Any, match: str) -> None:
    # A ValueError for a wrong value, a TypeError for a wrong type, as in the reference.
    with pytest.raises((ValueError, TypeError), match=match):
        getattr(ext, op)(64, flag(), *make_args())


def test_adam_rejects_lists_that_share_memory(ext: Any) -> None:
    g, p = torch.randn(8), torch.randn(8)
    message = r"tensor_lists\[1\]\[0\] and tensor_lists\[2\]\[0\] share"
    with pytest.raises(ValueError, match=message):
        ext.multi_tensor_adam(64, flag(), [[g], [p], [p], [torch.zeros(8)]], 1e-3, 0.9, 0.999,
                              1e-8, 1, 1, 1, 0.0)  # fmt: skip


# --- conversions of the float32 tiles -------------------------------------------------------


def _every_value(dtype: torch.dtype) -> Tensor:
    """Every bit pattern of a 16-bit float dtype: zeros, subnormals, normals, infs, nans."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiles_convert_exactly_like_torch(ext: Any, dtype: torch.dtype) -> None:
    # With lr 0 and no decay, Adam leaves the values alone: half params come back bit for bit
    # (half -> float32 tile -> half), and float32 masters reach the half params rounded
    # exactly as Tensor.to rounds them (ties to even, overflow to inf, nan stays nan; nan
    # payloads are not kept, by torch either).
    values = _every_value(dtype)
    n = values.numel()
    params = values.clone()
    lists = [[torch.zeros(n, dtype=dtype)], [params], [torch.zeros(n)], [torch.zeros(n)]]
    ext.multi_tensor_adam(2048, flag(), lists, 0.0, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    same = (params.view(torch.int16) == values.view(torch.int16)) | (
        params.isnan() & values.isnan()
    )
    assert bool(same.all()), values[~same][:8]

    generator = torch.Generator().manual_seed(5)
    masters = torch.cat([
        torch.randn(4096, generator=generator) * 1e3,
        torch.randn(4096, generator=generator) * 1e-6,  # half subnormals and underflow
        values.float(),  # exactly representable: round trip
        values.float() * (1 + 2**-9),  # near ties of bfloat16
        values.float() * (1 + 2**-12),  # near ties of float16
        torch.tensor([70000.0, -70000.0, 3.0e38, float("inf"), float("nan"), -0.0]),
    ])  # fmt: skip
    half = torch.zeros_like(masters, dtype=dtype)
    lists = [[torch.zeros_like(half)], [half], [torch.zeros_like(masters)],
             [torch.zeros_like(masters)], [masters.clone()]]  # fmt: skip
    lr, step, inv_scale = torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0])
    ext.multi_tensor_adam_capturable_master(
        2048, flag(), lists, lr, 0.9, 0.999, 1e-8, step, 1, 1, 0.0, inv_scale
    )
    want = masters.to(dtype)
    same = (half.view(torch.int16) == want.view(torch.int16)) | (half.isnan() & want.isnan())
    assert bool(same.all()), masters[~same][:8]
