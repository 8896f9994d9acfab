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

// --- autograd version counters ----------------------------------------------------------
//
// The kernels write through data pointers, which autograd does not see. As ATen's in-place
// ops do, every binding bumps the version counter of each tensor its op writes in place
// (whether or not values changed, e.g. a skipped step), so that backward through a graph that
// saved such a tensor raises "modified by an inplace operation" and caches keyed on versions
// (amp O1's weight casts) notice the change. The lists each op writes are those the reference
// writes (_reference*.py). Bumping is a host-side counter increment: no sync.

void bump(const at::Tensor& t) {
  if (t.defined()) torch::autograd::impl::bump_version(t);
}

void bump_lists(const TensorListsArg& lists, const std::vector<size_t>& which) {
  for (const size_t l : which) {
    if (l >= lists.size()) continue;
    for (const at::Tensor& t : lists[l]) bump(t);
  }
}

// `op` followed by the version bumps of the lists `written` (and of the noop flag when the op
// may raise it).
template <typename... Rest>
auto bumping(void (*op)(int64_t, const at::Tensor&, const TensorListsArg&, Rest...),
             std::vector<size_t> written, bool raises_flag) {
  return [op, written, raises_flag](int64_t chunk_size, const at::Tensor& noop_flag,
                                    const TensorListsArg& tensor_lists, Rest... rest) {
    op(chunk_size, noop_flag, tensor_lists, rest...);
    bump_lists(tensor_lists, written);
    if (raises_flag) bump(noop_flag);
  };
}

