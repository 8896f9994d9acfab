"""amp-legacy-fp16: Apex's deprecated ``fp16_utils`` and pre-1.0 ``amp.init()`` API.

Every entry point emits a :class:`DeprecatedFeatureWarning` (a ``FutureWarning``, as Apex's
``apex.DeprecatedFeatureWarning``) naming its amp-core replacement.

Example:
    >>> from amp_legacy_fp16 import FP16_Optimizer, convert_network
    >>> model = convert_network(Net(), torch.float16)
    >>> optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                            dynamic_loss_scale=True)
"""

from . import amp
from ._deprecation import DeprecatedFeatureWarning
from ._fp16_optimizer import FP16_Optimizer
from ._fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from ._loss_scaler import DynamicLossScaler, LossScaler
from ._version import __version__

__all__ = [
    # the optimizer wrapper
    "FP16_Optimizer",
    # loss scalers
    "DynamicLossScaler",
    "LossScaler",
    # casting networks
    "BN_convert_float",
    "FP16Model",
    "convert_module",
    "convert_network",
    "network_to_half",
    "tofp16",
    # master params and grads
    "clip_grad_norm",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "prep_param_lists",
    "to_python_float",
    # the pre-1.0 amp API (amp.init)
    "amp",
    # the warning the legacy API emits
    "DeprecatedFeatureWarning",
    "__version__",
]
