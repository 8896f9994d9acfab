"""``apex.normalization.fused_layer_norm`` at the same path, every public name of Apex's module.

Groups:
    * modules: :class:`FusedLayerNorm`, :class:`FusedRMSNorm`, :class:`MixedFusedLayerNorm`,
      :class:`MixedFusedRMSNorm`
    * functional forms (autocast-aware): :func:`fused_layer_norm_affine`,
      :func:`fused_layer_norm`, :func:`mixed_dtype_fused_layer_norm_affine`,
      :func:`fused_rms_norm_affine`, :func:`fused_rms_norm`,
      :func:`mixed_dtype_fused_rms_norm_affine`
    * autograd Functions with Apex's ``apply`` arguments: ``FusedLayerNormAffineFunction``,
      ``FusedLayerNormFunction``, ``FusedLayerNormAffineMixedDtypesFunction``,
      ``FusedRMSNormAffineFunction``, ``FusedRMSNormFunction``,
      ``FusedRMSNormAffineMixedDtypesFunction``
    * :func:`manual_rms_norm`, Apex's plain-PyTorch RMSNorm
"""

from amp_fused_ops.normalization._functional import (
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)
from amp_fused_ops.normalization._functions import (
    FusedLayerNormAffineFunction,
    FusedLayerNormAffineMixedDtypesFunction,
    FusedLayerNormFunction,
    FusedRMSNormAffineFunction,
    FusedRMSNormAffineMixedDtypesFunction,
    FusedRMSNormFunction,
    manual_rms_norm,
)
from amp_fused_ops.normalization._modules import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

__all__ = [
    # modules
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    # functional forms
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
    # autograd Functions
    "FusedLayerNormAffineFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedLayerNormFunction",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "FusedRMSNormFunction",
    # plain-PyTorch reference
    "manual_rms_norm",
]
