"""FusedMixedPrecisionLamb: FusedLAMB's math on float32 masters, device lr/step, GradScaler.

The oracle is FusedLAMB stepping float32 params (itself tested against the reference op): the
masters of a half model must follow it exactly when both see the same gradients, and the half
params must be the masters rounded to their dtype.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import Tensor

from amp_optimizers import FusedLAMB, FusedMixedPrecisionLamb

HALF_TOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}  # rtol per dtype: torch.testing's defaults


def _params(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33, 7), (7,), (5, 3, 2)]
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype))
        for s in shapes
    ]


def _grads(params: list[Tensor], step: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype) for p in params]


def _clone_params(params: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    return [torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True)) for p in params]


# -- float32 params: exactly FusedLAMB ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_grad_norm": 0.5},  # clipping active
        {"weight_decay": 0.0, "use_nvlamb": True},
        {"adam_w_mode": False, "grad_averaging": False, "bias_correction": False},
        {"weight_decay": 0.0},  # no trust ratio
    ],
)
def test_fp32_params_step_like_fused_lamb(kwargs: dict) -> None:
    expected = _params(torch.float32)
    actual = _clone_params(expected)
    ref = FusedLAMB(
        [{"params": expected[:2]}, {"params": expected[2:], "lr": 3e-2}], lr=1e-2, **kwargs
    )
    opt = FusedMixedPrecisionLamb(
        [{"params": actual[:2]}, {"params": actual[2:], "lr": 3e-2}], lr=1e-2, **kwargs
    )
    for step in range(4):
        for p, q, g in zip(expected, actual, _grads(expected, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    # The op of this optimizer (Apex's multi_tensor_lamb_mp) takes the step count as a device
    # tensor and computes the bias corrections in float32, as Apex's kernel does: 1 - 0.999**1
    # is then 1.3e-5 relative off the value FusedLAMB's op uses. Where no trust ratio
    # normalises the update, that is the update's relative error.
    no_ratio = kwargs.get("weight_decay") == 0.0 and not kwargs.get("use_nvlamb")
    rtol = 2e-5 if no_ratio else 0.0
    for p, q in zip(expected, actual, strict=True):
        torch.testing.assert_close(q, p, rtol=rtol, atol=1e-6)
        torch.testing.assert_close(
            opt.state[q]["exp_avg"], ref.state[p]["exp_avg"], rtol=0, atol=1e-6
        )
    assert all("master_param" not in opt.state[q] for q in actual)
    assert [int(g["step"]) for g in opt.param_groups] == [4, 4]


# -- half params: float32 masters ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_params_follow_a_float32_master_reference(dtype: torch.dtype) -> None:
    half = _params(dtype)
    reference = _clone_params(half, torch.float32)  # the masters start as the half values
    ref = FusedLAMB(reference, lr=1e-2, max_grad_norm=2.0)
    opt = FusedMixedPrecisionLamb(half, lr=1e-2, max_grad_norm=2.0, reduced_precision_dtype=dtype)
    for step in range(5):
        for h, r, g in zip(half, reference, _grads(half, step), strict=True):
            h.grad, r.grad = g, g.float()
        ref.step()
        opt.step()
    for h, r in zip(half, reference, strict=True):
        master = opt.state[h]["master_param"]
        assert master.dtype == torch.float32 and h.dtype == dtype
        torch.testing.assert_close(master, r, rtol=0, atol=1e-6)
        # The half param is its master rounded: within one rounding of the reference.
        torch.testing.assert_close(h.float(), r, rtol=HALF_TOL[dtype], atol=0)
        assert torch.equal(h, master.to(dtype))
        assert opt.state[h]["exp_avg"].dtype == torch.float32


def test_masters_keep_updates_smaller_than_a_bfloat16_ulp() -> None:
    # Every step moves a weight of ~1 by ~lr = 1e-4, far below bf16's half-ulp (~2e-3 near 1):
    # stepped in place the weights never move; stepped through masters they drift by ~50 * lr.
    start = torch.ones(64, dtype=torch.bfloat16)
    with_masters = torch.nn.Parameter(start.clone())
    in_place = torch.nn.Parameter(start.clone())
    kwargs = {"lr": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1e3}  # ratio 1, no clip
    opt_m = FusedMixedPrecisionLamb(
        [with_masters], reduced_precision_dtype=torch.bfloat16, **kwargs
    )
    opt_p = FusedMixedPrecisionLamb([in_place], **kwargs)
    for _ in range(50):
        with_masters.grad = torch.ones_like(start)
        in_place.grad = torch.ones_like(start)
        opt_m.step()
        opt_p.step()
    assert torch.equal(in_place, start)
    assert (with_masters.float() < 1.0 - 2e-3).all()
    torch.testing.assert_close(
        opt_m.state[with_masters]["master_param"],
        torch.full((64,), 1.0 - 50 * 1e-4),
        rtol=0,
        atol=1e-5,
    )


def test_only_params_of_the_reduced_dtype_get_masters() -> None:
    fp32 = torch.nn.Parameter(torch.randn(8))
    bf16 = torch.nn.Parameter(torch.randn(8).bfloat16())
    fp16 = torch.nn.Parameter(torch.randn(8).half())
    opt = FusedMixedPrecisionLamb([fp32, bf16, fp16], reduced_precision_dtype=torch.bfloat16)
    for p in (fp32, bf16, fp16):
        p.grad = torch.randn_like(p)
    opt.step()
    assert "master_param" in opt.state[bf16]
    assert "master_param" not in opt.state[fp32]
    assert "master_param" not in opt.state[fp16]


# -- lr and step on the device ---------------------------------------------------------------------


def test_lr_and_step_are_tensors_of_each_group() -> None:
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = FusedMixedPrecisionLamb([{"params": [a], "lr": 0.1}, {"params": [b]}], lr=1e-3, step=7)
    lr0, lr1 = opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]
    assert isinstance(lr0, Tensor) and lr0.dtype == torch.float32 and lr0.dim() == 0
    assert lr0.item() == pytest.approx(0.1) and lr1.item() == pytest.approx(1e-3)
    steps = [g["step"] for g in opt.param_groups]
    assert steps[0] is not steps[1]  # one tensor per group, not the shared default
    assert all(s.dtype == torch.int32 and s.tolist() == [7] for s in steps)
    a.grad = torch.ones(4)
    opt.step()
    assert steps[0].tolist() == [8]  # advanced in place
    assert steps[1].tolist() == [7]  # no gradient in this group: not stepped
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": 0.2})
    added = opt.param_groups[2]
    assert isinstance(added["lr"], Tensor) and added["lr"].item() == pytest.approx(0.2)
    assert added["step"].tolist() == [7] and added["step"] is not steps[1]


def test_an_lr_scheduler_changes_the_lr_tensor_in_place() -> None:
    p = torch.nn.Parameter(torch.randn(16))
    opt = FusedMixedPrecisionLamb([p], lr=0.1)
    lr = opt.param_groups[0]["lr"]
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0)  # sets lr = 0.1 * 0 at once
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.0
    before = p.detach().clone()
    p.grad = torch.randn(16)
    opt.step()
    assert torch.equal(p, before)  # lr 0: moments move, the param does not
    assert opt.state[p]["exp_avg"].abs().sum() > 0


# -- GradScaler ----------------------------------------------------------------------------------


def _tiny_model(dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    return model.to(device=device, dtype=dtype)


def _loss(model: torch.nn.Module, step: int, dtype: torch.dtype, device: str = "cpu") -> Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=gen).to(device=device, dtype=dtype)
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3])  # clipping on / off
@pytest.mark.parametrize(
    ("dtype", "init_scale"),
    [
        (torch.float16, 2.0**10),  # unscaled by the op's gradient divisor
        (torch.bfloat16, 0.25),  # below 1: unscaled into float32 copies (bf16 does not underflow)
    ],
)
def test_grad_scaler_steps_like_unscaled_gradients(
    max_grad_norm: float, dtype: torch.dtype, init_scale: float
) -> None:
    scaled_model, plain_model = _tiny_model(dtype), _tiny_model(dtype)
    # LAMB is nearly blind to the size of the gradients; eps and L2 weight decay are not, so
    # they make a step on wrongly unscaled gradients differ.
    kwargs = {
        "lr": 1e-2,
        "eps": 1e-3,
        "weight_decay": 0.1,
        "adam_w_mode": False,
        "max_grad_norm": max_grad_norm,
        "reduced_precision_dtype": dtype,
    }
    scaled_opt = FusedMixedPrecisionLamb(scaled_model.parameters(), **kwargs)
    plain_opt = FusedMixedPrecisionLamb(plain_model.parameters(), **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    for step in range(4):
        scaled_opt.zero_grad()
        plain_opt.zero_grad()
        scaler.scale(_loss(scaled_model, step, dtype)).backward()
        _loss(plain_model, step, dtype).backward()
        scaler.step(scaled_opt)
        scaler.update()
        plain_opt.step()
    assert scaler.get_scale() == init_scale  # no overflow: every step was taken
    for s, p in zip(scaled_model.parameters(), plain_model.parameters(), strict=True):
        # Power-of-two scales: the scaled grads are exact multiples of the plain ones.
        torch.testing.assert_close(
            scaled_opt.state[s]["master_param"],
            plain_opt.state[p]["master_param"],
            rtol=0,
            atol=1e-6,
        )
        # After the step .grad holds the unscaled gradient, as torch's GradScaler leaves it.
        torch.testing.assert_close(s.grad, p.grad, rtol=0, atol=1e-6)


def _snapshot(opt: FusedMixedPrecisionLamb, params: list[Tensor]) -> list[Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for v in opt.state[p].values()]
    return out + [g["step"].clone() for g in opt.param_groups]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_grad_scaler_inf_skips_the_step_and_backs_off(bad: float) -> None:
    dtype = torch.bfloat16
    model = _tiny_model(dtype)
    params = list(model.parameters())
    opt = FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=dtype)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(2):
        opt.zero_grad()
        scaler.scale(_loss(model, step, dtype)).backward()
        scaler.step(opt)
        scaler.update()
    before = _snapshot(opt, params)
    opt.zero_grad()
    scaler.scale(_loss(model, 2, dtype)).backward()
    params[0].grad[0, 0] = bad
    scaler.step(opt)
    scaler.update()
    after = _snapshot(opt, params)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert int(opt.param_groups[0]["step"]) == 2
    assert scaler.get_scale() == 128.0


def test_the_scalers_found_inf_alone_skips_the_step() -> None:
    # GradScaler's protocol: it sets these two attributes around optimizer.step().
    p = torch.nn.Parameter(torch.randn(10).bfloat16())
    opt = FusedMixedPrecisionLamb([p], reduced_precision_dtype=torch.bfloat16)
    p.grad = torch.randn(10).bfloat16()
    opt.step()
    before = _snapshot(opt, [p])
    p.grad = torch.randn(10).bfloat16()  # finite
    opt.grad_scale = torch.tensor(1.0)
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(opt, [p]), strict=True))
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert int(opt.param_groups[0]["step"]) == 2


def test_inf_gradient_without_a_scaler_skips_the_step() -> None:
    p = torch.nn.Parameter(torch.randn(10).half())
    opt = FusedMixedPrecisionLamb([p], reduced_precision_dtype=torch.float16)
    p.grad = torch.randn(10).half()
    opt.step()
    before = _snapshot(opt, [p])
    p.grad = torch.randn(10).half()
    p.grad[3] = float("inf")
    opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(opt, [p]), strict=True))


# -- checkpoints -------------------------------------------------------------------------------


def _train(
    model: torch.nn.Module,
    opt: FusedMixedPrecisionLamb,
    scaler: torch.amp.GradScaler,
    steps: range,
    dtype: torch.dtype,
) -> None:
    for step in steps:
        opt.zero_grad()
        scaler.scale(_loss(model, step, dtype)).backward()
        scaler.step(opt)
        scaler.update()


def _roundtrip(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_state_dict_resume_is_bitwise(dtype: torch.dtype) -> None:
    def build() -> tuple[torch.nn.Module, FusedMixedPrecisionLamb, torch.amp.GradScaler]:
        model = _tiny_model(dtype)
        opt = FusedMixedPrecisionLamb(model.parameters(), lr=5e-3, reduced_precision_dtype=dtype)
        return model, opt, torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)

    model, opt, scaler = build()
    _train(model, opt, scaler, range(3), dtype)
    saved = _roundtrip(
        {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    )
    _train(model, opt, scaler, range(3, 6), dtype)

    resumed_model, resumed_opt, resumed_scaler = build()
    with torch.no_grad():  # a different starting point, so that the load must restore it
        for p in resumed_model.parameters():
            p.add_(1.0)
    resumed_model.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    resumed_scaler.load_state_dict(saved["scaler"])
    assert all(
        resumed_opt.state[p]["master_param"].dtype == torch.float32
        for p in resumed_model.parameters()
    )
    _train(resumed_model, resumed_opt, resumed_scaler, range(3, 6), dtype)

    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], resumed_opt.state[q][key])
    for g, h in zip(opt.param_groups, resumed_opt.param_groups, strict=True):
        assert torch.equal(g["step"], h["step"]) and torch.equal(g["lr"], h["lr"])
        assert isinstance(h["lr"], Tensor) and h["step"].dtype == torch.int32


def test_load_state_dict_copies_the_groups_tensors() -> None:
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedMixedPrecisionLamb([p], lr=0.5)
    state = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(state)
    opt.param_groups[0]["lr"].fill_(0.0)
    assert state["param_groups"][0]["lr"].item() == 0.5


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"amsgrad": True}, RuntimeError, "does not support the AMSGrad variant"),
        ({"reduced_precision_dtype": torch.float32}, ValueError, "reduced_precision_dtype must be"),
        ({"step": -1}, ValueError, "invalid step -1"),
        ({"lr": -1.0}, ValueError, "invalid learning rate -1.0"),
        ({"betas": (0.9, 1.0)}, ValueError, "invalid beta parameter at index 1"),
        ({"max_grad_norm": -1.0}, ValueError, "invalid max_grad_norm -1.0"),
    ],
)
def test_invalid_arguments_raise(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        FusedMixedPrecisionLamb([torch.nn.Parameter(torch.randn(2))], **kwargs)


def test_sparse_gradient_raises() -> None:
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        FusedMixedPrecisionLamb([p]).step()


# -- CUDA ------------------------------------------------------------------------------------------


def _linear_loss(params: list[Tensor], step: int, device: str) -> Tensor:
    """A loss whose gradients are fixed numbers, so they are identical on every device."""
    gen = torch.Generator().manual_seed(step)
    terms = [(p.float() * torch.randn(p.shape, generator=gen).to(device)).sum() for p in params]
    return torch.stack(terms).sum()


def _run_on(device: str, dtype: torch.dtype, inject_inf_at: int | None) -> tuple[list[Tensor], int]:
    """Masters (on the CPU) and the step count after 4 steps on ``device``.

    float16 trains under GradScaler; bfloat16 without a loss scale, as it is used (PyTorch's
    CUDA unscale kernel, which GradScaler calls, takes no bfloat16): an inf gradient then skips
    the step through the optimizer's own non-finite norm check.
    """
    params = _params(dtype, device)
    opt = FusedMixedPrecisionLamb(params, lr=1e-2, max_grad_norm=5.0, reduced_precision_dtype=dtype)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0) if dtype == torch.float16 else None
    for step in range(4):
        opt.zero_grad()
        loss = _linear_loss(params, step, device)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if step == inject_inf_at:
            params[0].grad.view(-1)[0] = float("inf")
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return [opt.state[p]["master_param"].cpu() for p in params], int(opt.param_groups[0]["step"])


@pytest.mark.gpu
@pytest.mark.parametrize("inject_inf_at", [None, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_matches_cpu(dtype: torch.dtype, inject_inf_at: int | None) -> None:
    # The same gradients on both devices: the kernels differ only in the order of float32
    # operations (reductions for the norms), far below the dtype's rounding.
    cpu, cpu_steps = _run_on("cpu", dtype, inject_inf_at)
    cuda, cuda_steps = _run_on("cuda", dtype, inject_inf_at)
    assert cuda_steps == cpu_steps == (4 if inject_inf_at is None else 3)
    for a, b in zip(cpu, cuda, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
