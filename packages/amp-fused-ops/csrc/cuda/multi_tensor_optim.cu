// multi_tensor_sgd, multi_tensor_adagrad, multi_tensor_lamb, multi_tensor_novograd.
//
// Math in float32, the reference's (src/amp_fused_ops/reference/_optim.py for SGD and Adagrad,
// reference/_layerwise.py for LAMB and NovoGrad): the element math is csrc/common/optim_math.h,
// shared with the CPU kernels.
// LAMB and NovoGrad need per-tensor norms: a reducing pass writes per-chunk partials, the
// launcher's segment_reduce turns them into per-tensor values on the device, and the update
// pass reads its tensor's value in prepare(). Nothing synchronizes the host.
#include "../common/norm_math.h"
#include "../common/optim_math.h"
#include "../common/stochastic_round.h"
#include "multi_tensor_apply.cuh"
#include "lamb_apply.cuh"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cuda {
namespace {

// [grads, params, momentum_bufs(, model_copies)]; skips every chunk when the flag is set.
struct SgdOp {
  static constexpr unsigned kStores = 0b1110;
  static constexpr unsigned kLoads = 0b0111;  // model_copies (list 3) are only written
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  static constexpr bool kIndexed = true;  // for stochastic rounding
  float weight_decay;
  float momentum;
  float dampening;
  float lr;
  float scale;
  bool nesterov;
  bool first_run;
  bool wd_after_momentum;
  bool stochastic_round;  // round the (bfloat16) params stochastically
  math::StochasticRoundKey key;
  uint32_t tensor;  // set in prepare(): the block's tensor, for the random bits

  __device__ bool prepare(int tensor_index, const int* noop) {
    tensor = static_cast<uint32_t>(tensor_index);
    return *noop == 0;
  }
  // Without momentum the buffers are neither read for the math nor written.
  __device__ bool stores(int list) const { return list != 2 || momentum != 0.0f; }
  template <int Depth>
  __device__ void operator()(float (&x)[Depth], float (&)[2], bool&, int64_t offset) const {
    const math::SgdScalars s{weight_decay, momentum, dampening, lr, scale};
    math::sgd_math(s, momentum != 0.0f, nesterov, first_run, wd_after_momentum, x[0], x[1],
                   x[2]);
    if (stochastic_round) {
      x[1] = math::stochastic_round_bf16(x[1], math::stochastic_round_bits(key, tensor, offset));
    }
    if constexpr (Depth == 4) {
      x[3] = x[1];
    }
  }
};

// [grads, params, state_sums].
struct AdagradOp {
  static constexpr unsigned kStores = 0b110;
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  float lr;
  float epsilon;
  float weight_decay;
  bool decoupled;

  __device__ bool prepare(int, const int*) { return true; }
  __device__ void operator()(float (&x)[3], float (&)[2], bool&) const {
    math::adagrad_math({lr, epsilon, weight_decay}, decoupled, x[0], x[1], x[2]);
  }
};

// LAMB pass 1 on [grads, params, exp_avgs, exp_avg_sqs, updates (float32 scratch)]: moments
// and the update; reduces ||p||^2 and ||update||^2 per chunk.
struct LambStage1Op {
  static constexpr unsigned kStores = 0b11100;
  static constexpr unsigned kLoads = 0b01111;  // the updates are only written
  static constexpr int kReduce = 2;
  static constexpr bool kReduceMax = false;
  float beta1;
  float beta2;
  float beta3;
  float one_minus_beta2;
  float bc1;
  float bc2;
  float epsilon;
  float weight_decay;
  bool decoupled;
  const float* global_norm_ptr;
  float max_grad_norm;
  float clip;

  __device__ bool prepare(int, const int*) {
    clip = math::lamb_clip_math(*global_norm_ptr, max_grad_norm);
    return true;
  }
  __device__ void operator()(float (&x)[5], float (&acc)[2], bool&) const {
    const math::LambScalars s{beta1, beta2, beta3, one_minus_beta2, bc1, bc2, epsilon,
                              weight_decay};
    const float p = x[1];
    const float update = math::lamb_update_math(s, decoupled, x[0] / clip, p, x[2], x[3]);
    x[4] = update;
    acc[0] = math::sum_of_squares_step(acc[0], p, 1.0f);
    acc[1] = math::sum_of_squares_step(acc[1], update, 1.0f);
  }
};

// NovoGrad pass 1 on [grads]: per chunk, the sum of squares (L2) or the max of |g| (inf norm).
template <bool kMax>
struct GradNormOp {
  static constexpr unsigned kStores = 0;
  static constexpr int kReduce = 1;
  static constexpr bool kReduceMax = kMax;

