// The element math of the Adam ops (multi_tensor_adam, multi_tensor_adam_capturable and
// multi_tensor_adam_capturable_master), written once for the CUDA functors (csrc/cuda) and the
// CPU loops (csrc/cpu), in float32, as PyTorch's aten/src/ATen/native/cuda/fused_adam_utils.cuh
// shares `adam_math` (templated on ADAM_MODE) between its kernels. The pure-PyTorch reference
// (src/amp_fused_ops/reference/_adam.py: _adam_math) is the same formula in PyTorch ops:
//
//   g = grad (+ weight_decay * p in mode 0)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   update = (m / bc1) / (sqrt(v / bc2) + eps) (+ weight_decay * p in mode 1)
//   p = p - lr * update
//
// This is Apex's AdamFunctor (csrc/multi_tensor_adam.cu), not torch.optim.AdamW: decoupled
// decay enters the update instead of a separate p *= 1 - lr * weight_decay before it (the two
// differ in rounding, and for an infinite parameter). Unlike Apex, a weight decay of 0 adds no
// term at all, so an infinite parameter stays infinite (0 * inf would be nan).
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace amp_fused_ops {
namespace math {

enum class AdamMode : int {
  kL2 = 0,         // Adam: weight_decay * p added to the gradient
  kDecoupled = 1,  // AdamW: weight_decay * p added to the update
};

// The scalars of one step. bc1, bc2: the bias corrections 1 - beta**step, or 1 without them.
struct AdamScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;  // 1 - beta1 in double, then rounded (as the reference's Python)
  float one_minus_beta2;
  float eps;
  float weight_decay;
  float lr;
  float bc1;
  float bc2;
};

// The step-independent scalars, on the host; lr, bc1 and bc2 are filled by the caller (on the
// host, or on the device for the capturable ops, whose lr and step are device tensors).
inline AdamScalars adam_scalars(double beta1, double beta2, double eps, double weight_decay) {
  AdamScalars s{};
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.lr = 0.0f;
  s.bc1 = 1.0f;
  s.bc2 = 1.0f;
  return s;
}

// One Adam step on one element: g the (unscaled) gradient; p, m, v updated in place.
template <AdamMode kMode>
C10_HOST_DEVICE inline void adam_math(const AdamScalars& s, float g, float& p, float& m,
                                      float& v) {
  const bool decay = s.weight_decay != 0.0f;
  if (kMode == AdamMode::kL2 && decay) {
    g = g + s.weight_decay * p;
  }
  m = s.beta1 * m + s.one_minus_beta1 * g;
  v = s.beta2 * v + s.one_minus_beta2 * (g * g);
  float update = (m / s.bc1) / (::sqrtf(v / s.bc2) + s.eps);
  if (kMode == AdamMode::kDecoupled && decay) {
    update = update + s.weight_decay * p;
  }
  p = p - s.lr * update;
}

// adam_math with the mode chosen at run time (0: L2, 1: decoupled), for callers that branch
// once per element block rather than instantiating a loop per mode.
C10_HOST_DEVICE inline void adam_math(bool decoupled, const AdamScalars& s, float g, float& p,
                                      float& m, float& v) {
  if (decoupled) {
    adam_math<AdamMode::kDecoupled>(s, g, p, m, v);
  } else {
    adam_math<AdamMode::kL2>(s, g, p, m, v);
  }
}

}  // namespace math
}  // namespace amp_fused_ops
