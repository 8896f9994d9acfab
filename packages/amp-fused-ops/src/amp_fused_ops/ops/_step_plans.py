"""Step plans: a param group's tensor lists held by a device's compiled kernels across steps.

A multi-tensor op pays, on every call, for every tensor it is passed: the dispatcher converts
each element of each list from Python (about 80 ns a tensor on a current x86 host, which for
Adam's four lists of 100 params is more than the rest of the step's host time). A param
group's params and optimizer state stay the same tensors from one step to the next, so an
optimizer can store them once with the compiled kernels of their device
(:meth:`StepPlanLists.create`), then per step have the kernels read the gradients off the
params (:meth:`~StepPlanLists.gather`) and run its op on the stored lists
(``multi_tensor_adam_plan``, ``multi_tensor_sgd_plan``: the list op's arguments with the
plan's handle and a bucket in place of the lists): a step passes no list at all. The gathered
gradients are released by the op that steps them, or by :meth:`~StepPlanLists.release`.

The ops (``torch.ops.amp_fused_ops.multi_tensor_plan_*``, ``multi_tensor_adam_plan``,
``multi_tensor_sgd_plan``) exist in compiled kernels only and run eagerly only: where a device
has no compiled kernels, under a ``TorchDispatchMode`` (``use_reference``, the emulated-kernel
counters, a user's mode: the ops would hide the tensors they touch), and while
``torch.compile`` traces, the optimizer passes its lists as before (:func:`plans_available`).
Deciding when a plan is stale is the optimizer's (amp-optimizers' ``StepPlan``); the gather
only confirms that what it reads still matches: the same params have gradients, dense ones,
and no param changed dtype or device (docs/design.rst, decision 13).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from amp_fused_ops.ops._registry import OPS_NAMESPACE, compiled_kernel

__all__ = ["StepPlanLists", "plans_available"]

_handles = itertools.count(1)


def plans_available() -> bool:
    """Whether a step may use :class:`StepPlanLists` now: eagerly, with no dispatch mode."""
    # Compiling first: Dynamo does not trace the dispatch-mode lookup.
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def _drop(device_tensor: Tensor, handle: int) -> None:
    getattr(torch.ops, OPS_NAMESPACE).multi_tensor_plan_drop.default(device_tensor, handle)


class StepPlanLists:
    """One param group's lists, stored with the compiled kernels of their device.

    Made by :meth:`create`; released (the kernels' references dropped) when this object is
    garbage-collected.

    Attributes:
        device: The params' device.
        handle: The plan's key in the kernels' table.
        buckets: The number of buckets (the op runs once per bucket).
    """

    __slots__ = ("__weakref__", "_device_tensor", "buckets", "device", "handle")

    def __init__(self, device_tensor: Tensor, handle: int, buckets: int) -> None:
        self._device_tensor = device_tensor
        self.device = device_tensor.device
        self.handle = handle
        self.buckets = buckets

    @classmethod
    def create(
        cls,
        params: Sequence[Tensor],
        buckets: Sequence[int],
        state_columns: Sequence[Sequence[Tensor]],
    ) -> StepPlanLists | None:
        """Store a group's lists with the compiled kernels of its device.

        Args:
            params: The group's params, in order, those without a gradient included.
            buckets: For each param, its bucket (0, 1, ... in order of first use), or -1 when it
                has no gradient: the gather then requires it to have none still.
            state_columns: The state lists (Adam: exp_avgs, exp_avg_sqs), each with one tensor
                per param of a bucket, in the params' order.

        Returns:
            The plan, or None where it cannot be stored: no param in a bucket, bucketed params
            on several devices, or no compiled kernel for their device.
        """
        planned = [p for p, b in zip(params, buckets, strict=True) if b >= 0]
        if not planned:
            return None
        device = planned[0].device
        if (
            any(p.device != device for p in planned)
            or compiled_kernel("multi_tensor_plan_set", device) is None
        ):
            return None
        device_tensor = torch.empty(0, dtype=torch.int32, device=device)
        handle = next(_handles)
        state = [t for column in state_columns for t in column]
        getattr(torch.ops, OPS_NAMESPACE).multi_tensor_plan_set.default(
            device_tensor, handle, list(params), list(buckets), state, len(state_columns)
        )
        lists = cls(device_tensor, handle, max(buckets) + 1)
        # Also at exit, before the interpreter and the device go: the table holds tensors.
        weakref.finalize(lists, _drop, device_tensor, handle)
        return lists

    def release(self) -> None:
        """Drop the gradients a :meth:`gather` read and no op has stepped yet."""
        getattr(torch.ops, OPS_NAMESPACE).multi_tensor_plan_release.default(
            self._device_tensor, self.handle
        )

    def gather(self) -> bool:
        """Read the gradients of the plan's params; False (nothing read) when they no longer
        match the plan (see the module), or the kernels serving the device do not hold it."""
        return bool(
            getattr(torch.ops, OPS_NAMESPACE).multi_tensor_plan_gather.default(
                self._device_tensor, self.handle
            )
        )
