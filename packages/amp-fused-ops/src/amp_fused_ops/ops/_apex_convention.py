"""Apex's calling convention for the registry's ops: ``op(chunk_size, noop_flag, lists, *args)``.

A dispatcher schema has no list of tensor lists, so each op of
:data:`amp_fused_ops.ops._registry.REGISTRY` takes Apex's ``tensor_lists`` as separate
arguments. :func:`apex_convention` wraps one op back into Apex's signature (``amp_C``): it
checks the number of lists, turns Python numbers into the schema's tensor scalars, moves a
tensor learning rate to ``lr_tensor``, and steps DTensor (FSDP2) arguments on their local
shards (norms and overflow decisions agreed across the ranks, :mod:`amp_fused_ops.ops._sharding`).
:func:`compiled_ops` lists the ops a loaded extension has kernels for, so wrapped.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.ops._registry import REGISTRY, define_schemas
from amp_fused_ops.ops._schema_calls import (
    SHARD_NORM_OPS,
    holds_dtensor,
    raise_wrong_device,
    sharded_call,
)
from amp_fused_ops.ops._sharding import dtensor_type, outside_graph

__all__ = ["apex_convention", "compiled_ops"]


def _number_tensor(
    op: str, name: str, value: Any, device: torch.device, cpu: bool, written: bool = False
) -> Any:
    """``value`` as a one-element tensor when it is a Python number.

    Apex's callers pass ``lr``, ``step``, ``inv_scale`` ... as numbers or tensors; the schema
    takes a tensor: float64 on the CPU (the C++ kernels read it in double), float32 on the
    device otherwise. A tensor the op writes (``written``, NovoGrad's ``grad_norms``) must be
    given as one.
    """
    if isinstance(value, Tensor):
        return value
    if written:
        raise TypeError(f"{op}: {name} must be a tensor, got {type(value).__name__}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{op}: {name} must be a tensor or a number, got {type(value).__name__}; pass a "
            "one-element tensor (or a float)"
        )
    if cpu:
        return torch.tensor(float(value), dtype=torch.float64)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def apex_convention(
    name: str,
    overload: Any,
    *,
    cpu_scalars: bool | None = None,
    explain: Callable[[Any, tuple[Any, ...], dict[str, Any]], None] | None = None,
) -> Callable[..., Any]:
    """``overload`` (an op of :data:`REGISTRY`, separate list arguments) called as Apex's
    ``amp_C.<name>(chunk_size, noop_flag, tensor_lists, *args)``.

    A Python number given for a tensor scalar of the schema (``lr``, ``step``,
    ``inv_scale`` ...) becomes a tensor (see :func:`_number_tensor`): float64 on the CPU and
    float32 on other devices, unless ``cpu_scalars`` says which (the emulated CUDA kernels run
    on the CPU and read float32). Ops without tensor lists are returned as they are.

    ``explain(chunk_size, args, kwargs)``, when given, runs before any error of a call leaves
    the wrapper (the kernel's, or the wrapper's own), and before the cross-rank work of a
    sharded call: ``amp_C`` checks its table of preconditions there, so that its error, when
    the scalar arguments break one, is the one raised, while a call that succeeds is checked
    by its kernel only.
    """
    counts = REGISTRY[name].list_counts
    if not counts:  # update_scale_hysteresis: Apex's returns its first argument

        def plain(current_scale: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            overload(current_scale, *args, **kwargs)
            return current_scale

        plain.__name__ = plain.__qualname__ = name
        return plain
    most = max(counts)
    layouts = f"{' or '.join(map(str, counts))} tensor list{'' if list(counts) == [1] else 's'}"
    scalars = overload._schema.arguments[2 + most :]
    names = [argument.name for argument in scalars]
    # A tensor given for a ``float lr`` goes to the op's ``lr_tensor`` (see _tensor_lr).
    lr_at = (names.index("lr"), names.index("lr_tensor")) if "lr_tensor" in names else None
    numbers = tuple(
        (
            index,
            argument.name,
            argument.alias_info is not None and argument.alias_info.is_write,
        )
        for index, argument in enumerate(scalars)
        if str(argument.type) == "Tensor"
    )
    norm_op = name in SHARD_NORM_OPS
    # The dispatcher's callable behind the overload, without OpOverload.__call__'s Python frame;
    # torch.compile traces the overload itself.
    eager = getattr(overload, "_op", overload)

    def op(
        chunk_size: int,
        noop_flag: Tensor,
        tensor_lists: Sequence[Sequence[Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        given_args, given_kwargs = args, kwargs  # as the caller wrote them, for explain
        sharded = False
        try:
            given = len(tensor_lists)
            if given not in counts:
                raise ValueError(f"{name}: expected {layouts}, got {given}")
            if lr_at is not None:
                args, kwargs = _tensor_lr(name, *lr_at, args, kwargs)
            dtensor = dtensor_type()
            if dtensor is not None and holds_dtensor(dtensor, tensor_lists):
                sharded = True
                if explain is not None:
                    explain(chunk_size, given_args, given_kwargs)
                if norm_op and torch.compiler.is_compiling():
                    # The cross-rank reductions of a sharded step run outside the graph (see
                    # outside_graph), on the DTensors themselves.
                    return outside_graph(op, chunk_size, noop_flag, tensor_lists, *args, **kwargs)

                def scalars(lists: list[Any], args: Any, kwargs: Any) -> Any:
                    # For the kernel (a norm op's reference takes Apex's arguments as given).
                    if "mode" in kwargs:
                        kwargs = {**kwargs, "decay_mode": kwargs["mode"]}
                        del kwargs["mode"]
                    if not numbers:
                        return args, kwargs
                    return _tensor_numbers(
                        name, numbers, noop_flag, lists, args, kwargs, cpu_scalars
                    )

                return sharded_call(
                    name, overload, chunk_size, noop_flag, tensor_lists, args, kwargs, scalars
                )
            if kwargs and "mode" in kwargs:
                kwargs = {**kwargs, "decay_mode": kwargs["mode"]}
                del kwargs["mode"]
            if numbers:
                args, kwargs = _tensor_numbers(
                    name, numbers, noop_flag, tensor_lists, args, kwargs, cpu_scalars
                )
            kernel = overload if torch.compiler.is_compiling() else eager
            if given == most:
                return kernel(chunk_size, noop_flag, *tensor_lists, *args, **kwargs)
            return kernel(
                chunk_size, noop_flag, *tensor_lists, *([None] * (most - given)), *args, **kwargs
            )
        except Exception as error:
            if explain is not None and not sharded:
                try:
                    explain(chunk_size, given_args, given_kwargs)
                except ValueError as mistake:
                    raise mistake from None
            if isinstance(error, NotImplementedError) and not sharded:
                raise_wrong_device(name, noop_flag, tensor_lists)
            raise

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``torch.ops.{overload.namespace}.{name}`` with Apex's ``amp_C`` arguments."
    return op


def _tensor_numbers(
    name: str,
    numbers: tuple[tuple[int, str, bool], ...],
    noop_flag: Tensor,
    tensor_lists: Sequence[Sequence[Tensor]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cpu_scalars: bool | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with the Python numbers given for the schema's tensor scalars
    (``numbers``: their positions, names and whether the op writes them) made tensors on the
    tensors' device."""
    first = tensor_lists[0][0] if tensor_lists and tensor_lists[0] else noop_flag
    if not isinstance(first, Tensor):
        first = noop_flag
    device = first.device
    cpu = device.type == "cpu" if cpu_scalars is None else cpu_scalars
    args_list: list[Any] | None = None
    for index, argument, written in numbers:
        if index < len(args):
            value = args[index]
            if not isinstance(value, Tensor):
                if args_list is None:
                    args_list = list(args)
                args_list[index] = _number_tensor(name, argument, value, device, cpu, written)
        elif argument in kwargs:
            value = _number_tensor(name, argument, kwargs[argument], device, cpu, written)
            kwargs = {**kwargs, argument: value}
    return (args if args_list is None else tuple(args_list)), kwargs


def _tensor_lr(
    name: str, lr_at: int, lr_tensor_at: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with a tensor given for the op's ``float lr`` moved to ``lr_tensor``.

    ``torch.optim`` accepts a tensor learning rate, which under ``torch.compile`` stays data of
    the graph (a float read from the param group would be a constant, recompiled whenever a
    scheduler changes it). The kernels take the rate as a double and read ``lr_tensor`` on the
    host, so a tensor on another device is copied to the CPU here (which syncs, as reading it
    would). ``lr`` is then 0 and unread.

    Raises:
        ValueError: A tensor ``lr`` together with an ``lr_tensor``.
    """
    in_args = lr_at < len(args)
    lr = args[lr_at] if in_args else kwargs.get("lr")
    if not isinstance(lr, Tensor):
        return args, kwargs
    if kwargs.get("lr_tensor") is not None or (
        lr_tensor_at < len(args) and args[lr_tensor_at] is not None
    ):
        raise ValueError(
            f"{name}: lr is a tensor and lr_tensor is given too; pass the learning rate once, "
            "as lr (a float or a tensor) or as lr_tensor"
        )
    lr_tensor = lr.detach()
    if lr_tensor.device.type != "cpu":
        lr_tensor = lr_tensor.to("cpu")
    if in_args:
        args = (*args[:lr_at], 0.0, *args[lr_at + 1 :])
    else:
        kwargs = {**kwargs, "lr": 0.0}
    return args, {**kwargs, "lr_tensor": lr_tensor}


def compiled_ops(
    namespace: str, dispatch_key: str, path: str | Path, *, cpu_scalars: bool | None = None
) -> types.ModuleType:
    """The ops of ``torch.ops.<namespace>`` that have a kernel for ``dispatch_key``, as a module.

    Each attribute is one op with Apex's ``amp_C`` signature (:func:`apex_convention`).

    Args:
        namespace: The dispatcher namespace (:data:`~amp_fused_ops.ops._registry.OPS_NAMESPACE`;
            the emulation build's own).
        dispatch_key: ``"CPU"`` or ``"CUDA"``: only the ops with a kernel for it are listed.
        path: The shared library that registered the kernels (loaded already); the module's
            ``__file__``.
        cpu_scalars: As in :func:`apex_convention`.

    Returns:
        The module of ops.
    """
    define_schemas(namespace)
    module = types.ModuleType(
        f"{namespace}.{dispatch_key.lower()}",
        f"Kernels of torch.ops.{namespace} for {dispatch_key}, with Apex's amp_C signatures.",
    )
    module.__file__ = str(path)
    packets = getattr(torch.ops, namespace)
    for name in REGISTRY:
        qualified = f"{namespace}::{name}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, dispatch_key):
            continue
        overload = getattr(packets, name).default
        setattr(module, name, apex_convention(name, overload, cpu_scalars=cpu_scalars))
    return module
