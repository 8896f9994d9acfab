"""The dispatcher ops of ``amp_C``: the op registry, the schemas and the kernels of last resort.

Every ``amp_C`` op is one op of the PyTorch dispatcher, ``torch.ops.amp_fused_ops.<name>``,
and the dispatcher alone decides which kernel runs (``docs/design.rst``, decision 10):

========================== ====================================================================
dispatch key               kernel
========================== ====================================================================
``CPU``                    the C++ CPU kernel, once the CPU extension is loaded
``CUDA``                   the CUDA kernel, once the CUDA extension is loaded
any other device, or no    the pure-PyTorch reference (:mod:`amp_fused_ops.reference._ops`),
compiled kernel            registered here for ``CompositeExplicitAutograd``
``Meta`` / fake tensors    a fake kernel registered here: output shapes, no data
========================== ====================================================================

The extension of a device is loaded on its first op call (:func:`set_kernel_loader`), by the
kernel of last resort, the one place that loads kernels: however the op is called (``amp_C``,
the fused optimizers through :func:`amp_fused_ops.multi_tensor_op`, a graph of
``torch.compile``, which traced the fake kernel without loading anything, or
``torch.ops.amp_fused_ops.<name>``), the dispatcher reaches that kernel while the device has
no compiled kernel registered. It then hands the call to the compiled kernel, which serves
every later call directly.

The extensions register only kernels (``TORCH_LIBRARY_IMPL``); the schemas are defined here,
from :data:`REGISTRY`, when this module is imported, so the ops exist (and trace under
``torch.compile``) whether or not an extension can be built. A schema has no list of tensor
lists, so each op takes Apex's ``tensor_lists`` as separate arguments (those it writes marked
mutable); :func:`amp_fused_ops.ops._apex_convention.apex_convention` turns such an op back into
Apex's ``op(chunk_size, noop_flag, tensor_lists, *args)``.

Adding an op: one :class:`OpSpec` in :data:`REGISTRY` (schema, reference, fake kernel, the
numbers of lists Apex passes, the preconditions of its scalar arguments) and its compiled
kernels registered under the same name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from amp_fused_ops.ops import _preconditions
from amp_fused_ops.ops._plan_schemas import PLAN_SCHEMAS, plan_fake
from amp_fused_ops.ops._preconditions import OpPreconditions
from amp_fused_ops.reference import _ops as _reference
from amp_fused_ops.reference._common import find_wrong_device

__all__ = [
    "OPS_NAMESPACE",
    "REGISTRY",
    "OpSpec",
    "compiled_kernel",
    "define_schemas",
    "reference_kernel",
]

OPS_NAMESPACE = "amp_fused_ops"
"""Namespace of the multi-tensor ops: ``torch.ops.amp_fused_ops``."""


def _no_outputs(*args: Any, **kwargs: Any) -> None:
    """Fake kernel of an op that only writes its arguments in place."""


def _norms(chunk_size: int, noop_flag: Tensor, xs: Sequence[Tensor], *rest: Any) -> Any:
    """Fake kernel of the L2-norm ops: ``(total (1,), per_tensor (n,) or (0,))`` in float32.

    ``per_tensor`` is the last argument of every norm op's schema.
    """
    per_tensor = bool(rest[-1]) if rest else False
    device = xs[0].device if xs else noop_flag.device
    total = torch.empty(1, dtype=torch.float32, device=device)
    per = torch.empty(len(xs) if per_tensor else 0, dtype=torch.float32, device=device)
    return total, per


def _scaled_norms(
    chunk_size: int, noop_flag: Tensor, ins: Sequence[Tensor], outs: Sequence[Tensor], *rest: Any
) -> Any:
    """Fake kernel of ``multi_tensor_l2norm_scale``: the norms of ``ins``."""
    return _norms(chunk_size, noop_flag, ins, *rest)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op of :data:`REGISTRY`.

    Attributes:
        schema: The dispatcher schema, ``name(arguments) -> returns``; argument names are
            Apex's (callers may pass the scalars by keyword), except ``decay_mode`` for Apex's
            ``mode`` (PyTorch's functionalization of mutating ops, which ``torch.compile``
            runs, reserves ``mode``; :func:`apex_convention` still takes ``mode=``).
        reference: The pure-PyTorch reference, with Apex's calling convention.
        fake: The fake (meta) kernel, with the schema's arguments.
        list_counts: The numbers of tensor lists Apex passes (the schema's list arguments, the
            last ones optional when fewer are given); empty for an op without tensor lists.
        choices: ``(argument, allowed values)`` of the op's integer switches (Apex's names:
            ``mode`` for ``decay_mode``).
        step_at_least_one: The op's integer ``step`` must be >= 1 when ``bias_correction``
            is 1 (unless a ``step_tensor`` replaces it).
        autocast: What ``torch.autocast`` does to the op: ``None`` only (it runs in its tensors'
            dtypes): a multi-tensor op writes its tensors in place, which a cast would redirect
            to copies (:mod:`amp_fused_ops.ops._autocast`).
        preconditions: What ``choices`` and ``step_at_least_one`` make of the scalar
            arguments the schema lists after the tensor lists (Apex's order); ``amp_C`` and
            the references check calls against it (:mod:`amp_fused_ops.ops._preconditions`).
    """

    schema: str
    reference: Callable[..., Any]
    fake: Callable[..., Any] = _no_outputs
    list_counts: tuple[int, ...] = ()
    choices: tuple[tuple[str, tuple[int, ...]], ...] = ()
    step_at_least_one: bool = False
    autocast: None = None
    preconditions: OpPreconditions | None = dataclasses.field(
        init=False, default=None, compare=False, repr=False
    )

    @property
    def name(self) -> str:
        return self.schema[: self.schema.index("(")]

    def __post_init__(self) -> None:
        if self.name != self.reference.__name__:
            raise ValueError(f"{self.name}: the reference is {self.reference.__name__}")
        if self.autocast is not None:
            raise ValueError(f"{self.name}: a multi-tensor op runs in its tensors' dtypes")
        if self.list_counts:  # an op of Apex's convention: its scalars follow the lists
            schema = torch._C.parse_schema(f"{OPS_NAMESPACE}::{self.schema}")
            scalars = tuple(
                "mode" if argument.name == "decay_mode" else argument.name
                for argument in schema.arguments[2 + max(self.list_counts) :]
            )
            rule = OpPreconditions(scalars, self.choices, self.step_at_least_one)
            object.__setattr__(self, "preconditions", rule)
        elif self.choices or self.step_at_least_one:
            raise ValueError(f"{self.name}: preconditions need Apex's convention (list_counts)")


