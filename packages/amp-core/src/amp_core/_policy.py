"""Apex's O1 casting policy, as one table, and the autocast kernels that enforce it.

O1 rides on PyTorch's autocast dispatch: the C++ autocast kernels already cast most ops. Where
PyTorch's policy for a device lacks an op of Apex's policy (CPU autocast leaves ``softmax``,
``layer_norm``, ``exp``, ``sum`` ... in bf16; CUDA autocast leaves ``std``/``var`` alone), this
module registers an autocast kernel for that op and device key, so that the policy below holds
on every device. Registrations live in one ``torch.library.Library`` per activation and are
removed when casting is switched off.
"""

from __future__ import annotations

import enum
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

__all__ = [
    "BANNED_MESSAGE",
    "FP32_TENSOR_METHODS",
    "POLICY",
    "Cast",
    "PolicyKernels",
    "cast_args",
    "widest_dtype",
]


class Cast(enum.Enum):
    """What O1 does to the floating inputs of an op."""

    LOW = "low"  # run in the half dtype (matmul, conv, linear)
    FP32 = "fp32"  # run in fp32 (reductions, softmax, norms, losses, pointwise math)
    PROMOTE = "promote"  # run in the widest floating dtype among the inputs
    BANNED = "banned"  # refuse half inputs (binary_cross_entropy); fp32 inputs run
    NO_HALF_INPLACE = "no_half_inplace"  # in-place fp32 op: refuse a half tensor to write into


# The policy, by aten op name (all tensor overloads of each name). Mirrors Apex's lists in
# apex/amp/lists/{torch,functional,tensor}_overrides.py, expressed at the aten level, so the
# Python functions, Tensor methods and nn modules that reach these ops are all covered. An op
# of another library is named with its namespace ("amp_fused_ops::norm_forward"); it is covered
# when that library has defined it by the time O1 casting is switched on, and its own autocast
# kernel (if any) gives way to the policy's while O1 is on.
#: Apex's O1 policy: for each :class:`Cast`, the aten op names it applies to.
POLICY: dict[Cast, tuple[str, ...]] = {
    Cast.LOW: (
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "conv_tbc", "prelu", "linear",
        "addmm", "addmv", "addr", "matmul", "mm", "mv", "bmm", "baddbmm", "addbmm",
        # recurrent layers and cells (Apex cast their inputs, weights and hidden states)
        "lstm", "gru", "rnn_tanh", "rnn_relu",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    ),
    Cast.FP32: (
        # pointwise
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus",
        # reductions
        "cumprod", "cumsum", "dist", "norm", "linalg_vector_norm", "prod", "std", "sum",
        "var", "renorm",
        # softmax and normalization (the fused norms of amp-fused-ops follow layer_norm)
        "softmax", "log_softmax", "layer_norm", "group_norm", "cosine_similarity",
        "amp_fused_ops::norm_forward",
        # interpolation
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
        "upsample_trilinear3d", "grid_sampler",
        # losses
        "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy_loss",
        "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "nll_loss2d", "nll_loss_nd",
        "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "soft_margin_loss",
        "triplet_margin_loss", "ctc_loss",
    ),
    Cast.PROMOTE: (
        "addcdiv", "addcmul", "atan2", "cross", "linalg_cross", "bilinear", "dot", "cat",
        "stack",
    ),
    Cast.BANNED: ("binary_cross_entropy",),
    # The in-place twins of the fp32 pointwise and reduction ops: a half result cannot be
    # written in fp32, so Apex refused them on half tensors (and so do we).
    Cast.NO_HALF_INPLACE: (
        "acos_", "asin_", "cosh_", "erfinv_", "exp_", "expm1_", "log_", "log10_", "log2_",
        "reciprocal_", "rsqrt_", "sinh_", "tan_", "pow_", "cumprod_", "cumsum_", "renorm_",
    ),
}  # fmt: skip

#: Tensor methods cast to fp32 in Python (no aten op tells them apart): ``Tensor.cpu()`` of a
#: half tensor returns an fp32 tensor, as in Apex ("cast to fp32 before transfer to CPU").
FP32_TENSOR_METHODS: tuple[str, ...] = ("cpu",)

