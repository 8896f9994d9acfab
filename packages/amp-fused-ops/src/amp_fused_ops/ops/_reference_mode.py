"""``use_reference()``: run every op of this package on its PyTorch reference, in this process.

A compiled extension registers its kernels with the dispatcher when it is loaded, and a C++
registration cannot be undone: once the CPU (or CUDA) extension is loaded, the dispatcher
picks its kernels for the rest of the process, whatever ``AMP_FUSED_OPS_DISABLE`` says later.
:func:`use_reference` overrides the choice at the dispatcher for a block instead: a
``TorchDispatchMode`` that sees the calls of this package's ops (below autograd and autocast,
above every device kernel) and runs the op's registered reference in place of any kernel.

The ops it routes, by namespace (every device, since the mode sits above the device keys):

============================ ==================================================================
``amp_fused_ops``            the ``amp_C`` ops (each its reference in
                             :data:`~amp_fused_ops.ops._registry.REGISTRY`), the norm and SyncBN
                             ops (:data:`~amp_fused_ops.ops._kernel_ops.KERNEL_OPS`)
``amp_fused_ops_emu``        the same ops of the emulated CUDA build
============================ ==================================================================
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from amp_fused_ops.ops._kernel_ops import KERNEL_OPS
from amp_fused_ops.ops._registry import OPS_NAMESPACE, REGISTRY, reference_kernel

__all__ = [
    "ReferenceCalls",
    "Router",
    "override_kernels",
    "run_overridden",
    "use_reference",
]

ReferenceCalls: TypeAlias = collections.Counter[str]
"""What :func:`use_reference` yields: ``"namespace::op"`` -> how many calls ran the reference."""

_EMULATED_OPS_NAMESPACE = "amp_fused_ops_emu"  # AMP_FUSED_OPS_NS in csrc/emulation/amp_emu.h

# The namespaces whose ops an override may reroute, as qualified-name prefixes.
_NAMESPACES = (f"{OPS_NAMESPACE}::", f"{_EMULATED_OPS_NAMESPACE}::")

_table: dict[str, Callable[..., Any]] = {}


def _references() -> dict[str, Callable[..., Any]]:
    """``"namespace::op"`` -> the reference with the op's schema arguments (built on first
    use)."""
    if _table:
        return _table
    table: dict[str, Callable[..., Any]] = {}
    for namespace in (OPS_NAMESPACE, _EMULATED_OPS_NAMESPACE):
        for name, spec in REGISTRY.items():
            table[f"{namespace}::{name}"] = reference_kernel(spec)
        for name, kernel_op in KERNEL_OPS.items():
            table[f"{namespace}::{name}"] = kernel_op.reference
    _table.update(table)
    return _table


def _written(func: Any) -> tuple[int, ...]:
    """The positions of the arguments ``func``'s schema marks as written (``Tensor(a!)``)."""
    return tuple(
        index
        for index, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _bump_versions(args: tuple[Any, ...], written: tuple[int, ...]) -> None:
    """Bump the autograd version of every tensor at ``written`` (a tensor or a list of them).

    The reference's in-place ATen ops run below autograd here (a dispatch mode's handler runs
    where the dispatcher is, past the key that counts versions), so their writes are
    counted here, as every kernel of the ops counts its own.
    """
    tensors: list[torch.Tensor] = []
    for index in written:
        value = args[index]
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, list | tuple):
            tensors.extend(t for t in value if isinstance(t, torch.Tensor))
    if tensors:
        torch.autograd.graph.increment_version(tensors)


