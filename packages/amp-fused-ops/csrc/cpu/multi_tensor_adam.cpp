// Multi-tensor Adam / AdamW step on CPU, in place on [grads, params, exp_avgs, exp_avg_sqs].
//
// Follows torch.optim.Adam (mode 0: L2 penalty added to the gradient) and torch.optim.AdamW
// (mode 1: decoupled decay p *= 1 - lr * weight_decay before the update), including its
// bias correction. Gradients and parameters may be float32, float16 or bfloat16 (each list
// position on its own); the moments are float32; all math is float32. Plain loops that the
// compiler vectorizes at -O3 (see multi_tensor_elementwise.cpp).
#include <cmath>

#include "multi_tensor_apply.h"
#include "multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

// Scalars of one step, computed once on the host.
struct AdamStep {
  float beta1;
  float beta2;
  float eps;
  float step_size;     // lr / (1 - beta1**step), or lr without bias correction
  float bc2_sqrt;      // sqrt(1 - beta2**step), or 1 without bias correction
  float weight_decay;  // L2 coefficient (mode 0)
  float decay_factor;  // 1 - lr * weight_decay (mode 1)
};

template <typename g_t, typename p_t, bool kDecoupled>
struct AdamFunctor {
  // __restrict__: the four lists never overlap (checked by the launcher's callers), which
  // lets the compiler vectorize the loop.
  static void run(const g_t* __restrict__ grad, p_t* __restrict__ param,
                  float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, int64_t n,
                  const AdamStep& s) {
    for (int64_t i = 0; i < n; ++i) {
      float g = static_cast<float>(grad[i]);
      float p = static_cast<float>(param[i]);
      if (kDecoupled) {
        p *= s.decay_factor;
      } else {
        g += s.weight_decay * p;
      }
      const float m = exp_avg[i] + (1.0f - s.beta1) * (g - exp_avg[i]);  // torch's lerp
      const float v = s.beta2 * exp_avg_sq[i] + (1.0f - s.beta2) * g * g;
      const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      param[i] = static_cast<p_t>(p - s.step_size * (m / denom));
    }
  }
};

}  // namespace

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const std::vector<std::vector<at::Tensor>>& tensor_lists, double lr,
                       double beta1, double beta2, double eps, int64_t step, int64_t mode,
                       int64_t bias_correction, double weight_decay) {
  constexpr const char* op = "multi_tensor_adam";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4);
  TORCH_CHECK(mode == 0 || mode == 1, op,
              ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW, decoupled weight ",
              "decay), got ", mode);
  TORCH_CHECK(step >= 1 || bias_correction == 0, op,
              ": step must be >= 1 when bias_correction is on, got ", step);
  for (size_t l = 2; l < 4; ++l) {
    for (size_t i = 0; i < tensor_lists[l].size(); ++i) {
      TORCH_CHECK(tensor_lists[l][i].scalar_type() == at::kFloat, op, ": tensor ", i,
                  " of list ", l, (l == 2 ? " (exp_avg)" : " (exp_avg_sq)"), " has dtype ",
                  tensor_lists[l][i].scalar_type(),
                  "; optimizer state must be float32");
    }
  }
  // As Apex's kernel: the noop flag is neither read nor set; infs and nans propagate
  // into the results (the caller decides about skipping before calling).

  AdamStep s{};
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  s.step_size = static_cast<float>(lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);

  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& exp_avgs = tensor_lists[2];
  const auto& exp_avg_sqs = tensor_lists[3];
  const auto chunks = make_chunks(grads, chunk_size);
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    const at::Tensor& grad = grads[c.tensor];
    const at::Tensor& param = params[c.tensor];
    float* m = data_as<float>(exp_avgs[c.tensor]) + c.begin;
    float* v = data_as<float>(exp_avg_sqs[c.tensor]) + c.begin;
    const int64_t n = c.end - c.begin;
    dispatch_float(grad.scalar_type(), op, [&](auto g_tag) {
      using g_t = decltype(g_tag);
      dispatch_float(param.scalar_type(), op, [&](auto p_tag) {
        using p_t = decltype(p_tag);
        const g_t* g = data_as<g_t>(grad) + c.begin;
        p_t* p = data_as<p_t>(param) + c.begin;
        if (mode == 1) {
          AdamFunctor<g_t, p_t, true>::run(g, p, m, v, n, s);
        } else {
          AdamFunctor<g_t, p_t, false>::run(g, p, m, v, n, s);
        }
      });
    });
  });
}

}  // namespace cpu
}  // namespace amp_fused_ops
