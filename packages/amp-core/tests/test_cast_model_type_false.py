"""``amp.initialize(..., cast_model_type=False)`` and ``_amp_state.allow_incoming_model_not_fp32``.

Apex's multi-model tests build models that already hold float16 params, set
``_amp_state.allow_incoming_model_not_fp32 = True`` and pass ``cast_model_type=False`` ("do not
cast the model") at every opt level. See docs/opt_levels.rst, "Models that arrive in half
precision".
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from amp_core import amp

OPT_LEVELS = ["O0", "O1", "O2", "O3"]
X = torch.ones(2)


class TwoDtypes(nn.Module):
    """Apex's test model: one float32 and one float16 param; records its input's dtype."""

    def __init__(self, unique: float) -> None:
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float16))
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return (x * self.weight0.float() * self.weight1.float()).sum()


def _sgd(models: list[TwoDtypes]) -> torch.optim.SGD:
    lrs = (0.25, 0.5)
    groups = [{"params": m.parameters(), "lr": lr} for m, lr in zip(models, lrs, strict=True)]
    return torch.optim.SGD(groups, momentum=0.125)


def _train(models: list[TwoDtypes], optimizer: torch.optim.Optimizer, use_amp: bool) -> None:
    for _ in range(2):
        optimizer.zero_grad()
        loss = sum(m(X) for m in models)
        if use_amp:
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        else:
            loss.backward()
        optimizer.step()


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_cast_model_type_false_leaves_the_models_as_they_arrived(opt_level: str) -> None:
    reference = [TwoDtypes(1), TwoDtypes(2)]
    _train(reference, _sgd(reference), use_amp=False)

    models = [TwoDtypes(1), TwoDtypes(2)]
    optimizer = _sgd(models)
    models, optimizer = amp.initialize(
        models, optimizer, opt_level=opt_level, cast_model_type=False, verbosity=0
    )
    assert amp._amp_state.opt_properties.cast_model_type is False
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0  # as Apex's tests: exact in half
    _train(models, optimizer, use_amp=True)

    for model, ref in zip(models, reference, strict=True):
        assert model.seen == torch.float32  # no input cast
        assert [p.dtype for p in model.parameters()] == [torch.float32, torch.float16]
        for param, expected in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(param, expected)
        # state_dict(): the model's own tensors, in the dtypes they arrived in
        state = model.state_dict()
        assert [state[k].dtype for k in ("weight0", "weight1")] == [torch.float32, torch.float16]
        assert torch.equal(state["weight1"], model.weight1.detach())
    masters = list(amp.master_params(optimizer))
    if opt_level == "O2":  # float32 masters of the float16 params; float32 params stepped as is
        assert [m.dtype for m in masters] == [torch.float32] * 4
        half_params = [m.weight1 for m in models]
        assert all(not any(m is p for p in half_params) for m in masters)
    else:
        assert [m.dtype for m in masters] == [torch.float32, torch.float16] * 2


def test_o2_masters_of_a_model_that_arrived_in_half() -> None:
    model = TwoDtypes(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", cast_model_type=False, loss_scale=1.0, verbosity=0
    )
    master = list(amp.master_params(optimizer))[1]
    assert master.dtype == torch.float32 and torch.equal(master, model.weight1.float())
    for _ in range(3):
        optimizer.zero_grad()
        with amp.scale_loss(model(X), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    # The master keeps the updates below float16's spacing; the model holds it rounded, and
    # so does its state_dict().
    torch.testing.assert_close(master, torch.tensor([2.0, 3.0]) - 3e-4 * torch.tensor([1.0, 2.0]))
    assert torch.equal(model.weight1.detach(), master.detach().half())
    assert torch.equal(model.state_dict()["weight1"], master.detach().half())
    # An in-place edit of the half param and a load reach the master (read, or stepped).
    with torch.no_grad():
        model.weight1.fill_(7.0)
    assert torch.equal(model.state_dict()["weight1"], torch.full((2,), 7.0, dtype=torch.half))
    assert torch.equal(list(amp.master_params(optimizer))[1].detach(), torch.full((2,), 7.0))
    model.load_state_dict({"weight0": torch.ones(2), "weight1": torch.full((2,), 3.0).half()})
    assert torch.equal(list(amp.master_params(optimizer))[1].detach(), torch.full((2,), 3.0))


@pytest.mark.parametrize("value", [True, "half", torch.int8, torch.float64])
def test_other_cast_model_types_are_refused(value: object) -> None:
    model = TwoDtypes(1)
    with pytest.raises(
        ValueError,
        match=r"cast_model_type must be torch\.float16, torch\.bfloat16, torch\.float32, or "
        r"False \(do not cast the model\), got ",
    ):
        amp.initialize(model, opt_level="O2", cast_model_type=value, verbosity=0)
    assert model.weight0.dtype == torch.float32 and not model._forward_pre_hooks


def test_o1_still_refuses_a_cast_model_type_dtype() -> None:
    with pytest.raises(RuntimeError, match="O1 inserts casts around Torch functions"):
        amp.initialize(TwoDtypes(1), opt_level="O1", cast_model_type=torch.float16, verbosity=0)


@pytest.mark.parametrize("allow", [False, True])
def test_allow_incoming_model_not_fp32_declares_a_half_model(
    allow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Linear(2, 2).half()
    amp._amp_state.allow_incoming_model_not_fp32 = allow
    try:
        with caplog.at_level(logging.WARNING, logger="amp_core"):
            amp.initialize(model, opt_level="O2", half_dtype=torch.float16, verbosity=1)
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False
    warned = any("expected torch.float32" in r.getMessage() for r in caplog.records)
    assert warned is not allow
