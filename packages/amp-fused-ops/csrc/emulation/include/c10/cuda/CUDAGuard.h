// Emulator stand-in for <c10/cuda/CUDAGuard.h>: one device, nothing to switch.
#pragma once

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>

#include <optional>

namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
  explicit CUDAGuard(c10::DeviceIndex) {}
};
struct OptionalCUDAGuard {
  OptionalCUDAGuard() = default;
  explicit OptionalCUDAGuard(std::optional<c10::Device>) {}
  void set_device(c10::Device) {}
};
}  // namespace cuda
}  // namespace c10
