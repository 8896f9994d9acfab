// The dispatcher schemas of the multi-tensor ops: one list, used by the C++ CPU extension and
// the CUDA extension (and the emulation build of the CUDA sources).
//
// Apex's amp_C ops take `std::vector<std::vector<Tensor>> tensor_lists`; a schema has no
// `Tensor[][]`, so each op takes its lists as separate arguments, named after Apex's layouts,
// and marks the ones it writes (and the noop flag, when it may set it) as mutable. The Python
// amp_C shim (src/amp_fused_ops/_amp_C.py) keeps Apex's calling convention on top.
//
// A namespace's schemas can be defined once per process, while either extension may be loaded
// first (or alone): each extension calls define_multi_tensor_schemas() when it is loaded, which
// defines the schemas the dispatcher does not know yet (the other extension may have defined
// them), then registers its kernels for its dispatch key with TORCH_LIBRARY_IMPL.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <string>

// The namespace of the ops: torch.ops.amp_fused_ops. The emulation build, whose "CUDA" kernels
// run on the CPU, registers them under a namespace of its own (csrc/emulation/amp_emu.h), so
// that they never replace the C++ CPU kernels in a process that loads both.
#ifndef AMP_FUSED_OPS_NS
#define AMP_FUSED_OPS_NS amp_fused_ops
#endif
#define AMP_FUSED_OPS_STRINGIFY_(x) #x
#define AMP_FUSED_OPS_STRINGIFY(x) AMP_FUSED_OPS_STRINGIFY_(x)
#define AMP_FUSED_OPS_NS_NAME AMP_FUSED_OPS_STRINGIFY(AMP_FUSED_OPS_NS)

namespace amp_fused_ops {
namespace {  // internal linkage: each extension keeps its own copy of the state below

// Argument names are Apex's (callers may pass the scalars by keyword).
constexpr const char* kMultiTensorSchemas[] = {
    "multi_tensor_scale(int chunk_size, Tensor(a!) noop_flag, Tensor[] ins, Tensor(b!)[] outs, "
    "float scale) -> ()",
    "multi_tensor_axpby(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, Tensor[] ys, "
    "Tensor(b!)[] outs, float a, float b, int arg_to_check) -> ()",
    "multi_tensor_l2norm(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, "
    "bool? per_tensor=False) -> (Tensor, Tensor)",
    "multi_tensor_l2norm_mp(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, "
    "bool? per_tensor=False) -> (Tensor, Tensor)",
    "multi_tensor_unscale_l2norm(int chunk_size, Tensor(a!) noop_flag, Tensor[] xs, "
    "Tensor inv_scale, bool? per_tensor=False) -> (Tensor, Tensor)",
    "multi_tensor_adam(int chunk_size, Tensor noop_flag, Tensor[] grads, Tensor(a!)[] params, "
    "Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, "
    "float eps, int step, int mode, int bias_correction, float weight_decay) -> ()",
    "multi_tensor_adam_capturable(int chunk_size, Tensor(a!) noop_flag, Tensor(b!)[] grads, "
    "Tensor(c!)[] params, Tensor(d!)[] exp_avgs, Tensor(e!)[] exp_avg_sqs, Tensor lr, "
    "float beta1, float beta2, float eps, Tensor step, int mode, int bias_correction, "
    "float weight_decay, Tensor inv_scale) -> ()",
    "multi_tensor_adam_capturable_master(int chunk_size, Tensor(a!) noop_flag, Tensor[] grads, "
    "Tensor(b!)[] params, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, "
    "Tensor(e!)[] masters, Tensor lr, float beta1, float beta2, float eps, Tensor step, "
    "int mode, int bias_correction, float weight_decay, Tensor inv_scale) -> ()",
    "multi_tensor_sgd(int chunk_size, Tensor noop_flag, Tensor[] grads, Tensor(a!)[] params, "
    "Tensor(b!)[] momentum_bufs, Tensor(c!)[]? model_copies, float weight_decay, "
    "float momentum, float dampening, float lr, bool nesterov, bool first_run, "
    "bool wd_after_momentum, float scale) -> ()",
    "multi_tensor_adagrad(int chunk_size, Tensor noop_flag, Tensor[] grads, "
    "Tensor(a!)[] params, Tensor(b!)[] state_sums, float lr, float epsilon, int mode, "
    "float weight_decay) -> ()",
    "multi_tensor_lamb(int chunk_size, Tensor(a!) noop_flag, Tensor[] grads, "
    "Tensor(b!)[] params, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, float lr, "
    "float beta1, float beta2, float epsilon, int step, int bias_correction, "
    "float weight_decay, int grad_averaging, int mode, Tensor global_grad_norm, "
    "float max_grad_norm, bool? use_nvlamb=None) -> ()",
    "multi_tensor_novograd(int chunk_size, Tensor(a!) noop_flag, Tensor[] grads, "
    "Tensor(b!)[] params, Tensor(c!)[] exp_avgs, Tensor(d!) grad_norms, float lr, float beta1, "
    "float beta2, float epsilon, int step, int bias_correction, float weight_decay, "
    "int grad_averaging, int mode, int norm_type) -> ()",
    "multi_tensor_lamb_stage1_cuda(int chunk_size, Tensor noop_flag, Tensor[] grads, "
    "Tensor[] params, Tensor(a!)[] exp_avgs, Tensor(b!)[] exp_avg_sqs, Tensor(c!)[] updates, "
    "Tensor per_tensor_decay, int step, float beta1, float beta2, float epsilon, "
    "Tensor global_grad_norm, float max_global_grad_norm) -> ()",
    "multi_tensor_lamb_stage2_cuda(int chunk_size, Tensor noop_flag, Tensor(a!)[] params, "
    "Tensor[] updates, Tensor per_tensor_param_norm, Tensor per_tensor_update_norm, float lr, "
    "float weight_decay, bool? use_nvlamb=None) -> ()",
    "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, "
    "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
    "float backoff_factor, int growth_interval, int hysteresis) -> Tensor(a!)",
};

// Defines, in namespace `ns`, each schema of kMultiTensorSchemas the dispatcher does not know
// yet. Runs while a shared library is loaded (the loader holds the import lock): no race.
inline void define_multi_tensor_schemas(const char* ns) {
  static std::unique_ptr<torch::Library> library;
  for (const char* schema : kMultiTensorSchemas) {
    const std::string text(schema);
    const std::string name = std::string(ns) + "::" + text.substr(0, text.find('('));
    if (c10::Dispatcher::singleton().findSchema({name, ""}).has_value()) continue;
    if (!library) {
      library = std::make_unique<torch::Library>(torch::Library::FRAGMENT, ns, std::nullopt,
                                                 __FILE__, static_cast<uint32_t>(__LINE__));
    }
    library->def(schema);
  }
}

}  // namespace
}  // namespace amp_fused_ops
