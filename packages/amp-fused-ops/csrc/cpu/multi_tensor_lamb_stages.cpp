// multi_tensor_lamb_stage1_cuda and multi_tensor_lamb_stage2_cuda on CPU (Apex's names).
//
// Stage 1 on [grads, params, exp_avgs, exp_avg_sqs, updates], stage 2 on [params, updates];
// the element math is math::lamb_stage1_math / lamb_stage2_math (csrc/common/optim_math.h),
// shared with the CUDA kernels.
// Every list may be float32, float16 or bfloat16; math in float32 over tiles. The noop flag is
// neither read nor written (inf/nan propagate), as in Apex.
#include <cmath>

#include "../common/optim_math.h"
#include "multi_tensor_apply.h"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

using math::LambStage1Scalars;

// Stage 1 on float32 tiles (math::lamb_stage1_math).
struct LambStage1Functor {
  static void run(const float* g, const float* p, float* m, float* v, float* u, int64_t n,
                  float clip, float decay, const LambStage1Scalars& scalars) {
    const LambStage1Scalars s = scalars;
    for (int64_t i = 0; i < n; ++i) {
      float m1 = m[i];
      float v1 = v[i];
      const float update = math::lamb_stage1_math(s, clip, decay, g[i], p[i], m1, v1);
      m[i] = m1;
      v[i] = v1;
      u[i] = update;
    }
  }
};

// Stage 2 on float32 tiles (math::lamb_stage2_math).
struct LambStage2Functor {
  static void run(float* p, const float* u, int64_t n, float ratio) {
    for (int64_t i = 0; i < n; ++i) p[i] = math::lamb_stage2_math(p[i], u[i], ratio);
  }
};

// The float32 values of a CPU tensor of `n` elements (one per tensor of the lists).
std::vector<float> per_tensor_values(const char* op, const char* name, const at::Tensor& t,
                                     size_t n) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined (None)");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name,
              " must be a CPU tensor for the CPU extension, got device ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == static_cast<int64_t>(n), op, ": ",
              name, " must be a float32 tensor of ", n, " elements (one per tensor), got dtype ",
              t.scalar_type(), " with ", t.numel(), " elements");
  const at::Tensor flat = t.contiguous().reshape({-1});
  const float* data = flat.data_ptr<float>();
  return std::vector<float>(data, data + n);
}

}  // namespace

void multi_tensor_lamb_stage1(int64_t chunk_size, const at::Tensor& noop_flag,
                              const std::vector<std::vector<at::Tensor>>& tensor_lists,
                              const at::Tensor& per_tensor_decay, int64_t step, double beta1,
                              double beta2, double epsilon, const at::Tensor& global_grad_norm,
                              double max_global_grad_norm) {
  constexpr const char* op = "multi_tensor_lamb_stage1_cuda";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 5);
  check_state_lists(op, tensor_lists, 2, 3, 1);  // the moments
  check_state_dtype(op, tensor_lists, 4, 1);      // the updates
  check_overlap(op, tensor_lists, {2, 3, 4});
  const auto& grads = tensor_lists[0];
  const std::vector<float> decay =
      per_tensor_values(op, "per_tensor_decay", per_tensor_decay, grads.size());
  LambStage1Scalars s{};
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  // As the reference: bias corrections in double (Python numbers), then float32.
  s.bc1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(step + 1)));
  s.bc2 = static_cast<float>(1.0 - std::pow(beta2, static_cast<double>(step + 1)));
  s.epsilon = static_cast<float>(epsilon);
  const float norm = static_cast<float>(scalar_value(op, "global_grad_norm", global_grad_norm));
  const float clip = math::lamb_clip_math(norm, static_cast<float>(max_global_grad_norm));

  const auto chunks = make_chunks(grads, chunk_size);
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    const int64_t t = c.tensor;
    float g_buf[kTile];
    float p_buf[kTile];
    float m_buf[kTile];
    float v_buf[kTile];
    float u_buf[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      const float* g = tile_in(grads[t], offset, n, g_buf);
      const float* p = tile_in(tensor_lists[1][t], offset, n, p_buf);
      float* m = tile_in(tensor_lists[2][t], offset, n, m_buf);
      float* v = tile_in(tensor_lists[3][t], offset, n, v_buf);
      float* u = tile_in(tensor_lists[4][t], offset, n, u_buf, /*load=*/false);
      LambStage1Functor::run(g, p, m, v, u, n, clip, decay[t], s);
      tile_out(tensor_lists[2][t], offset, n, m);
      tile_out(tensor_lists[3][t], offset, n, v);
      tile_out(tensor_lists[4][t], offset, n, u);
    });
  });
}

void multi_tensor_lamb_stage2(int64_t chunk_size, const at::Tensor& noop_flag,
                              const std::vector<std::vector<at::Tensor>>& tensor_lists,
                              const at::Tensor& per_tensor_param_norm,
                              const at::Tensor& per_tensor_update_norm, double lr,
                              double weight_decay, bool use_nvlamb) {
  constexpr const char* op = "multi_tensor_lamb_stage2_cuda";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 2);
  check_state_dtype(op, tensor_lists, 1, 0);  // the updates
  check_overlap(op, tensor_lists, {0});
  const auto& params = tensor_lists[0];
  const size_t n_tensors = params.size();
  const std::vector<float> param_norms =
      per_tensor_values(op, "per_tensor_param_norm", per_tensor_param_norm, n_tensors);
  const std::vector<float> update_norms =
      per_tensor_values(op, "per_tensor_update_norm", per_tensor_update_norm, n_tensors);
  const float lr_f = static_cast<float>(lr);
  const bool use_ratio = use_nvlamb || weight_decay != 0.0;
  std::vector<float> ratios(n_tensors);
  for (size_t i = 0; i < n_tensors; ++i) {
    ratios[i] = lr_f * math::lamb_trust_ratio_math(use_ratio, param_norms[i], update_norms[i]);
  }
  const auto chunks = make_chunks(params, chunk_size);
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    const int64_t t = c.tensor;
    float p_buf[kTile];
    float u_buf[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      float* p = tile_in(params[t], offset, n, p_buf);
      const float* u = tile_in(tensor_lists[1][t], offset, n, u_buf);
      LambStage2Functor::run(p, u, n, ratios[t]);
      tile_out(params[t], offset, n, p);
    });
  });
}

}  // namespace cpu
}  // namespace amp_fused_ops
