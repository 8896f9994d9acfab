// Python bindings of the CUDA extension of amp_fused_ops (Apex's amp_C signatures).
//
// Other sources of this extension (the fused norms, SyncBN) register their ops with
// TORCH_LIBRARY_FRAGMENT; this file is the module's only PYBIND11_MODULE.
#include <torch/extension.h>

#include <optional>

#include "multi_tensor_ops.h"

namespace py = pybind11;
using namespace amp_fused_ops::cuda;

namespace {

// A Python number given where Apex passes a one-element tensor, as a float32 tensor on the
// device of the noop flag (a device fill, no host sync).
at::Tensor scalar_like(const at::Tensor& noop_flag, double value) {
  return at::full({1}, value, noop_flag.options().dtype(at::kFloat));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "amp_fused_ops CUDA kernels: multi-tensor ops with Apex's amp_C signatures";
  // The kernels never touch Python objects: release the GIL while they launch.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("multi_tensor_scale", &multi_tensor_scale, no_gil,
        "out = in * scale for [ins, outs]; sets noop_flag on inf/nan inputs",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("scale"));
  m.def("multi_tensor_axpby", &multi_tensor_axpby, no_gil,
        "out = a * x + b * y for [xs, ys, outs]; sets noop_flag on inf/nan in the checked input",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("a"),
        py::arg("b"), py::arg("arg_to_check"));
  // per_tensor / use_nvlamb may be None in Apex's Python callers: None means false.
  m.def(
      "multi_tensor_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         std::optional<bool> per_tensor) {
        return multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists,
                                   per_tensor.value_or(false));
      },
      no_gil, "(total L2 norm [1], per-tensor L2 norms [n] or empty) of [xs], in float32",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor") = false);
  m.def(
      "multi_tensor_unscale_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         const at::Tensor& inv_scale, std::optional<bool> per_tensor) {
        return multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale,
                                           per_tensor.value_or(false));
      },
      no_gil, "L2 norms of [xs] * inv_scale (a one-element tensor), as multi_tensor_l2norm",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("inv_scale"), py::arg("per_tensor") = false);
  m.def(
      "multi_tensor_unscale_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         double inv_scale, std::optional<bool> per_tensor) {
        return multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists,
                                           scalar_like(noop_flag, inv_scale),
                                           per_tensor.value_or(false));
      },
      no_gil, "L2 norms of [xs] * inv_scale (a number), as multi_tensor_l2norm",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("inv_scale"), py::arg("per_tensor") = false);
  m.def("multi_tensor_adam", &multi_tensor_adam, no_gil,
        "Adam (mode 0) / AdamW (mode 1) step in place on [grads, params, exp_avgs, exp_avg_sqs]",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"));
  m.def("multi_tensor_adam_capturable_master", &multi_tensor_adam_capturable_master, no_gil,
        "Adam step on float32 masters of [grads, params, exp_avgs, exp_avg_sqs, masters], "
        "writing the params in the same pass; skipped on noop_flag or inf/nan gradients",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"), py::arg("inv_scale"));
  m.def("multi_tensor_sgd", &multi_tensor_sgd, no_gil,
        "SGD step on [grads, params, momentum_bufs(, model_copies)]; skipped on noop_flag",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("weight_decay"), py::arg("momentum"), py::arg("dampening"), py::arg("lr"),
        py::arg("nesterov"), py::arg("first_run"), py::arg("wd_after_momentum"),
        py::arg("scale"));
  m.def("multi_tensor_adagrad", &multi_tensor_adagrad, no_gil,
        "Adagrad step on [grads, params, state_sums]", py::arg("chunk_size"),
        py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"), py::arg("epsilon"),
        py::arg("mode"), py::arg("weight_decay"));
  const char* lamb_doc = "LAMB step on [grads, params, exp_avgs, exp_avg_sqs]";
  m.def(
      "multi_tensor_lamb",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         double lr, double beta1, double beta2, double epsilon, int64_t step,
         int64_t bias_correction, double weight_decay, int64_t grad_averaging, int64_t mode,
         const at::Tensor& global_grad_norm, double max_grad_norm,
         std::optional<bool> use_nvlamb) {
        multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                          bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
                          max_grad_norm, use_nvlamb.value_or(false));
      },
      no_gil, lamb_doc, py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("epsilon"), py::arg("step"),
      py::arg("bias_correction"), py::arg("weight_decay"), py::arg("grad_averaging"),
      py::arg("mode"), py::arg("global_grad_norm"), py::arg("max_grad_norm"),
      py::arg("use_nvlamb") = false);
  m.def(
      "multi_tensor_lamb",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         double lr, double beta1, double beta2, double epsilon, int64_t step,
         int64_t bias_correction, double weight_decay, int64_t grad_averaging, int64_t mode,
         double global_grad_norm, double max_grad_norm, std::optional<bool> use_nvlamb) {
        multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                          bias_correction, weight_decay, grad_averaging, mode,
                          scalar_like(noop_flag, global_grad_norm), max_grad_norm,
                          use_nvlamb.value_or(false));
      },
      no_gil, lamb_doc, py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("epsilon"), py::arg("step"),
      py::arg("bias_correction"), py::arg("weight_decay"), py::arg("grad_averaging"),
      py::arg("mode"), py::arg("global_grad_norm"), py::arg("max_grad_norm"),
      py::arg("use_nvlamb") = false);
  m.def("multi_tensor_novograd", &multi_tensor_novograd, no_gil,
        "NovoGrad step on [grads, params, exp_avgs]; grad_norms blended in place",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("grad_norms"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("epsilon"), py::arg("step"), py::arg("bias_correction"),
        py::arg("weight_decay"), py::arg("grad_averaging"), py::arg("mode"),
        py::arg("norm_type"));
}
