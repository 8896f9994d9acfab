"""What an ``amp_C`` call does between Apex's arguments and the kernel: checks once, DTensors.

On the compiled CPU kernels (loaded by ``ext``): a call that succeeds is checked by its kernel
alone, and a call that fails raises the error of the precondition table whichever mistake the
kernel met first; a DTensor anywhere in the lists takes the sharded path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from _cpu_extension_helpers import load_from, session_cache
from _kernel_target import DEVICE as KERNEL_DEVICE
from _kernel_target import EMULATED, norm_ops
from _op_cases import OP_CASES
from _op_cases import noop_flag as flag
from amp_fused_ops import amp_C, multi_tensor_applier
from amp_fused_ops.ops import _apex_convention, _preconditions, _schema_calls
from amp_fused_ops.ops._registry import REGISTRY


@pytest.fixture(scope="module")
def ext(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_from(session_cache(tmp_path_factory).cache)


def _adam_lists(n: int = 4) -> list[list[Tensor]]:
    return [[torch.full((n,), 0.1)], [torch.ones(n)], [torch.zeros(n)], [torch.zeros(n)]]


def _counted_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    checked: list[str] = []
    real = _preconditions.check

    def check(op: str, *args: Any) -> None:
        checked.append(op)
        real(op, *args)

    monkeypatch.setattr(_preconditions, "check", check)
    return checked


def test_a_call_that_succeeds_is_checked_by_its_kernel_alone(
    ext: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert hasattr(ext, "multi_tensor_adam")
    checked = _counted_checks(monkeypatch)
    lists = _adam_lists()
    multi_tensor_applier(
        amp_C.multi_tensor_adam, flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0
    )
    multi_tensor_applier(amp_C.multi_tensor_scale, flag(), [lists[1], lists[2]], 0.5)
    assert checked == []
    assert torch.allclose(lists[1][0], torch.full((4,), 1 - 1e-3))  # one Adam step of lr 1e-3
    assert torch.equal(lists[2][0], lists[1][0] * 0.5)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        # The kernel meets the lists' lengths first; the table's mode error is the answer.
        (
            lambda: amp_C.multi_tensor_adam(
                64, flag(), [*_adam_lists()[:3], []], 1e-3, 0.9, 0.999, 1e-8, 1, 2, 1, 0.0
            ),
            r"^multi_tensor_adam: mode must be one of \[0, 1\], got 2$",
        ),
        # A wrong list count and a bad step: the table's error, as the table was checked first.
        (
            lambda: amp_C.multi_tensor_adam(
                64, flag(), _adam_lists()[:3], 1e-3, 0.9, 0.999, 1e-8, 0, 1, 1, 0.0
            ),
            r"^multi_tensor_adam: step must be >= 1 when bias_correction is on, got 0$",
        ),
        (
            lambda: amp_C.multi_tensor_axpby(
                64, flag(), [[torch.ones(3, dtype=torch.float64)]] * 3, 1.0, 1.0, 2
            ),
            r"^multi_tensor_axpby: arg_to_check must be one of \[-1, 0, 1\], got 2$",
        ),
        (
            lambda: amp_C.multi_tensor_adagrad(
                64, flag(), [[torch.ones(3)]] * 3, 1e-2, 1e-8, 3, 0.0
            ),
            r"^multi_tensor_adagrad: mode must be one of \[0, 1\], got 3$",
        ),
        (
            lambda: amp_C.multi_tensor_adam(
                64,
                flag(),
                _adam_lists(),
                1e-3,
                0.9,
                0.999,
                1e-8,
                1,
                mode=5,
                bias_correction=1,
                weight_decay=0.0,
            ),
            r"^multi_tensor_adam: mode must be one of \[0, 1\], got 5$",
        ),
        # A bool is an int to the dispatcher: refused before the call.
        (
            lambda: amp_C.multi_tensor_scale(True, flag(), [[torch.ones(3)]] * 2, 0.5),
            r"chunk_size must be an int in \[1, 2\*\*30\], got True",
        ),
        (
            lambda: amp_C.multi_tensor_scale(2**40, flag(), [[torch.ones(3)]] * 2, 0.5),
            r"chunk_size must be an int in \[1, 2\*\*30\], got 1099511627776",
        ),
    ],
)
def test_a_failed_call_raises_the_tables_error(ext: Any, call: Any, match: str) -> None:
    del ext
    with pytest.raises(ValueError, match=match) as caught:
        call()
    # Raised on its own, not chained to the kernel's error.
    error = caught.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_the_kernels_own_error_stands_when_the_scalars_are_right(ext: Any) -> None:
    del ext
    lists = _adam_lists()
    lists[3] = [torch.zeros(4, dtype=torch.float16)]
    with pytest.raises(ValueError, match=r"multi_tensor_adam: tensor_lists\[3\]\[0\]"):
        amp_C.multi_tensor_adam(64, flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)


# (op, argument, a value the table refuses) for every row of the table.
_REFUSED = [
    *((op, name, 7) for op, rule in _preconditions.rules().items() for name, _ in rule.choices),
    *((op, "step", 0) for op, rule in _preconditions.rules().items() if rule.step_at_least_one),
]


@pytest.mark.parametrize(("op", "argument", "value"), _REFUSED)
def test_every_kernel_refuses_what_the_table_refuses(
    ext: Any, op: str, argument: str, value: int
) -> None:
    """A call that succeeds is checked by its kernel only, so each kernel (compiled where the
    CPU extension has one, else the reference) must refuse every value the table refuses."""
    del ext
    sample = list(OP_CASES[op].sample())
    at = 2 + max(REGISTRY[op].list_counts)
    sample[at + _preconditions.rules()[op].arguments.index(argument)] = value
    with pytest.raises(ValueError, match=argument):
        getattr(torch.ops.amp_fused_ops, op).default(*sample)


def _on(value: Any, device: str) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_on(v, device) for v in value]
    return value


@pytest.mark.gpu
@pytest.mark.cuda_emulation
@pytest.mark.parametrize(("op", "argument", "value"), _REFUSED)
def test_every_cuda_kernel_refuses_what_the_table_refuses(
    op: str, argument: str, value: int
) -> None:
    """The same for the kernels of csrc/cuda (on a GPU, or the emulated build on the CPU): a
    call on CUDA tensors that succeeds is checked by them alone."""
    ops = norm_ops()  # torch.ops.amp_fused_ops on a GPU, the emulated build's namespace else
    qualified = f"{ops.name}::{op}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(
        qualified, "CUDA" if not EMULATED else "CPU"
    ):
        pytest.skip(f"{op} has no kernel in csrc/cuda (the reference runs, tested above)")
    sample = [_on(v, KERNEL_DEVICE) for v in OP_CASES[op].sample()]
    at = 2 + max(REGISTRY[op].list_counts)
    sample[at + _preconditions.rules()[op].arguments.index(argument)] = value
    with pytest.raises(ValueError, match=argument):
        getattr(ops, op).default(*sample)


class _Marked(Tensor):
    """Stands in for DTensor: a tensor subclass the ops take for the DTensor type."""


class _Other(Tensor):
    """Another tensor subclass (not a DTensor)."""


def test_dtensor_lookup_finds_one_anywhere_in_the_lists() -> None:
    plain, param = torch.ones(2), torch.nn.Parameter(torch.ones(2))
    marked = torch.ones(2).as_subclass(_Marked)
    other = torch.ones(2).as_subclass(_Other)
    holds = _schema_calls.holds_dtensor
    assert not holds(_Marked, [[plain, param], [plain, plain], None])
    assert not holds(_Marked, [[plain, other]])  # another subclass: walked, and not one
    assert holds(_Marked, [[plain, param], [plain, marked]])
    assert holds(_Marked, [[marked]])


def test_a_dtensor_after_the_first_position_takes_the_sharded_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_apex_convention, "dtensor_type", lambda: _Marked)
    monkeypatch.setattr(_schema_calls, "dtensor_type", lambda: _Marked)
    lists = _adam_lists()
    lists[0].append(torch.ones(4))
    for part in lists[1:]:
        part.append(torch.zeros(4))
    lists[3][1] = lists[3][1].as_subclass(_Marked)  # its param at position 1 is plain
    with pytest.raises(ValueError, match=r"tensor_lists\[3\]\[1\] and tensor_lists\[0\]\[1\]"):
        amp_C.multi_tensor_adam(64, flag(), lists, 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert torch.equal(lists[1][0], torch.ones(4))  # nothing was stepped


# --- the documented errors on the usual path (any kernel), not only on the reference's -------


def test_a_number_in_a_later_list_gives_the_documented_type_error() -> None:
    # Only tensor_lists[0][0] used to be looked at before the call: the dispatcher then failed
    # to parse the list with an error naming no list or position.
    ins, outs = [torch.ones(3)], [3.0]
    with pytest.raises(TypeError, match=r"tensor_lists\[1\]\[0\] must be a tensor, got float"):
        amp_C.multi_tensor_scale(64, flag(), [ins, outs], 0.5)


def test_a_written_tensor_on_another_device_is_refused_not_skipped() -> None:
    # NovoGrad's grad_norms on the meta device: the dispatcher picks the meta (fake) kernel for
    # the call, which used to return without a word while nothing was stepped.
    grads, params, exp_avgs = ([torch.ones(4)] for _ in range(3))
    before = params[0].clone()
    with pytest.raises(RuntimeError, match="grad_norms is on meta but the tensors are on cpu"):
        amp_C.multi_tensor_novograd(
            64,
            flag(),
            [grads, params, exp_avgs],
            torch.zeros(1, device="meta"),
            1e-3, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 1, 2,
        )  # fmt: skip
    assert torch.equal(params[0], before)


def test_a_number_for_a_written_tensor_is_refused() -> None:
    grads, params, exp_avgs = ([torch.ones(4)] for _ in range(3))
    with pytest.raises(TypeError, match="grad_norms must be a tensor, got float"):
        amp_C.multi_tensor_novograd(
            64, flag(), [grads, params, exp_avgs], 0.0,
            1e-3, 0.9, 0.999, 1e-8, 1, 1, 0.0, 1, 1, 2,
        )  # fmt: skip
