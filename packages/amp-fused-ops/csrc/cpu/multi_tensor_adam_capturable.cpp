// multi_tensor_adam_capturable on CPU: Adam on the params themselves with lr, step and
// inv_scale given as one-element tensors, in the reference's order of operations
// (_reference_optim.py: _capturable_adam):
//   g = grad * inv_scale (written back into grad); g += wd * p (mode 0);
//   m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//   u = (m / bc1) / (sqrt(v / bc2) + eps) (+ wd * p in mode 1); p -= lr u.
// Nothing is written when the noop flag is set on entry or when some grad * inv_scale is inf
// or nan (then the flag is set). Grads and params may be float32, float16 or bfloat16; the
// moments are float32; all math is float32 over tiles (multi_tensor_apply.h).
#include <atomic>
#include <cmath>

#include "multi_tensor_apply.h"
#include "multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

struct CapturableAdamScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;  // 1 - beta1 in double, then rounded (as the reference's Python)
  float one_minus_beta2;
  float eps;
  float lr;
  float bc1;
  float bc2;
  float weight_decay;
  float inv_scale;
};

// One tile: g (float32 grad values, replaced by the unscaled grads), p (float32 param values,
// replaced by the new params), m and v (the float32 moments, updated in place).
// kDecay is weight_decay != 0: the reference adds no wd * p term then (0 * inf is nan).
template <bool kDecoupled, bool kDecay>
struct CapturableAdamFunctor {
  static void run(float* __restrict__ g, float* __restrict__ p, float* __restrict__ m,
                  float* __restrict__ v, int64_t n, const CapturableAdamScalars& s) {
    const float beta1 = s.beta1;
    const float beta2 = s.beta2;
    const float one_minus_beta1 = s.one_minus_beta1;
    const float one_minus_beta2 = s.one_minus_beta2;
    const float bc1 = s.bc1;
    const float bc2 = s.bc2;
    const float eps = s.eps;
    const float lr = s.lr;
    const float weight_decay = s.weight_decay;
    const float inv_scale = s.inv_scale;
    for (int64_t i = 0; i < n; ++i) {
      const float unscaled = g[i] * inv_scale;
      const float w = p[i];
      float grad = unscaled;
      if (!kDecoupled && kDecay) grad += weight_decay * w;
      const float m1 = beta1 * m[i] + one_minus_beta1 * grad;
      const float v1 = beta2 * v[i] + one_minus_beta2 * (grad * grad);
      float update = (m1 / bc1) / (std::sqrt(v1 / bc2) + eps);
      if (kDecoupled && kDecay) update += weight_decay * w;
      g[i] = unscaled;
      m[i] = m1;
      v[i] = v1;
      p[i] = w - lr * update;
    }
  }
};

void run_tile(bool decoupled, bool decay, float* g, float* p, float* m, float* v, int64_t n,
              const CapturableAdamScalars& s) {
  if (decoupled) {
    if (decay) {
      CapturableAdamFunctor<true, true>::run(g, p, m, v, n, s);
    } else {
      CapturableAdamFunctor<true, false>::run(g, p, m, v, n, s);
    }
  } else if (decay) {
    CapturableAdamFunctor<false, true>::run(g, p, m, v, n, s);
  } else {
    CapturableAdamFunctor<false, false>::run(g, p, m, v, n, s);
  }
}

// True when every grad * inv_scale of the tile is finite.
bool unscaled_finite(const float* g, int64_t n, float inv_scale) {
  int finite = 1;
  for (int64_t i = 0; i < n; ++i) finite &= finite_bit(g[i] * inv_scale);
  return finite != 0;
}

// Lists a and b must not share memory at any position (the functor uses __restrict__).
void check_disjoint(const char* op, const TensorLists& lists, size_t a, size_t b) {
  for (size_t i = 0; i < lists[0].size(); ++i) {
    const at::Tensor& x = lists[a][i];
    const at::Tensor& y = lists[b][i];
    const auto* x0 = static_cast<const char*>(x.data_ptr());
    const auto* y0 = static_cast<const char*>(y.data_ptr());
    const bool disjoint = x.numel() == 0 || x0 + x.nbytes() <= y0 || y0 + y.nbytes() <= x0;
    TORCH_CHECK(disjoint, op, ": tensor ", i, " of list ", a, " and tensor ", i, " of list ", b,
                " share memory; every list needs tensors of its own");
  }
}

}  // namespace

void multi_tensor_adam_capturable(int64_t chunk_size, const at::Tensor& noop_flag,
                                  const std::vector<std::vector<at::Tensor>>& tensor_lists,
                                  const at::Tensor& lr, double beta1, double beta2, double eps,
                                  const at::Tensor& step, int64_t mode, int64_t bias_correction,
                                  double weight_decay, const at::Tensor& inv_scale) {
  constexpr const char* op = "multi_tensor_adam_capturable";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4);
  TORCH_CHECK(mode == 0 || mode == 1, op,
              ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW, decoupled weight ",
              "decay), got ", mode);
  TORCH_CHECK(bias_correction == 0 || bias_correction == 1, op,
              ": bias_correction must be 0 or 1, got ", bias_correction);
  check_fp32_lists(op, tensor_lists, {{2, "exp_avg"}, {3, "exp_avg_sq"}});
  for (size_t a = 0; a < 4; ++a) {
    for (size_t b = a + 1; b < 4; ++b) check_disjoint(op, tensor_lists, a, b);
  }
  CapturableAdamScalars s{};
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.lr = static_cast<float>(scalar_value(op, "lr", lr));
  s.weight_decay = static_cast<float>(weight_decay);
  s.inv_scale = static_cast<float>(scalar_value(op, "inv_scale", inv_scale));
  // As the reference: step as float32, beta**step in float32.
  const float step_f = static_cast<float>(scalar_value(op, "step", step));
  s.bc1 = bias_correction ? 1.0f - std::pow(s.beta1, step_f) : 1.0f;
  s.bc2 = bias_correction ? 1.0f - std::pow(s.beta2, step_f) : 1.0f;
  const bool decoupled = mode == 1;
  const bool decay = weight_decay != 0.0;
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
      if (!unscaled_finite(tile_in(grads[c.tensor], offset, n, buffer), n, s.inv_scale)) {
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
  const bool write_grads = s.inv_scale != 1.0f;
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    float grad_buffer[kTile];
    float param_buffer[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      float* g = tile_in(grads[c.tensor], offset, n, grad_buffer);
      float* p = tile_in(params[c.tensor], offset, n, param_buffer);
      float* m = data_as<float>(exp_avgs[c.tensor]) + offset;
      float* v = data_as<float>(exp_avg_sqs[c.tensor]) + offset;
      run_tile(decoupled, decay, g, p, m, v, n, s);
      if (write_grads) tile_out(grads[c.tensor], offset, n, g);
      tile_out(params[c.tensor], offset, n, p);
    });
  });
}

}  // namespace cpu
}  // namespace amp_fused_ops
