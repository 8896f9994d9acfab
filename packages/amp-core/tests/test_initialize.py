"""amp.initialize: opt-level presets, their properties, overrides, errors, return types."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from amp_test_support import DEVICES, HALF_DTYPES

from _amp_core_helpers import amp_log_records, tiny_bn_net, tiny_mlp
from amp_core import amp

OPT_LEVELS = ["O0", "O1", "O2", "O3"]


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _loss_scale() -> float:
    return float(amp.state_dict()["loss_scaler0"]["loss_scale"])


# ---------------------------------------------------------------- return types


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_single_model_single_optimizer_returns_pair(opt_level):
    model = tiny_mlp()
    opt = _sgd(model)
    out = amp.initialize(model, opt, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0)
    assert isinstance(out, tuple) and len(out) == 2
    m, o = out
    assert isinstance(m, torch.nn.Module)
    assert isinstance(o, torch.optim.Optimizer)


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_lists_in_lists_out(opt_level):
    m1, m2 = tiny_mlp(0), tiny_mlp(1)
    o1, o2 = _sgd(m1), _sgd(m2)
    models, opts = amp.initialize(
        [m1, m2], [o1, o2], opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0
    )
    assert isinstance(models, list) and len(models) == 2
    assert isinstance(opts, list) and len(opts) == 2
    assert all(isinstance(m, torch.nn.Module) for m in models)
    assert all(isinstance(o, torch.optim.Optimizer) for o in opts)


def test_model_list_with_single_optimizer():
    m1, m2 = tiny_mlp(0), tiny_mlp(1)
    opt = torch.optim.SGD(list(m1.parameters()) + list(m2.parameters()), lr=0.1)
    models, o = amp.initialize(
        [m1, m2], opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0
    )
    assert isinstance(models, list) and len(models) == 2
    assert isinstance(o, torch.optim.Optimizer)


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_no_optimizer_returns_only_models(opt_level):
    model = tiny_mlp()
    out = amp.initialize(model, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0)
    assert isinstance(out, torch.nn.Module)
    out_list = amp.initialize(
        [tiny_mlp(1)], opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0
    )
    assert isinstance(out_list, list) and len(out_list) == 1
    assert isinstance(out_list[0], torch.nn.Module)


# ---------------------------------------------------------------- enabled=False


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_enabled_false_is_a_no_op(opt_level):
    model = tiny_mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = _sgd(model)
    m, o = amp.initialize(model, opt, enabled=False, opt_level=opt_level, verbosity=0)
    assert m is model and o is opt
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32

    x = torch.randn(5, 4)
    loss = model(x).pow(2).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss)
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), b - 0.1 * g, rtol=1e-6, atol=1e-7)


def test_enabled_false_returns_models_only_without_optimizer():
    model = tiny_mlp()
    assert amp.initialize(model, enabled=False, verbosity=0) is model
    models = [tiny_mlp(1), tiny_mlp(2)]
    out = amp.initialize(models, enabled=False, verbosity=0)
    assert isinstance(out, list) and all(a is b for a, b in zip(out, models, strict=True))


# ---------------------------------------------------------------- opt-level properties


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o0_keeps_fp32_and_scale_one(device, half):
    model = tiny_bn_net().to(device)
    model, _ = amp.initialize(model, _sgd(model), opt_level="O0", half_dtype=half, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = model(torch.randn(4, 4, device=device))
    assert out.dtype == torch.float32
    assert (
        F.linear(torch.ones(2, 3, device=device), torch.ones(4, 3, device=device)).dtype
        == torch.float32
    )
    assert _loss_scale() == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o1_keeps_weights_fp32_and_casts_ops(device, half):
    model = tiny_bn_net().to(device)
    model, _ = amp.initialize(model, _sgd(model), opt_level="O1", half_dtype=half, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    a = torch.randn(2, 3, device=device)
    w = torch.randn(4, 3, device=device)
    assert F.linear(a, w).dtype == half


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp16_default_scale_is_dynamic_65536(opt_level):
    model = tiny_mlp()
    amp.initialize(model, _sgd(model), opt_level=opt_level, half_dtype=torch.float16, verbosity=0)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_bf16_default_scale_is_dynamic_65536(opt_level):
    # Apex's contract (dynamic unless overridden) holds for bf16 too.
    model = tiny_mlp()
    amp.initialize(model, _sgd(model), opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}


def test_bf16_o3_scale_is_one():
    model = tiny_mlp()
    amp.initialize(model, _sgd(model), opt_level="O3", half_dtype=torch.bfloat16, verbosity=0)
    assert _loss_scale() == 1.0


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_default_scaling_skips_a_nonfinite_step_bitwise(opt_level, half, bad):
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0)
    x, y = torch.randn(4, 4), torch.randn(4, 3)

    def step(inject):
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled_loss:
            scaled_loss.backward()
            if inject:
                model[0].weight.grad.view(-1)[0] = bad
        opt.step()

    step(False)
    before = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    momenta = [v["momentum_buffer"].clone() for v in opt.state.values()]
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    step(True)
    for a, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(amp.master_params(opt), masters, strict=True):
        assert torch.equal(a, b)
    for a, b in zip([v["momentum_buffer"] for v in opt.state.values()], momenta, strict=True):
        assert torch.equal(a, b)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": scale / 2, "unskipped": 0}


def test_o3_fp16_scale_is_one():
    model = tiny_mlp()
    amp.initialize(model, _sgd(model), opt_level="O3", half_dtype=torch.float16, verbosity=0)
    assert _loss_scale() == 1.0


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_explicit_loss_scale_overrides_default(half):
    model = tiny_mlp()
    amp.initialize(
        model, _sgd(model), opt_level="O1", half_dtype=half, loss_scale=128.0, verbosity=0
    )
    assert _loss_scale() == 128.0


def test_bf16_explicit_dynamic_scale_starts_at_65536():
    model = tiny_mlp()
    amp.initialize(
        model,
        _sgd(model),
        opt_level="O2",
        half_dtype=torch.bfloat16,
        loss_scale="dynamic",
        verbosity=0,
    )
    assert _loss_scale() == 65536.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_casts_model_but_not_batchnorm(device, half):
    model = tiny_bn_net().to(device)
    model, _ = amp.initialize(model, _sgd(model), opt_level="O2", half_dtype=half, verbosity=0)
    lin0, bn, lin1 = model[0], model[1], model[3]
    assert lin0.weight.dtype == half and lin0.bias.dtype == half and lin1.weight.dtype == half
    assert bn.weight.dtype == torch.float32 and bn.bias.dtype == torch.float32
    assert bn.running_mean.dtype == torch.float32 and bn.running_var.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o3_casts_everything(device, half):
    model = tiny_bn_net().to(device)
    model, _ = amp.initialize(model, _sgd(model), opt_level="O3", half_dtype=half, verbosity=0)
    assert all(p.dtype == half for p in model.parameters())


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_keep_batchnorm_fp32_false_casts_batchnorm(half):
    model = tiny_bn_net()
    model, _ = amp.initialize(
        model, _sgd(model), opt_level="O2", half_dtype=half, keep_batchnorm_fp32=False, verbosity=0
    )
    assert all(p.dtype == half for p in model.parameters())


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o3_keep_batchnorm_fp32_true_keeps_batchnorm(half):
    model = tiny_bn_net()
    model, _ = amp.initialize(
        model, _sgd(model), opt_level="O3", half_dtype=half, keep_batchnorm_fp32=True, verbosity=0
    )
    assert model[0].weight.dtype == half
    assert model[1].weight.dtype == torch.float32


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_cast_model_type_selects_half_dtype(opt_level, half):
    model = tiny_mlp()
    model, _ = amp.initialize(
        model, _sgd(model), opt_level=opt_level, cast_model_type=half, verbosity=0
    )
    assert all(p.dtype == half for p in model.parameters())


def test_default_half_dtype_on_cpu_is_bf16():
    model = tiny_mlp()
    model, _ = amp.initialize(model, _sgd(model), opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0


def test_default_half_dtype_on_cpu_is_bf16_for_o1():
    model = tiny_mlp()
    amp.initialize(model, _sgd(model), opt_level="O1", verbosity=0)
    assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_half_dtype_on_cuda_is_fp16():
    model = tiny_mlp().cuda()
    model, _ = amp.initialize(model, _sgd(model), opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert _loss_scale() == 65536.0


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o2_master_weights_false_has_no_masters(half):
    model = tiny_mlp()
    model, opt = amp.initialize(
        model, _sgd(model), opt_level="O2", half_dtype=half, master_weights=False, verbosity=0
    )
    masters = list(amp.master_params(opt))
    assert {id(p) for p in masters} == {id(p) for p in model.parameters()}
    assert all(p.dtype == half for p in masters)


def test_o0_after_o1_switches_casting_off():
    model = tiny_mlp()
    amp.initialize(model, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32
    assert torch.exp(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", ["O4", "o1", "fast", ""])
def test_unknown_opt_level(bad):
    with pytest.raises(RuntimeError, match=r"'O0', 'O1', 'O2', 'O3'"):
        amp.initialize(tiny_mlp(), opt_level=bad, verbosity=0)


def test_digit_zero_opt_level_explains_letter_o():
    with pytest.raises(RuntimeError, match=r"letter O, not the number zero"):
        amp.initialize(tiny_mlp(), opt_level="01", verbosity=0)


def test_o1_master_weights_refused():
    with pytest.raises(RuntimeError, match=r"doesn't make sense to use master_weights with O1"):
        amp.initialize(tiny_mlp(), opt_level="O1", master_weights=True, verbosity=0)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_o1_cast_model_type_refused(half):
    with pytest.raises(RuntimeError, match=r"O1 inserts casts around Torch functions"):
        amp.initialize(tiny_mlp(), opt_level="O1", cast_model_type=half, verbosity=0)


@pytest.mark.parametrize("value", [True, False])
def test_o1_keep_batchnorm_fp32_refused(value):
    with pytest.raises(RuntimeError, match=r"keep_batchnorm_fp32 should be None"):
        amp.initialize(tiny_mlp(), opt_level="O1", keep_batchnorm_fp32=value, verbosity=0)


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_patch_torch_functions_only_with_o1(opt_level):
    with pytest.raises(RuntimeError, match=r"should only be set by selecting opt_level='O1'"):
        amp.initialize(tiny_mlp(), opt_level=opt_level, patch_torch_functions=True, verbosity=0)


def test_bad_loss_scale_string():
    with pytest.raises((ValueError, RuntimeError), match=r"dynamic"):
        amp.initialize(tiny_mlp(), opt_level="O1", loss_scale="foo", verbosity=0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 1e39, True, "Dynamic"])
def test_bad_loss_scale_value(bad):
    # 1e39 does not fit the fp32 scale tensor; refuse it at initialize, not at the first step
    with pytest.raises(ValueError, match=r"'dynamic' or a positive number"):
        amp.initialize(tiny_mlp(), opt_level="O1", loss_scale=bad, verbosity=0)


def test_failed_initialize_leaves_model_untouched():
    model = tiny_mlp()
    with pytest.raises(RuntimeError):
        amp.initialize(model, opt_level="O2", patch_torch_functions=True, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.float32


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_same_optimizer_twice_refused(opt_level):
    model = tiny_mlp()
    opt = _sgd(model)
    amp.initialize(model, opt, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(RuntimeError, match=r"(?i)optimizer"):
        amp.initialize(
            tiny_mlp(1), opt, opt_level=opt_level, half_dtype=torch.bfloat16, verbosity=0
        )


@pytest.mark.parametrize("first,second", [("O1", "O2"), ("O2", "O1"), ("O2", "O2")])
def test_reinitialize_with_new_objects_works(first, second):
    m1 = tiny_mlp(0)
    amp.initialize(m1, _sgd(m1), opt_level=first, half_dtype=torch.float16, verbosity=0)
    m2 = tiny_mlp(1)
    m2, o2 = amp.initialize(m2, _sgd(m2), opt_level=second, half_dtype=torch.float16, verbosity=0)
    before = [p.detach().float().clone() for p in m2.parameters()]
    x = torch.randn(4, 4) * 0.5
    loss = m2(x).float().pow(2).mean()
    with amp.scale_loss(loss, o2) as scaled:
        scaled.backward()
    o2.step()
    after = [p.detach().float() for p in m2.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1


@pytest.mark.slow  # starts a fresh interpreter
def test_scale_loss_before_initialize_raises():
    # Needs a process in which amp.initialize has never run.
    code = (
        "import torch\n"
        "from amp_core import amp\n"
        "m = torch.nn.Linear(2, 2)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "try:\n"
        "    with amp.scale_loss(m(torch.ones(1, 2)).sum(), o) as s:\n"
        "        s.backward()\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    # The timeout only catches a hang; it is generous so that a loaded machine cannot fail it.
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    assert res.returncode == 0, res.stderr
    assert "RAISED" in res.stdout and "amp.initialize" in res.stdout, res.stdout + res.stderr


# ---------------------------------------------------------------- logging


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_verbosity_zero_logs_nothing(opt_level, caplog):
    caplog.set_level(logging.DEBUG)
    model = tiny_mlp()
    model, opt = amp.initialize(
        model, _sgd(model), opt_level=opt_level, half_dtype=torch.float16, verbosity=0
    )
    loss = model(torch.randn(4, 4)).float().sum() * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp_log_records(caplog) == []


def test_verbosity_one_logs_selected_opt_level(caplog):
    caplog.set_level(logging.DEBUG)
    model = tiny_mlp()
    amp.initialize(model, _sgd(model), opt_level="O2", half_dtype=torch.float16, verbosity=1)
    assert any("O2" in r.getMessage() for r in amp_log_records(caplog))


def test_half_model_passed_to_o2_is_reported(caplog):
    """Apex warns when the model was already cast to half before initialize."""
    model = tiny_mlp().half()
    with caplog.at_level(logging.WARNING, logger="amp_core"):
        amp.initialize(model, opt_level="O2", half_dtype=torch.float16, verbosity=1)
    assert any("expected torch.float32" in r.getMessage() for r in caplog.records)


class _Wrapper:
    """An optimizer wrapper shaped like Apex's / amp_parallel's LARC: the optimizer is `.optim`."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def step(self, closure=None):
        return self.optim.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)


def test_optimizer_wrapper_like_larc_accepted():
    model = torch.nn.Linear(3, 2)
    wrapper = _Wrapper(torch.optim.SGD(model.parameters(), lr=0.5))
    model, out = amp.initialize(model, wrapper, opt_level="O1", loss_scale=8.0, verbosity=0)
    assert out is wrapper
    before = model.weight.detach().clone()
    with amp.scale_loss(model(torch.ones(1, 3)).float().sum(), wrapper) as scaled:
        scaled.backward()
    wrapper.step()
    # d(sum(W x + b))/dW = 1 for x = ones: one SGD step of lr 0.5, the scale of 8 removed.
    torch.testing.assert_close(model.weight.detach(), before - 0.5)


def test_objects_that_are_not_optimizers_still_refused():
    with pytest.raises(TypeError, match="optimizers must be"):
        amp.initialize(torch.nn.Linear(2, 2), object(), opt_level="O1", verbosity=0)
