"""One truth per weight: every way of touching a weight agrees with the weight amp steps.

Deep copies (EMA, SWA), pickling, tied weights, in-place edits after ``amp.initialize``, and
``amp.close()`` followed by plain training or a new ``amp.initialize``; each compared with a
plain float32 PyTorch model trained on the same data.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import CHAIN_TOL, HALF_DTYPES
from torch import nn
from torch.optim.swa_utils import AveragedModel

from _amp_core_helpers import batch, fp32_copy, tiny_mlp
from amp_core import amp

LEVELS = ["O0", "O1", "O2", "O3"]
# Adam with an eps that float16 can hold (O3 steps the half weights with half state).
OPTIMIZERS = [
    pytest.param(torch.optim.SGD, id="SGD"),
    pytest.param(functools.partial(torch.optim.Adam, eps=1e-3), id="Adam"),
]


def _init(model, opt_level, half, opt_cls=torch.optim.SGD, **opt_kw):
    opt = opt_cls(model.parameters(), lr=0.1, **opt_kw)
    return amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0)


def _amp_step(model, opt, seed):
    x, y = batch(seed)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()


def _plain_step(model, opt, seed):
    x, y = batch(seed)
    opt.zero_grad()
    dtype = next(model.parameters()).dtype
    F.mse_loss(model(x.to(dtype)).float(), y).backward()
    opt.step()


def _reference(model, opt_level, half):
    """The plain PyTorch twin of an amp run: float32, or all-half for O3 (which trains the
    half weights themselves, with the optimizer's state in half)."""
    twin = fp32_copy(model)
    return twin.to(half) if opt_level == "O3" else twin


def _cast_plain(model, opt, dtype):
    """Cast a plain model and its optimizer's floating state but ``step`` (as
    ``Optimizer.load_state_dict`` casts state to its param's dtype)."""
    model.to(dtype)
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                state[key] = value.to(dtype)


def _tol(opt_level, half):
    return dict(rtol=1e-5, atol=1e-6) if opt_level == "O0" else CHAIN_TOL[half]


def _assert_close_state(got, expected, opt_level, half):
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            got[key].float(), expected[key].float(), **_tol(opt_level, half), msg=key
        )