_FLAG = (0, 1)
_ADAM_CHOICES = (("mode", _FLAG), ("bias_correction", _FLAG))
_LAMB_CHOICES = (("bias_correction", _FLAG), ("grad_averaging", _FLAG), ("mode", _FLAG))

# In the order of Apex's csrc/amp_C_frontend.cpp.
_SPECS = (
    OpSpec(
        "multi_tensor_scale(int chunk_size, Tensor(a!) noop_flag, Tensor[] ins, "
        "Tensor(b!)[] outs, float scale) -> ()",
        _reference.multi_tensor_scale,
        list_counts=(2,),
    ),
    OpSpec(
        "multi_tensor_sgd(int chunk_size, Tensor noop_flag, Tensor[] grads, Tensor(a!)[] params, "
        "Tensor(b!)[] momentum_bufs, Tensor(c!)[]? model_copies, float weight_decay, "
        "float momentum, float dampening, float lr, bool nesterov, bool first_run, "
        "bool wd_after_momentum, float scale, int? sr_seed=None, int? sr_step=None, "
        "Tensor? step_tensor=None, Tensor? lr_tensor=None) -> ()",
        _reference.multi_tensor_sgd,
        list_counts=(3, 4),
    ),
    OpSpec(
        "multi_tensor_axpby(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, Tensor[] ys, "
        "Tensor(b!)[] outs, float a, float b, int arg_to_check) -> ()",
        _reference.multi_tensor_axpby,
        list_counts=(3,),
        choices=(("arg_to_check", (-1, 0, 1)),),
    ),
    OpSpec(
        "multi_tensor_l2norm(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, "
        "bool? per_tensor=False) -> (Tensor, Tensor)",
        _reference.multi_tensor_l2norm,
        _norms,
        (1,),
    ),
    OpSpec(
        "multi_tensor_l2norm_mp(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, "
        "bool? per_tensor=False) -> (Tensor, Tensor)",
        _reference.multi_tensor_l2norm_mp,
        _norms,
        (1,),
    ),
    OpSpec(
        "multi_tensor_l2norm_scale(int chunk_size, Tensor(a!) noop_flag, Tensor[] ins, "
        "Tensor(b!)[] outs, float scale, bool? per_tensor=False) -> (Tensor, Tensor)",
        _reference.multi_tensor_l2norm_scale,
        _scaled_norms,
        (2,),
    ),
    OpSpec(
        "multi_tensor_unscale_l2norm(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, "
        "Tensor inv_scale, bool? per_tensor=False) -> (Tensor, Tensor)",
        _reference.multi_tensor_unscale_l2norm,
        _norms,
        (1,),
    ),
    OpSpec(
        "multi_tensor_lamb_stage1_cuda(int chunk_size, Tensor noop_flag, Tensor[] grads, "
        "Tensor[] params, Tensor(a!)[] exp_avgs, Tensor(b!)[] exp_avg_sqs, "
        "Tensor(c!)[] updates, Tensor per_tensor_decay, int step, float beta1, float beta2, "
        "float epsilon, Tensor global_grad_norm, float max_global_grad_norm, "
        "Tensor? step_tensor=None) -> ()",
        _reference.multi_tensor_lamb_stage1_cuda,
        list_counts=(5,),
    ),
    OpSpec(
        "multi_tensor_lamb_stage2_cuda(int chunk_size, Tensor noop_flag, Tensor(a!)[] params, "
        "Tensor[] updates, Tensor per_tensor_param_norm, Tensor per_tensor_update_norm, "
        "float lr, float weight_decay, bool? use_nvlamb=None) -> ()",
        _reference.multi_tensor_lamb_stage2_cuda,
        list_counts=(2,),
    ),
    OpSpec(
        "multi_tensor_adam(int chunk_size, Tensor noop_flag, Tensor[] grads, "
        "Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, "
        "float beta1, float beta2, float eps, int step, int decay_mode, int bias_correction, "
        "float weight_decay, Tensor? step_tensor=None, int? sr_seed=None, int? sr_step=None, "
        "Tensor? lr_tensor=None) -> ()",
        _reference.multi_tensor_adam,
        list_counts=(4,),
        choices=_ADAM_CHOICES,
        step_at_least_one=True,
    ),
    OpSpec(
        "multi_tensor_adam_capturable(int chunk_size, Tensor(a!) noop_flag, "
        "Tensor(b!)[] grads, Tensor(c!)[] params, Tensor(d!)[] exp_avgs, "
        "Tensor(e!)[] exp_avg_sqs, Tensor lr, float beta1, float beta2, float eps, "
        "Tensor step, int decay_mode, int bias_correction, float weight_decay, "
        "Tensor inv_scale) -> ()",
        _reference.multi_tensor_adam_capturable,
        list_counts=(4,),
        choices=_ADAM_CHOICES,  # step is a device tensor: checking it would sync the host
    ),
    OpSpec(
        "multi_tensor_adam_capturable_master(int chunk_size, Tensor(a!) noop_flag, "
        "Tensor[] grads, Tensor(b!)[] params, Tensor(c!)[] exp_avgs, "
        "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] masters, Tensor lr, float beta1, float beta2, "
        "float eps, Tensor step, int decay_mode, int bias_correction, float weight_decay, "
        "Tensor inv_scale) -> ()",
        _reference.multi_tensor_adam_capturable_master,
        list_counts=(5,),
        choices=_ADAM_CHOICES,
    ),
    OpSpec(
        "multi_tensor_adagrad(int chunk_size, Tensor noop_flag, Tensor[] grads, "
        "Tensor(a!)[] params, Tensor(b!)[] state_sums, float lr, float epsilon, int decay_mode, "
        "float weight_decay, Tensor? lr_tensor=None) -> ()",
        _reference.multi_tensor_adagrad,
        list_counts=(3,),
        choices=(("mode", _FLAG),),
    ),
    OpSpec(
        "multi_tensor_novograd(int chunk_size, Tensor(a!) noop_flag, Tensor[] grads, "
        "Tensor(b!)[] params, Tensor(c!)[] exp_avgs, Tensor(d!) grad_norms, float lr, "
        "float beta1, float beta2, float epsilon, int step, int bias_correction, "
        "float weight_decay, int grad_averaging, int decay_mode, int norm_type, "
        "Tensor? step_tensor=None, Tensor? lr_tensor=None) -> ()",
        _reference.multi_tensor_novograd,
        list_counts=(3,),
        choices=(*_LAMB_CHOICES, ("norm_type", (0, 2))),
    ),
    OpSpec(
        "multi_tensor_lamb(int chunk_size, Tensor(a!) noop_flag, Tensor[] grads, "
        "Tensor(b!)[] params, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, float lr, "
        "float beta1, float beta2, float epsilon, int step, int bias_correction, "
        "float weight_decay, int grad_averaging, int decay_mode, Tensor global_grad_norm, "
        "float max_grad_norm, bool? use_nvlamb=None, Tensor? step_tensor=None, "
        "Tensor? lr_tensor=None) -> ()",
        _reference.multi_tensor_lamb,
        list_counts=(4,),
        choices=_LAMB_CHOICES,
    ),
    OpSpec(
        "multi_tensor_lamb_mp(int chunk_size, Tensor(a!) noop_flag, Tensor[] grads, "
        "Tensor(b!)[] params, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, "
        "Tensor(e!)[]? model_params, Tensor lr, float beta1, float beta2, float epsilon, "
        "Tensor step, int bias_correction, float weight_decay, int grad_averaging, int decay_mode, "
        "Tensor global_grad_norm, Tensor max_grad_norm, bool? use_nvlamb, Tensor found_inf, "
        "Tensor inv_scale) -> ()",
        _reference.multi_tensor_lamb_mp,
        list_counts=(4, 5),
        choices=_LAMB_CHOICES,
    ),
    OpSpec(
        "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, "
        "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval, int hysteresis) -> ()",
        _reference.update_scale_hysteresis,
    ),
)