  __device__ bool prepare(int, const int*) { return true; }
  __device__ void operator()(float (&x)[1], float (&acc)[2], bool&) const {
    if constexpr (kMax) {
      acc[0] = math::max_abs_step(acc[0], x[0]);
    } else {
      acc[0] = math::sum_of_squares_step(acc[0], x[0], 1.0f);
    }
  }
};

// NovoGrad: blend each tensor's gradient norm into grad_norms; flag a non-finite norm.
__global__ void novograd_blend_kernel(const float* norms, float* grad_norms, int n, float beta2,
                                      float one_minus_beta2, bool l2, int* noop) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) {
    return;
  }
  const float norm = norms[i];
  const float old = grad_norms[i];
  grad_norms[i] = math::novograd_blend_math(old, norm, beta2, one_minus_beta2, l2);
  if (!isfinite(norm)) {
    *noop = 1;
  }
}

// NovoGrad pass 2 on [grads, params, exp_avgs].
struct NovogradOp {
  static constexpr unsigned kStores = 0b110;
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  const float* grad_norms;
  float lr;
  float beta1;
  float beta3;
  float bc1;
  float bc2;
  float epsilon;
  float weight_decay;
  bool decoupled;
  float denom;

  __device__ bool prepare(int tensor, const int*) {
    denom = grad_norms[tensor] / bc2 + epsilon;
    return true;
  }
  __device__ void operator()(float (&x)[3], float (&)[2], bool&) const {
    const math::NovoGradScalars s{beta1, beta3, bc1, lr, weight_decay};
    math::novograd_math(s, decoupled, denom, x[0], x[1], x[2]);
  }
};

void check_choice(const char* op, const char* name, int64_t value, int64_t a, int64_t b) {
  TORCH_CHECK_VALUE(value == a || value == b, op, ": ", name, " must be ", a, " or ", b, ", got ",
                    value);
}

// The 0-or-1 choices of multi_tensor_lamb and multi_tensor_novograd.
void check_layerwise_choices(const char* op, int64_t bias_correction, int64_t grad_averaging,
                             int64_t mode) {
  check_choice(op, "bias_correction", bias_correction, 0, 1);
  check_choice(op, "grad_averaging", grad_averaging, 0, 1);
  check_choice(op, "mode", mode, 0, 1);
}

// Calls fn(TypeList<G, P, S>{}) with S float or P, as the state list's dtype says.
template <typename Fn>
void dispatch_grad_param_state(const char* op, const TensorListsArg& lists, size_t state_list,
                               Fn fn) {
  const bool fp32_state = lists[state_list][0].scalar_type() == at::kFloat;
  const std::array<at::ScalarType, 2> types{lists[0][0].scalar_type(),
                                            lists[1][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using G = TypeAt<0, decltype(type_list)>;
    using P = TypeAt<1, decltype(type_list)>;
    if (fp32_state || std::is_same_v<P, float>) {
      fn(TypeList<G, P, float>{});
    } else {
      fn(TypeList<G, P, P>{});
    }
  });
}

}  // namespace

void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const TensorListsArg& tensor_lists, double weight_decay, double momentum,
                      double dampening, double lr, bool nesterov, bool first_run,
                      bool wd_after_momentum, double scale, std::optional<int64_t> sr_seed,
                      int64_t sr_step) {
  constexpr const char* op = "multi_tensor_sgd";
  const size_t depth = tensor_lists.size();
  // [grads, params, momentum_bufs] or [grads, params, momentum_bufs, model_copies].
  checks::check_list_count(op, tensor_lists, {3, 4});
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, depth) == 0) {
    return;
  }
  if (sr_seed.has_value()) {
    checks::check_stochastic_round(op, tensor_lists, 1, 3);
  }
  check_state_dtype(op, tensor_lists, 2, 1);
  if (depth == 4) {
    check_overlap(op, tensor_lists, {1, 2, 3});
  } else {
    check_overlap(op, tensor_lists, {1, 2});
  }
  SgdOp sgd{};
  sgd.weight_decay = static_cast<float>(weight_decay);
  sgd.momentum = static_cast<float>(momentum);
  sgd.dampening = static_cast<float>(dampening);
  sgd.lr = static_cast<float>(lr);
  sgd.scale = static_cast<float>(scale);
  sgd.nesterov = nesterov;
  sgd.first_run = first_run;
  sgd.wd_after_momentum = wd_after_momentum;
  sgd.stochastic_round = sr_seed.has_value();
  sgd.key = math::stochastic_round_key(sr_seed.value_or(0), sr_step);
  dispatch_grad_param_state(op, tensor_lists, 2, [&](auto type_list) {
    using L = decltype(type_list);
    using G = TypeAt<0, L>;
    using P = TypeAt<1, L>;
    using S = TypeAt<2, L>;
    if (depth == 3) {
      multi_tensor_apply<SgdOp, G, P, S>(chunk_size, noop_flag, tensor_lists, sgd);
      return;
    }
    const std::array<at::ScalarType, 1> copy_type{tensor_lists[3][0].scalar_type()};
    dispatch_float_types(op, copy_type, [&](auto copy_list) {
      using C = TypeAt<0, decltype(copy_list)>;
      multi_tensor_apply<SgdOp, G, P, S, C>(chunk_size, noop_flag, tensor_lists, sgd);
    });
  });
}

