"""The C++ CPU kernels give the same bits on one thread and on several.

A launch runs on PyTorch's intra-op threads over all chunks of all its tensors, split between
the threads by elements. The lists here mix a few big tensors (several chunks each, so a
launch is split between threads) with many tiny ones placed before, between and after them.
Each op runs on fresh copies of the same inputs with 1 thread and then with 2 and 4 threads
(``torch.set_num_threads``, restored after); every output (the lists written in place, the
noop flag, the returned norms) must be bitwise equal (``torch.equal``) to the 1-thread run:
the reductions merge one partial per chunk in chunk order whatever the thread count. The
1-thread results are also checked against the pure-PyTorch reference (within the rounding
of each dtype), so the equal results are right ones too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from _op_cases import TWO_ROUNDINGS as TOL
from _op_cases import noop_flag as flag
from amp_fused_ops.reference import _ops as _reference

BIG = 98_317  # elements: two chunks of 65536, 296 chunks of 333
TINY = (1, 3, 17, 128, 555, 4097)
# 10 tiny tensors before, between and after each of three big ones.
SIZES = tuple(n for block in range(4) for n in (*TINY, *TINY[:4], *((BIG,) if block < 3 else ())))
CHUNKS = (333, 2048 * 32)
THREADS = (2, 4)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32 = torch.float32

Lists = list[list[Tensor]]
# impl (the extension or the reference), chunk size -> every tensor the op wrote or returned.
Case = Callable[[Any, int], list[Tensor]]


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        assert torch.get_num_threads() == n
        yield
    finally:
        torch.set_num_threads(before)


def tensors(seed: int, dtype: torch.dtype, init: Callable[[Tensor], Tensor] | None = None
            ) -> list[Tensor]:  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=generator) for n in SIZES]
    return [(v if init is None else init(v)).to(dtype) for v in values]


def positive(x: Tensor) -> Tensor:
    return x.square() + 0.1


def small(x: Tensor) -> Tensor:
    return x * 0.1


def flat(lists: Lists) -> list[Tensor]:
    return [t for ts in lists for t in ts]


def check(case: Case, ext: Any, chunk: int) -> None:
    """``case`` on 1 thread agrees with the reference, and on 2 and 4 threads bit for bit."""
    with num_threads(1):
        one = case(ext, chunk)
        want = case(_reference, chunk)
    assert len(one) == len(want) > 0
    for a, b in zip(one, want, strict=True):
        assert a.dtype == b.dtype
        if a.is_floating_point():
            torch.testing.assert_close(a, b, **TOL[a.dtype])
        else:
            assert torch.equal(a, b)
    for n in THREADS:
        with num_threads(n):
            many = case(ext, chunk)
        for index, (a, b) in enumerate(zip(one, many, strict=True)):
            assert torch.equal(a, b), f"output {index} differs between 1 and {n} threads"


# --- elementwise and norms ----------------------------------------------------------------


def scale_case(dtype: torch.dtype) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        ins, outs = tensors(1, dtype), tensors(2, dtype)
        noop = flag()
        impl.multi_tensor_scale(chunk, noop, [ins, outs], 0.37)
        return [*outs, noop]

    return case


def axpby_case(dtype: torch.dtype) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        xs, ys, outs = tensors(1, dtype), tensors(2, FP32), tensors(3, dtype)
        noop = flag()
        impl.multi_tensor_axpby(chunk, noop, [xs, ys, outs], 2.0, -0.5, -1)
        return [*outs, noop]

    return case


def l2norm_case(dtype: torch.dtype) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        xs = tensors(4, dtype)
        noop = flag()
        total, per_tensor = impl.multi_tensor_l2norm(chunk, noop, [xs], True)
        return [total, per_tensor, noop]

    return case


def unscale_l2norm_case(dtype: torch.dtype) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        xs = tensors(5, dtype, lambda x: x * 128.0)
        noop = flag()
        inv_scale = torch.tensor([1 / 128.0])
        total, per_tensor = impl.multi_tensor_unscale_l2norm(chunk, noop, [xs], inv_scale, True)
        return [total, per_tensor, noop]

    return case


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "make_case",
    [scale_case, axpby_case, l2norm_case, unscale_l2norm_case],
    ids=["scale", "axpby", "l2norm", "unscale_l2norm"],
)
def test_elementwise_and_norms_same_on_any_thread_count(
    ext: Any, make_case: Callable[[torch.dtype], Case], dtype: torch.dtype, chunk: int
) -> None:
    check(make_case(dtype), ext, chunk)


# --- optimizers ---------------------------------------------------------------------------


def adam_case(dtype: torch.dtype, mode: int) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        lists = [tensors(6, dtype), tensors(7, dtype), tensors(8, FP32, small),
                 tensors(9, FP32, positive)]  # fmt: skip
        noop = flag()
        impl.multi_tensor_adam(chunk, noop, lists, 1e-2, 0.9, 0.999, 1e-8, 3, mode, 1, 0.05)
        return [*flat(lists), noop]

    return case


def adam_capturable_case(dtype: torch.dtype, mode: int) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        lists = [tensors(10, dtype, lambda x: x * 64.0), tensors(11, dtype),
                 tensors(12, FP32, small), tensors(13, FP32, positive)]  # fmt: skip
        noop = flag()
        lr, step, inv_scale = torch.tensor([1e-2]), torch.tensor([3.0]), torch.tensor([1 / 64])
        impl.multi_tensor_adam_capturable(chunk, noop, lists, lr, 0.9, 0.999, 1e-8, step, mode,
                                          1, 0.05, inv_scale)  # fmt: skip
        return [*flat(lists), noop]

    return case


def adam_capturable_master_case(dtype: torch.dtype, mode: int) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        masters = tensors(14, FP32)
        lists = [tensors(15, dtype, lambda x: x * 64.0), [m.to(dtype) for m in masters],
                 tensors(16, FP32, small), tensors(17, FP32, positive), masters]  # fmt: skip
        noop = flag()
        lr, step, inv_scale = torch.tensor([1e-2]), torch.tensor([3.0]), torch.tensor([1 / 64])
        impl.multi_tensor_adam_capturable_master(chunk, noop, lists, lr, 0.9, 0.999, 1e-8, step,
                                                 mode, 1, 0.05, inv_scale)  # fmt: skip
        return [*flat(lists), noop]

    return case


def sgd_case(dtype: torch.dtype, mode: int) -> Case:
    nesterov = mode == 1

    def case(impl: Any, chunk: int) -> list[Tensor]:
        lists = [tensors(18, dtype), tensors(19, dtype), tensors(20, FP32, small),
                 tensors(21, dtype)]  # fmt: skip
        noop = flag()
        impl.multi_tensor_sgd(chunk, noop, lists, 1e-2, 0.9, 0.0, 0.05, nesterov, False, False,
                              0.5)  # fmt: skip
        return [*flat(lists), noop]

    return case


def adagrad_case(dtype: torch.dtype, mode: int) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        lists = [tensors(22, dtype), tensors(23, dtype), tensors(24, FP32, positive)]
        noop = flag()
        impl.multi_tensor_adagrad(chunk, noop, lists, 0.1, 1e-10, mode, 0.01)
        return [*flat(lists), noop]

    return case


def lamb_case(dtype: torch.dtype, mode: int) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        lists = [tensors(25, dtype), tensors(26, dtype), tensors(27, FP32, small),
                 tensors(28, FP32, positive)]  # fmt: skip
        noop = flag()
        impl.multi_tensor_lamb(chunk, noop, lists, 1e-2, 0.9, 0.999, 1e-6, 4, 1, 0.01, 1, mode,
                               torch.tensor([5.0]), 1.0, False)  # fmt: skip
        return [*flat(lists), noop]

    return case


def novograd_case(dtype: torch.dtype, mode: int) -> Case:
    norm_type = 2 if mode == 0 else 0  # L2 norms, or infinity norms

    def case(impl: Any, chunk: int) -> list[Tensor]:
        lists = [tensors(29, dtype), tensors(30, dtype), tensors(31, FP32, small)]
        grad_norms = torch.rand(len(SIZES), generator=torch.Generator().manual_seed(32)) + 0.5
        noop = flag()
        impl.multi_tensor_novograd(chunk, noop, lists, grad_norms, 1e-2, 0.95, 0.98, 1e-8, 3, 1,
                                   0.001, 1, mode, norm_type)  # fmt: skip
        return [*flat(lists), grad_norms, noop]

    return case


def lamb_stages_case(dtype: torch.dtype, mode: int) -> Case:
    def case(impl: Any, chunk: int) -> list[Tensor]:
        grads, params = tensors(33, dtype), tensors(34, dtype)
        moments = [tensors(35, FP32, small), tensors(36, FP32, positive)]
        updates = tensors(37, FP32)
        decay = torch.full((len(SIZES),), 0.01 * mode)
        noop = flag()
        impl.multi_tensor_lamb_stage1_cuda(chunk, noop, [grads, params, *moments, updates],
                                           decay, 3, 0.9, 0.999, 1e-6, torch.tensor([2.0]),
                                           1.0)  # fmt: skip
        # Stage 2 with the norms of stage 1's outputs, as FusedMixedPrecisionLamb does.
        _, param_norms = impl.multi_tensor_l2norm(chunk, noop, [params], True)
        _, update_norms = impl.multi_tensor_l2norm(chunk, noop, [updates], True)
        impl.multi_tensor_lamb_stage2_cuda(chunk, noop, [params, updates], param_norms,
                                           update_norms, 1e-2, 0.01, False)  # fmt: skip
        return [*params, *moments[0], *moments[1], *updates, param_norms, update_norms, noop]

    return case


OPTIMIZER_CASES: dict[str, Callable[[torch.dtype, int], Case]] = {
    "adam": adam_case,
    "adam_capturable": adam_capturable_case,
    "adam_capturable_master": adam_capturable_master_case,
    "sgd": sgd_case,
    "adagrad": adagrad_case,
    "lamb": lamb_case,
    "novograd": novograd_case,
    "lamb_stages": lamb_stages_case,
}


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPTIMIZER_CASES))
def test_optimizers_same_on_any_thread_count(
    ext: Any, op: str, dtype: torch.dtype, mode: int, chunk: int
) -> None:
    check(OPTIMIZER_CASES[op](dtype, mode), ext, chunk)
