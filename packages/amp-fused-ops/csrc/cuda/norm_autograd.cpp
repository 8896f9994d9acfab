// The autograd kernel of the norm op torch.ops.amp_fused_ops.norm_forward for CUDA tensors
// (../common/norm_autograd.h; the CUDA kernels are in layer_norm.cu). No kernel here: the
// emulated builds leave this file out (src/amp_fused_ops/emulation/_kernels.py).
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common/norm_autograd.h"
#include "../common/ops_schema.h"

namespace amp_fused_ops {
namespace norm_autograd {
namespace {

// Whether the current stream of t's device is being captured into a CUDA graph.
bool captured_on_cuda(const at::Tensor& t) {
  const c10::cuda::CUDAGuard guard(t.device());
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

}  // namespace
}  // namespace norm_autograd
}  // namespace amp_fused_ops

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, AutogradCUDA, m) {
  m.impl("norm_forward",
         TORCH_FN(amp_fused_ops::norm_autograd::norm_forward_autograd<
                  amp_fused_ops::norm_autograd::captured_on_cuda>));
  m.impl("norm_backward", TORCH_FN(amp_fused_ops::norm_autograd::norm_backward_autograd));
}
