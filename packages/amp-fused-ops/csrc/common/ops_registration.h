// The dispatcher kernels of the multi-tensor ops of one backend: wrappers that take the
// separate tensor lists of the schemas (src/amp_fused_ops/ops/_registry.py), call the backend's
// launcher (multi_tensor_ops.h, Apex's `tensor_lists` signature) and bump the autograd
// version counters.
//
// Included by one source per backend (csrc/cpu/ops_registration.cpp,
// csrc/cuda/ops_registration.cpp) after it defines AMP_FUSED_OPS_BACKEND (cpu or cuda: the
// namespace of the launchers); that source registers the wrappers for its dispatch key with
// register_multi_tensor_impls, plus its own multi_tensor_l2norm_mp.
#pragma once

#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

#include "multi_tensor_ops.h"
#include "ops_schema.h"
#include "step_plans.h"

#ifndef AMP_FUSED_OPS_BACKEND
#error "define AMP_FUSED_OPS_BACKEND (cpu or cuda) before including ops_registration.h"
#endif

namespace amp_fused_ops {
namespace {

namespace backend = ::amp_fused_ops::AMP_FUSED_OPS_BACKEND;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using OptionalTensorList = std::optional<at::TensorList>;

// Apex's `tensor_lists` from the separate lists of a schema.
TensorLists lists(std::initializer_list<at::TensorList> parts) {
  TensorLists out;
  out.reserve(parts.size());
  for (const at::TensorList part : parts) out.emplace_back(part.begin(), part.end());
  return out;
}

// --- autograd version counters ----------------------------------------------------------
//
// The kernels write through data pointers, which autograd does not see (and the dispatcher
// bumps no version for a custom op's mutable arguments). As ATen's in-place ops do, every
// wrapper bumps the version counter of each tensor its op writes in place (whether or not
// values changed, e.g. a skipped step), so that backward through a graph that saved such a
// tensor raises "modified by an inplace operation" and caches keyed on versions (amp O1's
// weight casts) notice the change. The tensors each op writes are those the reference writes
// (src/amp_fused_ops/reference/), the mutable arguments of its schema. Bumping is a host-side
// counter increment: no device sync.

void bump(const at::Tensor& t) {
  // What torch::autograd::impl::bump_version does, without autograd's headers.
  if (t.defined()) t.unsafeGetTensorImpl()->bump_version();
}

void bump(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) bump(t);
}

// --- the step count ---------------------------------------------------------------------
//
// The ops with Apex's `int step` (adam, lamb, novograd, lamb_stage1) also take an optional
// `step_tensor`: when given, the count is its value and `step` is not read (sgd's holds the
// `sr_step` its stochastic rounding is keyed by). The optimizers pass
// it under torch.compile, where an int that changes every step would be a constant of the graph
// and recompile it (docs/compile.rst). It is read on the host, so it must be a one-element CPU
// tensor; a count on the device is what the capturable ops take.

int64_t step_count(const char* op, int64_t step, const std::optional<at::Tensor>& step_tensor) {
  if (!step_tensor.has_value() || !step_tensor->defined()) return step;
  const at::Tensor& t = *step_tensor;
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.numel() == 1, op,
                    ": step_tensor must be a one-element CPU tensor (the step count is read on "
                    "the host), got ",
                    t.numel(), " elements on ", t.device(),
                    "; keep the count on the CPU, or use the capturable ops for a count on the "
                    "device");
  const double value = t.item<double>();
  TORCH_CHECK_VALUE(value >= 0 && value == std::floor(value) && value < 9.0e15, op,
                    ": step_tensor must hold a whole number >= 0, got ", value);
  return static_cast<int64_t>(value);
}

// --- the learning rate -----------------------------------------------------------------
//
// The ops with Apex's `double lr` (adam, sgd, adagrad, lamb, novograd) also take an optional
// `lr_tensor`: when given, the rate is its value and `lr` is not read. A tensor learning rate
// (torch.optim accepts one) is data of a torch.compile graph, so a scheduler that changes it
// recompiles nothing (docs/compile.rst). It is read here, on the host, as `step_tensor` is,
// and the kernels keep taking a double.

double learning_rate(const char* op, double lr, const std::optional<at::Tensor>& lr_tensor) {
  if (!lr_tensor.has_value() || !lr_tensor->defined()) return lr;
  const at::Tensor& t = *lr_tensor;
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.numel() == 1 && t.is_floating_point(), op,
                    ": lr_tensor must be a one-element floating-point CPU tensor (the learning "
                    "rate is read on the host), got ",
                    t.numel(), " elements of ", t.scalar_type(), " on ", t.device(),
                    "; pass lr as a float, or keep the tensor on the CPU");
  return t.item<double>();
}

