// Multi-tensor Adam / AdamW step on CPU, in place on [grads, params, exp_avgs, exp_avg_sqs].
//
// The element math is csrc/common/adam_math.h, shared with the CUDA kernels: Apex's
// AdamFunctor (mode 0: L2 penalty added to the gradient; mode 1: decoupled decay added to the
// update, not torch.optim.AdamW's p *= 1 - lr * weight_decay), no decay term at all when
// weight_decay is 0. Gradients and parameters may be float32, float16 or bfloat16 (each list
// position on its own); the moments are float32; all math is float32. Plain loops that the
// compiler vectorizes at -O3 (see multi_tensor_elementwise.cpp).
#include <atomic>
#include <cmath>
#include <optional>
#include <type_traits>

#include "../common/adam_math.h"
#include "multi_tensor_apply.h"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

using math::AdamMode;
using math::AdamScalars;

template <typename g_t, typename p_t, AdamMode kMode>
struct AdamFunctor {
  // __restrict__: the four lists never overlap (the op checks it), which lets the compiler
  // vectorize the loop; the scalars are copied into a local for the same reason.
  static void run(const g_t* __restrict__ grad, p_t* __restrict__ param,
                  float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, int64_t n,
                  const AdamScalars& scalars) {
    const AdamScalars s = scalars;
    for (int64_t i = 0; i < n; ++i) {
      float p = static_cast<float>(param[i]);
      float m = exp_avg[i];
      float v = exp_avg_sq[i];
      math::adam_math<kMode>(s, static_cast<float>(grad[i]), p, m, v);
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      param[i] = static_cast<p_t>(p);
    }
  }
};

// Scalars of one capturable step, read from the tensors on the host (CPU tensors: no sync).
struct MasterAdamStep {
  AdamScalars scalars;
  float inv_scale;
};

// Adam on float32 masters (the shared math of csrc/common/adam_math.h) on the unscaled gradient
// g = grad * inv_scale. The mode is a template parameter and the scalars are copied into
// locals, so the loop has no load that a store could alias, and it vectorizes.
template <AdamMode kMode>
void master_adam(const float* __restrict__ grad, float* __restrict__ master,
                 float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, int64_t n,
                 const MasterAdamStep& step) {
  const AdamScalars s = step.scalars;
  const float inv_scale = step.inv_scale;
  for (int64_t i = 0; i < n; ++i) {
    float p = master[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    math::adam_math<kMode>(s, grad[i] * inv_scale, p, m, v);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = p;
  }
}

// Returns false when some grad * inv_scale is inf or nan.
struct UnscaledFiniteFunctor {
  static bool run(const float* grad, int64_t n, float inv_scale) {
    int finite = 1;
    for (int64_t i = 0; i < n; ++i) finite &= finite_bit(grad[i] * inv_scale);
    return finite != 0;
  }
};

void check_mode_and_bias_correction(const char* op, int64_t mode, int64_t bias_correction) {
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW, decoupled weight ",
                    "decay), got ", mode);
  TORCH_CHECK_VALUE(bias_correction == 0 || bias_correction == 1, op,
                    ": bias_correction must be 0 or 1, got ", bias_correction);
}

}  // namespace

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const std::vector<std::vector<at::Tensor>>& tensor_lists, double lr,
                       double beta1, double beta2, double eps, int64_t step, int64_t mode,
                       int64_t bias_correction, double weight_decay,
                       std::optional<int64_t> sr_seed, int64_t sr_step) {
  constexpr const char* op = "multi_tensor_adam";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4);
  if (sr_seed.has_value()) checks::check_stochastic_round(op, tensor_lists, 1, 4);
  check_mode_and_bias_correction(op, mode, bias_correction);
  TORCH_CHECK_VALUE(step >= 1 || bias_correction == 0, op,
                    ": step must be >= 1 when bias_correction is on, got ", step);
  check_fp32_lists(op, tensor_lists, {2, 3});
  check_overlap(op, tensor_lists, {1, 2, 3});
  // As Apex's kernel: the noop flag is neither read nor set; infs and nans propagate
  // into the results (the caller decides about skipping before calling).

  // Bias corrections in double on the host, as the reference computes them in Python.
  AdamScalars s = math::adam_scalars(beta1, beta2, eps, weight_decay);
  s.lr = static_cast<float>(lr);
  const double steps = static_cast<double>(step);
  s.bc1 = bias_correction ? static_cast<float>(1.0 - std::pow(beta1, steps)) : 1.0f;
  s.bc2 = bias_correction ? static_cast<float>(1.0 - std::pow(beta2, steps)) : 1.0f;

  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& exp_avgs = tensor_lists[2];
  const auto& exp_avg_sqs = tensor_lists[3];
  const auto chunks = make_chunks(grads, chunk_size);
  if (sr_seed.has_value()) {
    // bfloat16 params rounded stochastically: the float32 step on tiles, each tile rounded
    // with its elements' own random bits before the (then exact) store.
    const math::StochasticRoundKey key = math::stochastic_round_key(*sr_seed, sr_step);
    for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
      float grad_buffer[kTile];
      float param_buffer[kTile];
      for_each_tile(c, [&](int64_t offset, int64_t len) {
        const float* g = tile_in(grads[c.tensor], offset, len, grad_buffer);
        float* p = tile_in(params[c.tensor], offset, len, param_buffer);
        float* m = data_as<float>(exp_avgs[c.tensor]) + offset;
        float* v = data_as<float>(exp_avg_sqs[c.tensor]) + offset;
        if (mode == 1) {
          AdamFunctor<float, float, AdamMode::kDecoupled>::run(g, p, m, v, len, s);
        } else {
          AdamFunctor<float, float, AdamMode::kL2>::run(g, p, m, v, len, s);
        }
        stochastic_round_tile(key, c.tensor, offset, len, p);
        tile_out(params[c.tensor], offset, len, p);
      });
    });
    return;
  }
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    const at::Tensor& grad = grads[c.tensor];
    const at::Tensor& param = params[c.tensor];
    float* m = data_as<float>(exp_avgs[c.tensor]) + c.begin;
    float* v = data_as<float>(exp_avg_sqs[c.tensor]) + c.begin;
    const int64_t n = c.end - c.begin;
    const auto adam = [&](const float* g, float* p, float* m_tile, float* v_tile, int64_t len) {
      if (mode == 1) {
        AdamFunctor<float, float, AdamMode::kDecoupled>::run(g, p, m_tile, v_tile, len, s);
      } else {
        AdamFunctor<float, float, AdamMode::kL2>::run(g, p, m_tile, v_tile, len, s);
      }
    };
    if (grad.scalar_type() == at::kFloat && param.scalar_type() == at::kFloat) {
      adam(data_as<float>(grad) + c.begin, data_as<float>(param) + c.begin, m, v, n);
      return;
    }
    if (grad.scalar_type() != at::kHalf && param.scalar_type() != at::kHalf) {
      // float32 / bfloat16 mixes: the loop converts inline and still vectorizes.
      dispatch_float(grad.scalar_type(), op, [&](auto g_tag) {
        using g_t = decltype(g_tag);
        dispatch_float(param.scalar_type(), op, [&](auto p_tag) {
          using p_t = decltype(p_tag);
          const g_t* g = data_as<g_t>(grad) + c.begin;
          p_t* p = data_as<p_t>(param) + c.begin;
          if constexpr (!std::is_same_v<g_t, c10::Half> && !std::is_same_v<p_t, c10::Half>) {
            if (mode == 1) {
              AdamFunctor<g_t, p_t, AdamMode::kDecoupled>::run(g, p, m, v, n, s);
            } else {
              AdamFunctor<g_t, p_t, AdamMode::kL2>::run(g, p, m, v, n, s);
            }
          }
        });
      });
      return;
    }
    // float16 grads or params: c10::Half converts one value at a time, which keeps an inline
    // loop from vectorizing; the float32 loop runs over tiles converted 8 values at a time.
    float grad_buffer[kTile];
    float param_buffer[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t len) {
      const float* g = tile_in(grad, offset, len, grad_buffer);
      float* p = tile_in(param, offset, len, param_buffer);
      adam(g, p, m + (offset - c.begin), v + (offset - c.begin), len);
      tile_out(param, offset, len, p);
    });
  });
}

