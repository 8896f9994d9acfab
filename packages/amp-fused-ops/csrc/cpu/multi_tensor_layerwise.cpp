// Multi-tensor LAMB and NovoGrad steps on CPU: optimizers with a per-tensor scale (semantics:
// src/amp_fused_ops/reference/_layerwise.py).
//
// Both run in two stages over the same chunks. LAMB: stage 1 updates the moments, keeps the
// float32 update in a scratch buffer and sums the squares of each parameter and update per
// chunk; the per-tensor trust ratios are computed on the host from those sums; stage 2 applies
// the scaled updates. NovoGrad: stage 1 reduces each gradient to its norm per chunk; the host
// blends the norms into grad_norms; stage 2 is the elementwise step. Every list may be float32,
// float16 or bfloat16 on its own (float32 tiles, multi_tensor_apply.h).
#include <atomic>
#include <cmath>

#include "../common/optim_math.h"
#include "multi_tensor_apply.h"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

void check_flag(const char* op, const char* name, int64_t value) {
  TORCH_CHECK_VALUE(value == 0 || value == 1, op, ": ", name, " must be 0 or 1, got ", value);
}

using math::LambScalars;
using math::NovoGradScalars;

// The float32 LAMB arguments of one call: the shared scalars and the clipping divisor.
struct LambArgs {
  LambScalars s;
  float clip;  // the gradients are divided by it
};

// LAMB stage 1 on float32 tiles (math::lamb_update_math): new moments in place, the update
// into `update`.
template <bool kDecoupled>
struct LambStage1Functor {
  static void run(const float* grad, const float* param, float* exp_avg, float* exp_avg_sq,
                  float* update, int64_t n, const LambArgs& a) {
    const LambScalars s = a.s;
    const float clip = a.clip;
    for (int64_t i = 0; i < n; ++i) {
      float m = exp_avg[i];
      float v = exp_avg_sq[i];
      update[i] = math::lamb_update_math(s, kDecoupled, grad[i] / clip, param[i], m, v);
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
    }
  }
};

// LAMB stage 2: p -= lr * (ratio * update).
struct LambStage2Functor {
  static void run(const float* update, float* param, int64_t n, float lr, float ratio) {
    for (int64_t i = 0; i < n; ++i) param[i] = param[i] - lr * (update[i] * ratio);
  }
};

// NovoGrad stage 2 on float32 tiles (math::novograd_math), with denom = grad_norms[i] / bc2 +
// eps of the tensor.
template <bool kDecoupled>
struct NovoGradFunctor {
  static void run(const float* grad, float* param, float* exp_avg, int64_t n, float denom,
                  const NovoGradScalars& scalars) {
    const NovoGradScalars s = scalars;
    for (int64_t i = 0; i < n; ++i) {
      float p = param[i];
      float m = exp_avg[i];
      math::novograd_math(s, kDecoupled, denom, grad[i], p, m);
      exp_avg[i] = m;
      param[i] = p;
    }
  }
};

}  // namespace

