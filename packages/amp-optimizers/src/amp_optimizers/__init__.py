"""amp-optimizers: Apex's fused optimizers for PyTorch 2.x, on CPU and CUDA, fp32/fp16/bf16.

Replaces ``apex.optimizers`` with one import line::

    from amp_optimizers import FusedAdam      # was: from apex.optimizers import FusedAdam

Every optimizer is a ``torch.optim.Optimizer`` that launches one ``amp_fused_ops.amp_C``
multi-tensor op per ``(device, dtype)`` of its params; the ops run a compiled kernel where one
is built and a pure-PyTorch reference otherwise.
"""

# Master weights and loss scaling around FusedAdam (Apex's cut-down FP16_Optimizer)
from amp_optimizers._fp16_optimizer import FP16_Optimizer

# Fused optimizers (Apex's apex.optimizers), one multi-tensor launch per (device, dtype)
from amp_optimizers._fused_adagrad import FusedAdagrad
from amp_optimizers._fused_adam import FusedAdam
from amp_optimizers._fused_lamb import FusedLAMB
from amp_optimizers._fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from amp_optimizers._fused_novograd import FusedNovoGrad
from amp_optimizers._fused_sgd import FusedSGD
from amp_optimizers._version import __version__

__all__ = [
    "__version__",
    # Adam family
    "FusedAdam",
    # LAMB family
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    # Other fused optimizers
    "FusedAdagrad",
    "FusedNovoGrad",
    "FusedSGD",
    # Master weights and loss scaling around FusedAdam
    "FP16_Optimizer",
]
