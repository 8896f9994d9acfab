// Declarations of the multi-tensor launchers of both backends, with Apex's amp_C signatures:
// amp_fused_ops::cpu (csrc/cpu) and amp_fused_ops::cuda (csrc/cuda, also compiled for the CPU
// by the emulation build). The registrations (csrc/common/ops_registration.h) wrap them into the
// dispatcher's ops (schemas in src/amp_fused_ops/ops/_registry.py).
#pragma once

#include "aten_headers.h"

#include <optional>
#include <tuple>
#include <vector>

namespace amp_fused_ops {

namespace cpu {
using TensorListsArg = std::vector<std::vector<at::Tensor>>;
#include "multi_tensor_launchers.h"
}  // namespace cpu

namespace cuda {
using TensorListsArg = std::vector<std::vector<at::Tensor>>;
#include "multi_tensor_launchers.h"

// Loss-scale update with hysteresis (Apex's update_scale_hysteresis); returns current_scale.
at::Tensor update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, double growth_factor,
                                   double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis);
}  // namespace cuda

}  // namespace amp_fused_ops
