// The op of bench_stable_abi_cost.py written against ATen's C++ API (TORCH_LIBRARY, TORCH_FN,
// at::TensorList), as the compiled modules of amp-fused-ops are. `adam_like` has the schema
// of multi_tensor_adam and the per-tensor checks a real op makes (dtype, layout, device, size
// of every tensor of every list), then a trivial update; `empty_body` takes the same arguments
// and does nothing (the cost of the call and of passing the arguments alone).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "schemas.h"

namespace {

void check_list(at::TensorList ts, at::TensorList first, const char* what) {
  TORCH_CHECK(ts.size() == first.size(), what, ": lists of different lengths");
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK(t.scalar_type() == at::kFloat, what, "[", i, "]: expected float32");
    TORCH_CHECK(t.is_contiguous(), what, "[", i, "]: expected a contiguous tensor");
    TORCH_CHECK(t.device().is_cpu(), what, "[", i, "]: expected a CPU tensor");
    TORCH_CHECK(t.numel() == first[i].numel(), what, "[", i, "]: sizes differ");
  }
}

void adam_like(int64_t, const at::Tensor&, at::TensorList grads, at::TensorList params,
               at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr, double, double,
               double, int64_t, int64_t, int64_t, double) {
  check_list(grads, grads, "grads");
  check_list(params, grads, "params");
  check_list(exp_avgs, grads, "exp_avgs");
  check_list(exp_avg_sqs, grads, "exp_avg_sqs");
  const float step = static_cast<float>(lr);
  for (size_t k = 0; k < grads.size(); ++k) {
    const float* g = grads[k].const_data_ptr<float>();
    float* p = params[k].mutable_data_ptr<float>();
    float* m = exp_avgs[k].mutable_data_ptr<float>();
    float* v = exp_avg_sqs[k].mutable_data_ptr<float>();
    for (int64_t i = 0, n = grads[k].numel(); i < n; ++i) {
      p[i] -= step * g[i];
      m[i] += g[i];
      v[i] += g[i] * g[i];
    }
  }
}

void empty_body(int64_t, const at::Tensor&, at::TensorList, at::TensorList, at::TensorList,
                at::TensorList, double, double, double, double, int64_t, int64_t, int64_t,
                double) {}

}  // namespace

TORCH_LIBRARY(amp_abi_cost_aten, m) {
  m.def(SCHEMA_ADAM);
  m.def(SCHEMA_EMPTY);
}
TORCH_LIBRARY_IMPL(amp_abi_cost_aten, CPU, m) {
  m.impl("adam_like", TORCH_FN(adam_like));
  m.impl("empty_body", TORCH_FN(empty_body));
}