void multi_tensor_adagrad(int64_t chunk_size, const at::Tensor& noop_flag,
                          const TensorListsArg& tensor_lists, double lr, double epsilon,
                          int64_t mode, double weight_decay) {
  constexpr const char* op = "multi_tensor_adagrad";
  check_choice(op, "mode", mode, 0, 1);
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3) == 0) {
    return;
  }
  check_state_dtype(op, tensor_lists, 2, 1);
  check_overlap(op, tensor_lists, {1, 2});
  const AdagradOp adagrad{static_cast<float>(lr), static_cast<float>(epsilon),
                          static_cast<float>(weight_decay), mode == 1};
  dispatch_grad_param_state(op, tensor_lists, 2, [&](auto type_list) {
    using L = decltype(type_list);
    multi_tensor_apply<AdagradOp, TypeAt<0, L>, TypeAt<1, L>, TypeAt<2, L>>(
        chunk_size, noop_flag, tensor_lists, adagrad);
  });
}

void multi_tensor_lamb(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListsArg& tensor_lists, double lr, double beta1, double beta2,
                       double epsilon, int64_t step, int64_t bias_correction,
                       double weight_decay, int64_t grad_averaging, int64_t mode,
                       const at::Tensor& global_grad_norm, double max_grad_norm,
                       bool use_nvlamb) {
  constexpr const char* op = "multi_tensor_lamb";
  check_layerwise_choices(op, bias_correction, grad_averaging, mode);
  const size_t n = check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 4);
  if (n == 0) {
    return;
  }
  check_state_lists(op, tensor_lists, 2, 3, 1);
  check_overlap(op, tensor_lists, {1, 2, 3});
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const auto options = noop_flag.options().dtype(at::kFloat);
  const at::Tensor norm = device_scalar(op, "global_grad_norm", global_grad_norm,
                                        noop_flag.device());

  // Float32 scratch for the update, laid out as each param (same memory order).
  TensorListsArg lists{tensor_lists[0], tensor_lists[1], tensor_lists[2], tensor_lists[3], {}};
  lists[4].reserve(n);
  for (const at::Tensor& p : tensor_lists[1]) {
    lists[4].push_back(at::empty_like(p, options));
  }
  const std::vector<int64_t> offsets = chunk_offsets(tensor_lists[0], chunk_size);
  at::Tensor partials = at::empty({std::max<int64_t>(2 * offsets.back(), 1)}, options);
  at::Tensor norms = at::empty({2, static_cast<int64_t>(n)}, options);  // ||p||, ||update||
  float* param_norms = norms.data_ptr<float>();
  float* update_norms = param_norms + n;
  int* noop = noop_flag.data_ptr<int>();

  LambStage1Op stage1{};
  stage1.beta1 = static_cast<float>(beta1);
  stage1.beta2 = static_cast<float>(beta2);
  stage1.beta3 = grad_averaging == 1 ? static_cast<float>(1.0 - beta1) : 1.0f;
  stage1.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  stage1.bc1 = static_cast<float>(bias_correction_of(beta1, step, bias_correction == 1));
  stage1.bc2 = static_cast<float>(bias_correction_of(beta2, step, bias_correction == 1));
  stage1.epsilon = static_cast<float>(epsilon);
  stage1.weight_decay = static_cast<float>(weight_decay);
  stage1.decoupled = mode == 1;
  stage1.global_norm_ptr = norm.data_ptr<float>();
  stage1.max_grad_norm = static_cast<float>(max_grad_norm);
  LambApplyOp<false> stage2{};
  stage2.param_norms = param_norms;
  stage2.update_norms = update_norms;
  stage2.lr = static_cast<float>(lr);
  stage2.use_ratio = use_nvlamb || weight_decay != 0.0;
  const TensorListsArg params_and_updates{tensor_lists[1], lists[4]};

  dispatch_grad_param_state(op, tensor_lists, 2, [&](auto type_list) {
    using L = decltype(type_list);
    using G = TypeAt<0, L>;
    using P = TypeAt<1, L>;
    using S = TypeAt<2, L>;
    multi_tensor_apply<LambStage1Op, G, P, S, S, float>(chunk_size, noop_flag, lists, stage1,
                                                        partials.data_ptr<float>());
    for (int k = 0; k < 2; ++k) {
      segment_reduce<false>(partials.data_ptr<float>(), 2, k, offsets, /*take_sqrt=*/true,
                            k == 0 ? param_norms : update_norms, nullptr, noop,
                            /*flag_per_tensor=*/true, /*flag_total=*/false);
    }
    multi_tensor_apply<LambApplyOp<false>, P, float>(chunk_size, noop_flag,
                                                     params_and_updates, stage2);
  });
}

