"""Written-out pure-PyTorch references of Apex's optimizers, for the parity tests.

Each class restates, one tensor at a time and in the dtype of its params (float32 in the
tests), the algorithm of Apex's Python class and CUDA kernel:

* :class:`RefAdam`: ``apex/optimizers/fused_adam.py`` + ``csrc/multi_tensor_adam.cu`` (with
  ``bias_correction`` and both weight-decay modes; torch has no ``bias_correction=False``).
* :class:`RefSGD`: ``csrc/multi_tensor_sgd_kernel.cu`` (``wd_after_momentum``).
* :class:`RefAdagrad`: ``csrc/multi_tensor_adagrad.cu`` (``adagrad_w_mode``).
* :class:`RefLAMB`: ``apex/optimizers/fused_lamb.py`` + ``csrc/multi_tensor_lamb.cu``.
* :class:`RefNovoGrad`: ``apex/optimizers/fused_novograd.py`` +
  ``csrc/multi_tensor_novograd.cu``.

As in Apex, the step count of the Adam family lives in the param group and advances once per
``step()`` for every group that has a gradient. Hyperparameters use the same group keys as the
fused optimizers, so one ``second_group`` dict configures both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


def _grads(group: dict[str, Any]) -> list[Tensor]:
    return [p for p in group["params"] if p.grad is not None]


def _next_step(group: dict[str, Any]) -> int:
    group["step"] = group.get("step", 0) + 1
    return int(group["step"])


class RefAdam(torch.optim.Optimizer):
    """Apex's Adam / AdamW: ``update = (m / bc1) / (sqrt(v / bc2) + eps) [+ wd * p]``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            params = _grads(group)
            if not params:
                continue
            t = _next_step(group)
            beta1, beta2 = group["betas"]
            bc1 = 1.0 - beta1**t if group["bias_correction"] else 1.0
            bc2 = 1.0 - beta2**t if group["bias_correction"] else 1.0
            wd = group["weight_decay"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                assert p.grad is not None
                g = p.grad if self.adam_w_mode else p.grad + wd * p
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + wd * p
                p.sub_(group["lr"] * update)


class RefSGD(torch.optim.Optimizer):
    """Apex's SGD kernel, with the weight decay before or after the momentum update."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            wd, momentum = group["weight_decay"], group["momentum"]
            for p in _grads(group):
                assert p.grad is not None
                g = p.grad.clone()
                if not self.wd_after_momentum:
                    g += wd * p
                if momentum != 0.0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        buf = state["momentum_buffer"] = g.clone()
                    else:
                        buf = state["momentum_buffer"]
                        buf.mul_(momentum).add_(g, alpha=1.0 - group["dampening"])
                    g = g + momentum * buf if group["nesterov"] else buf.clone()
                if self.wd_after_momentum:
                    g += wd * p
                p.sub_(group["lr"] * g)


class RefAdagrad(torch.optim.Optimizer):
    """Apex's Adagrad kernel: L2 (mode 0) or decoupled (``adagrad_w_mode``) weight decay."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        adagrad_w_mode: bool = False,
    ) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))
        self.adagrad_w_mode = adagrad_w_mode

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in _grads(group):
                assert p.grad is not None
                state = self.state[p]
                if not state:
                    state["sum"] = torch.zeros_like(p)
                g = p.grad if self.adagrad_w_mode else p.grad + wd * p
                state["sum"].addcmul_(g, g)
                update = g / (state["sum"].sqrt() + group["eps"])
                if self.adagrad_w_mode:
                    update = update + wd * p
                p.sub_(group["lr"] * update)


class RefLAMB(torch.optim.Optimizer):
    """Apex's FusedLAMB: global gradient clipping, Adam(W) update, per-tensor trust ratio."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        all_grads = [p.grad for g in self.param_groups for p in _grads(g)]
        if not all_grads:
            return
        # One norm over every gradient of every group; the threshold is the constructor's.
        global_norm = torch.stack([g.float().norm() for g in all_grads if g is not None]).norm()
        max_norm = self.defaults["max_grad_norm"]
        clip = global_norm / max_norm if global_norm > max_norm else torch.ones_like(global_norm)
        for group in self.param_groups:
            params = _grads(group)
            if not params:
                continue
            t = _next_step(group)
            beta1, beta2 = group["betas"]
            bc1 = 1.0 - beta1**t if group["bias_correction"] else 1.0
            bc2 = 1.0 - beta2**t if group["bias_correction"] else 1.0
            beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
            wd = group["weight_decay"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                assert p.grad is not None
                g = p.grad / clip
                if not self.adam_w_mode:
                    g = g + wd * p
                m.mul_(beta1).add_(g, alpha=beta3)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + wd * p
                ratio = 1.0
                if self.use_nvlamb or wd != 0.0:
                    p_norm, u_norm = p.norm().item(), update.norm().item()
                    if p_norm != 0.0 and u_norm != 0.0:
                        ratio = p_norm / u_norm
                p.sub_(group["lr"] * ratio * update)


class RefNovoGrad(torch.optim.Optimizer):
    """Apex's FusedNovoGrad: a per-tensor blended gradient norm as the second moment."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            norm_type=norm_type,
            init_zero=init_zero,
        )
        super().__init__(params, defaults)
        self.reg_inside_moment = reg_inside_moment

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            params = _grads(group)
            if not params:
                continue
            t = _next_step(group)
            beta1, beta2 = group["betas"]
            bc1 = 1.0 - beta1**t if group["bias_correction"] else 1.0
            bc2 = math.sqrt(1.0 - beta2**t) if group["bias_correction"] else 1.0
            beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
            wd = group["weight_decay"]
            for p in params:
                assert p.grad is not None
                g = p.grad
                norm = g.norm() if group["norm_type"] == 2 else g.abs().max()
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    # A norm, not its square; before the first step: that step's norm (so the
                    # first blend keeps it) or zero.
                    state["exp_avg_sq"] = torch.zeros_like(norm) if group["init_zero"] else norm
                blended = state["exp_avg_sq"]
                if group["norm_type"] == 2:
                    blended = (beta2 * blended.square() + (1.0 - beta2) * norm.square()).sqrt()
                else:
                    blended = beta2 * blended + (1.0 - beta2) * norm
                state["exp_avg_sq"] = blended
                denom = blended / bc2 + group["eps"]
                m = state["exp_avg"]
                if self.reg_inside_moment:
                    m.mul_(beta1).add_(g / denom + wd * p, alpha=beta3)
                    p.sub_(group["lr"] * m / bc1)
                else:
                    m.mul_(beta1).add_(g, alpha=beta3)
                    p.sub_(group["lr"] * ((m / bc1) / denom + wd * p))
