// The autograd kernel of the norm op torch.ops.amp_fused_ops.norm_forward for CUDA tensors
// (../common/norm_autograd.h; the CUDA kernels are in layer_norm.cu). No kernel here: the
// emulated builds leave this file out (src/amp_fused_ops/emulation/_kernels.py).
#include <torch/library.h>

#include "../common/norm_autograd.h"
#include "../common/ops_schema.h"

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, AutogradCUDA, m) {
  m.impl("norm_forward", TORCH_FN(amp_fused_ops::norm_autograd::norm_forward_autograd));
  m.impl("norm_backward", TORCH_FN(amp_fused_ops::norm_autograd::norm_backward_autograd));
}
