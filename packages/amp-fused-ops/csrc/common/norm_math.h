// The reductions of the norm ops (multi_tensor_l2norm, multi_tensor_unscale_l2norm,
// multi_tensor_l2norm_mp and its per-tensor norms, the gradient norms of NovoGrad and the
// parameter/update norms of LAMB), written once for the CUDA functors and the CPU loops:
// what each element adds to a partial, how two partials combine, and the norm of a total.
//
// How the elements are grouped differs by design: the CPU loops keep 16 float32 lanes per
// block of 2048 elements and merge the per-chunk partials in double in chunk order; the CUDA
// kernels keep one float32 partial per thread, reduce it over the block and then over the
// chunks of a tensor on the device. Both use the functions below for every step.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace amp_fused_ops {
namespace math {

// max that propagates NaN (as torch.max and torch.linalg.norm(ord=inf) do), without a branch
// so that the CPU loops vectorize. The operands are absolute values (no signed zeros).
template <typename T>
C10_HOST_DEVICE inline T nan_max(T a, T b) {
  return (a != a || b != b) ? a + b : (a > b ? a : b);
}

// What one element x adds to a sum of squares, scaled first (inv_scale, or 1).
C10_HOST_DEVICE inline float sum_of_squares_term(float x, float scale) {
  const float v = x * scale;
  return v * v;
}

// The L2 partial after one more element.
C10_HOST_DEVICE inline float sum_of_squares_step(float acc, float x, float scale) {
  return acc + sum_of_squares_term(x, scale);
}

// The inf-norm partial (max |x|, nan sticks) after one more element.
C10_HOST_DEVICE inline float max_abs_step(float best, float x) {
  return nan_max(best, ::fabsf(x));
}

// Two partials of one reduction (a sum of squares, or a max of |x|) into one.
template <bool kMax, typename T>
C10_HOST_DEVICE inline T combine_partials(T a, T b) {
  if (kMax) {
    return nan_max(a, b);
  }
  return a + b;
}

// NovoGrad's running gradient norm of one tensor after this step's norm:
//   L2: sqrt(b2 old**2 + (1 - b2) norm**2); inf-norm: b2 old + (1 - b2) norm.
C10_HOST_DEVICE inline float novograd_blend_math(float old, float norm, float beta2,
                                                 float one_minus_beta2, bool l2) {
  return l2 ? ::sqrtf(beta2 * (old * old) + one_minus_beta2 * (norm * norm))
            : beta2 * old + one_minus_beta2 * norm;
}

}  // namespace math
}  // namespace amp_fused_ops
