// LAMB's last pass on [params, updates], for multi_tensor_lamb (multi_tensor_optim.cu) and
// multi_tensor_lamb_stage2_cuda (multi_tensor_lamb_stages.cu): p -= lr * ratio * update, with
// the trust ratio of each tensor from its param and update norms (device arrays, one value per
// tensor; math::lamb_trust_ratio_math). The two ops round as their references do:
//   kLrInRatio false (multi_tensor_lamb): p + (-lr) * (update * ratio)
//   kLrInRatio true (Apex's stage 2):     p - update * (lr * ratio)   (math::lamb_stage2_math)
#pragma once

#include "../common/optim_math.h"

namespace amp_fused_ops {
namespace cuda {

template <bool kLrInRatio>
struct LambApplyOp {
  static constexpr unsigned kStores = 0b01;
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  const float* param_norms;
  const float* update_norms;
  float lr;
  bool use_ratio;
  float ratio;

  __device__ bool prepare(int tensor, const int*) {
    ratio = math::lamb_trust_ratio_math(use_ratio, param_norms[tensor], update_norms[tensor]);
    if constexpr (kLrInRatio) {
      ratio = lr * ratio;
    }
    return true;
  }
  __device__ void operator()(float (&x)[2], float (&)[2], bool&) const {
    if constexpr (kLrInRatio) {
      x[0] = math::lamb_stage2_math(x[0], x[1], ratio);
    } else {
      x[0] = x[0] + (-lr) * (x[1] * ratio);
    }
  }
};

}  // namespace cuda
}  // namespace amp_fused_ops
