"""Faults and misuse that must not corrupt training: param groups added after initialize, long
runs of overflows, bad checkpoints, sparse gradients, several amp.initialize calls."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, HALF_DTYPES

from _amp_core_helpers import batch, fp32_copy, tiny_mlp
from amp_core import amp

DEFAULT_FLOOR = 2.0**-24  # the documented floor of a dynamic scale without min_loss_scale


def _scale(key: str = "loss_scaler0") -> float:
    return float(amp.state_dict()[key]["loss_scale"])


def _step(model, opt, seed: int, *, poison: bool = False, loss_id: int = 0) -> None:
    opt.zero_grad()
    x, y = batch(seed)
    loss = F.mse_loss(model(x).float(), y)
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------ add_param_group after initialize


@pytest.mark.parametrize(
    "opt_level, kw",
    [("O0", {}), ("O1", {}), ("O2", {}), ("O3", {"loss_scale": 128.0})],
    ids=["O0", "O1", "O2", "O3-static128"],
)
def test_param_group_added_after_initialize_steps_as_the_first(opt_level, kw):
    """A head unfrozen later: its group is unscaled (and gets fp32 masters under O2) exactly as
    the groups amp.initialize saw; the update matches plain fp32 SGD."""
    half = torch.float16
    model = tiny_mlp()
    ref = fp32_copy(model)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, **kw)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.05})  # a generator
    ref_opt = torch.optim.SGD(ref[0].parameters(), lr=0.1)
    ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 0.05})
    if opt_level == "O2":
        assert [p.dtype for p in opt.param_groups[1]["params"]] == [torch.float32] * 2

    for seed in range(3):
        _step(model, opt, seed)
        ref_opt.zero_grad()
        x, y = batch(seed)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()

    for got, want in zip(model[2].parameters(), ref[2].parameters(), strict=True):
        torch.testing.assert_close(got.detach().float(), want.detach(), **CHAIN_TOL[half])
    if opt_level == "O2":  # the model's state dict holds the new masters, as for the others
        masters = opt.param_groups[1]["params"]
        assert torch.equal(model.state_dict()["2.weight"], masters[0].detach())


def test_param_group_added_after_initialize_skips_with_the_others():
    model = tiny_mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    opt.add_param_group({"params": list(model[2].parameters())})
    before = _params(model)
    model[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
    _step(model, opt, 0)
    assert _same(_params(model), before)
    assert amp.skipped_steps(opt) == 1


def test_param_group_with_a_param_amp_already_masters_is_refused():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight]})


# ------------------------------------------------------------ the floor of the dynamic scale


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_long_run_of_overflows_stops_at_the_floor_and_training_goes_on(opt_level):
    """170 overflowing steps halve 2**16 past float32's smallest number (Apex reached 0 and the
    next clean step wrote nan); the scale stops at the floor and the clean step is finite."""
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level=opt_level, half_dtype=torch.float16, verbosity=0
    )
    before = _params(model)
    for seed in range(170):
        _step(model, opt, seed, poison=True)
    assert _same(_params(model), before)
    assert amp.skipped_steps(opt) == 170
    assert _scale() == DEFAULT_FLOOR

    _step(model, opt, 1000)
    after = _params(model)
    assert all(bool(p.isfinite().all()) for p in after)
    assert amp.skipped_steps(opt) == 170


def test_given_min_loss_scale_is_the_floor():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, min_loss_scale=0.25, verbosity=0
    )
    for seed in range(25):
        _step(model, opt, seed, poison=True)
    assert _scale() == 0.25


@pytest.mark.parametrize("bad", [0.0, 1e-40, -1.0, float("nan")])
def test_min_loss_scale_that_cannot_be_a_floor_is_refused(bad):
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="min_loss_scale"):
        amp.initialize(model, opt, opt_level="O1", min_loss_scale=bad, verbosity=0)


@pytest.mark.parametrize("loss_scale", ["dynamic", 2.0**-20], ids=["dynamic", "static"])
def test_gradient_that_overflows_only_when_unscaled_skips_the_step(loss_scale):
    """Below a scale of one, unscaling multiplies: a finite scaled gradient can become inf."""
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, loss_scale=loss_scale, verbosity=0
    )
    if loss_scale == "dynamic":
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**-20, "unskipped": 0}})
    before = _params(model)
    # finite as it arrives (scaled), 1e36 * 2**20 overflows float32 once unscaled
    model[2].weight.register_hook(lambda g: torch.full_like(g, 1e36))
    _step(model, opt, 0)
    assert _same(_params(model), before)
    assert amp.skipped_steps(opt) == 1


# ------------------------------------------------------------ a static scale skips inf steps too


@pytest.mark.parametrize("loss_scale", [1.0, 128.0])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o3_static_scale_skips_a_step_with_inf_gradients(half, loss_scale):
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(
        model, opt, opt_level="O3", half_dtype=half, loss_scale=loss_scale, verbosity=0
    )
    _step(model, opt, 0)
    before = _params(model)
    _step(model, opt, 1, poison=True)
    assert _same(_params(model), before)
    assert amp.skipped_steps(opt) == 1
    assert _scale() == loss_scale
    _step(model, opt, 2)
    assert not _same(_params(model), before)


def test_o0_applies_every_step_as_apex():
    """O0 is plain fp32: amp checks nothing there (Apex's O0)."""
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    _step(model, opt, 0, poison=True)
    assert amp.skipped_steps(opt) == 0


# ------------------------------------------------------------ checkpoint validation


def _o1_two_losses():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, num_losses=2, verbosity=0
    )