// --- the wrappers, in the order of the op registry ------------------------------------------

void scale(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList ins,
           at::TensorList outs, double scale) {
  backend::multi_tensor_scale(chunk_size, noop_flag, lists({ins, outs}), scale);
  bump(outs);
  bump(noop_flag);
}

void axpby(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList xs, at::TensorList ys,
           at::TensorList outs, double a, double b, int64_t arg_to_check) {
  backend::multi_tensor_axpby(chunk_size, noop_flag, lists({xs, ys, outs}), a, b, arg_to_check);
  bump(outs);
  bump(noop_flag);
}

// per_tensor / use_nvlamb may be None in Apex's Python callers: None means false.
std::tuple<at::Tensor, at::Tensor> l2norm(int64_t chunk_size, const at::Tensor& noop_flag,
                                          at::TensorList xs, std::optional<bool> per_tensor) {
  auto result =
      backend::multi_tensor_l2norm(chunk_size, noop_flag, lists({xs}), per_tensor.value_or(false));
  bump(noop_flag);
  return result;
}

std::tuple<at::Tensor, at::Tensor> unscale_l2norm(int64_t chunk_size, const at::Tensor& noop_flag,
                                                  at::TensorList xs, const at::Tensor& inv_scale,
                                                  std::optional<bool> per_tensor) {
  auto result = backend::multi_tensor_unscale_l2norm(chunk_size, noop_flag, lists({xs}),
                                                     inv_scale, per_tensor.value_or(false));
  bump(noop_flag);
  return result;
}

// Adam on [grads, params, exp_avgs, exp_avg_sqs], however the op was given them: passed
// (multi_tensor_adam) or held by a step plan (multi_tensor_adam_plan).
void adam_lists(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                const TensorLists& tensor_lists, double lr, double beta1, double beta2,
                double eps, int64_t step, int64_t mode, int64_t bias_correction,
                double weight_decay, const std::optional<at::Tensor>& step_tensor,
                std::optional<int64_t> sr_seed, std::optional<int64_t> sr_step,
                const std::optional<at::Tensor>& lr_tensor) {
  // The stochastic rounding's step defaults to the op's own step count.
  const int64_t count = step_count(op, step, step_tensor);
  backend::multi_tensor_adam(chunk_size, noop_flag, tensor_lists,
                             learning_rate(op, lr, lr_tensor), beta1, beta2, eps, count, mode,
                             bias_correction, weight_decay, sr_seed, sr_step.value_or(count));
  bump(tensor_lists[1]);
  bump(tensor_lists[2]);
  bump(tensor_lists[3]);
}

void adam(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads,
          at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr,
          double beta1, double beta2, double eps, int64_t step, int64_t mode,
          int64_t bias_correction, double weight_decay,
          const std::optional<at::Tensor>& step_tensor, std::optional<int64_t> sr_seed,
          std::optional<int64_t> sr_step, const std::optional<at::Tensor>& lr_tensor) {
  adam_lists("multi_tensor_adam", chunk_size, noop_flag,
             lists({grads, params, exp_avgs, exp_avg_sqs}), lr, beta1, beta2, eps, step, mode,
             bias_correction, weight_decay, step_tensor, sr_seed, sr_step, lr_tensor);
}

// multi_tensor_adam's arguments, with a gathered step plan's bucket (step_plans.h) in place of
// the lists.
void adam_plan(int64_t chunk_size, const at::Tensor& noop_flag, int64_t plan, int64_t bucket,
               double lr, double beta1, double beta2, double eps, int64_t step, int64_t mode,
               int64_t bias_correction, double weight_decay,
               const std::optional<at::Tensor>& step_tensor, std::optional<int64_t> sr_seed,
               std::optional<int64_t> sr_step, const std::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_adam_plan";
  const GatheredBucket gathered(op, plan, bucket, /*state_lists=*/2);
  adam_lists(op, chunk_size, noop_flag, gathered.lists(), lr, beta1, beta2, eps, step, mode,
             bias_correction, weight_decay, step_tensor, sr_seed, sr_step, lr_tensor);
}

void adam_capturable(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads,
                     at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     const at::Tensor& lr, double beta1, double beta2, double eps,
                     const at::Tensor& step, int64_t mode, int64_t bias_correction,
                     double weight_decay, const at::Tensor& inv_scale) {
  backend::multi_tensor_adam_capturable(chunk_size, noop_flag,
                                        lists({grads, params, exp_avgs, exp_avg_sqs}), lr, beta1,
                                        beta2, eps, step, mode, bias_correction, weight_decay,
                                        inv_scale);
  bump(grads);
  bump(params);
  bump(exp_avgs);
  bump(exp_avg_sqs);
  bump(noop_flag);
}

