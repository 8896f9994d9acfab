// Welford states (count, mean, m2: the sum of squared deviations from the mean) in float32, for
// the per-row statistics of layer_norm.cu and the per-channel statistics of syncbn.cu: one
// value added, two states merged (Chan's formula), and the merge across a warp.
#pragma once

namespace amp_fused_ops {
namespace cuda {

// Adds the value v to the state (n, mean, m2).
__device__ __forceinline__ void welford_add(float& n, float& mean, float& m2, float v) {
  n += 1.f;
  const float delta = v - mean;
  mean += delta / n;
  m2 += delta * (v - mean);
}

// Chan's merge of Welford states (count, mean, m2); b is merged into a. Two empty states stay
// empty (no division by a zero count).
__device__ __forceinline__ void welford_merge(float& n, float& mean, float& m2, float nb,
                                              float mean_b, float m2_b) {
  const float total = n + nb;
  if (total == 0.f) return;
  const float delta = mean_b - mean;
  const float wb = nb / total;
  mean += delta * wb;
  m2 += m2_b + delta * delta * n * wb;
  n = total;
}

// Merges the Welford states of the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ void warp_welford(float& n, float& mean, float& m2) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, offset);
    const float mean_b = __shfl_xor_sync(0xffffffffu, mean, offset);
    const float m2_b = __shfl_xor_sync(0xffffffffu, m2, offset);
    welford_merge(n, mean, m2, nb, mean_b, m2_b);
  }
}

}  // namespace cuda
}  // namespace amp_fused_ops
