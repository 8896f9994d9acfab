// The CUDA kernels of the multi-tensor ops and the loss-scale update, registered with the
// dispatcher for the CUDA dispatch key (torch.ops.amp_fused_ops.*; schemas in
// src/amp_fused_ops/ops/_registry.py). The emulation build compiles this file for the CPU, under
// its own namespace and the CPU key (csrc/emulation/amp_emu.h).
#include <torch/library.h>

#include <tuple>

#define AMP_FUSED_OPS_BACKEND cuda
#include "../common/ops_registration.h"

namespace amp_fused_ops {
namespace {

// multi_tensor_l2norm that honours a flag set on entry (zero norms then), without a host
// sync: the flag is read on the device before the norm may raise it.
std::tuple<at::Tensor, at::Tensor> l2norm_mp(int64_t chunk_size, const at::Tensor& noop_flag,
                                             at::TensorList xs, std::optional<bool> per_tensor) {
  TORCH_CHECK(noop_flag.defined() && noop_flag.is_cuda(),
              "multi_tensor_l2norm_mp: noop_flag must be a CUDA tensor for the CUDA extension");
  const at::Tensor skipped = noop_flag.reshape({}).ne(0);
  auto [total, per] =
      cuda::multi_tensor_l2norm(chunk_size, noop_flag, lists({xs}), per_tensor.value_or(false));
  bump(noop_flag);
  return {total.masked_fill(skipped, 0.0), per.masked_fill(skipped, 0.0)};
}

// Returns nothing: Apex's Python-facing op returns current_scale, which amp_C does (a custom
// op whose output aliases an input cannot be functionalized by torch.compile).
void update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, double growth_factor,
                                   double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis) {
  cuda::update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                                growth_factor, backoff_factor, growth_interval, hysteresis);
  bump(current_scale);
  bump(growth_tracker);
  bump(hysteresis_tracker);
}

}  // namespace
}  // namespace amp_fused_ops

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, CUDA, m) {
  amp_fused_ops::register_multi_tensor_impls(m);
  m.impl("multi_tensor_l2norm_mp", TORCH_FN(amp_fused_ops::l2norm_mp));
  m.impl("update_scale_hysteresis", TORCH_FN(amp_fused_ops::update_scale_hysteresis));
}
