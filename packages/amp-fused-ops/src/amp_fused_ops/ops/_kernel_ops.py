"""The norm and SyncBN dispatcher ops: schema, reference, fake kernel and kernel of last resort.

Beside the ``amp_C`` ops of :mod:`amp_fused_ops.ops._registry`, the package has seven ops that
take plain tensors: the LayerNorm / RMSNorm forward and backward and the five SyncBN steps.
Each is one :class:`KernelOpSpec` of :data:`KERNEL_OPS`, defined here in
``torch.ops.amp_fused_ops`` when this module is imported, and the dispatcher alone picks its
kernel (``docs/design.rst``, decision 10):

========================== ====================================================================
dispatch key               kernel
========================== ====================================================================
``CUDA``                   the CUDA kernel (``csrc/cuda/layer_norm.cu``, ``csrc/cuda/syncbn.cu``)
                           once the CUDA extension is loaded; norm inputs the kernel does not
                           take run the C++ reference there (``csrc/common/norm_reference.h``)
``CPU``                    for the norm ops, the C++ CPU kernel (``csrc/cpu/norm_ops.cpp``)
                           once the CPU extension is loaded
any other device, or no    the op's PyTorch implementation, registered here for
compiled kernel            ``CompositeExplicitAutograd``
``Meta`` / fake tensors    the fake kernel registered here: output shapes, no data
``AutogradCPU`` /          ``norm_forward``'s autograd formula in C++
``AutogradCUDA``           (``csrc/common/norm_autograd.h``), with the extension
``Autograd``               the same formula in Python, everywhere else
                           (:mod:`amp_fused_ops.normalization._ops`)
========================== ====================================================================

The kernel of last resort loads the device's extension on the op's first call there and then
hands the call to its kernel, as the ``amp_C`` ops' does. The autocast kernels follow each
entry's ``autocast`` rule (:mod:`amp_fused_ops.ops._autocast`; ``norm_forward`` casts to the
autocast dtype). The emulated CUDA build registers its kernels for the same schemas under
``torch.ops.amp_fused_ops_emu`` (:func:`define_kernel_ops` with that namespace).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.ops._autocast import AUTOCAST_RULES, register_autocast_kernels
from amp_fused_ops.ops._registry import OPS_NAMESPACE, compiled_kernel
from amp_fused_ops.reference import _norm, _syncbn

__all__ = ["KERNEL_OPS", "KernelOpSpec", "define_kernel_ops"]


# --- fake kernels: the real kernels' output shapes and dtypes, no data ----------------------


def _channels(x: Tensor, channel_last: bool) -> int:
    return x.shape[-1] if channel_last else x.shape[1]


def _per_channel(x: Tensor, channels: int) -> Tensor:
    return x.new_empty((channels,), dtype=torch.float32)


def _welford_mean_var_fake(x: Tensor, channel_last: bool) -> tuple[Tensor, Tensor]:
    channels = _channels(x, channel_last)
    return _per_channel(x, channels), _per_channel(x, channels)


def _welford_parallel_fake(
    means: Tensor, vars_biased: Tensor, counts: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    channels = means.shape[1]
    return tuple(_per_channel(means, channels) for _ in range(3))  # type: ignore[return-value]


def _forward_fake(x: Tensor, *args: Any) -> Tensor:
    return torch.empty_like(x)


def _reduce_fake(dy: Tensor, x: Tensor, mean: Tensor, channel_last: bool) -> tuple[Tensor, Tensor]:
    channels = _channels(x, channel_last)
    return _per_channel(x, channels), _per_channel(x, channels)


def _backward_fake(dy: Tensor, x: Tensor, *args: Any) -> Tensor:
    return torch.empty_like(x)


def _norm_forward_fake(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    mixed: bool,
    memory_efficient: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _norm.check_floating("norm_forward", x, weight, bias)
    _norm.check_mixed(weight, mixed)
    out = x.new_empty(x.shape, dtype=_norm.output_dtype(x, weight, mixed))
    stats = x.new_empty((x.shape[0],), dtype=torch.float32)
    return out, stats, stats.clone()


def _norm_backward_fake(
    grad_out: Tensor,
    saved: Tensor,
    mean: Tensor,
    invvar: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    rms: bool,
    memory_efficient: bool,
    input_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    dx = grad_out.new_empty(grad_out.shape, dtype=input_dtype)
    dw = torch.empty_like(weight) if weight is not None else grad_out.new_empty((0,))
    db = torch.empty_like(bias) if bias is not None and not rms else grad_out.new_empty((0,))
    return dx, dw, db


# --- the kernels where no compiled one serves ---------------------------------------------------


def _norm_forward_aten(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    mixed: bool,
    memory_efficient: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _norm.check_floating("norm_forward", x, weight, bias)
    _norm.check_mixed(weight, mixed)
    return _norm.norm_forward_aten(x, weight, bias, eps, rms, mixed)


def _norm_forward_reference(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    mixed: bool,
    memory_efficient: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _norm.check_floating("norm_forward", x, weight, bias)
    _norm.check_mixed(weight, mixed)
    return _norm.norm_forward_reference(x, weight, bias, eps, rms, mixed)


@dataclasses.dataclass(frozen=True)
class KernelOpSpec:
    """One op of :data:`KERNEL_OPS`.

    Attributes:
        schema: The dispatcher schema, ``name(arguments) -> returns``.
        reference: The pure-PyTorch reference, with the schema's arguments: the kernels' test
            oracle and what :func:`amp_fused_ops.extensions.use_reference` runs.
        fake: The fake (meta) kernel, with the schema's arguments.
        compiled_on: The device types whose extension registers a kernel of the op.
        fallback: The kernel where no compiled one serves, when it is not the reference (the
            norms take ATen's fused CPU LayerNorm where it computes the same).
        autocast: What ``torch.autocast`` does to the op: ``None`` (nothing, it runs in its
            tensors' dtypes) or ``"lower_precision"`` (see :mod:`amp_fused_ops.ops._autocast`).
    """

    schema: str
    reference: Callable[..., Any]
    fake: Callable[..., Any]
    compiled_on: tuple[str, ...] = ("cuda",)
    fallback: Callable[..., Any] | None = None
    autocast: str | None = None

    @property
    def name(self) -> str:
        return self.schema[: self.schema.index("(")]

    def __post_init__(self) -> None:
        if self.autocast not in AUTOCAST_RULES:
            raise ValueError(f"{self.name}: autocast must be one of {AUTOCAST_RULES}")


_SPECS = (
    KernelOpSpec(
        "norm_forward(Tensor x, Tensor? weight, Tensor? bias, float eps, bool rms, bool mixed, "
        "bool memory_efficient) -> (Tensor, Tensor, Tensor)",
        _norm_forward_reference,
        _norm_forward_fake,
        ("cpu", "cuda"),
        _norm_forward_aten,
        autocast="lower_precision",  # as Apex's fused norms under torch.autocast
    ),
    KernelOpSpec(
        "norm_backward(Tensor grad_out, Tensor saved, Tensor mean, Tensor invvar, "
        "Tensor? weight, Tensor? bias, bool rms, bool memory_efficient, "
        "ScalarType input_dtype) -> (Tensor, Tensor, Tensor)",
        _norm.norm_backward_reference,
        _norm_backward_fake,
        ("cpu", "cuda"),
        _norm.norm_backward_aten,
    ),
    KernelOpSpec(
        "syncbn_welford_mean_var(Tensor x, bool channel_last) -> (Tensor, Tensor)",
        _syncbn.syncbn_welford_mean_var,
        _welford_mean_var_fake,
    ),
    KernelOpSpec(
        "syncbn_welford_parallel(Tensor means, Tensor vars, Tensor counts, float eps) "
        "-> (Tensor, Tensor, Tensor)",
        _syncbn.syncbn_welford_parallel,
        _welford_parallel_fake,
    ),
    KernelOpSpec(
        "syncbn_forward(Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
        "Tensor? z, bool fuse_relu, bool channel_last) -> Tensor",
        _syncbn.syncbn_forward,
        _forward_fake,
    ),
    KernelOpSpec(
        "syncbn_reduce(Tensor dy, Tensor x, Tensor mean, bool channel_last) -> (Tensor, Tensor)",
        _syncbn.syncbn_reduce,
        _reduce_fake,
    ),
    KernelOpSpec(
        "syncbn_backward(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, "
        "Tensor sum_dy, Tensor sum_dy_xmu, int count, bool channel_last) -> Tensor",
        _syncbn.syncbn_backward,
        _backward_fake,
    ),
)

KERNEL_OPS: dict[str, KernelOpSpec] = {spec.name: spec for spec in _SPECS}
"""The norm and SyncBN ops by name."""


def _last_resort_kernel(spec: KernelOpSpec) -> Callable[..., Any]:
    """The ``CompositeExplicitAutograd`` kernel: on a device of ``spec.compiled_on``, the
    extension's kernel (the extension loaded on first use; every later call goes to its kernel
    directly); else the op's ``fallback``."""
    body = spec.fallback or spec.reference

    def kernel(first: Tensor, *rest: Any) -> Any:
        if first.device.type in spec.compiled_on:
            compiled = compiled_kernel(spec.name, first.device)
            if compiled is not None:
                return compiled(first, *rest)
        return body(first, *rest)

    kernel.__name__ = kernel.__qualname__ = f"{spec.name}_fallback"
    return kernel


_libraries: dict[str, torch.library.Library] = {}


def define_kernel_ops(namespace: str = OPS_NAMESPACE) -> None:
    """Define every op of :data:`KERNEL_OPS` in ``torch.ops.<namespace>`` (once per process),
    with its fake kernel; in :data:`~amp_fused_ops.ops._registry.OPS_NAMESPACE` also with its
    kernel of last resort.

    Args:
        namespace: The dispatcher namespace; the emulated CUDA build registers its kernels
            under one of its own.
    """
    if namespace in _libraries:
        return
    library = torch.library.Library(namespace, "FRAGMENT")
    for spec in KERNEL_OPS.values():
        library.define(spec.schema)
        if namespace == OPS_NAMESPACE:
            library.impl(spec.name, _last_resort_kernel(spec), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{spec.name}", spec.fake, lib=library)
    _libraries[namespace] = library


define_kernel_ops()
register_autocast_kernels(KERNEL_OPS.values(), OPS_NAMESPACE)
