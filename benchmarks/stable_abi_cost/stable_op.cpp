// The op of bench_stable_abi_cost.py written against PyTorch's stable ABI
// (STABLE_TORCH_LIBRARY, TORCH_BOX, torch::stable::Tensor), compiled with TORCH_TARGET_VERSION
// set to torch 2.11: the same checks and update as aten_op.cpp. The second namespace gets a
// Python ADInplaceOrView kernel in the benchmark (version counters have no stable C++ API).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <vector>

#include "schemas.h"

using torch::headeronly::DeviceType;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

void check_list(const std::vector<Tensor>& ts, const std::vector<Tensor>& first,
                const char* what) {
  STD_TORCH_CHECK(ts.size() == first.size(), what, ": lists of different lengths");
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float, what, "[", i, "]: expected float32");
    STD_TORCH_CHECK(t.is_contiguous(), what, "[", i, "]: expected a contiguous tensor");
    STD_TORCH_CHECK(t.device().type() == DeviceType::CPU, what, "[", i,
                    "]: expected a CPU tensor");
    STD_TORCH_CHECK(t.numel() == first[i].numel(), what, "[", i, "]: sizes differ");
  }
}

void adam_like(int64_t, Tensor, std::vector<Tensor> grads, std::vector<Tensor> params,
               std::vector<Tensor> exp_avgs, std::vector<Tensor> exp_avg_sqs, double lr, double,
               double, double, int64_t, int64_t, int64_t, double) {
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

void empty_body(int64_t, Tensor, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                std::vector<Tensor>, double, double, double, double, int64_t, int64_t, int64_t,
                double) {}

}  // namespace

STABLE_TORCH_LIBRARY(amp_abi_cost_stable, m) {
  m.def(SCHEMA_ADAM);
  m.def(SCHEMA_EMPTY);
}
STABLE_TORCH_LIBRARY_IMPL(amp_abi_cost_stable, CPU, m) {
  m.impl("adam_like", TORCH_BOX(&adam_like));
  m.impl("empty_body", TORCH_BOX(&empty_body));
}

STABLE_TORCH_LIBRARY(amp_abi_cost_stable_bumped, m) { m.def(SCHEMA_ADAM); }
STABLE_TORCH_LIBRARY_IMPL(amp_abi_cost_stable_bumped, CPU, m) {
  m.impl("adam_like", TORCH_BOX(&adam_like));
}
