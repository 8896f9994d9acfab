// multi_tensor_adam, multi_tensor_adam_capturable and multi_tensor_adam_capturable_master.
//
// One functor (AdamOp) serves the three ops; its template argument says where lr and the bias
// corrections come from and which lists the step writes. The element math is
// csrc/common/adam_math.h (shared with the CPU kernels and written as the reference's
// _adam_math), in float32.
//
// The capturable ops read lr, step and inv_scale from device tensors (CUDA-graph capturable, no
// host sync) and launch twice: the first launch raises the noop flag when some
// grad * inv_scale is inf or nan; the second does nothing when the flag is set (by the caller
// or by the first), so a skipped step writes nothing at all.
#include "../common/adam_math.h"
#include "../common/stochastic_round.h"
#include "multi_tensor_apply.cuh"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cuda {
namespace {

using math::AdamScalars;

enum class AdamVariant {
  // multi_tensor_adam, [grads, params, exp_avgs, exp_avg_sqs]: lr and the bias corrections
  // from the host; the noop flag is neither read nor written.
  kHost,
  // multi_tensor_adam_capturable, the same lists: lr, step and inv_scale on the device; the
  // grads receive grad * inv_scale (that store is skipped when inv_scale is 1: it would
  // write the same values).
  kCapturable,
  // multi_tensor_adam_capturable_master, [grads, params, exp_avgs, exp_avg_sqs, masters]: as
  // kCapturable, but the step is on the float32 masters and the params are written from the
  // new masters; the grads are not written.
  kMaster,
};

template <AdamVariant V>
struct AdamOp {
  static constexpr bool kDevice = V != AdamVariant::kHost;
  static constexpr bool kMasters = V == AdamVariant::kMaster;
  static constexpr unsigned kStores =
      kMasters ? 0b11110 : (V == AdamVariant::kCapturable ? 0b1111 : 0b1110);
  static constexpr unsigned kLoads = kMasters ? 0b11101 : 0b1111;  // params of kMaster: written
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  static constexpr bool kIndexed = V == AdamVariant::kHost;  // for stochastic rounding
  AdamScalars s;  // kDevice: lr, bc1, bc2 filled in prepare()
  bool decoupled;
  bool bias_correction;
  const float* lr_ptr;  // kDevice only, like the two below
  const float* step_ptr;
  const float* inv_scale_ptr;
  float inv_scale;
  bool stochastic_round;  // kHost only: round the (bfloat16) params stochastically
  math::StochasticRoundKey key;
  uint32_t tensor;  // set in prepare(): the block's tensor, for the random bits

  // kDevice: skips every chunk when the noop flag is set.
  __device__ bool prepare(int tensor_index, const int* noop) {
    tensor = static_cast<uint32_t>(tensor_index);
    if constexpr (kDevice) {
      if (*noop != 0) {
        return false;
      }
      s.lr = *lr_ptr;
      inv_scale = *inv_scale_ptr;
      const float step = *step_ptr;
      s.bc1 = bias_correction ? 1.0f - powf(s.beta1, step) : 1.0f;
      s.bc2 = bias_correction ? 1.0f - powf(s.beta2, step) : 1.0f;
    }
    return true;
  }
  __device__ bool stores(int list) const {
    return V != AdamVariant::kCapturable || list != 0 || inv_scale != 1.0f;
  }
  template <int Depth>
  __device__ void operator()(float (&x)[Depth], float (&)[2], bool&, int64_t offset = 0) const {
    float g = x[0];
    if constexpr (kDevice) {
      g = g * inv_scale;
    }
    if constexpr (V == AdamVariant::kCapturable) {
      x[0] = g;
    }
    if constexpr (kMasters) {
      math::adam_math(decoupled, s, g, x[4], x[2], x[3]);
      x[1] = x[4];
    } else {
      math::adam_math(decoupled, s, g, x[1], x[2], x[3]);
      if (stochastic_round) {
        x[1] = math::stochastic_round_bf16(x[1], math::stochastic_round_bits(key, tensor, offset));
      }
    }
  }
};

// [grads]: raises the noop flag when a grad * inv_scale is inf or nan; writes nothing. Skips
// its reads when the flag is already set.
struct UnscaledNonfiniteOp {
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
    nonfinite = nonfinite || !is_finite(x[0] * inv_scale);
  }
};

void check_adam_choices(const char* op, int64_t mode, int64_t bias_correction) {
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (Adam, L2 weight decay) or 1 (AdamW, decoupled weight "
                    "decay), got ", mode);
  TORCH_CHECK_VALUE(bias_correction == 0 || bias_correction == 1, op,
                    ": bias_correction must be 0 or 1, got ", bias_correction);
}

template <AdamVariant V>
AdamOp<V> adam_op(double beta1, double beta2, double eps, double weight_decay, int64_t mode,
                  int64_t bias_correction) {
  AdamOp<V> adam{};
  adam.s = math::adam_scalars(beta1, beta2, eps, weight_decay);
  adam.decoupled = mode == 1;
  adam.bias_correction = bias_correction == 1;
  return adam;
}

