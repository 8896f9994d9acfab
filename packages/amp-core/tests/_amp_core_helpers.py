"""Constants and small builders shared by the amp_core tests (not a test module)."""

from __future__ import annotations

import copy

import pytest
import torch


def tiny_mlp(seed: int = 0, din: int = 4, dhid: int = 8, dout: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(din, dhid), torch.nn.ReLU(), torch.nn.Linear(dhid, dout)
    )


def tiny_bn_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


def batch(seed: int, n: int = 8, din: int = 4, dout: int = 3, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, din, generator=g) * 0.5
    y = torch.randn(n, dout, generator=g) * 0.5
    return x.to(device), y.to(device)


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent float32 twin (deep copy taken before amp.initialize)."""
    return copy.deepcopy(model).float()


def params_as_float(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


def amp_log_records(caplog: pytest.LogCaptureFixture) -> list:
    return [r for r in caplog.records if r.name.startswith("amp_core")]


class MasterAdam(torch.optim.Adam):
    """``torch.optim.Adam`` that implements ``amp_core.FusedMasterWeightOptimizer``: it keeps
    float32 masters of the half params and steps them in ``amp_fused_master_step``, in plain
    PyTorch (the fused kernels are another package's)."""

    def amp_enable_fused_master_weights(self, fp32_sources):
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype in (torch.float16, torch.bfloat16):
                    source = fp32_sources.get(p, p)
                    self.masters[p] = source.detach().to(torch.float32, copy=True)
        return list(self.masters.items())

    def amp_disable_fused_master_weights(self) -> None:
        self.masters = {}

    @torch.no_grad()
    def amp_fused_master_step(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        work = []  # (group, param, the tensor stepped, its float32 gradient)
        for group in self.param_groups:
            for p in group["params"]:
                master = self.masters.get(p)
                if master is not None and master.grad is not None:
                    grad = master.grad.float()  # unscaled by amp already (inv_scale is 1)
                elif p.grad is not None:
                    grad = p.grad.float() * inv_scale
                else:
                    continue
                work.append((group, p, p if master is None else master, grad))
        if found_inf.item() != 0 or not all(torch.isfinite(g).all() for *_, g in work):
            found_inf.fill_(1.0)
            return
        for group, p, target, grad in work:
            assert group["weight_decay"] == 0 and not group["amsgrad"]
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(target)
                state["exp_avg_sq"] = torch.zeros_like(target)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            correction1 = 1 - beta1 ** state["step"]
            correction2 = 1 - beta2 ** state["step"]
            denom = (state["exp_avg_sq"].sqrt() / correction2**0.5).add_(group["eps"])
            target.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / correction1)
            if target is not p:
                p.copy_(target)