void adam_capturable_master(int64_t chunk_size, const at::Tensor& noop_flag,
                            at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList masters,
                            const at::Tensor& lr, double beta1, double beta2, double eps,
                            const at::Tensor& step, int64_t mode, int64_t bias_correction,
                            double weight_decay, const at::Tensor& inv_scale) {
  backend::multi_tensor_adam_capturable_master(
      chunk_size, noop_flag, lists({grads, params, exp_avgs, exp_avg_sqs, masters}), lr, beta1,
      beta2, eps, step, mode, bias_correction, weight_decay, inv_scale);
  bump(params);
  bump(exp_avgs);
  bump(exp_avg_sqs);
  bump(masters);
  bump(noop_flag);
}

// SGD on [grads, params, momentum_bufs] or [..., model_copies], however the op was given them:
// passed (multi_tensor_sgd) or held by a step plan (multi_tensor_sgd_plan).
void sgd_lists(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
               const TensorLists& tensor_lists, double weight_decay, double momentum,
               double dampening, double lr, bool nesterov, bool first_run,
               bool wd_after_momentum, double scale, std::optional<int64_t> sr_seed,
               std::optional<int64_t> sr_step, const std::optional<at::Tensor>& step_tensor,
               const std::optional<at::Tensor>& lr_tensor) {
  backend::multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum,
                            dampening, learning_rate(op, lr, lr_tensor), nesterov, first_run,
                            wd_after_momentum, scale, sr_seed,
                            step_count(op, sr_step.value_or(0), step_tensor));
  bump(tensor_lists[1]);
  // The momentum buffers are written only with momentum (as the reference).
  if (momentum != 0.0) bump(tensor_lists[2]);
  if (tensor_lists.size() == 4) bump(tensor_lists[3]);
}

void sgd(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads,
         at::TensorList params, at::TensorList momentum_bufs,
         const OptionalTensorList& model_copies, double weight_decay, double momentum,
         double dampening, double lr, bool nesterov, bool first_run, bool wd_after_momentum,
         double scale, std::optional<int64_t> sr_seed, std::optional<int64_t> sr_step,
         const std::optional<at::Tensor>& step_tensor, const std::optional<at::Tensor>& lr_tensor) {
  const TensorLists tensor_lists = model_copies.has_value()
                                       ? lists({grads, params, momentum_bufs, *model_copies})
                                       : lists({grads, params, momentum_bufs});
  sgd_lists("multi_tensor_sgd", chunk_size, noop_flag, tensor_lists, weight_decay, momentum,
            dampening, lr, nesterov, first_run, wd_after_momentum, scale, sr_seed, sr_step,
            step_tensor, lr_tensor);
}

// multi_tensor_sgd's arguments (no model copies), with a gathered step plan's bucket
// (step_plans.h) in place of the lists.
void sgd_plan(int64_t chunk_size, const at::Tensor& noop_flag, int64_t plan, int64_t bucket,
              double weight_decay, double momentum, double dampening, double lr, bool nesterov,
              bool first_run, bool wd_after_momentum, double scale, std::optional<int64_t> sr_seed,
              std::optional<int64_t> sr_step, const std::optional<at::Tensor>& step_tensor,
              const std::optional<at::Tensor>& lr_tensor) {
  constexpr const char* op = "multi_tensor_sgd_plan";
  const GatheredBucket gathered(op, plan, bucket, /*state_lists=*/1);
  sgd_lists(op, chunk_size, noop_flag, gathered.lists(), weight_decay, momentum, dampening, lr,
            nesterov, first_run, wd_after_momentum, scale, sr_seed, sr_step, step_tensor,
            lr_tensor);
}

void adagrad(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads,
             at::TensorList params, at::TensorList state_sums, double lr, double epsilon,
             int64_t mode, double weight_decay, const std::optional<at::Tensor>& lr_tensor) {
  backend::multi_tensor_adagrad(chunk_size, noop_flag, lists({grads, params, state_sums}),
                                learning_rate("multi_tensor_adagrad", lr, lr_tensor), epsilon,
                                mode, weight_decay);
  bump(params);
  bump(state_sums);
}

