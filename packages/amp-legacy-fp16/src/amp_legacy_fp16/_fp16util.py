"""Apex's ``fp16_utils.fp16util`` helpers: casting networks, master params, grad copies.

Where Apex hard-codes ``.half()``, each helper takes a keyword-only ``dtype`` (default
``torch.float16``) so that bf16 works too. Batchnorm layers with affine parameters stay fp32,
as in Apex.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ._deprecation import warn_deprecated

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]

_O2 = 'amp_core.amp.initialize(model, optimizer, opt_level="O2")'


def _is_affine_bn(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class tofp16(nn.Module):
    """A module that casts its (floating) input to ``dtype``.

    Args:
        dtype: The low-precision dtype (keyword-only; Apex always used fp16).
    """

    def __init__(self, *, dtype: torch.dtype = torch.float16) -> None:
        warn_deprecated("tofp16", _O2 + " (it casts the model's inputs)")
        super().__init__()
        self.dtype = dtype

    @classmethod
    def _quiet(cls, dtype: torch.dtype) -> tofp16:
        """Built by :func:`network_to_half`, which has already warned."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.dtype = dtype
        return module

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _cast_floating(input, self.dtype)


def _bn_convert_float(module: nn.Module) -> nn.Module:
    if _is_affine_bn(module):
        module.float()
    for child in module.children():
        _bn_convert_float(child)
    return module


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Cast every batchnorm layer with affine parameters back to fp32, in place.

    Args:
        module: The network (already cast to half).

    Returns:
        ``module`` itself.
    """
    warn_deprecated("BN_convert_float", _O2 + " (keep_batchnorm_fp32=True is its default)")
    return _bn_convert_float(module)


def network_to_half(network: nn.Module, *, dtype: torch.dtype = torch.float16) -> nn.Sequential:
    """Cast ``network`` to ``dtype`` (affine batchnorm stays fp32) behind an input cast.

    Args:
        network: The model; it is cast in place.
        dtype: The low-precision dtype (keyword-only).

    Returns:
        ``nn.Sequential(tofp16(dtype=dtype), network)``.
    """
    warn_deprecated("network_to_half", _O2)
    return nn.Sequential(tofp16._quiet(dtype), _bn_convert_float(network.to(dtype)))


def _convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype=dtype)
        if param.grad is not None and param.grad.is_floating_point():
            param.grad = param.grad.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype=dtype)


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating params, grads and buffers of ``module`` itself (not its children).

    Args:
        module: The module, changed in place.
        dtype: The target dtype.
    """
    warn_deprecated("convert_module", "module.to(dtype) or " + _O2)
    _convert_module(module, dtype)


def _convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    for module in network.modules():
        if _is_affine_bn(module):
            continue
        _convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``network`` to ``dtype`` in place, leaving affine batchnorm layers in fp32.

    Args:
        network: The model.
        dtype: The target dtype (``torch.float16`` or ``torch.bfloat16``).

    Returns:
        ``network`` itself.
    """
    warn_deprecated("convert_network", _O2)
    return _convert_network(network, dtype)


class FP16Model(nn.Module):
    """A network cast to ``dtype`` (affine batchnorm in fp32) that casts its floating inputs.

    Args:
        network: The model; it is cast in place.
        dtype: The low-precision dtype (keyword-only).
    """

    def __init__(self, network: nn.Module, *, dtype: torch.dtype = torch.float16) -> None:
        warn_deprecated("FP16Model", _O2)
        super().__init__()
        self.dtype = dtype
        self.network = _convert_network(network, dtype)

    def forward(self, *inputs: Any) -> Any:
        # Only floating inputs are cast: Apex's `.half()` on every input broke index tensors.
        return self.network(*(_cast_floating(t, self.dtype) for t in inputs))


def prep_param_lists(
    model: nn.Module, flat_master: bool = False
) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The model's trainable params and fp32 master copies of them.

    Args:
        model: The (half) model.
        flat_master: One flat fp32 master for all params (they must share one dtype).

    Returns:
        ``(model_params, master_params)``; with ``flat_master`` the second list holds one
        flat ``nn.Parameter`` with a zero ``.grad``.

    Raises:
        TypeError: with ``flat_master=True`` when the params do not share one dtype.
    """
    warn_deprecated("prep_param_lists", _O2 + " and amp_core.amp.master_params(optimizer)")
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError(
                f"prep_param_lists(flat_master=True) needs params of one dtype, got "
                f"{sorted(str(d) for d in dtypes)}. Use flat_master=False, or FP16_Optimizer."
            )
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        flat_param = nn.Parameter(flat)
        flat_param.grad = torch.zeros_like(flat)
        return model_params, [flat_param]
    masters: list[torch.Tensor] = []
    for p in model_params:
        master = p.detach().clone().float()
        master.requires_grad_(True)
        masters.append(master)
    return model_params, masters


def model_grads_to_master_grads(
    model_params: list[nn.Parameter], master_params: list[torch.Tensor], flat_master: bool = False
) -> None:
    """Copy the model's grads into the masters' ``.grad`` (as fp32).

    A model param without a grad leaves its master without one.

    Args:
        model_params: From :func:`prep_param_lists`.
        master_params: From :func:`prep_param_lists`.
        flat_master: Whether the masters are one flat tensor.
    """
    warn_deprecated("model_grads_to_master_grads", _O2)
    if flat_master:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
        flat = _flatten_dense_tensors(grads)
        master = master_params[0]
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(flat)
        return
    for model, master in zip(model_params, master_params, strict=True):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


def master_params_to_model_params(
    model_params: list[nn.Parameter], master_params: list[torch.Tensor], flat_master: bool = False
) -> None:
    """Copy the masters' values into the model's params (rounding to their dtype).

    Args:
        model_params: From :func:`prep_param_lists`.
        master_params: From :func:`prep_param_lists`.
        flat_master: Whether the masters are one flat tensor.
    """
    warn_deprecated("master_params_to_model_params", _O2)
    with torch.no_grad():
        if flat_master:
            pieces = _unflatten_dense_tensors(master_params[0].detach(), model_params)
            for model, piece in zip(model_params, pieces, strict=True):
                model.copy_(piece)
            return
        for model, master in zip(model_params, master_params, strict=True):
            model.copy_(master)


def clip_grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` under Apex's name.

    Returns:
        The total norm of the gradients (before clipping), as a tensor.
    """
    warn_deprecated("clip_grad_norm", "torch.nn.utils.clip_grad_norm_")
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)


def to_python_float(t: Any) -> float:
    """``t.item()`` for a tensor (``t[0]`` for an indexable without ``item``)."""
    warn_deprecated("to_python_float", "tensor.item()")
    if hasattr(t, "item"):
        return float(t.item())
    return float(t[0])
