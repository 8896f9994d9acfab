"""Every op of Apex's ``amp_C`` exists, with Apex's signature, its name in ``dir``, and the
reference's module layout; ``update_scale_hysteresis`` dispatches on its scale's device.

Apex's last release with amp (``csrc/amp_C_frontend.cpp``) defines 17 ops. What each op computes
is checked on every path by the contract tests (``test_contract_*.py``).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import amp_fused_ops
from amp_fused_ops import amp_C
from amp_fused_ops.reference import _adam as _reference_adam
from amp_fused_ops.reference import _layerwise as _reference_layerwise
from amp_fused_ops.reference import _ops as _reference
from amp_fused_ops.reference import _optim as _reference_optim

# Apex's amp_C ops (csrc/amp_C_frontend.cpp at its last release with amp) and their
# arguments, in order (Apex's C++ parameter names).
APEX_OPS: dict[str, list[str]] = {
    "multi_tensor_scale": ["chunk_size", "noop_flag", "tensor_lists", "scale"],
    "multi_tensor_sgd": ["chunk_size", "noop_flag", "tensor_lists", "wd", "momentum",
                         "dampening", "lr", "nesterov", "first_run", "wd_after_momentum",
                         "scale"],
    "multi_tensor_axpby": ["chunk_size", "noop_flag", "tensor_lists", "a", "b", "arg_to_check"],
    "multi_tensor_l2norm": ["chunk_size", "noop_flag", "tensor_lists", "per_tensor_python"],
    "multi_tensor_l2norm_mp": ["chunk_size", "noop_flag", "tensor_lists", "per_tensor_python"],
    "multi_tensor_l2norm_scale": ["chunk_size", "noop_flag", "tensor_lists", "scale",
                                  "per_tensor_python"],
    "multi_tensor_unscale_l2norm": ["chunk_size", "noop_flag", "tensor_lists", "inv_scale",
                                    "per_tensor_python"],
    "multi_tensor_lamb_stage1_cuda": ["chunk_size", "noop_flag", "tensor_lists",
                                      "per_tensor_decay", "step", "beta1", "beta2", "epsilon",
                                      "global_grad_norm", "max_global_grad_norm"],
    "multi_tensor_lamb_stage2_cuda": ["chunk_size", "noop_flag", "tensor_lists",
                                      "per_tensor_param_norm", "per_tensor_update_norm", "lr",
                                      "weight_decay", "use_nvlamb_python"],
    "multi_tensor_adam": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1", "beta2",
                          "epsilon", "step", "mode", "bias_correction", "weight_decay"],
    "multi_tensor_adam_capturable": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1",
                                     "beta2", "epsilon", "step", "mode", "bias_correction",
                                     "weight_decay", "inv_scale"],
    "multi_tensor_adam_capturable_master": ["chunk_size", "noop_flag", "tensor_lists", "lr",
                                            "beta1", "beta2", "epsilon", "step", "mode",
                                            "bias_correction", "weight_decay", "inv_scale"],
    "multi_tensor_adagrad": ["chunk_size", "noop_flag", "tensor_lists", "lr", "epsilon", "mode",
                             "weight_decay"],
    "multi_tensor_novograd": ["chunk_size", "noop_flag", "tensor_lists", "grad_norms", "lr",
                              "beta1", "beta2", "epsilon", "step", "bias_correction",
                              "weight_decay", "grad_averaging", "mode", "norm_type"],
    "multi_tensor_lamb": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1", "beta2",
                          "epsilon", "step", "bias_correction", "weight_decay",
                          "grad_averaging", "mode", "global_grad_norm", "max_grad_norm",
                          "use_nvlamb_python"],
    "multi_tensor_lamb_mp": ["chunk_size", "noop_flag", "tensor_lists", "lr", "beta1", "beta2",
                             "epsilon", "step", "bias_correction", "weight_decay",
                             "grad_averaging", "mode", "global_grad_norm", "max_grad_norm",
                             "use_nvlamb_python", "found_inf", "inv_scale"],
    "update_scale_hysteresis": ["current_scale", "growth_tracker", "hysteresis_tracker",
                                "found_inf", "growth_factor", "backoff_factor",
                                "growth_interval", "hysteresis"],
}  # fmt: skip


def test_amp_C_has_every_apex_op_in_apex_argument_order() -> None:
    assert sorted(amp_C.__all__) == sorted(APEX_OPS)
    for name, apex_args in APEX_OPS.items():
        op = getattr(amp_C, name)
        signature = inspect.signature(op).parameters
        params = list(signature)
        assert len(params) >= len(apex_args), name
        # Same positions; a few of our names are spelled out ("wd": "weight_decay", "eps").
        for ours, theirs in zip(params, apex_args, strict=False):
            assert ours[0] == theirs[0], (name, ours, theirs)
        # Ours may only add trailing optional arguments (step_tensor; bfloat16 stochastic
        # rounding's sr_seed and sr_step, sgd's step_tensor after them; lr_tensor last), which
        # Apex's calls omit.
        extra = params[len(apex_args) :]
        allowed = (
            [],
            ["lr_tensor"],
            ["step_tensor", "lr_tensor"],
            ["sr_seed", "sr_step"],
            ["step_tensor", "sr_seed", "sr_step", "lr_tensor"],
            ["sr_seed", "sr_step", "step_tensor", "lr_tensor"],
            ["step_tensor"],
        )
        assert extra in allowed, (name, extra)
        assert all(signature[p].default is None for p in extra), name
    assert amp_fused_ops.amp_C is amp_C


def test_dir_of_amp_C_lists_every_apex_op() -> None:
    # dir() is what help(), tab completion and `import amp_C; dir(amp_C)` scripts read.
    listed = dir(amp_C)
    assert set(APEX_OPS) <= set(listed), sorted(set(APEX_OPS) - set(listed))
    assert all(callable(getattr(amp_C, name)) for name in APEX_OPS)
    assert listed == sorted(listed)


def test_update_scale_hysteresis_dispatches_on_current_scale() -> None:
    scale = torch.tensor([8.0])
    tracker = torch.zeros(1, dtype=torch.int32)
    hyst = torch.ones(1, dtype=torch.int32)
    amp_C.update_scale_hysteresis(scale, tracker, hyst, torch.ones(1), 2.0, 0.5, 10, 1)
    assert scale.item() == 4.0 and tracker.item() == 0 and hyst.item() == 0
    with pytest.raises(ValueError, match="growth_tracker must be a one-element int32 tensor"):
        amp_C.update_scale_hysteresis(scale, torch.zeros(1), hyst, torch.ones(1), 2.0, 0.5, 10, 1)


def test_reference_reexports_the_moved_ops() -> None:
    assert _reference.multi_tensor_adam is _reference_adam.multi_tensor_adam
    assert _reference.multi_tensor_adam_capturable is _reference_adam.multi_tensor_adam_capturable
    assert _reference.multi_tensor_adagrad is _reference_optim.multi_tensor_adagrad
    assert _reference.multi_tensor_sgd is _reference_optim.multi_tensor_sgd
    assert _reference.multi_tensor_lamb is _reference_layerwise.multi_tensor_lamb
    assert _reference.multi_tensor_novograd is _reference_layerwise.multi_tensor_novograd
    assert {"multi_tensor_lamb", "multi_tensor_novograd"} <= set(amp_C.__all__)
