"""FP16_Optimizer: flat float32 masters around FusedAdam, loss scaling, skipped overflow steps.

The oracle is FusedAdam stepping a float32 copy of the model: fed the same (unscaled) gradients
it must end where the flat masters end, and trained on the same data it must stay close.
The dynamic-scale expectations follow Apex's rule for this class (start 2**16, halve on
overflow but not below 1, double after ``scale_window`` clean steps).
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import Tensor

from amp_optimizers import FP16_Optimizer, FusedAdam, FusedSGD

HALF_DTYPES = [torch.float16, torch.bfloat16]
HALF_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}  # torch.testing's default rtol per dtype
LOGGER = "amp_optimizers._fp16_optimizer"


def _model(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return model.to(device=device, dtype=dtype)


def _batch(step: int, dtype: torch.dtype, device: str = "cpu") -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=gen)
    y = torch.stack([x[:, 0] - x[:, 1], x[:, 2] * 0.5], dim=1)
    return x.to(device=device, dtype=dtype), y.to(device)


def _loss(model: torch.nn.Module, step: int, dtype: torch.dtype, device: str = "cpu") -> Tensor:
    x, y = _batch(step, dtype, device)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _wrap(model: torch.nn.Module, lr: float = 1e-2, **kwargs: object) -> FP16_Optimizer:
    return FP16_Optimizer(FusedAdam(model.parameters(), lr=lr, weight_decay=0.01), **kwargs)


def _train(model: torch.nn.Module, opt: FP16_Optimizer, steps: range, dtype: torch.dtype) -> None:
    for step in steps:
        opt.zero_grad()
        opt.backward(_loss(model, step, dtype))
        opt.step()


# -- the math: FusedAdam on float32 masters ---------------------------------------------------


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("loss_scale", [{"dynamic_loss_scale": True}, {"static_loss_scale": 128.0}])
def test_masters_step_like_fused_adam_on_float32(dtype: torch.dtype, loss_scale: dict) -> None:
    model = _model(dtype)
    reference = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    ref = FusedAdam(reference, lr=1e-2, weight_decay=0.01)
    opt = _wrap(model, **loss_scale)
    for step in range(5):
        opt.zero_grad()
        opt.backward(_loss(model, step, dtype))
        for r, p in zip(reference, model.parameters(), strict=True):
            r.grad = p.grad.float() / opt.loss_scale  # the same gradients, unscaled
        opt.step()
        ref.step()
    masters = torch.cat([r.detach().reshape(-1) for r in reference])
    torch.testing.assert_close(opt.fp32_groups_flat[0], masters, rtol=1e-5, atol=1e-6)
    for p in model.parameters():  # the model holds the masters, rounded
        assert p.dtype == dtype
    flat_model = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat_model, opt.fp32_groups_flat[0].to(dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_training_a_half_model_tracks_fused_adam_on_a_float32_copy(dtype: torch.dtype) -> None:
    half, full = _model(dtype), _model(dtype).float()  # the same (half-rounded) start
    opt = _wrap(half, dynamic_loss_scale=True)
    ref = FusedAdam(full.parameters(), lr=1e-2, weight_decay=0.01)
    start = torch.cat([p.detach().reshape(-1) for p in full.parameters()])
    for step in range(20):
        opt.zero_grad()
        opt.backward(_loss(half, step, dtype))
        opt.step()
        ref.zero_grad()
        _loss(full, step, torch.float32).backward()
        ref.step()
    moved = torch.cat([p.detach().reshape(-1) for p in full.parameters()]) - start
    error = opt.fp32_groups_flat[0] - torch.cat([p.detach().reshape(-1) for p in full.parameters()])
    # Only the forward/backward differ (half vs float32 rounding): the distance between the two
    # runs stays within the dtype's relative tolerance of how far training moved the weights.
    assert error.norm() < HALF_RTOL[dtype] * moved.norm()
    assert _loss(full, 99, torch.float32) < _loss(_model(dtype).float(), 99, torch.float32)


def test_groups_become_flat_buffers_the_params_view() -> None:
    model = _model(torch.float16)
    layers = [model[0], model[2]]
    adam = FusedAdam(
        [{"params": layers[0].parameters()}, {"params": layers[1].parameters(), "lr": 0.1}]
    )
    opt = FP16_Optimizer(adam)
    assert [m.dtype for m in opt.fp32_groups_flat] == [torch.float32, torch.float32]
    for layer, flat, master in zip(layers, opt.fp16_groups_flat, opt.fp32_groups_flat, strict=True):
        params = list(layer.parameters())
        assert flat.numel() == master.numel() == sum(p.numel() for p in params)
        for p in params:  # each param lives inside its group's flat buffer
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert torch.equal(master, flat.float())
    assert [g["params"] for g in opt.param_groups] == [[f] for f in opt.fp16_groups_flat]
    assert opt.param_groups[1]["lr"] == 0.1


def test_static_scale_scales_the_gradients_and_not_the_step() -> None:
    dtype = torch.bfloat16
    scaled, plain = _model(dtype), _model(dtype)
    scaled_opt = _wrap(scaled, static_loss_scale=256.0)
    plain_opt = _wrap(plain)  # static scale 1
    scaled_opt.backward(_loss(scaled, 0, dtype))
    plain_opt.backward(_loss(plain, 0, dtype))
    for s, p in zip(scaled.parameters(), plain.parameters(), strict=True):
        assert torch.equal(s.grad, p.grad * 256)  # a power of two: exact in bf16
    scaled_opt.step()
    plain_opt.step()
    torch.testing.assert_close(
        scaled_opt.fp32_groups_flat[0], plain_opt.fp32_groups_flat[0], rtol=0, atol=1e-7
    )
    assert scaled_opt.loss_scale == 256.0 and scaled_opt.cur_scale == 256.0


def test_param_groups_and_state_pass_through() -> None:
    model = _model(torch.float16)
    opt = _wrap(model)
    assert opt.param_groups is opt.optimizer.param_groups
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[0]["weight_decay"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(_loss(model, 0, torch.float16))
    opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert opt.state is opt.optimizer.state
    flat = opt.fp16_groups_flat[0]
    assert opt.state[flat]["exp_avg"].abs().sum() > 0  # lr 0: the moments still move


def test_a_param_without_gradient_counts_as_zero() -> None:
    used = torch.nn.Parameter(torch.randn(4).half())
    unused = torch.nn.Parameter(torch.randn(3).half())
    opt = FP16_Optimizer(FusedAdam([used, unused], lr=0.1))  # no weight decay: zero grad, no move
    used_before, unused_before = used.detach().clone(), unused.detach().clone()
    opt.backward((used.float() ** 2).sum())
    assert unused.grad is None
    opt.step()
    assert torch.equal(unused, unused_before)
    assert not torch.equal(used, used_before)


def test_zero_grad() -> None:
    model = _model(torch.float16)
    opt = _wrap(model)
    opt.backward(_loss(model, 0, torch.float16))
    opt.zero_grad(set_grads_to_None=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# -- overflow and the loss scale ---------------------------------------------------------------


def _snapshot(opt: FP16_Optimizer, model: torch.nn.Module) -> list[Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [m.clone() for m in opt.fp32_groups_flat]
    for flat in opt.fp16_groups_flat:
        out += [v.clone() for v in opt.state[flat].values() if isinstance(v, Tensor)]
    return out + [
        torch.as_tensor(g.get("step", 0), dtype=torch.float32).clone() for g in opt.param_groups
    ]


def test_overflow_skips_the_step_and_halves_the_dynamic_scale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dtype = torch.float16
    model = _model(dtype)
    opt = _wrap(model, dynamic_loss_scale=True)
    assert opt.loss_scale == 2.0**16
    _train(model, opt, range(2), dtype)
    before = _snapshot(opt, model)
    opt.zero_grad()
    opt.backward(_loss(model, 2, dtype))
    next(model.parameters()).grad[0, 0] = float("inf")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(opt, model), strict=True))
    assert opt.loss_scale == 2.0**15
    assert "Gradient overflow. Skipping step, reducing loss scale to 32768.0" in caplog.text
    assert opt.last_overflow_iter == 2 and opt.cur_iter == 3


def test_an_overflowing_loss_is_skipped_on_every_group(caplog: pytest.LogCaptureFixture) -> None:
    model = _model(torch.float16)
    adam = FusedAdam([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    opt = FP16_Optimizer(adam, dynamic_loss_scale=True, verbose=False)
    before = _snapshot(opt, model)
    opt.backward(_loss(model, 0, torch.float16) * 1e30)  # inf once scaled by 2**16
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(opt, model), strict=True))
    assert opt.loss_scale == 2.0**15
    assert caplog.text == ""  # verbose=False silences the dynamic scale's messages


def test_overflow_under_a_static_scale_skips_and_keeps_the_scale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _model(torch.bfloat16)
    opt = _wrap(model, static_loss_scale=8.0, verbose=False)
    before = _snapshot(opt, model)
    opt.backward(_loss(model, 0, torch.bfloat16))
    next(model.parameters()).grad[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(opt, model), strict=True))
    assert opt.loss_scale == 8.0
    assert "Gradient overflow. Skipping step" in caplog.text  # always logged, as in Apex


def test_dynamic_scale_follows_apex_growth_and_floor() -> None:
    dtype = torch.bfloat16
    model = _model(dtype)
    opt = _wrap(model, dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 3})
    scales = []
    for step in range(7):
        opt.zero_grad()
        opt.backward(_loss(model, step, dtype))
        if step == 3:
            next(model.parameters()).grad[0, 0] = float("inf")
        opt.step()
        scales.append(opt.loss_scale)
    # Apex: grow when (cur_iter - last_overflow_iter) % scale_window == 0, halve on overflow.
    s = 2.0**16
    assert scales == [s, s, 2 * s, s, s, s, 2 * s]


def test_dynamic_scale_never_goes_below_one() -> None:
    model = _model(torch.bfloat16)
    opt = _wrap(model, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0})
    for step in range(3):
        opt.zero_grad()
        opt.backward(_loss(model, step, torch.bfloat16) * float("inf"))
        opt.step()
    assert opt.loss_scale == 1.0  # Apex: max(cur_scale / scale_factor, 1)


# -- checkpoints -------------------------------------------------------------------------------


def _roundtrip(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_state_dict_resume_is_bitwise(dtype: torch.dtype) -> None:
    def build(seed: int) -> tuple[torch.nn.Module, FP16_Optimizer]:
        model = _model(dtype, seed=seed)
        args = {"scale_window": 2}
        return model, _wrap(model, dynamic_loss_scale=True, dynamic_loss_args=args)

    model, opt = build(0)
    _train(model, opt, range(2), dtype)
    opt.zero_grad()  # an overflow, so that the saved counters are not trivial
    opt.backward(_loss(model, 2, dtype) * float("inf"))
    opt.step()
    saved = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, range(3, 8), dtype)

    resumed_model, resumed_opt = build(1)  # other weights: the load must restore everything
    resumed_opt.load_state_dict(saved["opt"])
    assert torch.equal(
        torch.cat([p.detach().reshape(-1) for p in resumed_model.parameters()]),
        saved["opt"]["fp32_groups_flat"][0].to(dtype),
    )
    resumed_model.load_state_dict(saved["model"])
    _train(resumed_model, resumed_opt, range(3, 8), dtype)

    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(opt.fp32_groups_flat[0], resumed_opt.fp32_groups_flat[0])
    flat, resumed_flat = opt.fp16_groups_flat[0], resumed_opt.fp16_groups_flat[0]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[flat][key], resumed_opt.state[resumed_flat][key])
    assert (resumed_opt.loss_scale, resumed_opt.cur_iter) == (opt.loss_scale, opt.cur_iter)
    assert resumed_opt.last_overflow_iter == opt.last_overflow_iter >= 2
    assert opt.loss_scale > 2.0**15  # the scale grew after the resume, on both


def test_state_dict_has_apex_keys() -> None:
    opt = _wrap(_model(torch.float16), dynamic_loss_scale=True)
    state = opt.state_dict()
    assert state["dynamic_loss_scale"] is True
    assert (state["cur_scale"], state["cur_iter"], state["last_overflow_iter"]) == (2.0**16, 0, -1)
    assert (state["scale_factor"], state["scale_window"]) == (2.0, 1000)
    assert state["fp32_groups_flat"][0] is opt.fp32_groups_flat[0]
    assert "optimizer_state_dict" in state


# -- errors --------------------------------------------------------------------------------------


def _cast_there_and_back(model: torch.nn.Module, dtype: torch.dtype) -> None:
    model.float()
    model.to(dtype)  # model.half() / model.bfloat16(): same values, new storage


def _to_float32_and_back(model: torch.nn.Module, dtype: torch.dtype) -> None:
    model.to(torch.float32).to(dtype)


def _swap_there_and_back(model: torch.nn.Module, dtype: torch.dtype) -> None:
    # module._apply swaps the params' contents instead of assigning param.data
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        _cast_there_and_back(model, dtype)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


REALLOCATIONS = [
    pytest.param(_cast_there_and_back, id="float_then_back"),
    pytest.param(_to_float32_and_back, id="to_float32_and_back"),
    pytest.param(_swap_there_and_back, id="swap_module_params"),
]


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("reallocate", REALLOCATIONS)
def test_params_reallocated_after_wrapping_are_refused(dtype: torch.dtype, reallocate) -> None:
    model = _model(dtype)
    opt = _wrap(model, dynamic_loss_scale=True)
    _train(model, opt, range(1), dtype)
    saved = _roundtrip(opt.state_dict())
    reallocate(model, dtype)  # the params get new data: the flat buffers no longer reach the model
    before = [p.detach().clone() for p in model.parameters()]
    master = opt.fp32_groups_flat[0].clone()
    opt.zero_grad()
    opt.backward(_loss(model, 1, dtype))
    with pytest.raises(
        RuntimeError,
        match=rf"FP16_Optimizer\.step: param 0 of group 0 \(shape \(16, 6\), now {dtype} on "
        r"cpu\) no longer lives in the optimizer's flat .* buffer.*moved or cast.*Move and cast "
        r"the model first, then build the FusedAdam and the FP16_Optimizer",
    ):
        opt.step()
    # refused before anything was stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert torch.equal(master, opt.fp32_groups_flat[0])
    assert opt.cur_iter == 1 and opt.loss_scale == 2.0**16
    with pytest.raises(RuntimeError, match=r"FP16_Optimizer\.load_state_dict: param 0 of group 0"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_a_cast_to_the_dtype_the_params_have_keeps_them_in_the_flat_buffer(
    dtype: torch.dtype,
) -> None:
    model, plain = _model(dtype), _model(dtype)
    opt, plain_opt = _wrap(model), _wrap(plain)
    model.to(dtype)  # nothing to cast: the params keep their data
    model.to("cpu")
    _train(model, opt, range(3), dtype)
    _train(plain, plain_opt, range(3), dtype)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(model[0].weight, _model(dtype)[0].weight)  # it trained


def test_refuses_other_optimizers() -> None:
    params = _model(torch.float16).parameters()
    with pytest.raises(TypeError, match=r"only wraps amp_optimizers\.FusedAdam, got FusedSGD"):
        FP16_Optimizer(FusedSGD(params, lr=0.1))


def test_refuses_float32_params() -> None:
    model = _model(torch.float16)
    model[2].float()
    with pytest.raises(
        TypeError, match=r"must be float16 or bfloat16, param 2 of group 0 is torch\.float32"
    ):
        FP16_Optimizer(FusedAdam(model.parameters()))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: FusedAdam([{"params": m[0].parameters()}, {"params": []}]), "group 1 is empty"),
        (lambda m: FusedAdam([m[0].weight, m[2].weight.data.bfloat16()]), "mixes torch.float16"),
        (lambda m: FusedAdam([m[0].weight, m[2].weight.requires_grad_(False)]), "require grad"),
    ],
)
def test_refuses_groups_that_cannot_be_one_flat_buffer(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FP16_Optimizer(make(_model(torch.float16)))  # type: ignore[operator]


def test_refuses_a_stepped_optimizer() -> None:
    model = _model(torch.float16)
    adam = FusedAdam(model.parameters())
    _loss(model, 0, torch.float16).backward()
    adam.step()
    with pytest.raises(ValueError, match="already has state"):
        FP16_Optimizer(adam)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dynamic_loss_scale": True, "dynamic_loss_args": {"growth": 2}}, "unknown key"),
        ({"dynamic_loss_args": {"scale_window": 10}}, "dynamic_loss_scale is False"),
        ({"static_loss_scale": 0.0}, "static_loss_scale must be a positive number, got 0.0"),
        ({"dynamic_loss_scale": True, "dynamic_loss_args": {"scale_factor": 1}}, "must be > 1"),
    ],
)
def test_invalid_scale_arguments_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _wrap(_model(torch.float16), **kwargs)


def test_load_state_dict_checks_what_it_loads() -> None:
    opt = _wrap(_model(torch.float16))
    state = opt.state_dict()
    del state["fp32_groups_flat"]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['fp32_groups_flat'\]"):
        opt.load_state_dict(state)
    other = FP16_Optimizer(FusedAdam(_model(torch.float16)[0].parameters()))
    with pytest.raises(ValueError, match="saved flat masters have"):
        other.load_state_dict(opt.state_dict())


# -- CUDA ------------------------------------------------------------------------------------------


def _linear_loss(model: torch.nn.Module, step: int, device: str) -> Tensor:
    """A loss whose gradients are fixed numbers, so they are identical on every device (small
    enough not to overflow fp16 once scaled by 2**16)."""
    gen = torch.Generator().manual_seed(step)
    terms = [
        (p.float() * torch.randn(p.shape, generator=gen).mul(1e-2).to(device)).sum()
        for p in model.parameters()
    ]
    return torch.stack(terms).sum()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_cuda_matches_cpu_and_skips_overflow(dtype: torch.dtype) -> None:
    results = {}
    for device in ("cpu", "cuda"):
        model = _model(dtype, device)
        opt = _wrap(model, dynamic_loss_scale=True)
        for step in range(6):
            opt.zero_grad()
            opt.backward(_linear_loss(model, step, device))
            if step == 2:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            opt.step()
        results[device] = (opt.fp32_groups_flat[0].cpu(), opt.loss_scale, opt.cur_iter)
    (cpu, cpu_scale, cpu_iter), (cuda, cuda_scale, cuda_iter) = results["cpu"], results["cuda"]
    assert cpu_scale == cuda_scale == 2.0**15 and cpu_iter == cuda_iter == 6
    # The same gradients on both devices: only the order of float32 operations differs.
    torch.testing.assert_close(cuda, cpu, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_a_model_moved_to_cuda_after_wrapping_is_refused(dtype: torch.dtype) -> None:
    model = _model(dtype)
    opt = _wrap(model)
    model.cuda()
    opt.backward(_loss(model, 0, dtype, "cuda"))
    with pytest.raises(RuntimeError, match=r"now .* on cuda:0\) no longer lives .* on cpu"):
        opt.step()