void multi_tensor_lamb(int64_t chunk_size, const at::Tensor& noop_flag,
                       const std::vector<std::vector<at::Tensor>>& tensor_lists, double lr,
                       double beta1, double beta2, double epsilon, int64_t step,
                       int64_t bias_correction, double weight_decay, int64_t grad_averaging,
                       int64_t mode, const at::Tensor& global_grad_norm, double max_grad_norm,
                       bool use_nvlamb) {
  constexpr const char* op = "multi_tensor_lamb";
  check_flag(op, "bias_correction", bias_correction);
  check_flag(op, "grad_averaging", grad_averaging);
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (L2 weight decay) or 1 (decoupled weight decay), got ", mode);
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4);
  check_state_lists(op, tensor_lists, 2, 3, 1);
  check_overlap(op, tensor_lists, {1, 2, 3});
  const float norm = static_cast<float>(scalar_value(op, "global_grad_norm", global_grad_norm));
  const float max_norm = static_cast<float>(max_grad_norm);

  LambArgs a{};
  a.s.beta1 = static_cast<float>(beta1);
  a.s.beta2 = static_cast<float>(beta2);
  a.s.beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.0f;
  a.s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.s.epsilon = static_cast<float>(epsilon);
  a.s.bc1 = bias_correction ? static_cast<float>(1.0 - std::pow(beta1, double(step))) : 1.0f;
  a.s.bc2 = bias_correction ? static_cast<float>(1.0 - std::pow(beta2, double(step))) : 1.0f;
  // As Apex: a max_grad_norm of 0 clips every nonzero norm (g / inf = 0).
  a.clip = math::lamb_clip_math(norm, max_norm);
  a.s.weight_decay = static_cast<float>(weight_decay);

  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& exp_avgs = tensor_lists[2];
  const auto& exp_avg_sqs = tensor_lists[3];
  const size_t n_tensors = grads.size();
  const auto chunks = make_chunks(grads, chunk_size);
  // The float32 updates of all tensors, one after the other.
  std::vector<int64_t> starts(n_tensors + 1, 0);
  for (size_t i = 0; i < n_tensors; ++i) starts[i + 1] = starts[i] + grads[i].numel();
  at::Tensor scratch = at::empty({starts[n_tensors]}, at::TensorOptions().dtype(at::kFloat));
  float* updates = scratch.data_ptr<float>();

  // Stage 1: moments, updates, and the squares of params and updates summed per chunk.
  std::vector<float> param_sq(chunks.size(), 0.0f);
  std::vector<float> update_sq(chunks.size(), 0.0f);
  for_each_chunk(chunks, chunk_size, [&](int64_t index, const Chunk& c) {
    float g_tile[kTile], p_tile[kTile], m_tile[kTile], v_tile[kTile];
    float p_sum = 0.0f;
    float u_sum = 0.0f;
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      const float* g = tile_in(grads[c.tensor], offset, n, g_tile);
      const float* p = tile_in(params[c.tensor], offset, n, p_tile);
      float* m = tile_in(exp_avgs[c.tensor], offset, n, m_tile);
      float* v = tile_in(exp_avg_sqs[c.tensor], offset, n, v_tile);
      float* u = updates + starts[c.tensor] + offset;
      if (mode == 1) {
        LambStage1Functor<true>::run(g, p, m, v, u, n, a);
      } else {
        LambStage1Functor<false>::run(g, p, m, v, u, n, a);
      }
      tile_out(exp_avgs[c.tensor], offset, n, m);
      tile_out(exp_avg_sqs[c.tensor], offset, n, v);
      p_sum += SumOfSquaresFunctor<float>::run(p, n, 1.0f);
      u_sum += SumOfSquaresFunctor<float>::run(u, n, 1.0f);
    });
    param_sq[index] = p_sum;
    update_sq[index] = u_sum;
  });

  // Host: per-tensor norms (float32, as the reference's) and trust ratios.
  const std::vector<double> p_sums = sum_per_tensor(chunks, param_sq, n_tensors);
  const std::vector<double> u_sums = sum_per_tensor(chunks, update_sq, n_tensors);
  const bool apply_ratio = use_nvlamb || weight_decay != 0.0;
  std::vector<float> ratios(n_tensors, 1.0f);
  bool finite = true;
  for (size_t i = 0; i < n_tensors; ++i) {
    const float p_norm = std::sqrt(static_cast<float>(p_sums[i]));
    const float u_norm = std::sqrt(static_cast<float>(u_sums[i]));
    finite = finite && std::isfinite(p_norm) && std::isfinite(u_norm);
    ratios[i] = math::lamb_trust_ratio_math(apply_ratio, p_norm, u_norm);
  }

  // Stage 2: the scaled updates.
  const float lr_f = static_cast<float>(lr);
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    float p_tile[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      float* p = tile_in(params[c.tensor], offset, n, p_tile);
      LambStage2Functor::run(updates + starts[c.tensor] + offset, p, n, lr_f,
                             ratios[c.tensor]);
      tile_out(params[c.tensor], offset, n, p);
    });
  });
  // As Apex's norm kernels: an inf/nan norm raises the flag; the step is written anyway.
  if (!finite) set_noop(noop_flag);
}

