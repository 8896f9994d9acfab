// Python bindings of the C++ CPU extension of amp_fused_ops (Apex's amp_C signatures).
#include <torch/extension.h>

#include <string>

#include "multi_tensor_apply.h"
#include "multi_tensor_ops.h"

namespace py = pybind11;
using namespace amp_fused_ops::cpu;

namespace {

// A tensor argument that the reference also takes as a Python number (Apex passes one-element
// tensors: lr, step, inv_scale, global_grad_norm); a number becomes a float64 CPU tensor.
at::Tensor tensor_or_number(const py::handle& value, const char* op, const char* name) {
  if (THPVariable_Check(value.ptr())) return THPVariable_Unpack(value.ptr());
  if (PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr())) {
    return at::scalar_tensor(py::cast<double>(value), at::kDouble);
  }
  throw py::type_error(std::string(op) + ": " + name + " must be a tensor or a number, got " +
                       std::string(py::str(py::type::of(value).attr("__name__"))));
}

// Apex passes None for "off" in some optional flags (per_tensor, use_nvlamb).
bool flag_or_none(const py::handle& value) { return !value.is_none() && py::cast<bool>(value); }

// --- autograd version counters ----------------------------------------------------------
//
// The kernels write through data pointers, which autograd does not see. As ATen's in-place
// ops do, every binding bumps the version counter of each tensor its op writes in place
// (whether or not values changed, e.g. a skipped step), so that backward through a graph that
// saved such a tensor raises "modified by an inplace operation" and caches keyed on versions
// (amp O1's weight casts) notice the change. The lists each op writes are those the reference
// writes (_reference*.py).

void bump(const at::Tensor& t) {
  if (t.defined()) torch::autograd::impl::bump_version(t);
}

void bump_lists(const TensorLists& lists, const std::vector<size_t>& which) {
  for (const size_t l : which) {
    if (l >= lists.size()) continue;
    for (const at::Tensor& t : lists[l]) bump(t);
  }
}