// multi_tensor_l2norm that honours a flag set on entry (zero norms then), without a host
// sync: the flag is read on the device before the norm may raise it.
std::tuple<at::Tensor, at::Tensor> l2norm_mp(int64_t chunk_size, const at::Tensor& noop_flag,
                                             const TensorListsArg& tensor_lists,
                                             bool per_tensor) {
  TORCH_CHECK(noop_flag.defined() && noop_flag.is_cuda(),
              "multi_tensor_l2norm_mp: noop_flag must be a CUDA tensor for the CUDA extension");
  const at::Tensor skipped = noop_flag.reshape({}).ne(0);
  auto [total, per] = multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor);
  bump(noop_flag);
  return {total.masked_fill(skipped, 0.0), per.masked_fill(skipped, 0.0)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "amp_fused_ops CUDA kernels: multi-tensor ops with Apex's amp_C signatures";
  // The kernels never touch Python objects: release the GIL while they launch.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("multi_tensor_scale", bumping(&multi_tensor_scale, {1}, true), no_gil,
        "out = in * scale for [ins, outs]; sets noop_flag on inf/nan inputs",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("scale"));
  m.def("multi_tensor_axpby", bumping(&multi_tensor_axpby, {2}, true), no_gil,
        "out = a * x + b * y for [xs, ys, outs]; sets noop_flag on inf/nan in the checked input",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("a"),
        py::arg("b"), py::arg("arg_to_check"));
  // per_tensor / use_nvlamb may be None in Apex's Python callers: None means false.
  m.def(
      "multi_tensor_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         std::optional<bool> per_tensor) {
        auto result = multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists,
                                          per_tensor.value_or(false));
        bump(noop_flag);
        return result;
      },
      no_gil, "(total L2 norm [1], per-tensor L2 norms [n] or empty) of [xs], in float32",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor") = false);
  m.def(
      "multi_tensor_unscale_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         const at::Tensor& inv_scale, std::optional<bool> per_tensor) {
        auto result = multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists,
                                                  inv_scale, per_tensor.value_or(false));
        bump(noop_flag);
        return result;
      },
      no_gil, "L2 norms of [xs] * inv_scale (a one-element tensor), as multi_tensor_l2norm",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("inv_scale"), py::arg("per_tensor") = false);
  m.def(
      "multi_tensor_unscale_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         double inv_scale, std::optional<bool> per_tensor) {
        auto result = multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists,
                                                  scalar_like(noop_flag, inv_scale),
                                                  per_tensor.value_or(false));
        bump(noop_flag);
        return result;
      },
      no_gil, "L2 norms of [xs] * inv_scale (a number), as multi_tensor_l2norm",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("inv_scale"), py::arg("per_tensor") = false);
  m.def("multi_tensor_adam", bumping(&multi_tensor_adam, {1, 2, 3}, false), no_gil,
        "Adam (mode 0) / AdamW (mode 1) step in place on [grads, params, exp_avgs, exp_avg_sqs]",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"));
  m.def("multi_tensor_adam_capturable_master",
        bumping(&multi_tensor_adam_capturable_master, {1, 2, 3, 4}, true), no_gil,
        "Adam step on float32 masters of [grads, params, exp_avgs, exp_avg_sqs, masters], "
        "writing the params in the same pass; skipped on noop_flag or inf/nan gradients",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"), py::arg("inv_scale"));
  m.def(
      "multi_tensor_sgd",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         double weight_decay, double momentum, double dampening, double lr, bool nesterov,
         bool first_run, bool wd_after_momentum, double scale) {
        multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening,
                         lr, nesterov, first_run, wd_after_momentum, scale);
        // The momentum buffers are written only with momentum (as the reference).
        bump_lists(tensor_lists, momentum != 0.0 ? std::vector<size_t>{1, 2, 3}
                                                 : std::vector<size_t>{1, 3});
      },
      no_gil, "SGD step on [grads, params, momentum_bufs(, model_copies)]; skipped on noop_flag",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("weight_decay"), py::arg("momentum"), py::arg("dampening"), py::arg("lr"),
        py::arg("nesterov"), py::arg("first_run"), py::arg("wd_after_momentum"),
        py::arg("scale"));
  m.def("multi_tensor_adagrad", bumping(&multi_tensor_adagrad, {1, 2}, false), no_gil,
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
        bump_lists(tensor_lists, {1, 2, 3});
        bump(noop_flag);
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
        bump_lists(tensor_lists, {1, 2, 3});
        bump(noop_flag);
      },
      no_gil, lamb_doc, py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("epsilon"), py::arg("step"),
      py::arg("bias_correction"), py::arg("weight_decay"), py::arg("grad_averaging"),
      py::arg("mode"), py::arg("global_grad_norm"), py::arg("max_grad_norm"),
      py::arg("use_nvlamb") = false);
  m.def(
      "multi_tensor_novograd",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         const at::Tensor& grad_norms, double lr, double beta1, double beta2, double epsilon,
         int64_t step, int64_t bias_correction, double weight_decay, int64_t grad_averaging,
         int64_t mode, int64_t norm_type) {
        multi_tensor_novograd(chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2,
                              epsilon, step, bias_correction, weight_decay, grad_averaging,
                              mode, norm_type);
        bump_lists(tensor_lists, {1, 2});
        if (!tensor_lists.empty() && !tensor_lists[0].empty()) bump(grad_norms);
        bump(noop_flag);
      },
      no_gil, "NovoGrad step on [grads, params, exp_avgs]; grad_norms blended in place",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("grad_norms"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("epsilon"), py::arg("step"), py::arg("bias_correction"),
        py::arg("weight_decay"), py::arg("grad_averaging"), py::arg("mode"),
        py::arg("norm_type"));
  m.def(
      "multi_tensor_l2norm_mp",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         std::optional<bool> per_tensor) {
        return l2norm_mp(chunk_size, noop_flag, tensor_lists, per_tensor.value_or(false));
      },
      no_gil, "multi_tensor_l2norm that returns zero norms when noop_flag is set on entry",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor") = false);
  m.def("multi_tensor_adam_capturable",
        bumping(&multi_tensor_adam_capturable, {0, 1, 2, 3}, true), no_gil,
        "Adam step in place on [grads, params, exp_avgs, exp_avg_sqs] with device lr, step "
        "and inv_scale; writes grad * inv_scale back; skipped on noop_flag or inf/nan grads",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"), py::arg("inv_scale"));
  const char* stage1_doc = "LAMB stage 1 on [grads, params, exp_avgs, exp_avg_sqs, updates]";
  m.def(
      "multi_tensor_lamb_stage1_cuda",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         const at::Tensor& per_tensor_decay, int64_t step, double beta1, double beta2,
         double epsilon, const at::Tensor& global_grad_norm, double max_global_grad_norm) {
        multi_tensor_lamb_stage1(chunk_size, noop_flag, tensor_lists, per_tensor_decay, step,
                                 beta1, beta2, epsilon, global_grad_norm, max_global_grad_norm);
        bump_lists(tensor_lists, {2, 3, 4});
      },
      no_gil, stage1_doc, py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor_decay"), py::arg("step"), py::arg("beta1"), py::arg("beta2"),
      py::arg("epsilon"), py::arg("global_grad_norm"), py::arg("max_global_grad_norm"));
  m.def(
      "multi_tensor_lamb_stage1_cuda",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         const at::Tensor& per_tensor_decay, int64_t step, double beta1, double beta2,
         double epsilon, double global_grad_norm, double max_global_grad_norm) {
        multi_tensor_lamb_stage1(chunk_size, noop_flag, tensor_lists, per_tensor_decay, step,
                                 beta1, beta2, epsilon, scalar_like(noop_flag, global_grad_norm),
                                 max_global_grad_norm);
        bump_lists(tensor_lists, {2, 3, 4});
      },
      no_gil, stage1_doc, py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor_decay"), py::arg("step"), py::arg("beta1"), py::arg("beta2"),
      py::arg("epsilon"), py::arg("global_grad_norm"), py::arg("max_global_grad_norm"));
  m.def(
      "multi_tensor_lamb_stage2_cuda",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
         const at::Tensor& per_tensor_param_norm, const at::Tensor& per_tensor_update_norm,
         double lr, double weight_decay, std::optional<bool> use_nvlamb) {
        multi_tensor_lamb_stage2(chunk_size, noop_flag, tensor_lists, per_tensor_param_norm,
                                 per_tensor_update_norm, lr, weight_decay,
                                 use_nvlamb.value_or(false));
        bump_lists(tensor_lists, {0});
      },
      no_gil, "LAMB stage 2 on [params, updates]", py::arg("chunk_size"),
      py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("per_tensor_param_norm"),
      py::arg("per_tensor_update_norm"), py::arg("lr"), py::arg("weight_decay"),
      py::arg("use_nvlamb") = false);
  m.def(
      "update_scale_hysteresis",
      [](const at::Tensor& current_scale, const at::Tensor& growth_tracker,
         const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf, double growth_factor,
         double backoff_factor, int64_t growth_interval, int64_t hysteresis) {
        at::Tensor result =
            update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                                    growth_factor, backoff_factor, growth_interval, hysteresis);
        bump(current_scale);
        bump(growth_tracker);
        bump(hysteresis_tracker);
        return result;
      },
      no_gil, "Updates the loss scale and its trackers in place, with hysteresis",
      py::arg("current_scale"), py::arg("growth_tracker"), py::arg("hysteresis_tracker"),
      py::arg("found_inf"), py::arg("growth_factor"), py::arg("backoff_factor"),
      py::arg("growth_interval"), py::arg("hysteresis"));
}