@pytest.mark.parametrize(
    "value, error",
    [
        (0.0, ValueError),
        (-4.0, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        ("1024", TypeError),
        (None, TypeError),
        (True, TypeError),
        (torch.tensor(1024.0), TypeError),
    ],
    ids=["zero", "negative", "inf", "nan", "str", "None", "bool", "tensor"],
)
def test_load_state_dict_refuses_a_bad_loss_scale_and_loads_nothing(value, error):
    _o1_two_losses()
    before = amp.state_dict()
    bad = {
        "loss_scaler0": {"loss_scale": 512.0, "unskipped": 3},  # valid, must not be loaded
        "loss_scaler1": {"loss_scale": value, "unskipped": 0},
    }
    with pytest.raises(error, match=r'loss_scaler1"\]\["loss_scale"\]'):
        amp.load_state_dict(bad)
    assert amp.state_dict() == before


@pytest.mark.parametrize("value", [-1, 2.5, "3", None, False], ids=str)
def test_load_state_dict_refuses_a_bad_counter(value):
    _o1_two_losses()
    before = amp.state_dict()
    with pytest.raises((ValueError, TypeError), match=r'loss_scaler0"\]\["unskipped"\]'):
        amp.load_state_dict(
            {
                "loss_scaler0": {"loss_scale": 8.0, "unskipped": value},
                "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0},
            }
        )
    assert amp.state_dict() == before


@pytest.mark.parametrize(
    "state, match",
    [
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}}, "missing.*loss_scaler1"),
        (
            {
                "loss_scaler0": {"loss_scale": 8.0, "unskipped": 0},
                "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0},
                "loss_scaler2": {"loss_scale": 8.0, "unskipped": 0},
            },
            "unexpected.*loss_scaler2",
        ),
        (
            {
                "loss_scaler0": {"loss_scale": 8.0},
                "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0},
            },
            r"missing \['unskipped'\]",
        ),
        (
            {
                "loss_scaler0": {"loss_scale": 8.0, "unskipped": 0, "growth": 2},
                "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0},
            },
            r"unknown \['growth'\]",
        ),
    ],
    ids=["missing-scaler", "extra-scaler", "missing-field", "extra-field"],
)
def test_load_state_dict_refuses_a_checkpoint_of_another_shape(state, match):
    _o1_two_losses()
    before = amp.state_dict()
    with pytest.raises(ValueError, match=match):
        amp.load_state_dict(state)
    assert amp.state_dict() == before