REGISTRY: dict[str, OpSpec] = {spec.name: spec for spec in _SPECS}
"""Every ``amp_C`` op by name: the one list the schemas, the fallback kernels, the fake
kernels, ``amp_C`` itself and the op tests are made from."""

# The preconditions by op, gathered now: a call that torch.compile traces then only reads them.
_preconditions.rules()

_libraries: dict[str, torch.library.Library] = {}

# Loads the compiled extension of a device type ("cpu" / "cuda") on first use, registering its
# kernels; set by amp_fused_ops.extensions, which imports this module (not the other way).
_kernel_loader: Callable[[str], object] | None = None

# Device type -> the dispatch key its compiled kernels are registered for.
_COMPILED_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def set_kernel_loader(loader: Callable[[str], object]) -> None:
    """Install the function that loads a device type's compiled kernels (first use only)."""
    global _kernel_loader
    _kernel_loader = loader


def compiled_kernel(name: str, device: torch.device) -> Any | None:
    """The op ``name`` when a compiled kernel serves ``device`` (loading its extension on
    first use), else None: the kernel of last resort then runs the reference."""
    key = _COMPILED_KEYS.get(device.type)
    if key is None or _kernel_loader is None:
        return None
    _kernel_loader(device.type)  # remembered per process: one dictionary lookup after the first
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{OPS_NAMESPACE}::{name}", key):
        return None  # no compiled kernel of this op for the device, or no extension
    return getattr(getattr(torch.ops, OPS_NAMESPACE), name).default


