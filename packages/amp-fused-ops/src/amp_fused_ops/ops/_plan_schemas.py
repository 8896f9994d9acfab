"""The schemas of the step-plan ops, defined with the ``amp_C`` ops by
:func:`amp_fused_ops.ops._registry.define_schemas` in every namespace that has them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PLAN_SCHEMAS", "plan_fake"]

PLAN_SCHEMAS: tuple[str, ...] = (
    "multi_tensor_plan_set(Tensor device_tensor, int plan, Tensor[] params, int[] buckets, "
    "Tensor[] state, int state_lists) -> ()",
    "multi_tensor_plan_gather(Tensor device_tensor, int plan) -> bool",
    "multi_tensor_plan_release(Tensor device_tensor, int plan) -> ()",
    "multi_tensor_plan_drop(Tensor device_tensor, int plan) -> ()",
    "multi_tensor_adam_plan(int chunk_size, Tensor noop_flag, int plan, int bucket, float lr, "
    "float beta1, float beta2, float eps, int step, int decay_mode, int bias_correction, "
    "float weight_decay, Tensor? step_tensor=None, int? sr_seed=None, int? sr_step=None, "
    "Tensor? lr_tensor=None) -> ()",
    "multi_tensor_sgd_plan(int chunk_size, Tensor noop_flag, int plan, int bucket, "
    "float weight_decay, float momentum, float dampening, float lr, bool nesterov, "
    "bool first_run, bool wd_after_momentum, float scale, int? sr_seed=None, int? sr_step=None, "
    "Tensor? step_tensor=None, Tensor? lr_tensor=None) -> ()",
)
"""The step-plan ops (:mod:`amp_fused_ops.ops._step_plans`; kernels in
csrc/common/step_plans.h): a param group's lists stored by a device's compiled kernels across
steps, so that a step passes no lists. Not ``amp_C`` ops: compiled kernels only (no reference,
nothing of last resort), eager only (the fake kernels raise: a traced step passes its lists)."""


def plan_fake(name: str) -> Callable[..., Any]:
    """The fake kernel of the plan op ``name``: it refuses to be traced."""

    def fake(*args: Any) -> Any:
        raise RuntimeError(
            f"{name} runs eagerly only: a step plan is state held by a compiled kernel, which a "
            "traced graph cannot see; a traced optimizer step passes its tensor lists instead"
        )

    fake.__name__ = fake.__qualname__ = f"{name}_fake"
    return fake