def test_load_state_dict_brings_an_out_of_range_scale_within_bounds(caplog):
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**30, "unskipped": 5}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**24, "unskipped": 5}}
    assert "outside" in caplog.text


# ------------------------------------------------------------ sparse gradients


class _Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx)).float().sum() * 0.01  # no fp16 overflow at 2**16


@pytest.mark.parametrize(
    "opt_level, kw",
    [("O1", {}), ("O2", {}), ("O3", {"loss_scale": 128.0})],
    ids=["O1", "O2", "O3-static128"],
)
def test_sparse_gradients_are_unscaled_and_checked(opt_level, kw):
    half = torch.float16
    model = _Bag()
    ref = fp32_copy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, **kw)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    idx = torch.tensor([1, 2, 2, 7])  # a repeated index: an uncoalesced sparse gradient

    opt.zero_grad()
    with amp.scale_loss(model(idx).float(), opt) as scaled:
        scaled.backward()
    opt.step()
    ref_opt.zero_grad()
    ref(idx).backward()
    ref_opt.step()
    torch.testing.assert_close(
        model.emb.weight.detach().float(), ref.emb.weight.detach(), **CHAIN_TOL[half]
    )

    before = _params(model)
    opt.zero_grad()
    with amp.scale_loss(model(idx).float() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert _same(_params(model), before)
    assert amp.skipped_steps(opt) == 1


# ------------------------------------------------------------ several amp.initialize calls


def _pair(seed: int, num_losses: int = 1):
    model = tiny_mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(
        model, opt, opt_level="O1", half_dtype=torch.float16, num_losses=num_losses, verbosity=0
    )


def test_state_dict_covers_every_live_initialize_call():
    """One amp.initialize per model (a GAN): the first model's scale is saved and restored."""
    g, g_opt = _pair(0)
    d, d_opt = _pair(1, num_losses=2)
    _step(g, g_opt, 0, poison=True)  # only the first call's scale moves
    _step(d, d_opt, 1, loss_id=1)
    saved = amp.state_dict()
    assert saved == {  # the latest call owns Apex's keys
        "loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
        "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 1},
        "session1.loss_scaler0": {"loss_scale": 32768.0, "unskipped": 0},
    }

    del g, g_opt, d, d_opt  # as in a new process
    g, g_opt = _pair(0)
    _d, _d_opt = _pair(1, num_losses=2)  # kept alive: a live call
    amp.load_state_dict(saved)
    assert amp.state_dict() == saved
    _step(g, g_opt, 2)
    assert _scale("session1.loss_scaler0") == 32768.0


def test_checkpoint_of_one_call_loads_into_the_latest_of_two_and_back():
    g, g_opt = _pair(0)
    _step(g, g_opt, 0, poison=True)
    one = amp.state_dict()
    assert one == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 0}}  # Apex's format
    d, d_opt = _pair(1)
    _step(g, g_opt, 1)
    amp.load_state_dict(one)  # into the latest call; the first keeps its scaler
    assert amp.state_dict() == {
        "loss_scaler0": {"loss_scale": 32768.0, "unskipped": 0},
        "session1.loss_scaler0": {"loss_scale": 32768.0, "unskipped": 1},
    }
    two = amp.state_dict()

    del g, g_opt, d, d_opt
    _pair(0)
    before = amp.state_dict()
    with pytest.raises(ValueError, match=r"unexpected.*session1\.loss_scaler0"):
        amp.load_state_dict(two)
    assert amp.state_dict() == before


def test_a_call_whose_objects_are_gone_is_not_saved():
    g, g_opt = _pair(0)
    del g, g_opt
    gc.collect()
    _pair(1)
    assert set(amp.state_dict()) == {"loss_scaler0"}