# Ops PyTorch's autocast covers on a device through the op they call: CUDA runs ``lstm`` and
# friends through ``_cudnn_rnn``, which its autocast casts to half (with a cached weight copy).
_COVERED_BELOW: dict[str, frozenset[str]] = {
    "cuda": frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"}),
}

BANNED_MESSAGE = (
    "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` "
    "It requires that the output of the previous function be already a FloatTensor. \n\n"
    "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
    "    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss into a single layer "
    "that is compatible with amp.\nAnother option is to add\n"
    "    amp.register_float_function(torch, 'sigmoid')\nbefore calling `amp.initialize()`."
)


def inplace_message(name: str, dtype: torch.dtype) -> str:
    """The error for an in-place fp32-policy op on a half tensor."""
    return (
        f"Cannot call in-place function {name} on a {dtype} tensor under amp O1: the op runs in "
        f"float32 and its result cannot be written back in {dtype}. Use the out-of-place "
        f"version (for example `x = x.{name[:-1]}()`), or call it inside `amp.disable_casts()`."
    )


_AUTOCAST_KEYS = {"cpu": DispatchKey.AutocastCPU, "cuda": DispatchKey.AutocastCUDA}
# Registering over a kernel that another Python library registered (an op's own autocast
# kernel): allowed by default where torch.library has the switch, and asked for explicitly.
_OVERRIDE = (
    {"allow_override": True}
    if "allow_override" in inspect.signature(torch.library.Library.impl).parameters
    else {}
)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _iter_tensors(v)


def widest_dtype(values: Iterable[Any]) -> torch.dtype | None:
    """The widest floating dtype among the tensors in ``values`` (``None`` if there are none)."""
    widest: torch.dtype | None = None
    for t in _iter_tensors(list(values)):
        if t.is_floating_point():
            widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
    return widest


def cast_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, *, only: tuple[Any, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast the floating tensors of ``args``/``kwargs`` whose dtype is in ``only`` to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype in only and t.dtype != dtype else t

    return _map_tensors(args, cast), {k: _map_tensors(v, cast) for k, v in kwargs.items()}


def _tensor_overloads(name: str, *, mutable: bool = False) -> list[torch._ops.OpOverload]:
    namespace, _, op_name = name.rpartition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace or "aten"), op_name)
    except (AttributeError, RuntimeError):  # an op of a library that is not loaded
        return []
    found = []
    for overload_name in packet.overloads():
        if "out" in overload_name.split("_"):
            continue
        overload = getattr(packet, overload_name)
        schema = overload._schema
        takes_tensor = any(
            isinstance(a.type, (torch.TensorType, torch.ListType)) for a in schema.arguments
        )
        returns_tensor = any(isinstance(r.type, torch.TensorType) for r in schema.returns)
        if takes_tensor and returns_tensor and schema.is_mutable == mutable:
            found.append(overload)
    return found


