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
