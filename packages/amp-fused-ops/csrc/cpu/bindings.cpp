// Python bindings of the C++ CPU extension of amp_fused_ops (Apex's amp_C signatures).
#include <torch/extension.h>

#include "multi_tensor_ops.h"

namespace py = pybind11;
using namespace amp_fused_ops::cpu;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "amp_fused_ops C++ CPU kernels: multi-tensor ops with Apex's amp_C signatures";
  // The kernels never touch Python objects: release the GIL while they run.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("multi_tensor_scale", &multi_tensor_scale, no_gil,
        "out = in * scale for [ins, outs]; sets noop_flag on inf/nan inputs",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("scale"));
  m.def("multi_tensor_axpby", &multi_tensor_axpby, no_gil,
        "out = a * x + b * y for [xs, ys, outs]; sets noop_flag on inf/nan in the checked input",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("a"),
        py::arg("b"), py::arg("arg_to_check"));
  m.def("multi_tensor_l2norm", &multi_tensor_l2norm, no_gil,
        "(total L2 norm [1], per-tensor L2 norms [n] or empty) of [xs], in float32",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"),
        py::arg("per_tensor") = false);
  m.def("multi_tensor_adam", &multi_tensor_adam, no_gil,
        "Adam (mode 0) / AdamW (mode 1) step in place on [grads, params, exp_avgs, exp_avg_sqs]",
        py::arg("chunk_size"), py::arg("noop_flag"), py::arg("tensor_lists"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("step"), py::arg("mode"),
        py::arg("bias_correction"), py::arg("weight_decay"));
}
