// Declarations of the CUDA multi-tensor ops of amp_fused_ops, with Apex's amp_C signatures.
// Semantics (math, noop flag) are those of the pure-PyTorch reference,
// src/amp_fused_ops/_reference*.py, which the tests compare against.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace amp_fused_ops {
namespace cuda {

using TensorListsArg = std::vector<std::vector<at::Tensor>>;

// out = in * scale for [ins, outs]; sets noop_flag to 1 if an input is inf or nan.
void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListsArg& tensor_lists, double scale);

// out = a * x + b * y for [xs, ys, outs]; sets noop_flag to 1 if a checked input (x for
// arg_to_check 0, y for 1, both for -1) is inf or nan.
void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListsArg& tensor_lists, double a, double b,
                        int64_t arg_to_check);

// (total L2 norm [1], per-tensor L2 norms [n] or empty) of [xs], float32; sets noop_flag to
// 1 if the total is inf or nan.
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(int64_t chunk_size,
                                                       const at::Tensor& noop_flag,
                                                       const TensorListsArg& tensor_lists,
                                                       bool per_tensor);

// As multi_tensor_l2norm, of x * inv_scale (a one-element tensor).
std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
    const at::Tensor& inv_scale, bool per_tensor);

// Adam (mode 0) / AdamW (mode 1) step in place on [grads, params, exp_avgs, exp_avg_sqs].
void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListsArg& tensor_lists, double lr, double beta1, double beta2,
                       double eps, int64_t step, int64_t mode, int64_t bias_correction,
                       double weight_decay);

// Adam step on float32 masters of [grads, params, exp_avgs, exp_avg_sqs, masters], writing the
// params in the same pass; lr, step, inv_scale are device tensors; skips (writes nothing) when
// noop_flag is set on entry or an unscaled gradient is inf/nan (then sets noop_flag).
void multi_tensor_adam_capturable_master(int64_t chunk_size, const at::Tensor& noop_flag,
                                         const TensorListsArg& tensor_lists,
                                         const at::Tensor& lr, double beta1, double beta2,
                                         double eps, const at::Tensor& step, int64_t mode,
                                         int64_t bias_correction, double weight_decay,
                                         const at::Tensor& inv_scale);

// Adam step in place on [grads, params, exp_avgs, exp_avg_sqs] (float32 moments) with lr, step,
// inv_scale as device tensors; writes grad * inv_scale back into the grads; skips (writes
// nothing) when noop_flag is set on entry or an unscaled gradient is inf/nan (then sets it).
void multi_tensor_adam_capturable(int64_t chunk_size, const at::Tensor& noop_flag,
                                  const TensorListsArg& tensor_lists, const at::Tensor& lr,
                                  double beta1, double beta2, double eps, const at::Tensor& step,
                                  int64_t mode, int64_t bias_correction, double weight_decay,
                                  const at::Tensor& inv_scale);

// LAMB stage 1 (Apex's multi_tensor_lamb_stage1_cuda) on [grads, params, exp_avgs,
// exp_avg_sqs, updates]; per_tensor_decay and global_grad_norm are device tensors.
void multi_tensor_lamb_stage1(int64_t chunk_size, const at::Tensor& noop_flag,
                              const TensorListsArg& tensor_lists,
                              const at::Tensor& per_tensor_decay, int64_t step, double beta1,
                              double beta2, double epsilon, const at::Tensor& global_grad_norm,
                              double max_global_grad_norm);

// LAMB stage 2 (Apex's multi_tensor_lamb_stage2_cuda) on [params, updates].
void multi_tensor_lamb_stage2(int64_t chunk_size, const at::Tensor& noop_flag,
                              const TensorListsArg& tensor_lists,
                              const at::Tensor& per_tensor_param_norm,
                              const at::Tensor& per_tensor_update_norm, double lr,
                              double weight_decay, bool use_nvlamb);

// Loss-scale update with hysteresis (Apex's update_scale_hysteresis); returns current_scale.
at::Tensor update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, double growth_factor,
                                   double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis);

// SGD step on [grads, params, momentum_bufs(, model_copies)]; skips when noop_flag is set.
void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const TensorListsArg& tensor_lists, double weight_decay, double momentum,
                      double dampening, double lr, bool nesterov, bool first_run,
                      bool wd_after_momentum, double scale);

// Adagrad step on [grads, params, state_sums].
void multi_tensor_adagrad(int64_t chunk_size, const at::Tensor& noop_flag,
                          const TensorListsArg& tensor_lists, double lr, double epsilon,
                          int64_t mode, double weight_decay);

// LAMB step on [grads, params, exp_avgs, exp_avg_sqs]; global_grad_norm as tensor or number.
void multi_tensor_lamb(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListsArg& tensor_lists, double lr, double beta1, double beta2,
                       double epsilon, int64_t step, int64_t bias_correction,
                       double weight_decay, int64_t grad_averaging, int64_t mode,
                       const at::Tensor& global_grad_norm, double max_grad_norm,
                       bool use_nvlamb);

// NovoGrad step on [grads, params, exp_avgs]; grad_norms (float32, one per tensor) blended
// in place.
void multi_tensor_novograd(int64_t chunk_size, const at::Tensor& noop_flag,
                           const TensorListsArg& tensor_lists, const at::Tensor& grad_norms,
                           double lr, double beta1, double beta2, double epsilon, int64_t step,
                           int64_t bias_correction, double weight_decay, int64_t grad_averaging,
                           int64_t mode, int64_t norm_type);

}  // namespace cuda
}  // namespace amp_fused_ops
