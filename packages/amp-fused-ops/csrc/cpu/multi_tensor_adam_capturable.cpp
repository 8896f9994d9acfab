// multi_tensor_adam_capturable on CPU: Adam on the params themselves with lr, step and
// inv_scale given as one-element tensors. The gradient is g = grad * inv_scale (written back
// into grad); the element math is csrc/common/adam_math.h, shared with the CUDA kernels.
// Nothing is written when the noop flag is set on entry or when some grad * inv_scale is inf
// or nan (then the flag is set). Grads and params may be float32, float16 or bfloat16; the
// moments are float32; all math is float32 over tiles (multi_tensor_apply.h).
#include <atomic>
#include <cmath>

#include "../common/adam_math.h"
#include "multi_tensor_apply.h"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

using math::AdamMode;
using math::AdamScalars;

// One tile: g (float32 grad values, replaced by the unscaled grads), p (float32 param values,
// replaced by the new params), m and v (the float32 moments, updated in place). The mode is a
// template parameter and the scalars are copied into locals, so the loop vectorizes.
template <AdamMode kMode>
void capturable_adam_tile(float* __restrict__ g, float* __restrict__ p, float* __restrict__ m,
                          float* __restrict__ v, int64_t n, const AdamScalars& scalars,
                          float inv_scale) {
  const AdamScalars s = scalars;
  for (int64_t i = 0; i < n; ++i) {
    const float unscaled = g[i] * inv_scale;
    float w = p[i];
    float m1 = m[i];
    float v1 = v[i];
    math::adam_math<kMode>(s, unscaled, w, m1, v1);
    g[i] = unscaled;
    m[i] = m1;
    v[i] = v1;
    p[i] = w;
  }
}

// True when every grad * inv_scale of the tile is finite.
bool unscaled_finite(const float* g, int64_t n, float inv_scale) {
  int finite = 1;
  for (int64_t i = 0; i < n; ++i) finite &= finite_bit(g[i] * inv_scale);
  return finite != 0;
}

}  // namespace

void multi_tensor_adam_capturable(int64_t chunk_size, const at::Tensor& noop_flag,
                                  const std::vector<std::vector<at::Tensor>>& tensor_lists,
                                  const at::Tensor& lr, double beta1, double beta2, double eps,
                                  const at::Tensor& step, int64_t mode, int64_t bias_correction,
                                  double weight_decay, const at::Tensor& inv_scale) {
  constexpr const char* op = "multi_tensor_adam_capturable";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4);
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW, decoupled weight ",
                    "decay), got ", mode);
  TORCH_CHECK_VALUE(bias_correction == 0 || bias_correction == 1, op,
                    ": bias_correction must be 0 or 1, got ", bias_correction);
  check_fp32_lists(op, tensor_lists, {2, 3});
  check_overlap(op, tensor_lists, {0, 1, 2, 3});  // the unscaled grads are written back
  AdamScalars s = math::adam_scalars(beta1, beta2, eps, weight_decay);
  s.lr = static_cast<float>(scalar_value(op, "lr", lr));
  const float inv_scale_f = static_cast<float>(scalar_value(op, "inv_scale", inv_scale));
  // As the reference: step as float32, beta**step in float32.
  const float step_f = static_cast<float>(scalar_value(op, "step", step));
  s.bc1 = bias_correction ? 1.0f - std::pow(s.beta1, step_f) : 1.0f;
  s.bc2 = bias_correction ? 1.0f - std::pow(s.beta2, step_f) : 1.0f;
  if (noop_is_set(noop_flag)) return;  // a step already marked as skipped writes nothing

  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& exp_avgs = tensor_lists[2];
  const auto& exp_avg_sqs = tensor_lists[3];
  const auto chunks = make_chunks(grads, chunk_size);

  // Pass 1 reads the gradients only: one inf/nan unscaled gradient skips the whole step.
  std::atomic<bool> nonfinite{false};
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    if (nonfinite.load(std::memory_order_relaxed)) return;
    float buffer[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      if (!unscaled_finite(tile_in(grads[c.tensor], offset, n, buffer), n, inv_scale_f)) {
        nonfinite.store(true, std::memory_order_relaxed);
      }
    });
  });
  if (nonfinite.load()) {
    set_noop(noop_flag);
    return;
  }

  // Pass 2: the step, tile by tile; the unscaled grads go back into the grads (a multiply by
  // 1 rounds to the same value, so that write is skipped then).
  const bool write_grads = inv_scale_f != 1.0f;
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    float grad_buffer[kTile];
    float param_buffer[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      float* g = tile_in(grads[c.tensor], offset, n, grad_buffer);
      float* p = tile_in(params[c.tensor], offset, n, param_buffer);
      float* m = data_as<float>(exp_avgs[c.tensor]) + offset;
      float* v = data_as<float>(exp_avg_sqs[c.tensor]) + offset;
      if (mode == 1) {
        capturable_adam_tile<AdamMode::kDecoupled>(g, p, m, v, n, s, inv_scale_f);
      } else {
        capturable_adam_tile<AdamMode::kL2>(g, p, m, v, n, s, inv_scale_f);
      }
      if (write_grads) tile_out(grads[c.tensor], offset, n, g);
      tile_out(params[c.tensor], offset, n, p);
    });
  });
}

}  // namespace cpu
}  // namespace amp_fused_ops