def reference_kernel(spec: OpSpec) -> Callable[..., Any]:
    """The reference of ``spec`` as a kernel of its schema (separate lists, every argument
    positional) instead of Apex's call: what runs under
    :func:`amp_fused_ops.extensions.use_reference`, and behind the kernel of last resort."""
    if not spec.list_counts:

        def plain(*args: Any) -> None:
            spec.reference(*args)  # writes its arguments; the schema returns nothing

        plain.__name__ = plain.__qualname__ = f"{spec.name}_reference"
        return plain
    most = max(spec.list_counts)

    def kernel(chunk_size: int, noop_flag: Tensor, *rest: Any) -> Any:
        lists = [list(part) for part in rest[:most] if part is not None]
        return spec.reference(chunk_size, noop_flag, lists, *rest[most:])

    kernel.__name__ = kernel.__qualname__ = f"{spec.name}_reference"
    return kernel


def _last_resort_kernel(spec: OpSpec) -> Callable[..., Any]:
    """The kernel of last resort (``CompositeExplicitAutograd``): it first loads the compiled
    kernels of the arguments' device (a call that did not come through ``amp_C``, from a
    compiled graph for one), and hands the call to them when they serve the op; else it runs
    the reference (:func:`reference_kernel`)."""
    reference = reference_kernel(spec)
    if not spec.list_counts:

        def plain(*args: Any) -> None:
            compiled = compiled_kernel(spec.name, args[0].device)
            if compiled is not None:
                compiled(*args)
                return
            reference(*args)

        plain.__name__ = plain.__qualname__ = f"{spec.name}_reference"
        return plain
    most = max(spec.list_counts)

    def kernel(chunk_size: int, noop_flag: Tensor, *rest: Any) -> Any:
        lists = [part for part in rest[:most] if part is not None]
        first = lists[0][0] if lists and lists[0] else noop_flag
        if isinstance(first, Tensor):
            compiled = compiled_kernel(spec.name, first.device)
            if compiled is not None:
                return compiled(chunk_size, noop_flag, *rest)
        return reference(chunk_size, noop_flag, *rest)

    kernel.__name__ = kernel.__qualname__ = f"{spec.name}_reference"
    return kernel