void multi_tensor_adam_capturable_master(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const std::vector<std::vector<at::Tensor>>& tensor_lists, const at::Tensor& lr,
    double beta1, double beta2, double eps, const at::Tensor& step, int64_t mode,
    int64_t bias_correction, double weight_decay, const at::Tensor& inv_scale) {
  constexpr const char* op = "multi_tensor_adam_capturable_master";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 5);
  check_mode_and_bias_correction(op, mode, bias_correction);
  check_fp32_lists(op, tensor_lists, {2, 3, 4});
  MasterAdamStep s{};
  s.scalars = math::adam_scalars(beta1, beta2, eps, weight_decay);
  AdamScalars& a = s.scalars;
  a.lr = static_cast<float>(scalar_value(op, "lr", lr));
  s.inv_scale = static_cast<float>(scalar_value(op, "inv_scale", inv_scale));
  // As the reference: step as float32, beta**step in float32.
  const float step_f = static_cast<float>(scalar_value(op, "step", step));
  a.bc1 = bias_correction ? 1.0f - std::pow(a.beta1, step_f) : 1.0f;
  a.bc2 = bias_correction ? 1.0f - std::pow(a.beta2, step_f) : 1.0f;
  // A float32 param may be its own master (lists 1 and 4); nothing else may share memory.
  check_overlap(op, tensor_lists, {1, 2, 3, 4}, {{1, 4}});
  // The found-inf pattern: a set flag means "skip this step", nothing is written.
  if (noop_is_set(noop_flag)) return;

  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& exp_avgs = tensor_lists[2];
  const auto& exp_avg_sqs = tensor_lists[3];
  const auto& masters = tensor_lists[4];
  const auto chunks = make_chunks(grads, chunk_size);

  // Pass 1 reads the gradients only: a single inf/nan unscaled gradient skips the whole step,
  // so it must be known before anything is written.
  std::atomic<bool> nonfinite{false};
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    if (nonfinite.load(std::memory_order_relaxed)) return;
    float buffer[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      const float* g = tile_in(grads[c.tensor], offset, n, buffer);
      if (!UnscaledFiniteFunctor::run(g, n, s.inv_scale)) {
        nonfinite.store(true, std::memory_order_relaxed);
      }
    });
  });
  if (nonfinite.load()) {
    set_noop(noop_flag);
    return;
  }

  // Pass 2: the step on the masters and moments, and the model copy, tile by tile.
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    float buffer[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      const float* g = tile_in(grads[c.tensor], offset, n, buffer);
      float* master = data_as<float>(masters[c.tensor]) + offset;
      float* m = data_as<float>(exp_avgs[c.tensor]) + offset;
      float* v = data_as<float>(exp_avg_sqs[c.tensor]) + offset;
      if (mode == 1) {
        master_adam<AdamMode::kDecoupled>(g, master, m, v, n, s);
      } else {
        master_adam<AdamMode::kL2>(g, master, m, v, n, s);
      }
      tile_out(params[c.tensor], offset, n, master);
    });
  });
}

}  // namespace cpu
}  // namespace amp_fused_ops
