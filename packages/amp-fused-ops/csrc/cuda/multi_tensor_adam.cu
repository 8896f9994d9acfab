// multi_tensor_adam and multi_tensor_adam_capturable_master.
//
// The element math is csrc/common/adam_math.h (shared with the CPU kernels and written as the
// reference's _adam_math), in float32.
#include "../common/adam_math.h"
#include "multi_tensor_apply.cuh"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cuda {
namespace {

using math::AdamScalars;

// [grads, params, exp_avgs, exp_avg_sqs]; the noop flag is neither read nor written.
struct AdamOp {
  static constexpr unsigned kStores = 0b1110;
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  AdamScalars s;
  bool decoupled;

  __device__ bool prepare(int, const int*) { return true; }
  __device__ void operator()(float (&x)[4], float (&)[2], bool&) const {
    math::adam_math(decoupled, s, x[0], x[1], x[2], x[3]);
  }
};

// [grads]: raises the noop flag when a grad * inv_scale is inf or nan (writes nothing).
struct UnscaledNonfiniteOp {
  static constexpr unsigned kStores = 0;
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  const float* inv_scale_ptr;
  float inv_scale;

  __device__ bool prepare(int, const int*) {
    inv_scale = *inv_scale_ptr;
    return true;
  }
  __device__ void operator()(float (&x)[1], float (&)[2], bool& nonfinite) const {
    nonfinite = nonfinite || !is_finite(x[0] * inv_scale);
  }
};

// [grads, params, exp_avgs, exp_avg_sqs, masters]: the step on the float32 masters, params
// written from the new masters. Skips every chunk when the noop flag is set (by the caller,
// or by UnscaledNonfiniteOp just before).
struct AdamMasterOp {
  static constexpr unsigned kStores = 0b11110;
  static constexpr unsigned kLoads = 0b11101;  // params are only written (from the masters)
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  AdamScalars s;  // lr, bc1, bc2 filled in prepare()
  bool decoupled;
  bool bias_correction;
  const float* lr_ptr;
  const float* step_ptr;
  const float* inv_scale_ptr;
  float inv_scale;

  __device__ bool prepare(int, const int* noop) {
    if (*noop != 0) {
      return false;
    }
    s.lr = *lr_ptr;
    inv_scale = *inv_scale_ptr;
    const float step = *step_ptr;
    s.bc1 = bias_correction ? 1.0f - powf(s.beta1, step) : 1.0f;
    s.bc2 = bias_correction ? 1.0f - powf(s.beta2, step) : 1.0f;
    return true;
  }
  __device__ void operator()(float (&x)[5], float (&)[2], bool&) const {
    math::adam_math(decoupled, s, x[0] * inv_scale, x[4], x[2], x[3]);
    x[1] = x[4];
  }
};

void check_adam_choices(const char* op, int64_t mode, int64_t bias_correction) {
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW, decoupled weight "
                    "decay), got ", mode);
  TORCH_CHECK_VALUE(bias_correction == 0 || bias_correction == 1, op,
                    ": bias_correction must be 0 or 1, got ", bias_correction);
}

}  // namespace

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListsArg& tensor_lists, double lr, double beta1, double beta2,
                       double eps, int64_t step, int64_t mode, int64_t bias_correction,
                       double weight_decay) {
  constexpr const char* op = "multi_tensor_adam";
  check_adam_choices(op, mode, bias_correction);
  TORCH_CHECK_VALUE(step >= 1 || bias_correction == 0, op,
                    ": step must be >= 1 when bias_correction is on, got ", step);
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4) == 0) {
    return;
  }
  check_fp32_lists(op, tensor_lists, {2, 3});  // as Apex's AdamFunctor reads them
  check_overlap(op, tensor_lists, {1, 2, 3});
  AdamOp adam{};
  adam.s = math::adam_scalars(beta1, beta2, eps, weight_decay);
  adam.s.lr = static_cast<float>(lr);
  // Bias corrections in double on the host, as the reference computes them in Python.
  const double steps = static_cast<double>(step);
  adam.s.bc1 = bias_correction == 1 ? static_cast<float>(1.0 - std::pow(beta1, steps)) : 1.0f;
  adam.s.bc2 = bias_correction == 1 ? static_cast<float>(1.0 - std::pow(beta2, steps)) : 1.0f;
  adam.decoupled = mode == 1;
  const std::array<at::ScalarType, 2> types{tensor_lists[0][0].scalar_type(),
                                            tensor_lists[1][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using G = TypeAt<0, decltype(type_list)>;
    using P = TypeAt<1, decltype(type_list)>;
    multi_tensor_apply<AdamOp, G, P, float, float>(chunk_size, noop_flag, tensor_lists, adam);
  });
}

void multi_tensor_adam_capturable_master(int64_t chunk_size, const at::Tensor& noop_flag,
                                         const TensorListsArg& tensor_lists,
                                         const at::Tensor& lr, double beta1, double beta2,
                                         double eps, const at::Tensor& step, int64_t mode,
                                         int64_t bias_correction, double weight_decay,
                                         const at::Tensor& inv_scale) {
  constexpr const char* op = "multi_tensor_adam_capturable_master";
  check_adam_choices(op, mode, bias_correction);
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 5) == 0) {
    return;
  }
  check_fp32_lists(op, tensor_lists, {2, 3, 4});
  // A float32 param may be its own master (lists 1 and 4); nothing else may share memory.
  check_overlap(op, tensor_lists, {1, 2, 3, 4}, {{1, 4}});
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const at::Device device = noop_flag.device();
  // float32 copies on the device (no-ops when they already are): no host sync.
  const at::Tensor lr_d = device_scalar(op, "lr", lr, device);
  const at::Tensor step_d = device_scalar(op, "step", step, device);
  const at::Tensor inv_scale_d = device_scalar(op, "inv_scale", inv_scale, device);

  AdamMasterOp adam{};
  adam.s = math::adam_scalars(beta1, beta2, eps, weight_decay);  // lr, bc1, bc2: prepare()
  adam.decoupled = mode == 1;
  adam.bias_correction = bias_correction == 1;
  adam.lr_ptr = lr_d.data_ptr<float>();
  adam.step_ptr = step_d.data_ptr<float>();
  adam.inv_scale_ptr = inv_scale_d.data_ptr<float>();
  const UnscaledNonfiniteOp check{adam.inv_scale_ptr, 1.0f};
  const std::vector<std::vector<at::Tensor>> grads{tensor_lists[0]};

  const std::array<at::ScalarType, 2> types{tensor_lists[0][0].scalar_type(),
                                            tensor_lists[1][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using G = TypeAt<0, decltype(type_list)>;
    using P = TypeAt<1, decltype(type_list)>;
    // Pass 1 decides for the whole call (nothing is written if any gradient is not finite);
    // pass 2 reads the flag on the device.
    multi_tensor_apply<UnscaledNonfiniteOp, G>(chunk_size, noop_flag, grads, check);
    multi_tensor_apply<AdamMasterOp, G, P, float, float, float>(chunk_size, noop_flag,
                                                                tensor_lists, adam);
  });
}

}  // namespace cuda
}  // namespace amp_fused_ops