def _own_weights(model):
    """The model's own tensors by state-dict name (no amp hook involved)."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                out[prefix + attr] = tensor.detach()
    return out


# ---------------------------------------------------------------- deep copies and pickling


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_a_deep_copy_exports_its_own_weights_as_they_change(opt_level, half):
    """An EMA updated through its parameters (AveragedModel, timm's V3): its state_dict()
    follows its own weights, not the weights of the moment of the copy."""
    model, opt = _init(tiny_mlp(), opt_level, half)
    _amp_step(model, opt, 0)
    ema = copy.deepcopy(model)
    for seed in range(1, 4):
        _amp_step(model, opt, seed)
        with torch.no_grad():
            for p_ema, p_model in zip(ema.parameters(), model.parameters(), strict=True):
                p_ema.lerp_(p_model, 0.5)
    own = _own_weights(ema)
    exported = ema.state_dict()
    assert exported.keys() == own.keys()
    for key, value in own.items():
        assert torch.equal(exported[key].float(), value.float()), key
    # The original still exports its own truth (fp32: the masters under O2).
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32, key


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_timm_style_ema_through_state_dict_values_updates_the_copy(opt_level, half):
    """timm's ModelEmaV2 writes into ``ema.state_dict().values()`` in place: the copy's
    weights must change, and by exactly the computed update (rounded to the copy's dtype)."""
    model, opt = _init(tiny_mlp(), opt_level, half)
    _amp_step(model, opt, 0)
    ema = copy.deepcopy(model)
    decay = 0.5
    for seed in range(1, 4):
        _amp_step(model, opt, seed)
        before = {k: v.clone() for k, v in _own_weights(ema).items()}
        model_values = list(model.state_dict().values())
        with torch.no_grad():
            for ema_v, model_v in zip(ema.state_dict().values(), model_values, strict=True):
                ema_v.copy_(ema_v * decay + (1.0 - decay) * model_v)
        after = _own_weights(ema)
        for (key, old), model_v in zip(before.items(), model_values, strict=True):
            expected = (old.double() * decay + (1.0 - decay) * model_v.double()).float()
            torch.testing.assert_close(
                after[key].float(), expected.to(old.dtype).float(), rtol=0, atol=0, msg=key
            )
        assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_averaged_model_checkpoint_is_the_average(opt_level, half):
    model, opt = _init(tiny_mlp(), opt_level, half)
    swa = AveragedModel(model)
    for seed in range(3):
        _amp_step(model, opt, seed)
        swa.update_parameters(model)
    exported = swa.state_dict()
    for name, p in swa.module.named_parameters():
        assert torch.equal(exported[f"module.{name}"].float(), p.detach().float()), name


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_torch_save_of_the_model_round_trips(opt_level, half):
    model, opt = _init(tiny_mlp(), opt_level, half)
    for seed in range(2):
        _amp_step(model, opt, seed)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x, _ = batch(7)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    own = _own_weights(loaded)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value.float(), own[key].float()), key
    # The loaded copy keeps no reference to the optimizer's masters.
    _amp_step(model, opt, 5)
    with torch.no_grad():
        for key, value in _own_weights(loaded).items():
            assert torch.equal(value, own[key])


# ---------------------------------------------------------------- tied weights


class _Tied(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Linear(4, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_tied_weights_export_one_fp32_value_under_every_name(opt_level, half):
    model = _Tied()
    reference = fp32_copy(model)
    reference.head.weight = reference.emb.weight
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, opt = _init(model, opt_level, half)
    for seed in range(3):
        x, y = batch(seed, dout=4)
        for m, o, scaled in ((model, opt, True), (reference, ref_opt, False)):
            o.zero_grad()
            loss = F.mse_loss(m(x).float(), y)
            if scaled:
                with amp.scale_loss(loss, o) as s:
                    s.backward()
            else:
                loss.backward()
            o.step()
    exported = model.state_dict()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "head.weight" in names and "emb.weight" in names
    assert exported["head.weight"].dtype == torch.float32
    assert torch.equal(exported["head.weight"], exported["emb.weight"])
    _assert_close_state(exported, reference.state_dict(), opt_level, half)
    # Loaded into a plain fp32 model, the shared weight is the one amp steps.
    plain = _Tied(seed=5)
    plain.load_state_dict(exported)
    stepped = dict(zip(model.parameters(), amp.master_params(opt), strict=True))
    truth = stepped.get(model.emb.weight, model.emb.weight).detach().float()
    assert torch.equal(plain.emb.weight.detach(), truth)
    assert torch.equal(plain.head.weight.detach(), truth)


# ---------------------------------------------------------------- in-place edits


def _edit(kind, weight):
    with torch.no_grad():
        if kind == "zeros_":
            nn.init.zeros_(weight)
        elif kind == "fill_":
            weight.fill_(0.25)
        elif kind == "copy_":
            weight.copy_(torch.linspace(-1, 1, weight.numel()).reshape(weight.shape))
        elif kind == "row":
            weight[0].fill_(0.5)
        # Through `.data`, whose version counter is not the param's (Apex-era idioms).
        elif kind == "data.fill_":
            weight.data.fill_(0.25)
        elif kind == "init(data)":
            nn.init.constant_(weight.data, -0.125)
        elif kind == "data.copy_":
            weight.data.copy_(torch.linspace(-1, 1, weight.numel()).reshape(weight.shape))
        elif kind == "data[0]":
            weight.data[0] = 0.5
        else:
            raise AssertionError(kind)


DATA_EDITS = ["data.fill_", "init(data)", "data.copy_", "data[0]"]


@pytest.mark.parametrize("kind", ["zeros_", "fill_", "copy_", "row", *DATA_EDITS])
@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_an_in_place_edit_after_initialize_is_kept_and_exported(opt_level, half, opt_cls, kind):
    model = tiny_mlp()
    reference = _reference(model, opt_level, half)
    ref_opt = opt_cls(reference.parameters(), lr=0.1)
    model, opt = _init(model, opt_level, half, opt_cls)
    for seed in range(2):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _edit(kind, model[2].weight)
    _edit(kind, reference[2].weight)
    # Seen by state_dict() at once: the edited elements take the edit, the others keep the
    # full-precision value they had.
    exported = model.state_dict()
    edited = reference[2].weight.detach()
    torch.testing.assert_close(exported["2.weight"], edited.float(), **_tol(opt_level, half))
    if kind in ("row", "data[0]"):
        assert torch.equal(exported["2.weight"][1:], before["2.weight"][1:])
        assert torch.equal(exported["2.weight"][0], edited[0].float())
    # Not reverted by the next step, which starts from the edited weight.
    for seed in range(2, 4):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    _assert_close_state(model.state_dict(), reference.state_dict(), opt_level, half)
    for got, ref in zip(amp.master_params(opt), reference.parameters(), strict=True):
        torch.testing.assert_close(
            got.detach().float(), ref.detach().float(), **_tol(opt_level, half)
        )


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_an_edit_that_keeps_the_half_value_keeps_the_master(half):
    """Writing the same half values back (a broadcast from rank 0) changes no master."""
    model, opt = _init(tiny_mlp(), "O2", half)
    for seed in range(2):
        _amp_step(model, opt, seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.clone())
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_widening_the_model_is_not_an_edit(half):
    """``model.float()`` replaces each param's data by its widened half value: the masters keep
    their full precision (only a changed value is an edit)."""
    model, opt = _init(tiny_mlp(), "O2", half)
    for seed in range(2):
        _amp_step(model, opt, seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.float()
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_replacing_a_param_data_with_another_shape_names_the_fix(half):
    model, _ = _init(tiny_mlp(), "O2", half)
    model[2].weight.data = torch.zeros(5, 8, dtype=half)  # a new layer's weight
    with pytest.raises(RuntimeError, match=r"shape \(5, 8\).*amp\.close\(\)"):
        model.state_dict()
    amp.close()  # the fix the message gives: the model keeps the new weight, in float32
    assert model[2].weight.dtype == torch.float32 and model[2].weight.shape == (5, 8)
    assert not model[2].weight.detach().any()


# ---------------------------------------------------------------- close


@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_after_close_plain_pytorch_training_goes_on(opt_level, half, opt_cls):
    model = tiny_mlp()
    reference = _reference(model, opt_level, half)
    ref_opt = opt_cls(reference.parameters(), lr=0.1)
    model, opt = _init(model, opt_level, half, opt_cls)
    for seed in range(2):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    truth = {k: v.clone() for k, v in model.state_dict().items()}
    amp.close()
    _cast_plain(reference, ref_opt, torch.float32)  # as close() widens an O3 model
    # Back in float32, holding the truth amp kept, and stepped by the optimizer.
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert torch.equal(p.detach(), truth[name]), name
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    for seed in range(2, 5):
        _plain_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    _assert_close_state(model.state_dict(), reference.state_dict(), opt_level, half)


@pytest.mark.parametrize("opt_cls", OPTIMIZERS)
@pytest.mark.parametrize("second", LEVELS)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("first", LEVELS)
def test_close_then_initialize_again_trains(first, half, second, opt_cls):
    model = tiny_mlp()
    reference = _reference(model, first, half)
    ref_opt = opt_cls(reference.parameters(), lr=0.1)
    model, opt = _init(model, first, half, opt_cls)
    for seed in range(2):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    amp.close()
    _cast_plain(reference, ref_opt, torch.float32)  # as close() widens an O3 model
    model, opt = amp.initialize(model, opt, opt_level=second, half_dtype=half, verbosity=0)
    if second == "O3":  # O3 trains the half weights, with the optimizer's state in half
        _cast_plain(reference, ref_opt, half)
    for seed in range(2, 5):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    worst = "O0" if first == second == "O0" else (first if first != "O0" else second)
    _assert_close_state(model.state_dict(), reference.state_dict(), worst, half)


def test_amp_state_dict_after_close_says_the_session_was_closed():
    model, opt = _init(tiny_mlp(), "O2", torch.bfloat16)
    _amp_step(model, opt, 0)
    amp.close()
    with pytest.raises(RuntimeError, match=r"after amp\.close\(\).*amp\.initialize again"):
        amp.state_dict()
