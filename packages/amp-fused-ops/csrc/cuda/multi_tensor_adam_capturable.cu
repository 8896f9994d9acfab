// multi_tensor_adam_capturable: Adam on the params themselves with lr, step and inv_scale as
// device tensors (CUDA-graph capturable, no host sync).
//
// The gradient is g = grad * inv_scale (written back into grad); the element math is
// csrc/common/adam_math.h, shared with the CPU kernels and the other Adam ops, in float32.
// Two launches: the first raises the noop flag when some grad * inv_scale is inf/nan; the
// second does nothing when the flag is set (by the caller or by the first), so a skipped step
// writes nothing at all. Self-contained functors over multi_tensor_apply.cuh.
#include "../common/adam_math.h"
#include "multi_tensor_apply.cuh"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cuda {
namespace {

// [grads]: raises the noop flag when a grad * inv_scale is inf or nan; writes nothing. Skips
// its reads when the flag is already set.
struct CapturableNonfiniteOp {
  static constexpr unsigned kStores = 0;
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  const float* inv_scale_ptr;
  float inv_scale;

  __device__ bool prepare(int, const int* noop) {
    if (*noop != 0) {
      return false;
    }
    inv_scale = *inv_scale_ptr;
    return true;
  }
  __device__ void operator()(float (&x)[1], float (&)[2], bool& nonfinite) const {
    nonfinite = nonfinite || !isfinite(x[0] * inv_scale);
  }
};

// [grads, params, exp_avgs, exp_avg_sqs]: the step; grads receive the unscaled values (that
// store is skipped when inv_scale is 1: it would write the same values).
struct CapturableAdamOp {
  static constexpr unsigned kStores = 0b1111;
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  math::AdamScalars s;  // lr, bc1, bc2 filled in prepare()
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
  __device__ bool stores(int list) const { return list != 0 || inv_scale != 1.0f; }
  __device__ void operator()(float (&x)[4], float (&)[2], bool&) const {
    x[0] = x[0] * inv_scale;
    math::adam_math(decoupled, s, x[0], x[1], x[2], x[3]);
  }
};

}  // namespace

void multi_tensor_adam_capturable(int64_t chunk_size, const at::Tensor& noop_flag,
                                  const TensorListsArg& tensor_lists, const at::Tensor& lr,
                                  double beta1, double beta2, double eps, const at::Tensor& step,
                                  int64_t mode, int64_t bias_correction, double weight_decay,
                                  const at::Tensor& inv_scale) {
  constexpr const char* op = "multi_tensor_adam_capturable";
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW, decoupled weight "
                    "decay), got ", mode);
  TORCH_CHECK_VALUE(bias_correction == 0 || bias_correction == 1, op,
                    ": bias_correction must be 0 or 1, got ", bias_correction);
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4) == 0) {
    return;
  }
  check_fp32_lists(op, tensor_lists, {2, 3});
  check_overlap(op, tensor_lists, {0, 1, 2, 3});  // the unscaled grads are written back
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const at::Device device = noop_flag.device();
  // float32 copies on the device (no-ops when they already are): no host sync.
  const at::Tensor lr_d = device_scalar(op, "lr", lr, device);
  const at::Tensor step_d = device_scalar(op, "step", step, device);
  const at::Tensor inv_scale_d = device_scalar(op, "inv_scale", inv_scale, device);

  CapturableAdamOp adam{};
  adam.s = math::adam_scalars(beta1, beta2, eps, weight_decay);
  adam.decoupled = mode == 1;
  adam.bias_correction = bias_correction == 1;
  adam.lr_ptr = lr_d.data_ptr<float>();
  adam.step_ptr = step_d.data_ptr<float>();
  adam.inv_scale_ptr = inv_scale_d.data_ptr<float>();
  const CapturableNonfiniteOp check{adam.inv_scale_ptr, 1.0f};
  const TensorListsArg grads{tensor_lists[0]};

  const std::array<at::ScalarType, 2> types{tensor_lists[0][0].scalar_type(),
                                            tensor_lists[1][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using G = TypeAt<0, decltype(type_list)>;
    using P = TypeAt<1, decltype(type_list)>;
    multi_tensor_apply<CapturableNonfiniteOp, G>(chunk_size, noop_flag, grads, check);
    multi_tensor_apply<CapturableAdamOp, G, P, float, float>(chunk_size, noop_flag,
                                                             tensor_lists, adam);
  });
}

}  // namespace cuda
}  // namespace amp_fused_ops