void multi_tensor_novograd(int64_t chunk_size, const at::Tensor& noop_flag,
                           const std::vector<std::vector<at::Tensor>>& tensor_lists,
                           const at::Tensor& grad_norms, double lr, double beta1, double beta2,
                           double epsilon, int64_t step, int64_t bias_correction,
                           double weight_decay, int64_t grad_averaging, int64_t mode,
                           int64_t norm_type) {
  constexpr const char* op = "multi_tensor_novograd";
  check_flag(op, "bias_correction", bias_correction);
  check_flag(op, "grad_averaging", grad_averaging);
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (weight decay inside the moment) or 1 (decoupled weight ",
                    "decay), got ", mode);
  TORCH_CHECK_VALUE(norm_type == 0 || norm_type == 2, op,
                    ": norm_type must be 2 (L2 norm) or 0 (infinity norm), got ", norm_type);
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3);
  check_state_lists(op, tensor_lists, 2, 2, 1);
  check_overlap(op, tensor_lists, {1, 2});
  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& exp_avgs = tensor_lists[2];
  const size_t n_tensors = grads.size();
  TORCH_CHECK_TYPE(grad_norms.defined(), op, ": grad_norms is undefined (None)");
  TORCH_CHECK(grad_norms.device().is_cpu(), op,
              ": grad_norms must be a CPU tensor for the CPU extension, got device ",
              grad_norms.device());
  TORCH_CHECK_VALUE(grad_norms.scalar_type() == at::kFloat &&
                  grad_norms.numel() == static_cast<int64_t>(n_tensors),
                    op, ": grad_norms must be a float32 tensor of ", n_tensors,
                    " elements (one per tensor), got dtype ",
                    checks::dtype_name(grad_norms.scalar_type()), " with ",
                    grad_norms.numel(), " elements");

  // Stage 1: each gradient's norm, one partial (sum of squares or max |g|) per chunk.
  const auto chunks = make_chunks(grads, chunk_size);
  std::vector<float> partials(chunks.size(), 0.0f);
  for_each_chunk(chunks, chunk_size, [&](int64_t index, const Chunk& c) {
    const at::Tensor& g = grads[c.tensor];
    partials[index] = dispatch_float(g.scalar_type(), op, [&](auto tag) {
      using T = decltype(tag);
      const T* x = data_as<T>(g) + c.begin;
      const int64_t n = c.end - c.begin;
      return norm_type == 2 ? SumOfSquaresFunctor<T>::run(x, n, 1.0f)
                            : MaxAbsFunctor<T>::run(x, n);
    });
  });

  // Host: blend the norms into grad_norms (float32 math, as the reference).
  std::vector<float> norms(n_tensors, 0.0f);
  if (norm_type == 2) {
    const std::vector<double> sums = sum_per_tensor(chunks, partials, n_tensors);
    for (size_t i = 0; i < n_tensors; ++i) norms[i] = std::sqrt(static_cast<float>(sums[i]));
  } else {
    for (size_t c = 0; c < chunks.size(); ++c) {
      float& best = norms[chunks[c].tensor];
      best = math::combine_partials<true>(best, partials[c]);  // nan sticks
    }
  }
  at::Tensor old = grad_norms.reshape({-1}).contiguous();
  const float* old_norms = old.data_ptr<float>();
  const float b2 = static_cast<float>(beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - beta2);
  const float bc2 =
      bias_correction ? static_cast<float>(std::sqrt(1.0 - std::pow(beta2, double(step)))) : 1.0f;
  const float eps = static_cast<float>(epsilon);
  at::Tensor blended = at::empty({static_cast<int64_t>(n_tensors)}, old.options());
  float* blend = blended.data_ptr<float>();
  std::vector<float> denoms(n_tensors);
  bool finite = true;
  for (size_t i = 0; i < n_tensors; ++i) {
    const float o = old_norms[i];
    const float n = norms[i];
    finite = finite && std::isfinite(n);
    blend[i] = math::novograd_blend_math(o, n, b2, one_minus_b2, norm_type == 2);
    denoms[i] = blend[i] / bc2 + eps;
  }

  // Stage 2: the elementwise step.
  NovoGradScalars a{};
  a.beta1 = static_cast<float>(beta1);
  a.beta3 = grad_averaging ? static_cast<float>(1.0 - beta1) : 1.0f;
  a.bc1 = bias_correction ? static_cast<float>(1.0 - std::pow(beta1, double(step))) : 1.0f;
  a.lr = static_cast<float>(lr);
  a.weight_decay = static_cast<float>(weight_decay);
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    float g_tile[kTile], p_tile[kTile], m_tile[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      const float* g = tile_in(grads[c.tensor], offset, n, g_tile);
      float* p = tile_in(params[c.tensor], offset, n, p_tile);
      float* m = tile_in(exp_avgs[c.tensor], offset, n, m_tile);
      if (mode == 1) {
        NovoGradFunctor<true>::run(g, p, m, n, denoms[c.tensor], a);
      } else {
        NovoGradFunctor<false>::run(g, p, m, n, denoms[c.tensor], a);
      }
      tile_out(params[c.tensor], offset, n, p);
      tile_out(exp_avgs[c.tensor], offset, n, m);
    });
  });
  grad_norms.copy_(blended.reshape(grad_norms.sizes()));
  if (!finite) set_noop(noop_flag);
}

}  // namespace cpu
}  // namespace amp_fused_ops
