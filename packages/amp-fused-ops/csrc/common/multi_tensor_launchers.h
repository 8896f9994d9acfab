// The multi-tensor launchers, with Apex's amp_C signatures: the C++ CPU kernels (csrc/cpu) and
// the CUDA kernels (csrc/cuda) define the same functions, in amp_fused_ops::cpu and
// amp_fused_ops::cuda. Included by multi_tensor_ops.h inside each of those namespaces (hence no
// include guard); include multi_tensor_ops.h, not this file. Semantics (math, noop flag) are
// those of the pure-PyTorch reference, src/amp_fused_ops/reference/.

// out = in * scale for [ins, outs]; sets noop_flag to 1 if any input is inf or nan.
void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListsArg& tensor_lists, double scale);

// out = a * x + b * y for [xs, ys, outs]; sets noop_flag to 1 if a checked input (x for
// arg_to_check 0, y for 1, both for -1) is inf or nan.
void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListsArg& tensor_lists, double a,
                        double b, int64_t arg_to_check);

// Total L2 norm (float32, shape [1]) and per-tensor norms (float32, shape [n], or empty when
// per_tensor is false) of [xs]; sets noop_flag to 1 if a partial sum is inf or nan.
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const TensorListsArg& tensor_lists, bool per_tensor);

// As multi_tensor_l2norm, of x * inv_scale (a one-element tensor).
std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const TensorListsArg& tensor_lists, const at::Tensor& inv_scale,
    bool per_tensor);

// One Adam / AdamW step in place on [grads, params, exp_avgs, exp_avg_sqs]. As Apex's kernel,
// the noop flag is neither read nor written: inf/nan gradients propagate into the results.
// With sr_seed, the (bfloat16) params are rounded stochastically (stochastic_round.h), keyed by
// sr_seed and sr_step.
void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListsArg& tensor_lists, double lr,
                       double beta1, double beta2, double eps, int64_t step, int64_t mode,
                       int64_t bias_correction, double weight_decay,
                       std::optional<int64_t> sr_seed = std::nullopt, int64_t sr_step = 0);

// Adam step on float32 masters of [grads, params, exp_avgs, exp_avg_sqs, masters], writing the
// (float16 / bfloat16 / float32) params in the same pass; lr, step and inv_scale are one-element
// tensors. Writes nothing when noop_flag is set on entry or when an unscaled gradient is
// inf/nan (then sets noop_flag).
void multi_tensor_adam_capturable_master(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const TensorListsArg& tensor_lists, const at::Tensor& lr,
    double beta1, double beta2, double eps, const at::Tensor& step, int64_t mode,
    int64_t bias_correction, double weight_decay, const at::Tensor& inv_scale);

// Adam step on [grads, params, exp_avgs, exp_avg_sqs] (float32 moments) with lr, step and
// inv_scale as one-element tensors; writes grad * inv_scale back into the grads. Writes nothing
// when noop_flag is set on entry or an unscaled gradient is inf/nan (then sets noop_flag).
void multi_tensor_adam_capturable(int64_t chunk_size, const at::Tensor& noop_flag,
                                  const TensorListsArg& tensor_lists,
                                  const at::Tensor& lr, double beta1, double beta2, double eps,
                                  const at::Tensor& step, int64_t mode, int64_t bias_correction,
                                  double weight_decay, const at::Tensor& inv_scale);

// LAMB stage 1 (Apex's multi_tensor_lamb_stage1_cuda) on [grads, params, exp_avgs,
// exp_avg_sqs, updates]: moments and the update, bias correction at step + 1.
void multi_tensor_lamb_stage1(int64_t chunk_size, const at::Tensor& noop_flag,
                              const TensorListsArg& tensor_lists,
                              const at::Tensor& per_tensor_decay, int64_t step, double beta1,
                              double beta2, double epsilon, const at::Tensor& global_grad_norm,
                              double max_global_grad_norm);

// LAMB stage 2 (Apex's multi_tensor_lamb_stage2_cuda) on [params, updates]:
// p -= lr * trust ratio * update.
void multi_tensor_lamb_stage2(int64_t chunk_size, const at::Tensor& noop_flag,
                              const TensorListsArg& tensor_lists,
                              const at::Tensor& per_tensor_param_norm,
                              const at::Tensor& per_tensor_update_norm, double lr,
                              double weight_decay, bool use_nvlamb);

// SGD step on [grads, params, momentum_bufs(, model_copies)]; writes nothing when noop_flag
// is set on entry. With sr_seed, the (bfloat16) params are rounded stochastically, as
// multi_tensor_adam's.
void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const TensorListsArg& tensor_lists,
                      double weight_decay, double momentum, double dampening, double lr,
                      bool nesterov, bool first_run, bool wd_after_momentum, double scale,
                      std::optional<int64_t> sr_seed = std::nullopt, int64_t sr_step = 0);

// Adagrad step (mode 0 L2, 1 decoupled decay) on [grads, params, state_sums].
void multi_tensor_adagrad(int64_t chunk_size, const at::Tensor& noop_flag,
                          const TensorListsArg& tensor_lists, double lr,
                          double epsilon, int64_t mode, double weight_decay);

// LAMB step on [grads, params, exp_avgs, exp_avg_sqs]; sets noop_flag when a parameter or
// update norm is inf/nan.
void multi_tensor_lamb(int64_t chunk_size, const at::Tensor& noop_flag,
                       const TensorListsArg& tensor_lists, double lr,
                       double beta1, double beta2, double epsilon, int64_t step,
                       int64_t bias_correction, double weight_decay, int64_t grad_averaging,
                       int64_t mode, const at::Tensor& global_grad_norm, double max_grad_norm,
                       bool use_nvlamb);

// NovoGrad step on [grads, params, exp_avgs]; grad_norms (float32, one per tensor) is blended
// in place; sets noop_flag when a gradient norm is inf/nan.
void multi_tensor_novograd(int64_t chunk_size, const at::Tensor& noop_flag,
                           const TensorListsArg& tensor_lists,
                           const at::Tensor& grad_norms, double lr, double beta1, double beta2,
                           double epsilon, int64_t step, int64_t bias_correction,
                           double weight_decay, int64_t grad_averaging, int64_t mode,
                           int64_t norm_type);