// `op` followed by the version bumps of the lists `written` (and of the noop flag when the op
// may raise it).
template <typename... Rest>
auto bumping(void (*op)(int64_t, const at::Tensor&, const TensorLists&, Rest...),
             std::vector<size_t> written, bool raises_flag) {
  return [op, written, raises_flag](int64_t chunk_size, const at::Tensor& noop_flag,
                                    const TensorLists& tensor_lists, Rest... rest) {
    op(chunk_size, noop_flag, tensor_lists, rest...);
    bump_lists(tensor_lists, written);
    if (raises_flag) bump(noop_flag);
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "amp_fused_ops C++ CPU kernels: multi-tensor ops with Apex's amp_C signatures";
  // The kernels never touch Python objects: release the GIL while they run (the lambdas
  // convert their Python arguments first).
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("multi_tensor_scale", bumping(&multi_tensor_scale, {1}, true), no_gil,
        "out = in * scale for [ins, outs]; sets noop_flag on inf/nan inputs",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("scale"));
  m.def("multi_tensor_axpby", bumping(&multi_tensor_axpby, {2}, true), no_gil,
        "out = a * x + b * y for [xs, ys, outs]; sets noop_flag on inf/nan in the checked input",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("a"),
        py::arg("b"), py::arg("arg_to_check"));
  m.def(
      "multi_tensor_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag,
         const std::vector<std::vector<at::Tensor>>& tensor_lists, const py::object& per_tensor) {
        const bool per = flag_or_none(per_tensor);
        py::gil_scoped_release no_gil_here;
        auto result = multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per);
        bump(noop_flag);
        return result;
      },
      "(total L2 norm [1], per-tensor L2 norms [n] or empty) of [xs], in float32",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor") = false);
  m.def(
      "multi_tensor_unscale_l2norm",
      [](int64_t chunk_size, const at::Tensor& noop_flag,
         const std::vector<std::vector<at::Tensor>>& tensor_lists, const py::object& inv_scale,
         const py::object& per_tensor) {
        const at::Tensor scale =
            tensor_or_number(inv_scale, "multi_tensor_unscale_l2norm", "inv_scale");
        const bool per = flag_or_none(per_tensor);
        py::gil_scoped_release no_gil_here;
        auto result = multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, scale, per);
        bump(noop_flag);
        return result;
      },
      "L2 norms of [xs] * inv_scale, as multi_tensor_l2norm", py::arg("chunk_size"),
      py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("inv_scale"),
      py::arg("per_tensor") = false);
  m.def("multi_tensor_adam", bumping(&multi_tensor_adam, {1, 2, 3}, false), no_gil,
        "Adam (mode 0) / AdamW (mode 1) step in place on [grads, params, exp_avgs, exp_avg_sqs]",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"));
  m.def(
      "multi_tensor_adam_capturable_master",
      [](int64_t chunk_size, const at::Tensor& noop_flag,
         const std::vector<std::vector<at::Tensor>>& tensor_lists, const py::object& lr,
         double beta1, double beta2, double eps, const py::object& step, int64_t mode,
         int64_t bias_correction, double weight_decay, const py::object& inv_scale) {
        constexpr const char* op = "multi_tensor_adam_capturable_master";
        const at::Tensor lr_t = tensor_or_number(lr, op, "lr");
        const at::Tensor step_t = tensor_or_number(step, op, "step");
        const at::Tensor scale_t = tensor_or_number(inv_scale, op, "inv_scale");
        py::gil_scoped_release no_gil_here;
        multi_tensor_adam_capturable_master(chunk_size, noop_flag, tensor_lists, lr_t, beta1,
                                            beta2, eps, step_t, mode, bias_correction,
                                            weight_decay, scale_t);
        bump_lists(tensor_lists, {1, 2, 3, 4});
        bump(noop_flag);
      },
      "Adam step on fp32 masters of [grads, params, exp_avgs, exp_avg_sqs, masters], writing "
      "the params too; skipped when noop_flag is set or a grad * inv_scale is inf/nan",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
      py::arg("bias_correction"), py::arg("weight_decay"), py::arg("inv_scale"));
  m.def(
      "multi_tensor_sgd",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorLists& tensor_lists,
         double weight_decay, double momentum, double dampening, double lr, bool nesterov,
         bool first_run, bool wd_after_momentum, double scale) {
        multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening,
                         lr, nesterov, first_run, wd_after_momentum, scale);
        // The momentum buffers are written only with momentum (as the reference).
        bump_lists(tensor_lists, momentum != 0.0 ? std::vector<size_t>{1, 2, 3}
                                                 : std::vector<size_t>{1, 3});
      },
      no_gil,
      "SGD step on [grads, params, momentum_bufs(, model_copies)]; skipped when noop_flag "
      "is set",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("weight_decay"), py::arg("momentum"), py::arg("dampening"), py::arg("lr"),
        py::arg("nesterov"), py::arg("first_run"), py::arg("wd_after_momentum"),
        py::arg("scale"));
  m.def("multi_tensor_adagrad", bumping(&multi_tensor_adagrad, {1, 2}, false), no_gil,
        "Adagrad step on [grads, params, state_sums]", py::arg("chunk_size"),
        py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"), py::arg("epsilon"),
        py::arg("mode"), py::arg("weight_decay"));
  m.def(
      "multi_tensor_lamb",
      [](int64_t chunk_size, const at::Tensor& noop_flag,
         const std::vector<std::vector<at::Tensor>>& tensor_lists, double lr, double beta1,
         double beta2, double epsilon, int64_t step, int64_t bias_correction,
         double weight_decay, int64_t grad_averaging, int64_t mode,
         const py::object& global_grad_norm, double max_grad_norm,
         const py::object& use_nvlamb) {
        const at::Tensor norm =
            tensor_or_number(global_grad_norm, "multi_tensor_lamb", "global_grad_norm");
        const bool nvlamb = flag_or_none(use_nvlamb);
        py::gil_scoped_release no_gil_here;
        multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                          bias_correction, weight_decay, grad_averaging, mode, norm,
                          max_grad_norm, nvlamb);
        bump_lists(tensor_lists, {1, 2, 3});
        bump(noop_flag);
      },
      "LAMB step on [grads, params, exp_avgs, exp_avg_sqs]", py::arg("chunk_size"),
      py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("epsilon"), py::arg("step"), py::arg("bias_correction"),
      py::arg("weight_decay"), py::arg("grad_averaging"), py::arg("mode"),
      py::arg("global_grad_norm"), py::arg("max_grad_norm"), py::arg("use_nvlamb") = py::none());
  m.def(
      "multi_tensor_novograd",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorLists& tensor_lists,
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
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorLists& tensor_lists,
         const py::object& per_tensor) {
        const bool per = flag_or_none(per_tensor);
        py::gil_scoped_release no_gil_here;
        check_tensor_lists("multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, 1);
        // A step already marked as skipped computes nothing: zero norms (Apex: uninitialized).
        if (noop_is_set(noop_flag)) {
          const auto options = noop_flag.options().dtype(at::kFloat);
          const int64_t n = per ? static_cast<int64_t>(tensor_lists[0].size()) : 0;
          return std::make_tuple(at::zeros({1}, options), at::zeros({n}, options));
        }
        auto result = multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per);
        bump(noop_flag);
        return result;
      },
      "multi_tensor_l2norm that returns zero norms when noop_flag is set on entry",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor") = false);
  m.def(
      "multi_tensor_adam_capturable",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorLists& tensor_lists,
         const py::object& lr, double beta1, double beta2, double eps, const py::object& step,
         int64_t mode, int64_t bias_correction, double weight_decay,
         const py::object& inv_scale) {
        constexpr const char* op = "multi_tensor_adam_capturable";
        const at::Tensor lr_t = tensor_or_number(lr, op, "lr");
        const at::Tensor step_t = tensor_or_number(step, op, "step");
        const at::Tensor scale_t = tensor_or_number(inv_scale, op, "inv_scale");
        py::gil_scoped_release no_gil_here;
        multi_tensor_adam_capturable(chunk_size, noop_flag, tensor_lists, lr_t, beta1, beta2,
                                     eps, step_t, mode, bias_correction, weight_decay, scale_t);
        bump_lists(tensor_lists, {0, 1, 2, 3});
        bump(noop_flag);
      },
      "Adam step in place on [grads, params, exp_avgs, exp_avg_sqs] with device scalars; "
      "writes grad * inv_scale back; skipped when noop_flag is set or a grad is inf/nan",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
      py::arg("bias_correction"), py::arg("weight_decay"), py::arg("inv_scale"));
  m.def(
      "multi_tensor_lamb_stage1_cuda",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorLists& tensor_lists,
         const at::Tensor& per_tensor_decay, int64_t step, double beta1, double beta2,
         double epsilon, const py::object& global_grad_norm, double max_global_grad_norm) {
        const at::Tensor norm = tensor_or_number(global_grad_norm,
                                                 "multi_tensor_lamb_stage1_cuda",
                                                 "global_grad_norm");
        py::gil_scoped_release no_gil_here;
        multi_tensor_lamb_stage1(chunk_size, noop_flag, tensor_lists, per_tensor_decay, step,
                                 beta1, beta2, epsilon, norm, max_global_grad_norm);
        bump_lists(tensor_lists, {2, 3, 4});
      },
      "LAMB stage 1 on [grads, params, exp_avgs, exp_avg_sqs, updates]",
      py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
      py::arg("per_tensor_decay"), py::arg("step"), py::arg("beta1"), py::arg("beta2"),
      py::arg("epsilon"), py::arg("global_grad_norm"), py::arg("max_global_grad_norm"));
  m.def(
      "multi_tensor_lamb_stage2_cuda",
      [](int64_t chunk_size, const at::Tensor& noop_flag, const TensorLists& tensor_lists,
         const at::Tensor& per_tensor_param_norm, const at::Tensor& per_tensor_update_norm,
         double lr, double weight_decay, const py::object& use_nvlamb) {
        const bool nvlamb = flag_or_none(use_nvlamb);
        py::gil_scoped_release no_gil_here;
        multi_tensor_lamb_stage2(chunk_size, noop_flag, tensor_lists, per_tensor_param_norm,
                                 per_tensor_update_norm, lr, weight_decay, nvlamb);
        bump_lists(tensor_lists, {0});
      },
      "LAMB stage 2 on [params, updates]", py::arg("chunk_size"), py::arg("noop_flag"),
      py::arg("tensor_lists"), py::arg("per_tensor_param_norm"),
      py::arg("per_tensor_update_norm"), py::arg("lr"), py::arg("weight_decay"),
      py::arg("use_nvlamb") = py::none());
}
