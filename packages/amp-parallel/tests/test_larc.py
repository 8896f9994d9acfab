"""LARC against a written-out reference of its update rule."""

from __future__ import annotations

import pytest
import torch

from amp_parallel import LARC


def reference_step(params, grads, lr, wd, momentum_bufs, eta, clip, eps, momentum=0.9):
    """LARC then SGD(momentum) with weight decay folded into the gradient, by hand."""
    out = []
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        p, g = p.clone(), g.clone()
        pn, gn = p.norm().item(), g.norm().item()
        if pn != 0 and gn != 0:
            local = eta * pn / (gn + pn * wd + eps)
            if clip:
                local = min(local / lr, 1.0)
            g = (g + wd * p) * local
        buf = g.clone() if momentum_bufs[i] is None else momentum_bufs[i] * momentum + g
        momentum_bufs[i] = buf
        out.append(p - lr * buf)
    return out


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("wd", [0.0, 5e-4])
def test_matches_reference(clip, wd):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.zeros(3))]
    opt = LARC(torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=wd), clip=clip)
    expected = [p.detach().clone() for p in params]
    bufs: list = [None, None]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        expected = reference_step(expected, grads, 0.1, wd, bufs, 0.02, clip, 1e-8)
        opt.step()
        for p, e in zip(params, expected, strict=True):
            torch.testing.assert_close(p.detach(), e)
    assert opt.param_groups[0]["weight_decay"] == wd  # restored after each step


def test_passthrough():
    p = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    opt = LARC(inner, trust_coefficient=0.1)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    p.grad = torch.ones(2)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    opt.zero_grad()
    assert p.grad is None
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    assert len(inner.param_groups) == 2
    assert "LARC(trust_coefficient=0.1" in repr(opt)


def test_wraps_only_optimizers():
    with pytest.raises(TypeError, match=r"wraps a torch\.optim\.Optimizer"):
        LARC(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------ with amp.initialize


class _Elementwise(torch.nn.Module):
    """Only elementwise fp32 math, which O1 leaves alone: amp changes nothing but the scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((self.w * x - 1.0) ** 2).mean()


@pytest.fixture
def amp():
    amp = pytest.importorskip("amp_core").amp
    yield amp
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_amp_initialize_accepts_larc_and_steps_like_it(amp, opt_level):
    x = torch.linspace(-1.0, 1.0, 6)
    plain_model = _Elementwise()
    plain = LARC(torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9))
    model = _Elementwise()
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, opt = amp.initialize(model, larc, opt_level=opt_level, loss_scale=1024.0, verbosity=0)
    assert opt is larc
    for _ in range(3):
        plain.zero_grad()
        plain_model(x).backward()
        plain.step()
        opt.zero_grad()
        with amp.scale_loss(model(x), opt) as scaled:
            scaled.backward()
        opt.step()
    # A power-of-two scale is exact: the same steps as LARC without amp.
    torch.testing.assert_close(model.w.detach(), plain_model.w.detach(), rtol=0, atol=0)


def test_amp_initialize_accepts_a_list_with_larc(amp):
    models = [_Elementwise(), _Elementwise()]
    opts = [
        LARC(torch.optim.SGD(models[0].parameters(), lr=0.1)),
        torch.optim.SGD(models[1].parameters(), lr=0.1),
    ]
    _, out = amp.initialize(models, opts, opt_level="O1", verbosity=0)
    assert out == opts


def test_amp_initialize_larc_overflow_skips_step(amp):
    model = _Elementwise()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    before = model.w.detach().clone()
    with amp.scale_loss(model(torch.full((6,), float("inf"))), opt) as scaled:
        scaled.backward()
    opt.step()
    torch.testing.assert_close(model.w.detach(), before, rtol=0, atol=0)
    assert amp.skipped_steps(opt) == 1
