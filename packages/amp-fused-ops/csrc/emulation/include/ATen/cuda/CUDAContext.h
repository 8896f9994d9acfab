// Emulator stand-in for <ATen/cuda/CUDAContext.h> (see csrc/emulation/amp_emu.h).
#pragma once

#include <c10/cuda/CUDAException.h>

#include "../../../amp_emu_runtime.h"

namespace at {
namespace cuda {
inline cudaStream_t getCurrentCUDAStream(signed char = -1) { return amp_emu::current_stream(); }
inline cudaStream_t getDefaultCUDAStream(signed char = -1) { return amp_emu::current_stream(); }
inline const cudaDeviceProp* getCurrentDeviceProperties() { return amp_emu::device_properties(); }
inline const cudaDeviceProp* getDeviceProperties(signed char) {
  return amp_emu::device_properties();
}
}  // namespace cuda
}  // namespace at
