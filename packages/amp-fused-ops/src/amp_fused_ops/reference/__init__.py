"""The pure-PyTorch reference of every ``amp_C`` op (CPU and CUDA tensors, any float dtype).

The same math as the compiled kernels, written with PyTorch ops; :data:`amp_fused_ops.amp_C`
runs it wherever no compiled kernel serves the tensors' device, and the tests compare the
kernels against it. Each function has the ``amp_C`` signature of the op of the same name::

    from amp_fused_ops import multi_tensor_applier, reference

    multi_tensor_applier(reference.multi_tensor_scale, overflow_buf, [src, dst], 0.5)
"""

from __future__ import annotations

from amp_fused_ops.reference._ops import (
    multi_tensor_adagrad,
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_axpby,
    multi_tensor_l2norm,
    multi_tensor_l2norm_mp,
    multi_tensor_l2norm_scale,
    multi_tensor_lamb,
    multi_tensor_lamb_mp,
    multi_tensor_lamb_stage1_cuda,
    multi_tensor_lamb_stage2_cuda,
    multi_tensor_novograd,
    multi_tensor_scale,
    multi_tensor_sgd,
    multi_tensor_unscale_l2norm,
    update_scale_hysteresis,
)

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adagrad",
    "multi_tensor_novograd",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "update_scale_hysteresis",
]