// Launches `adam` over the checked lists, after the finiteness pass for the capturable ops.
template <AdamVariant V>
void launch_adam(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                 const TensorListsArg& tensor_lists, const AdamOp<V>& adam) {
  const std::array<at::ScalarType, 2> types{tensor_lists[0][0].scalar_type(),
                                            tensor_lists[1][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using G = TypeAt<0, decltype(type_list)>;
    using P = TypeAt<1, decltype(type_list)>;
    if constexpr (AdamOp<V>::kDevice) {
      // Pass 1 decides for the whole call (nothing is written if any gradient is not finite);
      // pass 2 reads the flag on the device.
      const UnscaledNonfiniteOp check{adam.inv_scale_ptr, 1.0f};
      const TensorListsArg grads{tensor_lists[0]};
      multi_tensor_apply<UnscaledNonfiniteOp, G>(chunk_size, noop_flag, grads, check);
    }
    if constexpr (AdamOp<V>::kMasters) {
      multi_tensor_apply<AdamOp<V>, G, P, float, float, float>(chunk_size, noop_flag,
                                                               tensor_lists, adam);
    } else {
      multi_tensor_apply<AdamOp<V>, G, P, float, float>(chunk_size, noop_flag, tensor_lists,
                                                        adam);
    }
  });
}

// Both capturable ops: lr, step and inv_scale as float32 device tensors.
template <AdamVariant V>
void adam_capturable(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                     const TensorListsArg& tensor_lists, const at::Tensor& lr, double beta1,
                     double beta2, double eps, const at::Tensor& step, int64_t mode,
                     int64_t bias_correction, double weight_decay,
                     const at::Tensor& inv_scale) {
  constexpr bool masters = AdamOp<V>::kMasters;
  check_adam_choices(op, mode, bias_correction);
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, masters ? 5 : 4) == 0) {
    return;
  }
  if constexpr (masters) {
    check_fp32_lists(op, tensor_lists, {2, 3, 4});
    // A float32 param may be its own master (lists 1 and 4); nothing else may share memory.
    check_overlap(op, tensor_lists, {1, 2, 3, 4}, {{1, 4}});
  } else {
    check_fp32_lists(op, tensor_lists, {2, 3});
    check_overlap(op, tensor_lists, {0, 1, 2, 3});  // the unscaled grads are written back
  }
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const at::Device device = noop_flag.device();
  // float32 copies on the device (no-ops when they already are): no host sync.
  const at::Tensor lr_d = device_scalar(op, "lr", lr, device);
  const at::Tensor step_d = device_scalar(op, "step", step, device);
  const at::Tensor inv_scale_d = device_scalar(op, "inv_scale", inv_scale, device);

  AdamOp<V> adam = adam_op<V>(beta1, beta2, eps, weight_decay, mode, bias_correction);
  adam.lr_ptr = lr_d.data_ptr<float>();
  adam.step_ptr = step_d.data_ptr<float>();
  adam.inv_scale_ptr = inv_scale_d.data_ptr<float>();
  launch_adam(op, chunk_size, noop_flag, tensor_lists, adam);
}

}  // namespace

void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListsArg& tensor_lists, double lr, double beta1, double beta2,
                       double eps, int64_t step, int64_t mode, int64_t bias_correction,
                       double weight_decay, std::optional<int64_t> sr_seed, int64_t sr_step) {
  constexpr const char* op = "multi_tensor_adam";
  check_adam_choices(op, mode, bias_correction);
  TORCH_CHECK_VALUE(step >= 1 || bias_correction == 0, op,
                    ": step must be >= 1 when bias_correction is on, got ", step);
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4) == 0) {
    return;
  }
  if (sr_seed.has_value()) {
    checks::check_stochastic_round(op, tensor_lists, 1, 4);
  }
  check_fp32_lists(op, tensor_lists, {2, 3});  // as Apex's AdamFunctor reads them
  check_overlap(op, tensor_lists, {1, 2, 3});
  AdamOp<AdamVariant::kHost> adam =
      adam_op<AdamVariant::kHost>(beta1, beta2, eps, weight_decay, mode, bias_correction);
  adam.s.lr = static_cast<float>(lr);
  adam.s.bc1 = static_cast<float>(bias_correction_of(beta1, step, bias_correction == 1));
  adam.s.bc2 = static_cast<float>(bias_correction_of(beta2, step, bias_correction == 1));
  adam.stochastic_round = sr_seed.has_value();
  adam.key = math::stochastic_round_key(sr_seed.value_or(0), sr_step);
  launch_adam(op, chunk_size, noop_flag, tensor_lists, adam);
}

void multi_tensor_adam_capturable(int64_t chunk_size, const at::Tensor& noop_flag,
                                  const TensorListsArg& tensor_lists, const at::Tensor& lr,
                                  double beta1, double beta2, double eps, const at::Tensor& step,
                                  int64_t mode, int64_t bias_correction, double weight_decay,
                                  const at::Tensor& inv_scale) {
  adam_capturable<AdamVariant::kCapturable>("multi_tensor_adam_capturable", chunk_size,
                                            noop_flag, tensor_lists, lr, beta1, beta2, eps,
                                            step, mode, bias_correction, weight_decay,
                                            inv_scale);
}

void multi_tensor_adam_capturable_master(int64_t chunk_size, const at::Tensor& noop_flag,
                                         const TensorListsArg& tensor_lists,
                                         const at::Tensor& lr, double beta1, double beta2,
                                         double eps, const at::Tensor& step, int64_t mode,
                                         int64_t bias_correction, double weight_decay,
                                         const at::Tensor& inv_scale) {
  adam_capturable<AdamVariant::kMaster>("multi_tensor_adam_capturable_master", chunk_size,
                                        noop_flag, tensor_lists, lr, beta1, beta2, eps, step,
                                        mode, bias_correction, weight_decay, inv_scale);
}

}  // namespace cuda
}  // namespace amp_fused_ops
