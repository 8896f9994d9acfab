// Force-included (-include) before every source of csrc/cuda when it is compiled as C++ for
// the CPU: the CUDA keywords and device functions on top of amp_emu_runtime.h. The sources
// themselves are not changed; the build only rewrites `<<<config>>>` into
// `% amp_emu::LaunchConfig(config)`.
#pragma once

#include "../common/aten_headers.h"
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "amp_emu_runtime.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

// Keywords. Blocks run one at a time, so a block's __shared__ variables are statics, all in
// one section of the module: the scheduler fills it with poison before each block, and the
// counting build checks every read of it against the bytes the block has written
// (amp_emu_runtime.cpp). Dynamic shared memory (`extern __shared__ T name[];`) is rewritten by
// the build into a pointer to the emulator's buffer of it (amp_emu_runtime.h).
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static __attribute__((section(AMP_EMU_SHARED_SECTION)))
#define __syncthreads() ::amp_emu::syncthreads(__FILE__, __LINE__)

// Device math under CUDA's names.
using std::isfinite;
using std::isinf;
using std::isnan;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
// The emulator is compiled with -ffp-contract=off: a product is always rounded on its own.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline int __float_as_int(float x) {
  int i;
  std::memcpy(&i, &x, sizeof i);
  return i;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// The host API: the emulated "device" is the CPU. Tensors of the emulated kernels are CPU
// tensors, so the sources' checks that a tensor is a CUDA tensor ask whether it is a CPU one,
// their ops are registered for the CPU dispatch key, under a namespace of their own (the CPU
// and the emulated extensions can be loaded in one process): torch.ops.amp_fused_ops_emu, with
// the schemas of torch.ops.amp_fused_ops (src/amp_fused_ops/ops/_registry.py for the
// multi-tensor ops, src/amp_fused_ops/ops/_kernel_ops.py for the norm and SyncBN ops).
#define is_cuda is_cpu
#define CUDA CPU
#define AMP_FUSED_OPS_NS amp_fused_ops_emu
