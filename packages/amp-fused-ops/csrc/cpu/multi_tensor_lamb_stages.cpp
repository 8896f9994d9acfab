// multi_tensor_lamb_stage1_cuda and multi_tensor_lamb_stage2_cuda on CPU (Apex's names).
//
// Stage 1 on [grads, params, exp_avgs, exp_avg_sqs, updates], in the reference's order of
// operations (_reference_lamb_stages.py), with bias correction at step + 1:
//   g = grad / clip; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//   update = (m / bc1) / (sqrt(v / bc2) + eps) + decay[tensor] * p.
// Stage 2 on [params, updates]: p -= ratio[tensor] * update.
// Every list may be float32, float16 or bfloat16; math in float32 over tiles. The noop flag is
// neither read nor written (inf/nan propagate), as in Apex.
#include <cmath>

#include "multi_tensor_apply.h"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

struct LambStage1Scalars {
  float beta1;
  float beta2;
  float one_minus_beta1;  // 1 - beta1 in double, then rounded (as the reference's Python)
  float one_minus_beta2;
  float bc1;
  float bc2;
  float eps;
  float clip;  // global_grad_norm / max_global_grad_norm when larger, else 1
};

struct LambStage1Functor {
  static void run(const float* g, const float* p, float* m, float* v, float* u, int64_t n,
                  float decay, const LambStage1Scalars& s) {
    const float beta1 = s.beta1;
    const float beta2 = s.beta2;
    const float one_minus_beta1 = s.one_minus_beta1;
    const float one_minus_beta2 = s.one_minus_beta2;
    const float bc1 = s.bc1;
    const float bc2 = s.bc2;
    const float eps = s.eps;
    const float clip = s.clip;
    for (int64_t i = 0; i < n; ++i) {
      const float grad = g[i] / clip;
      const float m1 = beta1 * m[i] + one_minus_beta1 * grad;
      const float v1 = beta2 * v[i] + one_minus_beta2 * (grad * grad);
      const float update = (m1 / bc1) / (std::sqrt(v1 / bc2) + eps);
      m[i] = m1;
      v[i] = v1;
      u[i] = update + p[i] * decay;
    }
  }
};

struct LambStage2Functor {
  static void run(float* p, const float* u, int64_t n, float ratio) {
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] - u[i] * ratio;
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
  s.eps = static_cast<float>(epsilon);
  const float norm = static_cast<float>(scalar_value(op, "global_grad_norm", global_grad_norm));
  const float max_norm = static_cast<float>(max_global_grad_norm);
  s.clip = norm > max_norm ? norm / max_norm : 1.0f;

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
      LambStage1Functor::run(g, p, m, v, u, n, decay[t], s);
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
  const auto& params = tensor_lists[0];
  const size_t n_tensors = params.size();
  const std::vector<float> param_norms =
      per_tensor_values(op, "per_tensor_param_norm", per_tensor_param_norm, n_tensors);
  const std::vector<float> update_norms =
      per_tensor_values(op, "per_tensor_update_norm", per_tensor_update_norm, n_tensors);
  const float lr_f = static_cast<float>(lr);
  const bool use_ratio = use_nvlamb || weight_decay != 0.0;
  std::vector<float> ratios(n_tensors, lr_f);
  for (size_t i = 0; i < n_tensors; ++i) {
    if (use_ratio && param_norms[i] != 0.0f && update_norms[i] != 0.0f) {
      ratios[i] = lr_f * (param_norms[i] / update_norms[i]);
    }
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
