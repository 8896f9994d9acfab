"""Capturable optimizer steps in a CUDA graph: one captured step, replayed, is N eager steps.

Every capturable mode (``FusedAdam(capturable=True)`` in Adam and AdamW mode, with and without
master weights, float32 and half params, with and without GradScaler's ``grad_scale`` /
``found_inf``; ``FusedMixedPrecisionLamb``) is captured once after a warm-up step and
replayed with new gradients copied into the same ``.grad`` tensors before each replay, as a
training loop with static inputs does. Params, gradients, optimizer state and the groups'
``step`` must equal those of the same optimizer stepped eagerly, bitwise (the same kernels
run both ways).

On a GPU the capture is ``torch.cuda.graph``. Without one, under ``AMP_FUSED_OPS_EMULATION``
(``nox -s cuda_emulation``), the CUDA kernels run on the CPU through the emulator and the
capture is :class:`amp_fused_ops.emulation.Graph`, which raises on a host synchronization
(``.item()``, ``.tolist()``, ``bool(tensor)``) during the capture, as a CUDA capture fails.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from amp_optimizers import FusedAdam, FusedMixedPrecisionLamb

EMULATION = os.environ.get("AMP_FUSED_OPS_EMULATION", "")
EMULATED = bool(EMULATION)
DEVICE = torch.device("cpu" if EMULATED else "cuda")

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emulation]

REPLAYS = 4
SCALE = 1024.0  # the loss scale of the GradScaler cases

# name -> (optimizer factory, param dtype, whether GradScaler hands over grad_scale/found_inf)
Factory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
CASES: dict[str, tuple[Factory, torch.dtype, bool]] = {
    "adamw_fp32": (
        lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.1, capturable=True),
        torch.float32,
        False,
    ),
    "adam_fp32": (
        lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.1, adam_w_mode=False, capturable=True),
        torch.float32,
        False,
    ),
    "adamw_fp32_scaler": (lambda g: FusedAdam(g, lr=1e-2, capturable=True), torch.float32, True),
    "adamw_bf16": (lambda g: FusedAdam(g, lr=1e-2, capturable=True), torch.bfloat16, False),
    "adam_fp16_scaler": (
        lambda g: FusedAdam(g, lr=1e-2, adam_w_mode=False, weight_decay=0.1, capturable=True),
        torch.float16,
        True,
    ),
    "adamw_bf16_master": (
        lambda g: FusedAdam(g, lr=1e-2, weight_decay=0.1, capturable=True, master_weights=True),
        torch.bfloat16,
        False,
    ),
    "adamw_fp16_master_scaler": (
        lambda g: FusedAdam(g, lr=1e-2, capturable=True, master_weights=True),
        torch.float16,
        True,
    ),
    "adam_fp16_master_scaler": (
        lambda g: FusedAdam(
            g, lr=1e-2, adam_w_mode=False, weight_decay=0.1, capturable=True, master_weights=True
        ),
        torch.float16,
        True,
    ),
    "mp_lamb_fp32": (lambda g: FusedMixedPrecisionLamb(g, lr=1e-2), torch.float32, False),
    "mp_lamb_bf16": (
        lambda g: FusedMixedPrecisionLamb(g, lr=1e-2, reduced_precision_dtype=torch.bfloat16),
        torch.bfloat16,
        False,
    ),
    "mp_lamb_fp16_scaler": (
        lambda g: FusedMixedPrecisionLamb(
            g, lr=1e-2, max_grad_norm=0.5, reduced_precision_dtype=torch.float16
        ),
        torch.float16,
        True,
    ),
}


@contextlib.contextmanager
def _kernels() -> Iterator[None]:
    """The CUDA kernels: the GPU's, or the emulated ones for the CPU tensors of the test."""
    if not EMULATED:
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA or AMP_FUSED_OPS_EMULATION")
        yield
        return
    from amp_fused_ops import emulation

    with emulation.amp_C_on_emulated_kernels(emulation.load(EMULATION)):
        yield


class _Graph:
    """A CUDA graph, or the emulator's (which raises on a host sync during the capture)."""

    def __init__(self) -> None:
        if EMULATED:
            from amp_fused_ops import emulation

            self._graph: Any = emulation.Graph()
        else:
            self._graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        if EMULATED:
            with self._graph:
                yield
        else:
            with torch.cuda.graph(self._graph):
                yield

    def replay(self) -> None:
        self._graph.replay()


def _model(dtype: torch.dtype) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(33, 7), (129,), (5, 3)]
    params = [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]
    # Two groups: the second with its own lr and weight decay.
    return [
        {"params": [torch.nn.Parameter(p) for p in params[:2]]},
        {"params": [torch.nn.Parameter(params[2])], "lr": 3e-3, "weight_decay": 0.0},
    ]


def _gradients(params: list[Tensor], steps: int, scaled: bool) -> list[list[Tensor]]:
    gen = torch.Generator().manual_seed(1)
    scale = SCALE if scaled else 1.0
    return [
        [(torch.randn(p.shape, generator=gen) * scale).to(DEVICE, p.dtype) for p in params]
        for _ in range(steps)
    ]


