// multi_tensor_lamb_stage1_cuda and multi_tensor_lamb_stage2_cuda (Apex's names).
//
// Math in float32, the reference's (src/amp_fused_ops/reference/_lamb_stages.py):
//   stage 1 on [grads, params, exp_avgs, exp_avg_sqs, updates], bias correction at step + 1:
//     g = grad / clip; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
//     update = (m / bc1) / (sqrt(v / bc2) + eps) + decay[tensor] * p
//   stage 2 on [params, updates]: p -= ratio[tensor] * update, with
//     ratio = lr * param_norm / update_norm when both are nonzero and (use_nvlamb or
//     weight_decay != 0), else lr.
// The per-tensor decays and norms and the global norm are device tensors read by the kernels
// (no host sync). The noop flag is neither read nor written, as in Apex. Functors over
// multi_tensor_apply.cuh (stage 2 is lamb_apply.cuh's, shared with multi_tensor_lamb); the
// element math is csrc/common/optim_math.h's lamb_stage1_math / lamb_stage2_math, shared with
// the CPU kernels.
#include "../common/optim_math.h"
#include "multi_tensor_apply.cuh"
#include "lamb_apply.cuh"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cuda {
namespace {

struct LambStage1ApexOp {
  // Five lists: 8-byte vectors keep its registers under the 64 of two blocks per SM (with 16,
  // sm_120 spilled).
  static constexpr int kVectorBytes = 8;
  static constexpr unsigned kStores = 0b11100;
  static constexpr unsigned kLoads = 0b01111;  // the updates are only written
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  const float* decays;
  const float* global_norm_ptr;
  float max_grad_norm;
  math::LambStage1Scalars scalars;
  float decay;
  float clip;

  __device__ bool prepare(int tensor, const int*) {
    clip = math::lamb_clip_math(*global_norm_ptr, max_grad_norm);
    decay = decays[tensor];
    return true;
  }
  __device__ void operator()(float (&x)[5], float (&)[2], bool&) const {
    x[4] = math::lamb_stage1_math(scalars, clip, decay, x[0], x[1], x[2], x[3]);
  }
};

// A float32 tensor of one value per tensor, on the tensors' device, contiguous.
at::Tensor per_tensor_arg(const char* op, const char* name, const at::Tensor& value, size_t n,
                          const at::Device& device) {
  TORCH_CHECK(value.defined() && value.scalar_type() == at::kFloat &&
                  value.numel() == static_cast<int64_t>(n),
              op, ": ", name, " must be a float32 tensor of ", n,
              " elements (one per tensor), got dtype ",
              value.defined() ? value.scalar_type() : at::kFloat, " with ",
              value.defined() ? value.numel() : 0, " elements");
  TORCH_CHECK(value.device() == device, op, ": ", name, " is on ", value.device(),
              " but the tensors are on ", device, "; create it on the tensors' device");
  return value.contiguous();
}

}  // namespace

void multi_tensor_lamb_stage1(int64_t chunk_size, const at::Tensor& noop_flag,
                              const TensorListsArg& tensor_lists,
                              const at::Tensor& per_tensor_decay, int64_t step, double beta1,
                              double beta2, double epsilon, const at::Tensor& global_grad_norm,
                              double max_global_grad_norm) {
  constexpr const char* op = "multi_tensor_lamb_stage1_cuda";
  const size_t n = check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 5);
  if (n == 0) {
    return;
  }
  check_state_lists(op, tensor_lists, 2, 3, 1);  // the moments
  check_state_dtype(op, tensor_lists, 4, 1);      // the updates
  check_overlap(op, tensor_lists, {2, 3, 4});
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const at::Device device = noop_flag.device();
  const at::Tensor decays = per_tensor_arg(op, "per_tensor_decay", per_tensor_decay, n, device);
  const at::Tensor norm = device_scalar(op, "global_grad_norm", global_grad_norm, device);

  LambStage1ApexOp stage1{};
  stage1.decays = decays.data_ptr<float>();
  stage1.global_norm_ptr = norm.data_ptr<float>();
  stage1.max_grad_norm = static_cast<float>(max_global_grad_norm);
  math::LambStage1Scalars& s = stage1.scalars;
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bc1 = static_cast<float>(bias_correction_of(beta1, step + 1, true));
  s.bc2 = static_cast<float>(bias_correction_of(beta2, step + 1, true));
  s.epsilon = static_cast<float>(epsilon);

  const bool fp32_state = tensor_lists[2][0].scalar_type() == at::kFloat;
  const bool fp32_update = tensor_lists[4][0].scalar_type() == at::kFloat;
  const std::array<at::ScalarType, 2> types{tensor_lists[0][0].scalar_type(),
                                            tensor_lists[1][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using G = TypeAt<0, decltype(type_list)>;
    using P = TypeAt<1, decltype(type_list)>;
    if (fp32_state && fp32_update) {
      multi_tensor_apply<LambStage1ApexOp, G, P, float, float, float>(chunk_size, noop_flag,
                                                                      tensor_lists, stage1);
    } else if (fp32_state) {
      multi_tensor_apply<LambStage1ApexOp, G, P, float, float, P>(chunk_size, noop_flag,
                                                                  tensor_lists, stage1);
    } else if (fp32_update) {
      multi_tensor_apply<LambStage1ApexOp, G, P, P, P, float>(chunk_size, noop_flag,
                                                              tensor_lists, stage1);
    } else {
      multi_tensor_apply<LambStage1ApexOp, G, P, P, P, P>(chunk_size, noop_flag, tensor_lists,
                                                          stage1);
    }
  });
}

void multi_tensor_lamb_stage2(int64_t chunk_size, const at::Tensor& noop_flag,
                              const TensorListsArg& tensor_lists,
                              const at::Tensor& per_tensor_param_norm,
                              const at::Tensor& per_tensor_update_norm, double lr,
                              double weight_decay, bool use_nvlamb) {
  constexpr const char* op = "multi_tensor_lamb_stage2_cuda";
  const size_t n = check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 2);
  if (n == 0) {
    return;
  }
  check_state_dtype(op, tensor_lists, 1, 0);  // the updates
  check_overlap(op, tensor_lists, {0});
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const at::Device device = noop_flag.device();
  const at::Tensor param_norms =
      per_tensor_arg(op, "per_tensor_param_norm", per_tensor_param_norm, n, device);
  const at::Tensor update_norms =
      per_tensor_arg(op, "per_tensor_update_norm", per_tensor_update_norm, n, device);
  LambApplyOp<true> stage2{};
  stage2.param_norms = param_norms.data_ptr<float>();
  stage2.update_norms = update_norms.data_ptr<float>();
  stage2.lr = static_cast<float>(lr);
  stage2.use_ratio = use_nvlamb || weight_decay != 0.0;
  const bool fp32_update = tensor_lists[1][0].scalar_type() == at::kFloat;
  const std::array<at::ScalarType, 1> types{tensor_lists[0][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using P = TypeAt<0, decltype(type_list)>;
    if (fp32_update) {
      multi_tensor_apply<LambApplyOp<true>, P, float>(chunk_size, noop_flag, tensor_lists, stage2);
    } else {
      multi_tensor_apply<LambApplyOp<true>, P, P>(chunk_size, noop_flag, tensor_lists, stage2);
    }
  });
}

}  // namespace cuda
}  // namespace amp_fused_ops
