"""Checks of the Apex names that resolve to amp-fused-ops and amp-optimizers, run with
``python -m amp_legacy_fp16.apex_run toolkit_alias_checks.py``.

Runs every check and prints one line, ``results <json>``: each check's name and either "ok"
or the traceback of its failure (tests/integration/test_apex_alias_other_packages.py reads it).
"""

import importlib
import json
import traceback

import pytest
import torch


def top_level_syncbn_is_the_syncbn_kernels() -> None:
    import syncbn

    from amp_fused_ops import syncbn as toolkit_syncbn

    for name in ("welford_mean_var", "welford_parallel", "batchnorm_forward", "reduce_bn",
                 "batchnorm_backward"):  # fmt: skip
        assert getattr(syncbn, name) is getattr(toolkit_syncbn, name), name
    x = torch.randn(4, 3, 5)
    mean, var_biased = syncbn.welford_mean_var(x)
    torch.testing.assert_close(mean, x.mean(dim=(0, 2)))
    torch.testing.assert_close(var_biased, x.var(dim=(0, 2), unbiased=False))


def apex_contrib_optimizers_holds_the_cut_down_fp16_optimizer_and_fused_adam() -> None:
    from apex.contrib.optimizers import FP16_Optimizer, FusedAdam
    from apex.contrib.optimizers.fp16_optimizer import FP16_Optimizer as FromSubmodule
    from apex.contrib.optimizers.fused_adam import FusedAdam as AdamFromSubmodule

    import amp_optimizers

    assert FP16_Optimizer is FromSubmodule is amp_optimizers.FP16_Optimizer
    assert FusedAdam is AdamFromSubmodule is amp_optimizers.FusedAdam
    contrib = importlib.import_module("apex.contrib.optimizers")
    assert sorted(contrib.__all__) == ["FP16_Optimizer", "FusedAdam"]
    assert {"FP16_Optimizer", "FusedAdam"} <= set(dir(contrib))
    # Apex's contrib FusedLAMB had another signature than amp_optimizers.FusedLAMB: not aliased.
    with pytest.raises(AttributeError, match="FusedLAMB"):
        _ = contrib.FusedLAMB
    assert "FusedSGD" not in dir(contrib)


def dir_of_the_top_level_amp_C_lists_its_ops() -> None:
    import amp_C

    names = dir(amp_C)
    for op in ("multi_tensor_scale", "multi_tensor_adam", "multi_tensor_l2norm",
               "update_scale_hysteresis"):  # fmt: skip
        assert op in names, op


CHECKS = [
    top_level_syncbn_is_the_syncbn_kernels,
    apex_contrib_optimizers_holds_the_cut_down_fp16_optimizer_and_fused_adam,
    dir_of_the_top_level_amp_C_lists_its_ops,
]

if __name__ == "__main__":
    results = {}
    for check in CHECKS:
        try:
            check()
            results[check.__name__] = "ok"
        except BaseException:  # reported to the test, which fails with it
            results[check.__name__] = traceback.format_exc()
    print("results " + json.dumps(results))
