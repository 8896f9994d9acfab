"""SyncBatchNorm kernels (Apex's ``syncbn`` extension): per-rank statistics, merge, backward.

``amp_parallel.SyncBatchNorm`` calls these with its own collectives in between. CUDA tensors
use the kernels of the CUDA extension when it is built; other devices use PyTorch ops.

Example:
    >>> from amp_fused_ops import syncbn
    >>> mean, var = syncbn.welford_mean_var(torch.randn(8, 3, 4, 4))
"""

from amp_fused_ops.syncbn._kernels import (
    batchnorm_backward,
    batchnorm_forward,
    reduce_bn,
    welford_mean_var,
    welford_parallel,
)

__all__ = [
    "batchnorm_backward",
    "batchnorm_forward",
    "reduce_bn",
    "welford_mean_var",
    "welford_parallel",
]