def _fake_kernel(spec: OpSpec) -> Callable[..., Any]:
    """The op's fake kernel, after the kernels' device check (a real kernel raises for a
    tensor on another device than the noop flag; so does the fake one, on meta tensors too)."""
    if not spec.list_counts:
        return spec.fake
    most = max(spec.list_counts)
    # The tensors besides the lists that the op writes (NovoGrad's grad_norms): on the noop
    # flag's device too (with another device's tensor among them the dispatcher picks this
    # kernel, the meta one, before any real kernel could check).
    arguments = torch._C.parse_schema(spec.schema).arguments
    written = [
        (index - 2, argument.name)
        for index, argument in enumerate(arguments)
        if index >= 2 + most
        and str(argument.type) == "Tensor"
        and argument.alias_info is not None
        and argument.alias_info.is_write
    ]

    def fake(chunk_size: int, noop_flag: Tensor, *rest: Any) -> Any:
        lists = [list(part) for part in rest[:most] if part is not None]
        wrong = find_wrong_device(spec.name, noop_flag, lists)
        if wrong is not None:
            raise wrong
        for index, name in written:
            value = rest[index] if index < len(rest) else None
            if isinstance(value, Tensor) and value.device != noop_flag.device:
                raise RuntimeError(
                    f"{spec.name}: {name} is on {value.device} but the tensors are on "
                    f"{noop_flag.device}; create it on the tensors' device"
                )
        return spec.fake(chunk_size, noop_flag, *rest)

    fake.__name__ = fake.__qualname__ = f"{spec.name}_fake"
    return fake


def define_schemas(namespace: str = OPS_NAMESPACE, *, fallbacks: bool | None = None) -> None:
    """Define every op of :data:`REGISTRY` in ``torch.ops.<namespace>`` (once per process),
    with its fake kernel (meta and fake tensors: shapes, and the kernels' device checks).

    Args:
        namespace: The dispatcher namespace; the emulated CUDA kernels register under one of
            their own.
        fallbacks: Also register the reference as the kernel of last resort
            (``CompositeExplicitAutograd``); default: for :data:`OPS_NAMESPACE` only.
    """
    if namespace in _libraries:
        return
    library = torch.library.Library(namespace, "FRAGMENT")
    for spec in REGISTRY.values():
        library.define(spec.schema)
        torch.library.register_fake(f"{namespace}::{spec.name}", _fake_kernel(spec), lib=library)
    for schema in PLAN_SCHEMAS:
        library.define(schema)
        name = schema[: schema.index("(")]
        torch.library.register_fake(f"{namespace}::{name}", plan_fake(name), lib=library)
    if fallbacks if fallbacks is not None else namespace == OPS_NAMESPACE:
        for spec in REGISTRY.values():
            library.impl(spec.name, _last_resort_kernel(spec), "CompositeExplicitAutograd")
    _libraries[namespace] = library


define_schemas()
