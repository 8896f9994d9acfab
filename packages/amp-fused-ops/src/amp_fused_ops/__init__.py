"""amp-fused-ops: Apex's multi-tensor ops and ``multi_tensor_applier`` for PyTorch 2.x.

Replaces ``apex.multi_tensor_apply`` and Apex's ``amp_C`` extension::

    from amp_fused_ops import amp_C, multi_tensor_applier

Every op has a pure-PyTorch reference (CPU and CUDA, float32 / float16 / bfloat16) that runs
whenever no compiled kernel is available for the tensors' device.
"""

# The op namespace (Apex: the amp_C extension)
from amp_fused_ops._amp_C import amp_C

# Multi-tensor apply (Apex: apex.multi_tensor_apply)
from amp_fused_ops._multi_tensor_apply import MultiTensorApply, multi_tensor_applier
from amp_fused_ops._version import __version__

__all__ = [
    "__version__",
    # Multi-tensor apply
    "MultiTensorApply",
    "multi_tensor_applier",
    # Ops
    "amp_C",
]
