// The autograd kernel of the norm op torch.ops.amp_fused_ops.norm_forward for CUDA tensors
// (../common/norm_autograd.h; the CUDA kernels are in layer_norm.cu). The emulation build
// compiles it for the CPU, registered for the CPU's Autograd key of its own namespace
// (csrc/emulation/amp_emu.h).
#include <torch/library.h>

#include "../common/norm_autograd.h"
#include "../common/ops_schema.h"

#ifndef AMP_FUSED_OPS_AUTOGRAD_KEY
#define AMP_FUSED_OPS_AUTOGRAD_KEY AutogradCUDA
#endif

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, AMP_FUSED_OPS_AUTOGRAD_KEY, m) {
  m.impl("norm_forward", TORCH_FN(amp_fused_ops::norm_autograd::norm_forward_autograd));
}
