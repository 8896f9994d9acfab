"""amp-core: Apex's Amp mixed-precision API for PyTorch 2.x, on CPU and CUDA, fp16 and bf16.

Example:
    >>> from amp_core import amp
    >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
"""

from . import amp

# the building blocks, for users who need them directly
from ._casting import O1Casting, o1_casting, o1_casting_active
from ._fused_master import FusedMasterWeightOptimizer, supports_fused_master_weights
from ._master_step import fused_master_step, read_overflow
from ._master_weights import GradUnscaler, MasterWeights
from ._model import model_master_weights
from ._opt_levels import OptLevel, Properties
from ._policy import POLICY, Cast
from ._scaler import LossScaler
from ._scaler_config import SCALER_PRESETS, ScalerConfig, check_count, check_scale
from ._version import __version__

__all__ = [
    "amp",
    # building blocks
    "Cast",
    "LossScaler",
    "O1Casting",
    "OptLevel",
    "POLICY",
    "Properties",
    # loss-scaler settings as data
    "SCALER_PRESETS",
    "ScalerConfig",
    "check_count",
    "check_scale",
    # for packages built on amp-core (wrappers, optimizers, kernels)
    "FusedMasterWeightOptimizer",
    "model_master_weights",
    "o1_casting",
    "o1_casting_active",
    "supports_fused_master_weights",
    "__version__",
    # master weights and the step, shared by every mixed-precision optimizer
    "GradUnscaler",
    "MasterWeights",
    "fused_master_step",
    "read_overflow",
]