void multi_tensor_novograd(int64_t chunk_size, const at::Tensor& noop_flag,
                           const TensorListsArg& tensor_lists, const at::Tensor& grad_norms,
                           double lr, double beta1, double beta2, double epsilon, int64_t step,
                           int64_t bias_correction, double weight_decay, int64_t grad_averaging,
                           int64_t mode, int64_t norm_type) {
  constexpr const char* op = "multi_tensor_novograd";
  check_layerwise_choices(op, bias_correction, grad_averaging, mode);
  check_choice(op, "norm_type", norm_type, 0, 2);
  const size_t n = check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3);
  if (n == 0) {
    return;
  }
  check_state_lists(op, tensor_lists, 2, 2, 1);
  check_overlap(op, tensor_lists, {1, 2});
  TORCH_CHECK_VALUE(grad_norms.defined() && grad_norms.scalar_type() == at::kFloat &&
                  grad_norms.numel() == static_cast<int64_t>(n),
                    op, ": grad_norms must be a float32 tensor of ", n,
                    " elements (one per tensor), got dtype ",
                    checks::dtype_name(grad_norms.defined() ? grad_norms.scalar_type()
                                                            : at::kFloat),
                    " with ",
                    grad_norms.defined() ? grad_norms.numel() : 0, " elements");
  TORCH_CHECK(grad_norms.device() == noop_flag.device(), op, ": grad_norms is on ",
              grad_norms.device(), " but the tensors are on ", noop_flag.device(),
              "; create it on the tensors' device");
  TORCH_CHECK_VALUE(grad_norms.is_contiguous(), op,
                    ": grad_norms must be contiguous; call .contiguous() on it first");
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto options = noop_flag.options().dtype(at::kFloat);
  const bool l2 = norm_type == 2;
  const std::vector<int64_t> offsets = chunk_offsets(tensor_lists[0], chunk_size);
  at::Tensor partials = at::empty({std::max<int64_t>(offsets.back(), 1)}, options);
  at::Tensor norms = at::empty({static_cast<int64_t>(n)}, options);
  int* noop = noop_flag.data_ptr<int>();
  const TensorListsArg grads{tensor_lists[0]};

  NovogradOp novograd{};
  novograd.grad_norms = grad_norms.data_ptr<float>();
  novograd.lr = static_cast<float>(lr);
  novograd.beta1 = static_cast<float>(beta1);
  novograd.beta3 = grad_averaging == 1 ? static_cast<float>(1.0 - beta1) : 1.0f;
  novograd.bc1 = static_cast<float>(bias_correction_of(beta1, step, bias_correction == 1));
  novograd.bc2 =
      static_cast<float>(std::sqrt(bias_correction_of(beta2, step, bias_correction == 1)));
  novograd.epsilon = static_cast<float>(epsilon);
  novograd.weight_decay = static_cast<float>(weight_decay);
  novograd.decoupled = mode == 1;

  dispatch_grad_param_state(op, tensor_lists, 2, [&](auto type_list) {
    using L = decltype(type_list);
    using G = TypeAt<0, L>;
    if (l2) {
      multi_tensor_apply<GradNormOp<false>, G>(chunk_size, noop_flag, grads, GradNormOp<false>{},
                                               partials.data_ptr<float>());
      segment_reduce<false>(partials.data_ptr<float>(), 1, 0, offsets, /*take_sqrt=*/true,
                            norms.data_ptr<float>(), nullptr, noop, false, false);
    } else {
      multi_tensor_apply<GradNormOp<true>, G>(chunk_size, noop_flag, grads, GradNormOp<true>{},
                                              partials.data_ptr<float>());
      segment_reduce<true>(partials.data_ptr<float>(), 1, 0, offsets, /*take_sqrt=*/false,
                           norms.data_ptr<float>(), nullptr, noop, false, false);
    }
    const int threads = 128;
    const int blocks = static_cast<int>((n + threads - 1) / threads);
    novograd_blend_kernel<<<blocks, threads, 0, stream>>>(
        norms.data_ptr<float>(), grad_norms.data_ptr<float>(), static_cast<int>(n),
        static_cast<float>(beta2), static_cast<float>(1.0 - beta2), l2, noop);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    multi_tensor_apply<NovogradOp, G, TypeAt<1, L>, TypeAt<2, L>>(chunk_size, noop_flag,
                                                                  tensor_lists, novograd);
  });
}

}  // namespace cuda
}  // namespace amp_fused_ops
