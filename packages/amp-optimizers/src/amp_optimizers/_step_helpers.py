"""The small jobs every fused optimizer's step shares, written once.

Step counters (:func:`advance_step`, :func:`step_arguments`), argument checks
(:func:`check_betas`, :func:`check_nonnegative`, :func:`params_with_grads`), gradient
unscaling, DTensor shards and steps that run outside a ``torch.compile`` graph, the bucketing
of per-parameter tensors by ``(device, dtype)`` (:func:`group_by_device_dtype`: one
multi-tensor op per bucket) and :class:`AmpCOp`, the ``amp_C`` op an optimizer calls.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AmpCOp",
    "advance_step",
    "check_betas",
    "check_nonnegative",
    "first_param_device",
    "group_by_device_dtype",
    "holds_dtensors",
    "lr_arguments",
    "local_shards",
    "outside_graph",
    "params_with_grads",
    "step_arguments",
    "step_outside_graph",
    "unscale_grads_in_place",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def advance_step(holder: dict[str, Any], key: str = "step") -> int | Tensor:
    """Add one to the step count ``holder[key]`` (a param group or a param's state) and return it.

    In eager mode the count is a Python int, as Apex keeps it. Under ``torch.compile`` an int
    that changes every step would be a constant of the graph, recompiled each step; there the
    count becomes a one-element int64 CPU tensor advanced in place, data of one graph that
    serves every step (``docs/compile.rst``). Once a tensor, it stays one, also in eager mode.
    A count on another device (a capturable optimizer's) is advanced there.
    """
    count = holder.get(key, 0)
    if isinstance(count, Tensor):
        count.add_(1)
        return count
    if torch.compiler.is_compiling():
        tensor = torch.tensor(int(count) + 1, dtype=torch.int64)
        holder[key] = tensor
        return tensor
    holder[key] = int(count) + 1
    return holder[key]


def step_arguments(step: int | Tensor) -> tuple[int, Tensor | None]:
    """``(step, step_tensor)`` for an op with Apex's ``int step`` and the optional
    ``step_tensor``: a tensor count goes in ``step_tensor`` (on the CPU: the kernels read it on
    the host), and ``step`` is then 0 and unread."""
    if isinstance(step, Tensor):
        return 0, step if step.device.type == "cpu" else step.to("cpu")
    return step, None


def lr_arguments(lr: float | Tensor) -> tuple[float, Tensor | None]:
    """``(lr, lr_tensor)`` for an op with a ``float lr`` and the optional ``lr_tensor``.

    ``torch.optim`` accepts a tensor learning rate, which under ``torch.compile`` stays data
    of the graph (a float read from the param group would be a constant, recompiled whenever a
    scheduler changes it). The kernels read ``lr_tensor`` on the host, so a tensor on another
    device is copied to the CPU here (a sync, as reading it would be); ``lr`` is then 0 and
    unread.
    """
    if isinstance(lr, Tensor):
        lr_tensor = lr.detach()
        return 0.0, lr_tensor if lr_tensor.device.type == "cpu" else lr_tensor.to("cpu")
    return lr, None


Bucket = list[list[Tensor]]


def check_nonnegative(optimizer: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number >= 0, or a one-element floating
    tensor holding one (read back once, at construction)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"{optimizer}: invalid {name}: a tensor {name} must hold one floating-point "
                f"value, got shape {tuple(value.shape)} and dtype {value.dtype}; pass e.g. "
                "torch.tensor(1e-3)"
            )
        number = float(value.detach().reshape(()).item())
        if not number >= 0.0 or not math.isfinite(number):
            raise ValueError(
                f"{optimizer}: invalid {name} {number!r} (a tensor); it must be a finite "
                "number >= 0"
            )
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0:
        raise ValueError(f"{optimizer}: invalid {name} {value!r}; it must be a number >= 0")
    if not math.isfinite(value):
        raise ValueError(f"{optimizer}: invalid {name} {value!r}; it must be finite")


def unscale_grads_in_place(grads: Sequence[Tensor], grad_scale: Tensor) -> None:
    """Divide ``grads`` by ``grad_scale`` in place, on their devices (no host sync).

    What ``torch.amp.GradScaler`` leaves behind for a plain optimizer (it unscales ``.grad``
    in place): an optimizer that unscales inside its step calls this after it, so code that
    reads the gradients after ``scaler.step(optimizer)`` sees the same values either way.
    """
    inv = grad_scale.double().reciprocal().float().reshape(())
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, inv.to(device))


def local_shards(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` with every DTensor (FSDP2 param or state) replaced by its local shard.

    Under ``torch.compile`` (which steps plain params here) ``tensors`` as they are.
    """
    if torch.compiler.is_compiling():
        return tensors
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def holds_dtensors(params: Iterable[Tensor]) -> bool:
    """Whether any of ``params`` is a DTensor (an FSDP2 param): decided once per step (a
    step plan keeps it), so that the ops' calls need not look at their tensors' types."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in params)


def step_outside_graph(param_groups: Iterable[dict[str, Any]]) -> bool:
    """Whether a step of an optimizer that takes norms of whole tensors (LAMB, NovoGrad) runs
    outside the graph: under ``torch.compile``, with DTensor (FSDP2) params.

    Such a step all-reduces the shards' partial norms over the ranks in the ops' PyTorch
    reference (``docs/large_models.rst``). Traced, it breaks the graph at host reads inside
    loops, recompiles as the step count changes, and the state it creates in a graph of
    DTensors of uneven shards took another rank's local shape. Run as in eager mode (one graph
    break, :func:`outside_graph`), it gives the eager result on every rank.
    """
    if not torch.compiler.is_compiling():
        return False
    return holds_dtensors(p for group in param_groups for p in group["params"])


_eager_call: Callable[..., Any] | None = None


def outside_graph(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run eagerly while ``torch.compile`` traces (one graph break).

    ``torch.compiler.disable`` imports ``torch._dynamo``, which importing this package must
    not: the wrapper is made on first use, always under ``torch.compile``.
    """
    global _eager_call
    if _eager_call is None:
        _eager_call = torch.compiler.disable(_call)
    return _eager_call(fn, *args, **kwargs)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def check_betas(optimizer: str, betas: Any) -> None:
    """Raise ``ValueError`` unless ``betas`` is a pair of numbers in ``[0, 1)``."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{optimizer}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(
                f"{optimizer}: invalid beta parameter at index {i}: {beta!r}; "
                "each beta must be in [0, 1)"
            )


def params_with_grads(optimizer: str, params: Iterable[Tensor]) -> list[Tensor]:
    """The params of a group that have a gradient, after checking sparsity and dtype.

    Raises:
        RuntimeError: A gradient is sparse, or a param is not float32/float16/bfloat16.
    """
    out = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(
                f"{optimizer} does not support sparse gradients, please consider SparseAdam instead"
            )
        if p.dtype not in _SUPPORTED_DTYPES:
            raise RuntimeError(
                f"{optimizer} supports float32, float16 and bfloat16 params, got {p.dtype}; "
                "cast the model with .float(), .half() or .bfloat16()"
            )
        out.append(p)
    return out


def group_by_device_dtype(
    rows: Iterable[Sequence[Any]],
) -> dict[tuple[torch.device, torch.dtype], Bucket]:
    """Transpose per-param rows into per-``(device, dtype)`` column lists.

    Args:
        rows: One tuple per param, its first element the param itself, e.g.
            ``(param, grad, exp_avg, exp_avg_sq)``.

    Returns:
        ``{(device, dtype): [column_0, column_1, ...]}`` with the key taken from the param, the
        columns in row order: exactly the ``tensor_lists`` of one multi-tensor launch.
    """
    rows = rows if isinstance(rows, list) else list(rows)
    keys = [(row[0].device, row[0].dtype) for row in rows]
    if keys and keys.count(keys[0]) == len(keys):
        # One device and dtype (the usual case): a transposition, without a lookup per row.
        return {keys[0]: [list(column) for column in zip(*rows, strict=True)]}
    buckets: dict[tuple[torch.device, torch.dtype], Bucket] = {}
    for key, row in zip(keys, rows, strict=True):
        columns = buckets.get(key)
        if columns is None:
            columns = buckets[key] = [[] for _ in row]
        for column, tensor in zip(columns, row, strict=True):
            column.append(tensor)
    return buckets


class AmpCOp:
    """A class attribute that reads the ``amp_C`` op of the given name (Apex's op handles).

    Apex's fused optimizers bind their multi-tensor ops in the constructor
    (``self.multi_tensor_adam = amp_C.multi_tensor_adam``) and code built on them reads those
    handles (fairseq's ``FusedAdam`` subclass refuses to run without ``multi_tensor_adam``) and
    calls them through ``multi_tensor_applier`` with Apex's arguments. The handle is looked up
    by name on ``amp_fused_ops.amp_C`` when read, so it is exactly that op; an op the installed
    amp-fused-ops does not provide reads as a missing attribute (``hasattr`` is False). An
    instance may assign its own handle over it, as with any attribute.

    Args:
        op_name: The name of the op in ``amp_C``.
    """

    def __init__(self, op_name: str) -> None:
        self.op_name = op_name

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr_name = name

    def __get__(self, obj: object, objtype: type | None = None) -> Callable[..., Any]:
        from amp_fused_ops import amp_C

        op = getattr(amp_C, self.op_name, None)
        if op is None:
            raise AttributeError(
                f"{getattr(objtype, '__name__', 'optimizer')}.{self.attr_name}: the installed "
                f"amp-fused-ops has no amp_C.{self.op_name}; upgrade amp-fused-ops"
            )
        return op


def first_param_device(param_groups: Iterable[dict[str, Any]]) -> torch.device:
    """The device of the first param of the first non-empty group (CPU when there is none)."""
    for group in param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
