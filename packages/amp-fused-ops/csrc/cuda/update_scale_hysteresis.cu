// update_scale_hysteresis: the loss-scale update with hysteresis of Apex's amp_C, in one
// single-thread kernel (no host sync, capturable). Logic and rounding are the reference's
// (src/amp_fused_ops/reference/_scaler.py): products in double, stored as float32; a growth that
// would reach inf is dropped; a backoff may underflow to 0.
#include "../common/aten_headers.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cuda {
namespace {

__global__ void update_scale_hysteresis_kernel(float* scale, int* growth_tracker,
                                               int* hysteresis_tracker, const float* found_inf,
                                               double growth_factor, double backoff_factor,
                                               int64_t growth_interval, int hysteresis) {
  const float found = *found_inf;
  int hyst = *hysteresis_tracker;
  if (found > 0.0f) {
    hyst -= 1;
    if (hyst > 0) {  // an overflow the hysteresis still tolerates: keep the scale
      *hysteresis_tracker = hyst;
      *growth_tracker = 0;
      return;
    }
  }
  if (found != 0.0f) {
    *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    *growth_tracker = 0;
  } else {
    const int successful = *growth_tracker + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      if (isfinite(grown)) {
        *scale = grown;
      }
      *growth_tracker = 0;
    } else {
      *growth_tracker = successful;
    }
  }
  *hysteresis_tracker = found <= 0.0f ? hysteresis : hyst;
}

void check_one(const char* name, const at::Tensor& t, at::ScalarType dtype,
               const at::Device& device) {
  constexpr const char* op = "update_scale_hysteresis";
  TORCH_CHECK(t.defined() && t.scalar_type() == dtype && t.numel() == 1, op, ": ", name,
              " must be a one-element ", dtype, " tensor, got dtype ",
              t.defined() ? t.scalar_type() : dtype, " with ", t.defined() ? t.numel() : 0,
              " elements");
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(),
              " but current_scale is on ", device, "; keep the scaler's tensors on one device");
}

}  // namespace

at::Tensor update_scale_hysteresis(const at::Tensor& current_scale,
                                   const at::Tensor& growth_tracker,
                                   const at::Tensor& hysteresis_tracker,
                                   const at::Tensor& found_inf, double growth_factor,
                                   double backoff_factor, int64_t growth_interval,
                                   int64_t hysteresis) {
  TORCH_CHECK(current_scale.defined() && current_scale.is_cuda(),
              "update_scale_hysteresis: current_scale must be a CUDA tensor for the CUDA "
              "extension");
  const at::Device device = current_scale.device();
  check_one("current_scale", current_scale, at::kFloat, device);
  check_one("growth_tracker", growth_tracker, at::kInt, device);
  check_one("hysteresis_tracker", hysteresis_tracker, at::kInt, device);
  check_one("found_inf", found_inf, at::kFloat, device);
  const c10::cuda::CUDAGuard guard(device);
  update_scale_hysteresis_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      current_scale.data_ptr<float>(), growth_tracker.data_ptr<int>(),
      hysteresis_tracker.data_ptr<int>(), found_inf.data_ptr<float>(), growth_factor,
      backoff_factor, growth_interval, static_cast<int>(hysteresis));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return current_scale;
}

}  // namespace cuda
}  // namespace amp_fused_ops
