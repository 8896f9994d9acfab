"""amp-parallel: Apex's ``apex.parallel`` on PyTorch 2.x's torch.distributed (Gloo and NCCL).

Example:
    >>> from amp_parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
    >>> model = DistributedDataParallel(convert_syncbn_model(model))
"""

from ._ddp import DistributedDataParallel
from ._flat_dist import (
    apply_flat_dist_call,
    extract_tensors,
    flat_dist_call,
    split_by_type,
    split_half_float_double,
)
from ._larc import LARC
from ._reducer import Reducer
from ._syncbn import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group
from ._version import __version__

__all__ = [
    # data parallelism
    "DistributedDataParallel",
    "Reducer",
    # Apex's bucket helpers (apex.parallel.distributed)
    "flat_dist_call",
    "apply_flat_dist_call",
    "split_by_type",
    "split_half_float_double",
    "extract_tensors",
    # synchronized batch norm
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
    # optimizer wrapper
    "LARC",
    "__version__",
]
