"""``apex.normalization`` at the same path: ``amp_fused_ops.normalization``.

``from apex.normalization import FusedLayerNorm`` becomes
``from amp_fused_ops.normalization import FusedLayerNorm`` (or ``from amp_fused_ops import
FusedLayerNorm``); the autograd Functions and functional forms are in
:mod:`amp_fused_ops.normalization.fused_layer_norm`, as in Apex.
"""

from amp_fused_ops.normalization import fused_layer_norm
from amp_fused_ops.normalization._modules import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

__all__ = [
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
]