void lamb(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads,
          at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr,
          double beta1, double beta2, double epsilon, int64_t step, int64_t bias_correction,
          double weight_decay, int64_t grad_averaging, int64_t mode,
          const at::Tensor& global_grad_norm, double max_grad_norm,
          std::optional<bool> use_nvlamb, const std::optional<at::Tensor>& step_tensor,
          const std::optional<at::Tensor>& lr_tensor) {
  backend::multi_tensor_lamb(chunk_size, noop_flag, lists({grads, params, exp_avgs, exp_avg_sqs}),
                             learning_rate("multi_tensor_lamb", lr, lr_tensor), beta1, beta2, epsilon,
                             step_count("multi_tensor_lamb", step, step_tensor), bias_correction,
                             weight_decay, grad_averaging, mode, global_grad_norm, max_grad_norm,
                             use_nvlamb.value_or(false));
  bump(params);
  bump(exp_avgs);
  bump(exp_avg_sqs);
  bump(noop_flag);
}

void novograd(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads,
              at::TensorList params, at::TensorList exp_avgs, const at::Tensor& grad_norms,
              double lr, double beta1, double beta2, double epsilon, int64_t step,
              int64_t bias_correction, double weight_decay, int64_t grad_averaging, int64_t mode,
              int64_t norm_type, const std::optional<at::Tensor>& step_tensor,
              const std::optional<at::Tensor>& lr_tensor) {
  backend::multi_tensor_novograd(chunk_size, noop_flag, lists({grads, params, exp_avgs}),
                                 grad_norms, learning_rate("multi_tensor_novograd", lr, lr_tensor),
                                 beta1, beta2, epsilon,
                                 step_count("multi_tensor_novograd", step, step_tensor),
                                 bias_correction, weight_decay, grad_averaging, mode, norm_type);
  bump(params);
  bump(exp_avgs);
  if (!grads.empty()) bump(grad_norms);
  bump(noop_flag);
}

void lamb_stage1(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads,
                 at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList updates, const at::Tensor& per_tensor_decay, int64_t step,
                 double beta1, double beta2, double epsilon, const at::Tensor& global_grad_norm,
                 double max_global_grad_norm, const std::optional<at::Tensor>& step_tensor) {
  backend::multi_tensor_lamb_stage1(
      chunk_size, noop_flag, lists({grads, params, exp_avgs, exp_avg_sqs, updates}),
      per_tensor_decay, step_count("multi_tensor_lamb_stage1_cuda", step, step_tensor), beta1,
      beta2, epsilon, global_grad_norm, max_global_grad_norm);
  bump(exp_avgs);
  bump(exp_avg_sqs);
  bump(updates);
}

void lamb_stage2(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList params,
                 at::TensorList updates, const at::Tensor& per_tensor_param_norm,
                 const at::Tensor& per_tensor_update_norm, double lr, double weight_decay,
                 std::optional<bool> use_nvlamb) {
  backend::multi_tensor_lamb_stage2(chunk_size, noop_flag, lists({params, updates}),
                                    per_tensor_param_norm, per_tensor_update_norm, lr,
                                    weight_decay, use_nvlamb.value_or(false));
  bump(params);
}

// Registers the wrappers of every op both backends have; the caller adds the rest.
void register_multi_tensor_impls(torch::Library& m) {
  m.impl("multi_tensor_scale", TORCH_FN(scale));
  m.impl("multi_tensor_axpby", TORCH_FN(axpby));
  m.impl("multi_tensor_l2norm", TORCH_FN(l2norm));
  m.impl("multi_tensor_unscale_l2norm", TORCH_FN(unscale_l2norm));
  m.impl("multi_tensor_adam", TORCH_FN(adam));
  m.impl("multi_tensor_adam_capturable", TORCH_FN(adam_capturable));
  m.impl("multi_tensor_adam_capturable_master", TORCH_FN(adam_capturable_master));
  m.impl("multi_tensor_sgd", TORCH_FN(sgd));
  m.impl("multi_tensor_adagrad", TORCH_FN(adagrad));
  m.impl("multi_tensor_lamb", TORCH_FN(lamb));
  m.impl("multi_tensor_novograd", TORCH_FN(novograd));
  m.impl("multi_tensor_lamb_stage1_cuda", TORCH_FN(lamb_stage1));
  m.impl("multi_tensor_lamb_stage2_cuda", TORCH_FN(lamb_stage2));
  m.impl("multi_tensor_plan_set", TORCH_FN(plan_set));
  m.impl("multi_tensor_plan_gather", TORCH_FN(plan_gather));
  m.impl("multi_tensor_plan_release", TORCH_FN(plan_release));
  m.impl("multi_tensor_plan_drop", TORCH_FN(plan_drop));
  m.impl("multi_tensor_adam_plan", TORCH_FN(adam_plan));
  m.impl("multi_tensor_sgd_plan", TORCH_FN(sgd_plan));
}

}  // namespace
}  // namespace amp_fused_ops
