"""FusedAdam / FusedSGD with ``bf16_stochastic_round=True``: pure bfloat16 training.

Checked against a float32 PyTorch computation of the same steps (an update far below half the
bfloat16 spacing is lost by round-to-nearest and kept on average by stochastic rounding),
resumed from a checkpoint bit for bit, and refused with a clear error where it cannot apply.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from amp_optimizers import FusedAdam, FusedSGD

BF16 = torch.bfloat16
Factory = Callable[..., torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "FusedAdam": lambda params, **kw: FusedAdam(params, lr=1e-3, weight_decay=0.01, **kw),
    "FusedSGD": lambda params, **kw: FusedSGD(params, lr=0.05, momentum=0.9, **kw),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5)).to(
        BF16
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 13, generator=g).to(BF16)
        y = torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()


@pytest.mark.parametrize("seed", [11, None], ids=["seeded", "default_seed"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_from_checkpoint_continues_bitwise(name: str, seed: int | None) -> None:
    make = OPTIMIZERS[name]
    model = _model()
    opt = make(model.parameters(), bf16_stochastic_round=True, stochastic_round_seed=seed)
    _train(model, opt, range(0, 4))
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, range(4, 9))

    resumed = _model()
    resumed.load_state_dict(saved_model)
    # Another seed at construction (given, or drawn from another global seed): the
    # checkpoint's seed must win.
    torch.manual_seed(999)
    opt2 = make(resumed.parameters(), bf16_stochastic_round=True,
                stochastic_round_seed=None if seed is None else 999)  # fmt: skip
    assert (
        opt2.param_groups[0]["stochastic_round_seed"]
        != opt.param_groups[0]["stochastic_round_seed"]
    )
    opt2.load_state_dict(saved_opt)
    _train(resumed, opt2, range(4, 9))
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))

    # The seed matters: the same run with another seed ends elsewhere.
    other = _model()
    opt3 = make(other.parameters(), bf16_stochastic_round=True, stochastic_round_seed=12)
    _train(other, opt3, range(0, 9))
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_same_seed_same_result(name: str) -> None:
    runs = []
    for _ in range(2):
        model = _model()
        opt = OPTIMIZERS[name](model.parameters(), bf16_stochastic_round=True,
                               stochastic_round_seed=5)  # fmt: skip
        _train(model, opt, range(3))
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_small_updates_survive_on_average(name: str) -> None:
    """Steps of 1/20 of the bfloat16 spacing: lost to round-to-nearest, kept on average by
    stochastic rounding (compared with the same steps in float32 PyTorch)."""
    n, steps = 1 << 14, 40
    ulp = 2.0**-7  # bfloat16 spacing in [1, 2)
    results = {}
    for rounding in (False, True):
        p = torch.nn.Parameter(torch.full((n,), 1.5, dtype=BF16))
        if name == "FusedSGD":
            opt: torch.optim.Optimizer = FusedSGD([p], lr=ulp / 20, bf16_stochastic_round=rounding,
                                                  stochastic_round_seed=3)  # fmt: skip
        else:
            opt = FusedAdam([p], lr=ulp / 20, bf16_stochastic_round=rounding,
                            stochastic_round_seed=3)  # fmt: skip
        for _ in range(steps):
            p.grad = torch.ones(n, dtype=BF16)
            opt.step()
        results[rounding] = p.detach().double().mean().item()
    # float32 reference: SGD moves by lr * g each step; Adam with a constant gradient too
    # (m_hat / sqrt(v_hat) = 1, up to eps).
    want = 1.5 - steps * ulp / 20
    assert results[False] == 1.5  # every step rounded back to 1.5
    # Each step's rounding adds noise of at most ulp / 2 standard deviation: the mean of 2**14
    # elements after 40 steps is within 0.025 ulp per standard error; 0.2 ulp is 8 of them,
    # against round-to-nearest's 2 ulps.
    assert abs(results[True] - want) < 0.2 * ulp


def test_mixed_groups_round_only_where_asked() -> None:
    n = 1 << 12
    bf = torch.nn.Parameter(torch.full((n,), 1.5, dtype=BF16))
    fp = torch.nn.Parameter(torch.full((n,), 1.5))
    lr = 2.0**-9  # a quarter of the bfloat16 spacing at 1.5
    opt = FusedSGD([{"params": [bf], "bf16_stochastic_round": True}, {"params": [fp]}], lr=lr)
    bf.grad, fp.grad = torch.ones(n, dtype=BF16), torch.ones(n)
    opt.step()
    torch.testing.assert_close(fp, torch.full((n,), 1.5 - lr), rtol=0, atol=0)
    # About a quarter of the bfloat16 params moved one spacing down (nearest would move none).
    moved = (bf.detach() < 1.5).float().mean().item()
    assert 0.2 < moved < 0.3
    assert opt.param_groups[1]["bf16_stochastic_round"] is False


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_non_bfloat16_params_are_refused(name: str) -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, dtype=BF16))]
    with pytest.raises(
        ValueError,
        match=rf"{name}: bf16_stochastic_round=True needs bfloat16 params, got \['torch.float32'\]"
        r"; convert the model with model.to\(torch.bfloat16\)",
    ):
        OPTIMIZERS[name](params, bf16_stochastic_round=True)
    opt = OPTIMIZERS[name]([params[1]], bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="needs bfloat16 params"):
        opt.add_param_group({"params": [params[0]]})


def test_master_weights_and_capturable_are_refused() -> None:
    p = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    with pytest.raises(ValueError, match="cannot be combined with float32 master weights"):
        FusedAdam([p], master_weights=True, bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="not supported with capturable=True"):
        FusedAdam([p], capturable=True, bf16_stochastic_round=True)
    opt = FusedAdam([p], bf16_stochastic_round=True)
    with pytest.raises(ValueError, match=r"master weights \(master_weights=True or amp O2\)"):
        opt.amp_enable_fused_master_weights({})


def test_seed_type_is_checked() -> None:
    p = torch.nn.Parameter(torch.ones(3, dtype=BF16))
    with pytest.raises(TypeError, match="stochastic_round_seed must be an int or None, got float"):
        FusedAdam([p], bf16_stochastic_round=True, stochastic_round_seed=1.5)  # type: ignore[arg-type]


def test_default_seed_follows_torch_manual_seed() -> None:
    seeds: list[Any] = []
    for _ in range(2):
        torch.manual_seed(123)
        p = torch.nn.Parameter(torch.ones(3, dtype=BF16))
        seeds.append(FusedSGD([p], lr=0.1, bf16_stochastic_round=True).state_dict())
    assert (
        seeds[0]["param_groups"][0]["stochastic_round_seed"]
        == (seeds[1]["param_groups"][0]["stochastic_round_seed"])
    )


def _fake_world(monkeypatch: pytest.MonkeyPatch, broadcast: Callable[..., Any]) -> None:
    """torch.distributed as two initialized ranks whose broadcast is ``broadcast``."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "broadcast", broadcast)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_first_step_takes_rank_0s_default_seed(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.distributed the drawn default seed is replaced by rank 0's at the first
    step, once; a group's own seed is kept."""
    calls = []

    def broadcast(tensor: torch.Tensor, src: int) -> None:
        calls.append(src)
        tensor.fill_(42)  # rank 0's seed

    _fake_world(monkeypatch, broadcast)
    model = _model()
    params = list(model.parameters())
    opt = OPTIMIZERS[name]([{"params": params[:2]}, {"params": params[2:],
                            "stochastic_round_seed": 7}], bf16_stochastic_round=True)  # fmt: skip
    drawn = opt.param_groups[0]["stochastic_round_seed"]
    assert drawn != 42
    _train(model, opt, range(2))
    assert calls == [0]
    assert [g["stochastic_round_seed"] for g in opt.param_groups] == [42, 7]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_default_seed_that_cannot_be_agreed_is_refused(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broadcast(tensor: torch.Tensor, src: int) -> None:
        raise RuntimeError("no backend for cpu tensors")

    _fake_world(monkeypatch, broadcast)
    model = _model()
    opt = OPTIMIZERS[name](model.parameters(), bf16_stochastic_round=True)
    with pytest.raises(
        RuntimeError,
        match=rf"{name}: bf16_stochastic_round=True without a stochastic_round_seed .*\(no backend "
        r"for cpu tensors\)\. Pass the same stochastic_round_seed=<int> on every rank",
    ):
        _train(model, opt, range(1))
    # A seed given needs no agreement.
    opt = OPTIMIZERS[name](model.parameters(), bf16_stochastic_round=True, stochastic_round_seed=3)
    _train(model, opt, range(1))
