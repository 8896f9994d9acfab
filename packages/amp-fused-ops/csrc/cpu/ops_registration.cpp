// The C++ CPU kernels of the multi-tensor ops, registered with the dispatcher for the CPU
// dispatch key (torch.ops.amp_fused_ops.*; schemas in src/amp_fused_ops/ops/_registry.py).
#include <torch/library.h>

#include <tuple>

#include "multi_tensor_apply.h"

#define AMP_FUSED_OPS_BACKEND cpu
#include "../common/ops_registration.h"

namespace amp_fused_ops {
namespace {

// multi_tensor_l2norm that returns zero norms when noop_flag is set on entry (a step already
// marked as skipped computes nothing; Apex leaves them uninitialized).
std::tuple<at::Tensor, at::Tensor> l2norm_mp(int64_t chunk_size, const at::Tensor& noop_flag,
                                             at::TensorList xs, std::optional<bool> per_tensor) {
  const bool per = per_tensor.value_or(false);
  const TensorLists tensor_lists = lists({xs});
  cpu::check_tensor_lists("multi_tensor_l2norm_mp", chunk_size, noop_flag, tensor_lists, 1);
  if (cpu::noop_is_set(noop_flag)) {
    const auto options = noop_flag.options().dtype(at::kFloat);
    const int64_t n = per ? static_cast<int64_t>(xs.size()) : 0;
    return std::make_tuple(at::zeros({1}, options), at::zeros({n}, options));
  }
  auto result = cpu::multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per);
  bump(noop_flag);
  return result;
}

}  // namespace
}  // namespace amp_fused_ops

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, CPU, m) {
  amp_fused_ops::register_multi_tensor_impls(m);
  m.impl("multi_tensor_l2norm_mp", TORCH_FN(amp_fused_ops::l2norm_mp));
}