def _tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor a step reads or writes: params, gradients, state, the groups' lr/step."""
    out: list[Tensor] = []
    for group in optimizer.param_groups:
        out += [v for k, v in sorted(group.items()) if k != "params" and isinstance(v, Tensor)]
        for p in group["params"]:
            out.append(p.detach())
            if p.grad is not None:
                out.append(p.grad)
            state = optimizer.state.get(p, {})
            out += [v for _, v in sorted(state.items()) if isinstance(v, Tensor)]
    return out


def _snapshot(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [t.detach().clone() for t in _tensors(optimizer)]


def _assert_same(actual: list[Tensor], expected: list[Tensor], what: str) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(
            a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m, i=i: f"{what}, tensor {i}: {m}"
        )


def _run(case: str, *, captured: bool, overflow_at: int | None) -> list[list[Tensor]]:
    """A warm-up step, then ``REPLAYS`` steps (replays of one captured step, or eager steps).

    ``overflow_at``: the step (0-based, after the warm-up) whose gradients overflow: GradScaler
    reports ``found_inf`` for it, or, with no scaler, one gradient holds an inf.

    Returns:
        The snapshot of every tensor after each of the ``REPLAYS`` steps.
    """
    make, dtype, scaled = CASES[case]
    groups = _model(dtype)
    params = [p for g in groups for p in g["params"]]
    optimizer = make(groups)
    grads = _gradients(params, REPLAYS + 1, scaled)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.clone()  # the static gradient tensors, written in place from here on
    found_inf = torch.zeros(1, dtype=torch.float32, device=DEVICE)
    if scaled:  # what GradScaler.step hands an optimizer that unscales in its step
        optimizer.grad_scale = torch.full((1,), SCALE, device=DEVICE)  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]

    def load_gradients(step: int) -> None:
        for p, g in zip(params, grads[step + 1], strict=True):
            assert p.grad is not None
            p.grad.copy_(g)
        found_inf.zero_()
        if step == overflow_at:
            if scaled:
                found_inf.fill_(1.0)
            else:
                params[1].grad[3] = float("inf")  # type: ignore[index]

    snapshots = []
    with _kernels():
        if EMULATED or not captured:
            optimizer.step()  # the warm-up step creates the state
        else:  # on a side stream, as torch.cuda.graph's documentation asks of a warm-up
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                optimizer.step()
            torch.cuda.current_stream().wait_stream(side)
        if not captured:
            for step in range(REPLAYS):
                load_gradients(step)
                optimizer.step()
                snapshots.append(_snapshot(optimizer))
            return snapshots
        graph = _Graph()
        if not EMULATED:
            torch.cuda.synchronize()
        # The emulator runs a capture's ATen ops (not its kernels), where a CUDA capture runs
        # nothing: put back what the capture saw, so that both replay from the same values.
        before = _tensors(optimizer)
        saved = [t.clone() for t in before]
        with graph.capture():
            optimizer.step()
        for t, value in zip(before, saved, strict=True):
            t.copy_(value)
        for step in range(REPLAYS):
            load_gradients(step)
            graph.replay()
            snapshots.append(_snapshot(optimizer))
        if not EMULATED:
            torch.cuda.synchronize()
    return snapshots


@pytest.mark.parametrize("case", list(CASES))
def test_replays_of_a_captured_step_equal_eager_steps(case: str) -> None:
    expected = _run(case, captured=False, overflow_at=None)
    actual = _run(case, captured=True, overflow_at=None)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        _assert_same(a, e, f"{case}: after replay {step + 1}")
    # The replays stepped: every param moved at every replay.
    params, _ = _positions(case)
    for before, after in itertools.pairwise(actual):
        assert any(not torch.equal(before[i], after[i]) for i in params)


@pytest.mark.parametrize("case", list(CASES))
def test_an_overflow_in_a_replay_skips_that_step_on_the_device(case: str) -> None:
    overflow_at = 2
    actual = _run(case, captured=True, overflow_at=overflow_at)
    expected = _run(case, captured=False, overflow_at=overflow_at)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        _assert_same(a, e, f"{case}: after replay {step + 1}")
    # The skipped replay changed nothing but the gradients (the ones it was given, unscaled
    # in place under a scaler): params, state and step are those of the replay before.
    before, after = actual[overflow_at - 1], actual[overflow_at]
    params, grads = _positions(case)
    kept = [i for i in range(len(before)) if i not in grads]
    _assert_same([after[i] for i in kept], [before[i] for i in kept], f"{case}: skipped replay")
    # ... and the replay after it stepped again.
    assert any(not torch.equal(actual[-1][i], after[i]) for i in params)


def _positions(case: str) -> tuple[list[int], set[int]]:
    """Positions of the params and of the gradients in a snapshot of ``case`` (:func:`_tensors`)."""
    make, dtype, _ = CASES[case]
    optimizer = make(_model(dtype))
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    with _kernels():
        optimizer.step()  # the state exists, as in the snapshots
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = {id(p.grad) for p in params}
    storages = [p.untyped_storage().data_ptr() for p in params]
    tensors = _tensors(optimizer)
    param_positions = [
        i
        for i, t in enumerate(tensors)
        if t.untyped_storage().data_ptr() in storages and id(t) not in ids
    ]
    return param_positions, {i for i, t in enumerate(tensors) if id(t) in ids}