def _without_data(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a tensor argument is a meta or fake tensor: no values, so the fake kernel runs."""
    return any(
        isinstance(leaf, torch.Tensor) and (leaf.device.type == "meta" or is_fake(leaf))
        for leaf in tree_leaves((args, kwargs))
    )


def _positional(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Every argument of ``func``'s schema by position (defaults for those not given)."""
    arguments = func._schema.arguments
    if len(args) == len(arguments) and not kwargs:
        return args
    values = list(args)
    for argument in arguments[len(args) :]:
        if argument.name in kwargs:
            values.append(kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise TypeError(f"{func}: missing argument {argument.name!r}")
    return tuple(values)


Router: TypeAlias = Callable[[str, tuple[Any, ...]], Callable[..., Any] | None]
"""``(qualified op name, positional arguments) -> the kernel to run instead, or None``."""


class _OverrideMode(TorchDispatchMode):
    """Runs, for this package's ops, the kernel its router names (with the op's schema
    arguments, all positional); every other call passes through unchanged."""

    def __init__(self, route: Router) -> None:
        super().__init__()
        self.route = route
        self.counters: list[ReferenceCalls] = []
        self.lock = threading.Lock()  # autograd's device threads run backward ops too

    def __torch_dispatch__(  # type: ignore[no-untyped-def]
        self, func, types, args=(), kwargs=None
    ):
        kwargs = kwargs or {}
        done, out = self.run(func, args, kwargs)
        return out if done else func(*args, **kwargs)

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """``(True, result)`` when the route names a kernel for this call (which then ran),
        else ``(False, None)``."""
        qualified = func._schema.name
        if "::" not in qualified or not qualified.startswith(_NAMESPACES):
            return False, None
        positional = _positional(func, args, kwargs)
        kernel = self.route(qualified, positional)
        if kernel is None or _without_data(args, kwargs):
            return False, None
        with self.lock:
            for calls in self.counters:
                calls[qualified] += 1
        out = kernel(*positional)
        _bump_versions(positional, _written(func))
        return True, out


def run_overridden(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """Run ``func`` on the kernel an override open on this thread names for it, the latest
    opened first: ``(True, result)``, or ``(False, None)`` when none does.

    For a dispatch mode above the overrides that handles this package's ops itself (the
    emulator's CUDA-graph capture), which would otherwise bypass them.
    """
    modes: dict[str, _OverrideMode] = getattr(_local, "modes", {})
    for mode in reversed(list(modes.values())):
        done, out = mode.run(func, args, kwargs)
        if done:
            return True, out
    return False, None


def _reference_route(qualified: str, positional: tuple[Any, ...]) -> Callable[..., Any] | None:
    return _references().get(qualified)


@contextlib.contextmanager
def override_kernels(key: str, route: Router) -> Iterator[ReferenceCalls]:
    """Run this package's ops on the kernels ``route`` names while the block is open, on this
    thread; yields the count of the calls it rerouted, by qualified op name.

    Blocks of one ``key`` nest and share one override (see :func:`use_reference`); a block of
    another key opened inside takes precedence over it while it is open.
    """
    calls: ReferenceCalls = collections.Counter()
    modes: dict[str, _OverrideMode] = _local.__dict__.setdefault("modes", {})
    mode = modes.get(key)
    outermost = mode is None
    if mode is None:
        mode = _OverrideMode(route)
        modes[key] = mode
        mode.__enter__()
    mode.counters.append(calls)
    try:
        yield calls
    finally:
        # By identity: two counters with the same counts are equal.
        mode.counters[:] = [c for c in mode.counters if c is not calls]
        if outermost:
            del modes[key]
            mode.__exit__(None, None, None)


# The overrides of this thread while their blocks are open (``modes``: key -> mode). The
# counters of the blocks that share one are on the mode.
_local = threading.local()


@contextlib.contextmanager
def use_reference() -> Iterator[ReferenceCalls]:
    """Run every op of amp-fused-ops on its pure-PyTorch reference while the block is open.

    Covers every op of the package on every device: the ``amp_C`` multi-tensor ops (however
    they are called: ``amp_C``, ``multi_tensor_applier``, the fused optimizers of
    amp-optimizers, ``torch.ops.amp_fused_ops.<op>``), the fused LayerNorm /
    RMSNorm forward and backward, the SyncBN kernels, and the same ops of the CUDA extension
    and of the emulated CUDA build. The compiled kernels stay loaded; they serve the ops again
    as soon as the block ends, also when its body raises. Unlike ``AMP_FUSED_OPS_DISABLE``
    (read once, before the first op loads an extension), it works at any time in a process.

    The override sits at the dispatcher (a ``TorchDispatchMode``, below autograd and autocast):
    autograd, autocast and the ops' checks of their arguments behave as outside the block, and
    only the kernel changes. Ops of other libraries pass through untouched, and so do calls on
    meta or fake tensors (their fake kernels: there are no values to compute).

    Blocks nest: an inner block shares the outer one's override and counts its own calls;
    leaving it keeps the outer block's override in place.

    Thread safety: PyTorch keeps dispatch modes per thread, so the override applies to the
    thread that opened the block (and to the backward of the ops it ran, which autograd runs
    with that thread's modes); other threads keep the normal dispatch meanwhile. Open and
    close a block on the same thread.

    ``torch.compile``: while a dispatch mode is active, Dynamo neither traces nor runs a
    compiled graph, so a compiled function called inside the block (compiled before it or
    not) runs its Python code eagerly and its ops run the reference like any other call;
    after the block it runs compiled again. With ``fullgraph=True`` the call raises PyTorch's
    ``RuntimeError`` about an active dispatch mode instead. ``torch.export`` is not supported
    inside the block.

    Yields:
        A :class:`collections.Counter` of the calls that ran a reference in this block, keyed
        by the op's qualified name (``"amp_fused_ops::multi_tensor_adam"``,
        ``"amp_fused_ops::norm_forward"`` ...): the proof that the reference ran.

    Example:
        >>> from amp_fused_ops.extensions import use_reference
        >>> with use_reference() as calls:
        ...     optimizer.step()  # a FusedAdam: the reference of multi_tensor_adam runs
        >>> calls["amp_fused_ops::multi_tensor_adam"]
        1
    """
    with override_kernels("reference", _reference_route) as calls:
        yield calls
