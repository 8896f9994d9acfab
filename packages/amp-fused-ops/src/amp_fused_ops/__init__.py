"""amp-fused-ops: Apex's multi-tensor ops and ``multi_tensor_applier`` for PyTorch 2.x.

Replaces ``apex.multi_tensor_apply`` and Apex's ``amp_C`` extension::

    from amp_fused_ops import amp_C, multi_tensor_applier
    from amp_fused_ops import FusedLayerNorm, FusedRMSNorm   # apex.normalization
    from amp_fused_ops import syncbn, flatten, unflatten      # apex.parallel's kernels

Every op has a pure-PyTorch reference (CPU and CUDA, float32 / float16 / bfloat16) that runs
whenever no compiled kernel is available for the tensors' device.
"""

# SyncBatchNorm kernels (Apex: the syncbn extension), as the module amp_fused_ops.syncbn
# The op namespace (Apex: the amp_C extension)
# extensions: the compiled kernels' loader, which the ops' kernel of last resort calls on the
# first op of a device (installed when it is imported, here)
from amp_fused_ops import amp_C, extensions, syncbn  # noqa: F401 (extensions: see above)
from amp_fused_ops._version import __version__

# Fused LayerNorm / RMSNorm (Apex: apex.normalization)
from amp_fused_ops.normalization._functional import (
    fused_layer_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)
from amp_fused_ops.normalization._modules import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

# Flatten / unflatten for bucketing (Apex: apex_C)
from amp_fused_ops.ops._flatten import flatten, unflatten

# Multi-tensor apply (Apex: apex.multi_tensor_apply)
from amp_fused_ops.ops._multi_tensor_apply import MultiTensorApply, multi_tensor_applier

# The multi-tensor ops with their schemas' arguments (what the fused optimizers call)
from amp_fused_ops.ops._schema_calls import multi_tensor_op

# Norms of whole tensors, DTensor (FSDP2) shards reduced over their mesh
from amp_fused_ops.ops._sharding import tensor_norms

# A param group's lists kept by the compiled kernels across steps (what FusedAdam steps on)
from amp_fused_ops.ops._step_plans import StepPlanLists, plans_available

__all__ = [
    "__version__",
    # Multi-tensor apply
    "MultiTensorApply",
    "multi_tensor_applier",
    # Ops
    "amp_C",
    "multi_tensor_op",
    "tensor_norms",
    "StepPlanLists",
    "plans_available",
    # Normalization
    "FusedLayerNorm",
    "FusedRMSNorm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_layer_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
    # SyncBatchNorm kernels and bucketing
    "syncbn",
    "flatten",
    "unflatten",
]
