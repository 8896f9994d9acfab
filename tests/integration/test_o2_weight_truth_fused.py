"""One truth per weight on the fused master-weight path (amp O2 + amp_optimizers.FusedAdam),
as on the ordinary path: in-place edits of the model are kept and exported, tied names export
the master, and after amp.close() the same objects train in plain PyTorch or under a new
amp.initialize. The reference is a float32 model stepped by a plain FusedAdam."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import HALF_DTYPES
from torch import nn

from amp_core import amp
from amp_optimizers import FusedAdam

LEVELS = ["O0", "O1", "O2", "O3"]
TOL = {
    torch.float16: dict(rtol=1e-2, atol=5e-3),
    torch.bfloat16: dict(rtol=6e-2, atol=4e-2),
}


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g) * 0.5, torch.randn(8, 3, generator=g) * 0.5


def _twin(model: nn.Module, opt_level: str, half: torch.dtype) -> nn.Module:
    twin = copy.deepcopy(model).float()
    return twin.to(half) if opt_level == "O3" else twin


def _adam(model: nn.Module) -> FusedAdam:
    return FusedAdam(model.parameters(), lr=0.05, eps=1e-3)


def _amp_step(model: nn.Module, opt: FusedAdam, seed: int) -> None:
    x, y = _batch(seed)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()


def _plain_step(model: nn.Module, opt: FusedAdam, seed: int) -> None:
    x, y = _batch(seed)
    opt.zero_grad()
    F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
    opt.step()


def _tol(opt_level: str, half: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-5, atol=1e-6) if opt_level == "O0" else TOL[half]


def _assert_close_states(got: dict, expected: dict, opt_level: str, half: torch.dtype) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            got[key].float(), expected[key].float(), **_tol(opt_level, half), msg=key
        )


@pytest.mark.parametrize("kind", ["zeros_", "row"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_fused_adam_keeps_an_in_place_edit(opt_level: str, half: torch.dtype, kind: str) -> None:
    model = _mlp()
    reference = _twin(model, opt_level, half)
    ref_opt = _adam(reference)
    model, opt = amp.initialize(
        model, _adam(model), opt_level=opt_level, half_dtype=half, verbosity=0
    )
    for seed in range(2):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for m in (model, reference):
        with torch.no_grad():
            if kind == "zeros_":
                nn.init.zeros_(m[2].weight)
            else:
                m[2].weight[0].fill_(0.5)
    exported = model.state_dict()
    torch.testing.assert_close(
        exported["2.weight"], reference[2].weight.detach().float(), **_tol(opt_level, half)
    )
    if kind == "row":  # the other rows keep their full-precision values
        assert torch.equal(exported["2.weight"][1:], before["2.weight"][1:])
    for seed in range(2, 4):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    _assert_close_states(model.state_dict(), reference.state_dict(), opt_level, half)


@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("opt_level", LEVELS)
def test_fused_adam_trains_in_plain_pytorch_after_close(opt_level: str, half: torch.dtype) -> None:
    model = _mlp()
    reference = _twin(model, opt_level, half)
    ref_opt = _adam(reference)
    model, opt = amp.initialize(
        model, _adam(model), opt_level=opt_level, half_dtype=half, verbosity=0
    )
    for seed in range(2):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    truth = {k: v.clone() for k, v in model.state_dict().items()}
    amp.close()
    reference.float()  # close() widens an O3 model (FusedAdam's state is float32 already)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert torch.equal(p.detach(), truth[name]), name
    for seed in range(2, 5):
        _plain_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    _assert_close_states(model.state_dict(), reference.state_dict(), opt_level, half)


@pytest.mark.parametrize("second", LEVELS)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_fused_adam_after_close_and_a_new_initialize(half: torch.dtype, second: str) -> None:
    model = _mlp()
    reference = _twin(model, "O2", half)
    ref_opt = _adam(reference)
    model, opt = amp.initialize(model, _adam(model), opt_level="O2", half_dtype=half, verbosity=0)
    for seed in range(2):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    amp.close()
    model, opt = amp.initialize(model, opt, opt_level=second, half_dtype=half, verbosity=0)
    for seed in range(2, 5):
        _amp_step(model, opt, seed)
        _plain_step(reference, ref_opt, seed)
    _assert_close_states(model.state_dict(), reference.state_dict(), "O2", half)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_fused_adam_tied_weight_exports_its_master_under_both_names(half: torch.dtype) -> None:
    model = _Tied()
    reference = copy.deepcopy(model)
    reference.head.weight = reference.emb.weight
    ref_opt = _adam(reference)
    model, opt = amp.initialize(model, _adam(model), opt_level="O2", half_dtype=half, verbosity=0)
    for seed in range(3):
        x, y = _batch(seed)
        y = torch.cat([y, y[:, :1]], dim=1)
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
    exported = model.state_dict()
    (master,) = [m for m in amp.master_params(opt)]
    assert exported["emb.weight"].dtype == torch.float32
    assert torch.equal(exported["emb.weight"], master.detach())
    assert torch.equal(exported["head.weight"], master.detach())
    _assert_close_states(exported, reference.state_dict(), "O2", half)


def _reset_state(opt: FusedAdam, param: torch.Tensor, how: str) -> None:
    if how == "del":
        del opt.state[param]
    elif how == "assign":
        opt.state[param] = {}
    else:
        opt.state[param].clear()


@pytest.mark.parametrize("how", ["del", "assign", "clear"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_fused_adam_state_reset_keeps_the_master_amp_exports(half: torch.dtype, how: str) -> None:
    """A param's optimizer state reset by hand (torch.optim re-creates it: zero moments) keeps
    its master, which is the weight itself: the optimizer goes on stepping the master that amp
    exports, and the model stays its rounded copy."""
    model = _mlp()
    model, opt = amp.initialize(model, _adam(model), opt_level="O2", half_dtype=half, verbosity=0)
    for seed in range(2):
        _amp_step(model, opt, seed)
    weight = model[0].weight
    master = opt.state[weight]["master_param"]
    masters = [id(m) for m in amp.master_params(opt)]
    assert id(master) in masters
    _reset_state(opt, weight, how)
    for seed in range(2, 5):
        _amp_step(model, opt, seed)
    exported = model.state_dict()
    for name, p in model.named_parameters():
        assert exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name].to(p.dtype), p.detach()), name
    assert opt.state[weight]["master_param"] is master  # the one amp holds and exports
    assert [id(m) for m in amp.master_params(opt)] == masters
    assert torch.equal(exported["0.weight"], master.detach())