def _make_kernel(
    op: torch._ops.OpOverload, cast: Cast, device_type: str, key: DispatchKey
) -> Callable[..., Any]:
    below = DispatchKeySet(key)

    if cast is Cast.BANNED:

        def banned(*args: Any, **kwargs: Any) -> Any:
            # As Apex: refused when an input is half; fp32 inputs run (in fp32).
            if any(t.dtype in _LOW_PRECISION for t in _iter_tensors([*args, *kwargs.values()])):
                raise NotImplementedError(BANNED_MESSAGE)
            with torch._C._ExcludeDispatchKeyGuard(below):
                return op(*args, **kwargs)

        return banned

    if cast is Cast.NO_HALF_INPLACE:
        name = op.name().split("::", 1)[1].split(".", 1)[0]

        def no_half_inplace(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.dtype in _LOW_PRECISION:
                raise NotImplementedError(inplace_message(name, self.dtype))
            with torch._C._ExcludeDispatchKeyGuard(below):
                args, kwargs = cast_args(args, kwargs, torch.float32, only=_LOW_PRECISION)
                return op(self, *args, **kwargs)

        return no_half_inplace

    call = getattr(op, "_op", op)  # the C++ callable: one Python frame less per call
    guard = torch._C._ExcludeDispatchKeyGuard

    if cast is Cast.FP32:
        # Most calls under O1 get fp32 inputs already: look before rebuilding the arguments.
        def fp32(*args: Any, **kwargs: Any) -> Any:
            with guard(below):
                if _has_dtype(args, _LOW_PRECISION) or (
                    kwargs and _has_dtype(tuple(kwargs.values()), _LOW_PRECISION)
                ):
                    args, kwargs = cast_args(args, kwargs, torch.float32, only=_LOW_PRECISION)
                return call(*args, **kwargs)

        return fp32

    if cast is Cast.LOW:

        def low(*args: Any, **kwargs: Any) -> Any:
            with guard(below):
                half = torch.get_autocast_dtype(device_type)
                args, kwargs = cast_args(args, kwargs, half, only=(torch.float32, *_LOW_PRECISION))
                return call(*args, **kwargs)

        return low

    def promote(*args: Any, **kwargs: Any) -> Any:
        with guard(below):
            widest = widest_dtype([*args, *kwargs.values()])
            if widest is not None:
                args, kwargs = cast_args(
                    args, kwargs, widest, only=(torch.float32, torch.float64, *_LOW_PRECISION)
                )
            return call(*args, **kwargs)

    return promote


def _has_dtype(values: tuple[Any, ...] | list[Any], dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether a tensor in ``values`` (nested lists and tuples included) has one of ``dtypes``."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dtype in dtypes:
                return True
        elif isinstance(v, (list, tuple)) and _has_dtype(v, dtypes):
            return True
    return False


class PolicyKernels:
    """Autocast kernels that close the gaps between PyTorch's policy and Apex's, per device.

    For every op of :data:`POLICY` with no autocast kernel of PyTorch's for a device, one is
    registered; the banned op always gets one (it replaces PyTorch's, and PyTorch's returns when
    these kernels are removed).
    """

    def __init__(self, device_types: Iterable[str]) -> None:
        # One library per namespace of the ops registered ("aten", and other libraries' ops).
        self._libs: dict[str, torch.library.Library] | None = {}
        self.registered: list[tuple[str, str, Cast]] = []
        for device_type in device_types:
            key = _AUTOCAST_KEYS.get(device_type)
            if key is None:
                continue
            covered = _COVERED_BELOW.get(device_type, frozenset())
            for cast, names in POLICY.items():
                for name in names:
                    if name in covered:
                        continue
                    mutable = cast is Cast.NO_HALF_INPLACE
                    for op in _tensor_overloads(name, mutable=mutable):
                        self._register(op, cast, device_type, key)

    def _register(
        self, op: torch._ops.OpOverload, cast: Cast, device_type: str, key: DispatchKey
    ) -> None:
        assert self._libs is not None
        qualified = op.name()  # "aten::softmax.int"
        namespace, name = qualified.split("::", 1)
        has_torch_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key.name)
        if has_torch_kernel and cast is not Cast.BANNED and namespace == "aten":
            return  # PyTorch's own autocast kernel already implements this op's policy
        library = self._libs.get(namespace)
        if library is None:
            library = self._libs[namespace] = torch.library.Library(namespace, "IMPL")
        with warnings.catch_warnings():
            # Replacing an autocast kernel (PyTorch's for the banned op, another library's own
            # for its ops) warns once; that is intended here, and undone by remove().
            warnings.simplefilter("ignore")
            library.impl(name, _make_kernel(op, cast, device_type, key), key.name, **_OVERRIDE)
        self.registered.append((qualified, device_type, cast))

    def remove(self) -> None:
        """Unregister every kernel; PyTorch's own policy applies again."""
        if self._libs is not None:
            for library in self._libs.values():
                library._destroy()
            self._libs = None
            self.registered = []
