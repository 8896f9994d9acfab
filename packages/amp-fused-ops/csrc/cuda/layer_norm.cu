// Fused LayerNorm / RMSNorm forward and backward kernels (Apex's fused_layer_norm_cuda).
//
// The CUDA kernels of the dispatcher ops torch.ops.amp_fused_ops.norm_forward / norm_backward
// (schemas, reference and fake kernels in src/amp_fused_ops/ops/_kernel_ops.py; autograd in
// src/amp_fused_ops/normalization/_ops.py):
//   norm_forward(x, weight?, bias?, eps, rms, mixed, memory_efficient) -> (y, mean, invvar)
//   norm_backward(dy, saved, mean, invvar, weight?, bias?, rms, memory_efficient,
//                 input_dtype) -> (dx, dweight, dbias)
// The kernels take x as (rows, hidden), hidden in [1, 65536], float32 / float16 / bfloat16
// with parameters of x's dtype or float32; any other input of the ops (longer rows, float64,
// mixed parameter dtypes) runs the fp32 ATen reference of ../common/norm_reference.h.
// Statistics are fp32 (LayerNorm: mean and variance; RMSNorm: the mean square). With
// memory_efficient, `saved` is the output y and the normalized input is recomputed as
// (y - beta) / gamma.
//
// Two sets of kernels, chosen per call (AMP_FUSED_OPS_NORM_KERNELS, read at every call):
// - resident (the default): for rows whose buffers are 16-byte aligned with hidden % VEC == 0
//   (VEC elements: 16 bytes) and at most kMaxElements elements per thread of a row of up to
//   512 threads (hidden up to 16384 in float32, bfloat16 and float16). A grid of a few blocks
//   per SM, each block walking the rows, a thread holding its columns of the row in registers:
//   the forward reads x once and the weight and bias once per block; the backward reads dy and
//   the saved tensor once and sums the parameter gradients in the same pass (a partial per
//   block, added by a last kernel): in registers up to kBackwardElements elements per thread
//   (hidden 8192), above in the block's dynamic shared memory (a float32 sum per column and
//   parameter: 128 KiB for a LayerNorm of 16384). A device with less shared memory per block
//   than that (99 KiB on RTX-class GPUs) leaves such rows' parameter gradients to the column
//   kernel below, which reads dy and the saved tensor again. The memory-efficient backward
//   also needs the bias: in registers up to kBackwardElements per thread, above in shared
//   memory beside the sums (192 KiB for a LayerNorm of 16384), for float16 / bfloat16 outputs
//   (float32 rows that wide, or a device without room for the bias, take the per-row
//   kernels). The statistics are two-pass over the registers (the mean, then the squared
//   deviations). A norm without a bias (RMSNorm, a LayerNorm with a weight only) runs the
//   resident kernels compiled without one (BIAS = false: no bias registers, no sums of dy;
//   resident_generic runs those for a bias instead, the bias skipped at run time), but for
//   the backward of rows whose sums are in shared memory, where a bias costs no registers.
// - per_row (the earlier kernels; everything the resident ones do not take): one block per
//   row, each thread walking the row in chunks of VEC elements (VEC = 1 when unaligned or
//   hidden % VEC != 0), Welford statistics; the backward reads each row twice for dx, then a
//   column kernel writes per-row-slice partial sums of dy * xhat and dy, and a last kernel
//   reduces them into dgamma / dbeta.
// The two differ by rounding only (the order of the sums, the statistics' formula).
#include "../common/aten_headers.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>

#include "../common/norm_reference.h"
#include "../common/ops_schema.h"
#include "welford.cuh"

namespace {

using amp_fused_ops::cuda::warp_welford;
using amp_fused_ops::cuda::welford_add;
using amp_fused_ops::cuda::welford_merge;

constexpr int64_t kMaxHidden = 65536;
constexpr int kMaxThreads = 512;
constexpr int kColumns = 32;   // columns per block in the gamma/beta partial kernel
constexpr int kRowLanes = 16;  // threads along rows in that kernel
// Threads per block of the resident kernels at least: rows of fewer threads share a block.
constexpr int kResidentBlock = 256;
// Row elements per thread up to which the resident backward sums the parameter gradients
// in registers (two float32 sums per element); above, in dynamic shared memory where the
// device has enough (a float32 sum per column and parameter: 128 KiB for LayerNorm at 16384),
// else a column kernel does.
constexpr int kBackwardElements = 16;
// Static shared memory of the resident backward at most (the row sums and the staged
// parameters: 2.1-4.2 KiB by ptxas), for sizing its dynamic shared memory and blocks per SM.
constexpr size_t kStaticSharedBound = 8 * 1024;

template <typename T>
struct Tag {
  using type = T;
};

// VEC elements of type T; aligned to min(16, VEC * sizeof(T)) bytes so that loads of it
// compile to vector loads (two 16-byte loads for 8 floats).
template <typename T, int VEC>
struct alignas(VEC * sizeof(T) < 16 ? VEC * sizeof(T) : 16) Pack {
  T v[VEC];
};

template <int VEC, typename T>
__device__ __forceinline__ void load(const T* __restrict__ p, int64_t i, float (&out)[VEC]) {
  const Pack<T, VEC> pack = reinterpret_cast<const Pack<T, VEC>*>(p)[i];
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = static_cast<float>(pack.v[k]);
}

template <int VEC, typename T>
__device__ __forceinline__ void store(T* __restrict__ p, int64_t i, const float (&in)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.v[k] = static_cast<T>(in[k]);
  reinterpret_cast<Pack<T, VEC>*>(p)[i] = pack;
}

// Block-wide Welford reduction; every thread gets the result. blockDim.x is a multiple of 32.
__device__ void block_welford(float& n, float& mean, float& m2) {
  __shared__ float shared[3][kMaxThreads / 32];
  warp_welford(n, mean, m2);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  __syncthreads();  // shared is reused across calls
  if (lane == 0) {
    shared[0][warp] = n;
    shared[1][warp] = mean;
    shared[2][warp] = m2;
  }
  __syncthreads();
  n = 0.f;
  mean = 0.f;
  m2 = 0.f;
  for (int w = 0; w < warps; ++w) welford_merge(n, mean, m2, shared[0][w], shared[1][w], shared[2][w]);
}

// Sums each of the N values over the threads of this thread's row: blockDim.x threads (a power
// of two >= 32, so a whole number of warps, contiguous: warp = threadIdx.y * warps_per_row +
// threadIdx.x / 32), one row per threadIdx.y; a 1-D block is one row. Every thread of the row
// gets the sums. Called by every thread of the block (it synchronizes the block when a row
// spans several warps).
template <int N>
__device__ __forceinline__ void row_sum(float (&v)[N]) {
  __shared__ float shared[N][kMaxThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], offset);
  }
  const int warps_per_row = static_cast<int>(blockDim.x / 32);
  if (warps_per_row == 1) return;
  const int first = static_cast<int>(threadIdx.y) * warps_per_row;
  __syncthreads();  // shared is reused across calls
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) shared[k][first + threadIdx.x / 32] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    v[k] = 0.f;
    for (int w = 0; w < warps_per_row; ++w) v[k] += shared[k][first + w];
  }
}

__device__ __forceinline__ void row_sum(float& a) {
  float v[1] = {a};
  row_sum(v);
  a = v[0];
}

__device__ __forceinline__ void row_sum(float& a, float& b) {
  float v[2] = {a, b};
  row_sum(v);
  a = v[0];
  b = v[1];
}

template <typename TIn, typename TP, typename TOut, int VEC>
__global__ void norm_forward_kernel(const TIn* __restrict__ x, const TP* __restrict__ gamma,
                                    const TP* __restrict__ beta, TOut* __restrict__ y,
                                    float* __restrict__ mean_out, float* __restrict__ invvar_out,
                                    int64_t hidden, float eps, bool rms) {
  const int64_t row = blockIdx.x;
  const int64_t chunks = hidden / VEC;
  const TIn* xr = x + row * hidden;
  float n = 0.f, mean = 0.f, m2 = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[VEC];
    load<VEC>(xr, c, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (rms) {
        m2 += v[k] * v[k];
      } else {
        welford_add(n, mean, m2, v[k]);
      }
    }
  }
  if (rms) {
    row_sum(m2);
    mean = 0.f;
  } else {
    block_welford(n, mean, m2);
  }
  const float invvar = rsqrtf(m2 / static_cast<float>(hidden) + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    invvar_out[row] = invvar;
  }
  TOut* yr = y + row * hidden;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[VEC], g[VEC], b[VEC];
    load<VEC>(xr, c, v);
    if (gamma != nullptr) load<VEC>(gamma, c, g);
    if (beta != nullptr) load<VEC>(beta, c, b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float out = (v[k] - mean) * invvar;
      if (gamma != nullptr) out *= g[k];
      if (beta != nullptr) out += b[k];
      v[k] = out;
    }
    store<VEC>(yr, c, v);
  }
}

// xhat of VEC elements from the saved input (or the saved output when memory_efficient).
template <int VEC, typename TS, typename TP>
__device__ __forceinline__ void normalized(const TS* __restrict__ saved_row,
                                           const TP* __restrict__ gamma,
                                           const TP* __restrict__ beta, int64_t c, float mean,
                                           float invvar, bool memory_efficient,
                                           float (&xhat)[VEC]) {
  load<VEC>(saved_row, c, xhat);
  if (memory_efficient) {
    float g[VEC], b[VEC];
    if (gamma != nullptr) load<VEC>(gamma, c, g);
    if (beta != nullptr) load<VEC>(beta, c, b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (beta != nullptr) xhat[k] -= b[k];
      if (gamma != nullptr) xhat[k] /= g[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) xhat[k] = (xhat[k] - mean) * invvar;
  }
}

// Chunk c of a row for the input gradient: gk = dy * gamma (dy without gamma) and xhat.
// __fmul_rn: the rounded product, never fused into a later `gk - mean_g` (nvcc contracts a
// product and a subtraction into one fma by default), so that gk cancels exactly against the
// mean it was summed into (hidden = 1, or a constant dy * gamma: dx is exactly 0).
template <int VEC, typename TOut, typename TS, typename TP>
__device__ __forceinline__ void scaled_dy_and_xhat(const TOut* __restrict__ dy_row,
                                                   const TS* __restrict__ saved_row,
                                                   const TP* __restrict__ gamma,
                                                   const TP* __restrict__ beta, int64_t c,
                                                   float mean, float invvar,
                                                   bool memory_efficient, float (&gk)[VEC],
                                                   float (&xhat)[VEC]) {
  float g[VEC];
  load<VEC>(dy_row, c, gk);
  if (gamma != nullptr) load<VEC>(gamma, c, g);
  normalized<VEC>(saved_row, gamma, beta, c, mean, invvar, memory_efficient, xhat);
  if (gamma != nullptr) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) gk[k] = __fmul_rn(gk[k], g[k]);
  }
}

template <typename TIn, typename TP, typename TOut, typename TS, int VEC>
__global__ void norm_backward_input_kernel(const TOut* __restrict__ dy, const TS* __restrict__ saved,
                                           const float* __restrict__ mean,
                                           const float* __restrict__ invvar,
                                           const TP* __restrict__ gamma,
                                           const TP* __restrict__ beta, TIn* __restrict__ dx,
                                           int64_t hidden, bool rms, bool memory_efficient) {
  const int64_t row = blockIdx.x;
  const int64_t chunks = hidden / VEC;
  const float mu = rms ? 0.f : mean[row];
  const float iv = invvar[row];
  const TOut* dyr = dy + row * hidden;
  const TS* sr = saved + row * hidden;
  float sum_g = 0.f, sum_gx = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float gk[VEC], xh[VEC];
    scaled_dy_and_xhat<VEC>(dyr, sr, gamma, beta, c, mu, iv, memory_efficient, gk, xh);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sum_g += gk[k];
      sum_gx += gk[k] * xh[k];
    }
  }
  row_sum(sum_g, sum_gx);
  const float inv_n = 1.f / static_cast<float>(hidden);
  const float mean_g = rms ? 0.f : sum_g * inv_n;
  const float proj = sum_gx * inv_n;
  TIn* dxr = dx + row * hidden;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float gk[VEC], xh[VEC];
    scaled_dy_and_xhat<VEC>(dyr, sr, gamma, beta, c, mu, iv, memory_efficient, gk, xh);
#pragma unroll
    for (int k = 0; k < VEC; ++k) gk[k] = (gk[k] - mean_g - xh[k] * proj) * iv;
    store<VEC>(dxr, c, gk);
  }
}

// Partial sums over a slice of rows of dy * xhat (-> dgamma) and dy (-> dbeta), per column.
// Block (kColumns, kRowLanes); grid (ceil(hidden / kColumns), slices).
static_assert(kColumns == 32, "a warp of norm_backward_params_partial is one row's columns");
template <typename TP, typename TOut, typename TS>
__global__ void norm_backward_params_partial(const TOut* __restrict__ dy, const TS* __restrict__ saved,
                                             const float* __restrict__ mean,
                                             const float* __restrict__ invvar,
                                             const TP* __restrict__ gamma,
                                             const TP* __restrict__ beta, float* __restrict__ part_g,
                                             float* __restrict__ part_b, int64_t rows,
                                             int64_t hidden, bool rms, bool memory_efficient) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  const int64_t per_slice = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * per_slice;
  const int64_t end = begin + per_slice < rows ? begin + per_slice : rows;
  float acc_g = 0.f, acc_b = 0.f;
  const bool in_row = col < hidden;
  float g = 1.f, b = 0.f;
  if (in_row && memory_efficient) {
    if (gamma != nullptr) g = static_cast<float>(gamma[col]);
    if (beta != nullptr) b = static_cast<float>(beta[col]);
  }
  for (int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) {
    // The row's statistics, loaded by lane 0 for the warp (a warp is the block's 32 columns
    // of one row) and broadcast.
    float mu = 0.f, iv = 0.f;
    if (!memory_efficient && threadIdx.x == 0) {
      iv = invvar[r];
      if (!rms) mu = mean[r];
    }
    mu = __shfl_sync(0xffffffffu, mu, 0);
    iv = __shfl_sync(0xffffffffu, iv, 0);
    if (!in_row) continue;
    const float d = static_cast<float>(dy[r * hidden + col]);
    const float s = static_cast<float>(saved[r * hidden + col]);
    const float xh = memory_efficient ? (s - b) / g : (s - mu) * iv;
    acc_g += d * xh;
    acc_b += d;
  }
  __shared__ float sg[kRowLanes][kColumns + 1];
  __shared__ float sb[kRowLanes][kColumns + 1];
  sg[threadIdx.y][threadIdx.x] = acc_g;
  sb[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    for (int i = 1; i < kRowLanes; ++i) {
      acc_g += sg[i][threadIdx.x];
      acc_b += sb[i][threadIdx.x];
    }
    part_g[blockIdx.y * hidden + col] = acc_g;
    part_b[blockIdx.y * hidden + col] = acc_b;
  }
}

template <typename TP>
__global__ void norm_backward_params_final(const float* __restrict__ part_g,
                                           const float* __restrict__ part_b, TP* __restrict__ dgamma,
                                           TP* __restrict__ dbeta, int64_t slices, int64_t hidden) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= hidden) return;
  // Only the partials of the gradients asked for are read (the others need not be written).
  float g = 0.f, b = 0.f;
  for (int64_t s = 0; s < slices; ++s) {
    if (dgamma != nullptr) g += part_g[s * hidden + col];
    if (dbeta != nullptr) b += part_b[s * hidden + col];
  }
  if (dgamma != nullptr) dgamma[col] = static_cast<TP>(g);
  if (dbeta != nullptr) dbeta[col] = static_cast<TP>(b);
}

// --- the resident kernels: a row held on chip, several rows per block ----------------------
//
// A block of (tpr, rpb) threads: tpr threads per row (a power of two in [32, kMaxThreads]),
// rpb rows at a time, and a grid of at most a few blocks per SM, each walking the rows with a
// stride of gridDim.x * rpb. A thread owns the same CHUNKS chunks of VEC columns in every row
// (chunk k * tpr + threadIdx.x), so it loads its weight and bias once per block and keeps them
// in registers. The row's chunks stay in registers between the statistics and the output
// (forward), and between the row sums and dx (backward): each element of x, dy, y and dx
// crosses global memory once. The backward also sums dy * xhat and dy over the block's rows
// for the thread's columns, and writes one partial per block; norm_backward_params_final adds
// the partials of all blocks.

template <typename T, int VEC>
__device__ __forceinline__ float element(const Pack<T, VEC>& p, int i) {
  return static_cast<float>(p.v[i]);
}

// This thread's CHUNKS packs of a parameter (the same columns in every row of the block), with
// one global read per pack and block: with several rows per block, the threads of row 0 read
// and the others take the packs from shared memory. Called by every thread of the block.
template <typename TP, int VEC, int CHUNKS>
__device__ __forceinline__ void load_block_params(const TP* __restrict__ p, int chunks,
                                                  Pack<TP, VEC> (&out)[CHUNKS]) {
  const int tpr = static_cast<int>(blockDim.x);
  if (blockDim.y == 1) {
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = k * tpr + static_cast<int>(threadIdx.x);
      if (c < chunks) out[k] = reinterpret_cast<const Pack<TP, VEC>*>(p)[c];
    }
    return;
  }
  // Several rows per block only when tpr * 2 <= kResidentBlock.
  __shared__ Pack<TP, VEC> staged[kResidentBlock / 2];
#pragma unroll
  for (int k = 0; k < CHUNKS; ++k) {
    const int c = k * tpr + static_cast<int>(threadIdx.x);
    __syncthreads();  // the previous chunk's reads are done
    if (threadIdx.y == 0 && c < chunks) staged[threadIdx.x] = reinterpret_cast<const Pack<TP, VEC>*>(p)[c];
    __syncthreads();
    if (c < chunks) out[k] = staged[threadIdx.x];
  }
}

// BIAS: whether the kernel handles a bias (then `beta` may still be null); without (an RMSNorm, a
// LayerNorm without bias: `beta` is null), the bias's registers and arithmetic are not compiled.
template <typename TIn, typename TP, typename TOut, int VEC, int CHUNKS, bool BIAS>
__global__ void __launch_bounds__(kMaxThreads, 1)
    norm_forward_resident(const TIn* __restrict__ x, const TP* __restrict__ gamma,
                          const TP* __restrict__ beta, TOut* __restrict__ y,
                          float* __restrict__ mean_out, float* __restrict__ invvar_out,
                          int64_t rows, int64_t hidden, float eps, bool rms) {
  const int chunks = static_cast<int>(hidden / VEC);  // hidden <= kMaxHidden
  const int tpr = static_cast<int>(blockDim.x);
  Pack<TP, VEC> g[CHUNKS], b[BIAS ? CHUNKS : 1];
  if (gamma != nullptr) load_block_params<TP, VEC, CHUNKS>(gamma, chunks, g);
  if constexpr (BIAS) {
    if (beta != nullptr) load_block_params<TP, VEC, CHUNKS>(beta, chunks, b);
  }
  const float inv_n = 1.f / static_cast<float>(hidden);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y; first < rows;
       first += step) {
    const int64_t row = first + threadIdx.y;
    const bool valid = row < rows;
    const TIn* xr = x + row * hidden;
    Pack<TIn, VEC> v[CHUNKS];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = k * tpr + static_cast<int>(threadIdx.x);
      if (valid && c < chunks) {
        v[k] = reinterpret_cast<const Pack<TIn, VEC>*>(xr)[c];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e = element(v[k], i);
          sum += rms ? e * e : e;
        }
      }
    }
    row_sum(sum);
    float mean = 0.f, m2 = sum;
    if (!rms) {
      // Two passes over the registers: the mean, then the squared deviations from it.
      mean = sum * inv_n;
      m2 = 0.f;
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        const int c = k * tpr + static_cast<int>(threadIdx.x);
        if (valid && c < chunks) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float d = element(v[k], i) - mean;
            m2 += d * d;
          }
        }
      }
      row_sum(m2);
    }
    const float invvar = rsqrtf(m2 * inv_n + eps);
    if (!valid) continue;  // after the last block-wide sum of this row group
    if (threadIdx.x == 0) {
      mean_out[row] = mean;
      invvar_out[row] = invvar;
    }
    TOut* yr = y + row * hidden;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = k * tpr + static_cast<int>(threadIdx.x);
      if (c < chunks) {
        Pack<TOut, VEC> out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float o = (element(v[k], i) - mean) * invvar;
          if (gamma != nullptr) o *= element(g[k], i);
          if constexpr (BIAS) {
            if (beta != nullptr) o += element(b[k], i);
          }
          out.v[i] = static_cast<TOut>(o);
        }
        reinterpret_cast<Pack<TOut, VEC>*>(yr)[c] = out;
      }
    }
  }
}

// Element i of a chunk for the backward: xhat, from the saved input and the row's statistics
// (or, ME, from the saved output as (y - beta) / gamma), and gk = dy * gamma (dy without a
// weight; __fmul_rn: see scaled_dy_and_xhat).
// `beta` is the bias's element (ME with a bias only).
template <bool ME, typename TS, typename TP, int VEC>
__device__ __forceinline__ void resident_terms(float dy, const Pack<TS, VEC>& saved,
                                               const Pack<TP, VEC>& g, float beta, int i,
                                               float mu, float iv, bool has_gamma,
                                               bool has_beta, float& xh, float& gk) {
  if (ME) {
    xh = element(saved, i);
    if (has_beta) xh -= beta;
    if (has_gamma) xh /= element(g, i);
  } else {
    xh = (element(saved, i) - mu) * iv;
  }
  gk = has_gamma ? __fmul_rn(dy, element(g, i)) : dy;
}

// The block's partials of the register sums: the rows of the block (threadIdx.y) added through
// shared memory, one chunk index k at a time, then written by the threads of row 0. Without
// BIAS there are no sums of dy (acc_b has one unused element) and part_b is not written.
template <int VEC, int kAcc, bool BIAS>
__device__ __forceinline__ void block_partials(float (&acc_g)[kAcc][VEC],
                                               float (&acc_b)[BIAS ? kAcc : 1][BIAS ? VEC : 1],
                                               int chunks, float* __restrict__ part_g,
                                               float* __restrict__ part_b, int64_t hidden) {
  const int tpr = static_cast<int>(blockDim.x);
  __shared__ float shared_g[kMaxThreads * 4];
  __shared__ float shared_b[kMaxThreads * 4];
  const int slot = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  constexpr int kHalves = VEC > 4 ? VEC / 4 : 1;  // shared holds 4 floats per thread
  constexpr int kPer = VEC > 4 ? 4 : VEC;
#pragma unroll
  for (int k = 0; k < kAcc; ++k) {
    const int c = k * tpr + static_cast<int>(threadIdx.x);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      if (blockDim.y > 1) {
        __syncthreads();  // the previous round's reads are done
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          shared_g[slot * kPer + i] = acc_g[k][h * kPer + i];
          if constexpr (BIAS) shared_b[slot * kPer + i] = acc_b[k][h * kPer + i];
        }
        __syncthreads();
        if (threadIdx.y == 0) {
          for (int r = 1; r < static_cast<int>(blockDim.y); ++r) {
            const int other = (r * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x));
#pragma unroll
            for (int i = 0; i < kPer; ++i) {
              acc_g[k][h * kPer + i] += shared_g[other * kPer + i];
              if constexpr (BIAS) acc_b[k][h * kPer + i] += shared_b[other * kPer + i];
            }
          }
        }
      }
    }
    if (threadIdx.y == 0 && c < chunks) {
      store<VEC>(part_g + static_cast<int64_t>(blockIdx.x) * hidden, c, acc_g[k]);
      if constexpr (BIAS) store<VEC>(part_b + static_cast<int64_t>(blockIdx.x) * hidden, c, acc_b[k]);
    }
  }
}

// The block's running sums of a wide row's parameter gradients in dynamic shared memory: a
// float32 sum per column of dy * xhat (when the norm has a weight) and of dy (a bias), each
// thread adding to its own columns only. Such rows have kMaxThreads threads and CHUNKS chunks
// per thread; element i of chunk c is at float i * kMaxThreads * CHUNKS + c of a parameter's
// VEC * kMaxThreads * CHUNKS floats (shared_sums_floats), so that the 32 threads of a warp, at
// one element of consecutive chunks, touch 32 consecutive floats (no bank conflict), and the
// offsets are constants (no register for the stride).
template <int VEC, int CHUNKS>
constexpr int shared_sums_floats() {
  return VEC * kMaxThreads * CHUNKS;
}

template <int CHUNKS>
__device__ __forceinline__ int shared_sum_index(int i, int c) {
  return i * kMaxThreads * CHUNKS + c;
}

template <int VEC, int CHUNKS>
__device__ __forceinline__ void write_shared_sums(float* __restrict__ sums, int c,
                                                  const float (&v)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) sums[shared_sum_index<CHUNKS>(i, c)] = v[i];
}

template <int VEC, int CHUNKS>
__device__ __forceinline__ void read_shared_sums(const float* __restrict__ sums, int c,
                                                 float (&v)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = sums[shared_sum_index<CHUNKS>(i, c)];
}

// The input gradient of a row group and the block's partial sums of dy * xhat (-> dgamma) and
// dy (-> dbeta) per column, written to part_g / part_b[blockIdx.x * hidden + column] (when
// the norm has a weight or a bias; part_g null: no partials, a column kernel sums them). ME:
// memory_efficient, `saved` is the output and xhat is recomputed as (y - beta) / gamma. Up to
// kBackwardElements elements per thread the sums are in registers; above (rows of one row
// per block), in the launch's dynamic shared memory (write_shared_sums), whose size the host
// checks against the device: shared_sums_floats for the weight, as many for the bias, then,
// ME, as many for the bias itself. BIAS: as for norm_forward_resident; the kernels without a
// bias (`beta` null: no sums of dy kept, part_b not written) are for the register sums only.
template <typename TIn, typename TP, typename TOut, typename TS, int VEC, int CHUNKS, bool ME,
          bool BIAS>
__global__ void __launch_bounds__(kMaxThreads, 1)
    norm_backward_resident(const TOut* __restrict__ dy, const TS* __restrict__ saved,
                           const float* __restrict__ mean, const float* __restrict__ invvar,
                           const TP* __restrict__ gamma, const TP* __restrict__ beta,
                           TIn* __restrict__ dx, float* __restrict__ part_g,
                           float* __restrict__ part_b, int64_t rows, int64_t hidden, bool rms) {
  const int chunks = static_cast<int>(hidden / VEC);  // hidden <= kMaxHidden
  const int tpr = static_cast<int>(blockDim.x);
  // The parameter-gradient sums stay in registers up to kBackwardElements elements per thread;
  // above (kSharedSums), in dynamic shared memory, and so does the bias of the
  // memory-efficient backward (its registers, beside the row's, would spill).
  constexpr bool kPartials = CHUNKS * VEC <= kBackwardElements;
  constexpr bool kSharedSums = !kPartials;
  constexpr int kAcc = kPartials ? CHUNKS : 1;
  static_assert(BIAS || kPartials, "the shared sums are compiled for a bias only");
  // In the dynamic shared memory (kSharedSums), shared_sums_floats each: the weight's sums at
  // float sums_g, the bias's at sums_b (-1 where the norm has no such parameter or no partials
  // are asked for), then, ME, the bias as float32 at bias_at (-1 without a bias), each
  // element at its sum's index. Each thread writes and reads its own columns only.
  extern __shared__ float norm_sums[];
  int sums_g = -1, sums_b = -1, bias_at = -1;
  if constexpr (kSharedSums) {
    int next = 0;
    if (part_g != nullptr) {
      if (gamma != nullptr) {
        sums_g = next;
        next += shared_sums_floats<VEC, CHUNKS>();
      }
      if (beta != nullptr) {
        sums_b = next;
        next += shared_sums_floats<VEC, CHUNKS>();
      }
    }
    if (ME && beta != nullptr) bias_at = next;
    const float zero[VEC] = {};
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = k * tpr + static_cast<int>(threadIdx.x);
      if (c >= chunks) continue;
      if (sums_g >= 0) write_shared_sums<VEC, CHUNKS>(norm_sums + sums_g, c, zero);
      if (sums_b >= 0) write_shared_sums<VEC, CHUNKS>(norm_sums + sums_b, c, zero);
      if (bias_at >= 0) {
        float v[VEC];
        load<VEC>(beta, c, v);
        write_shared_sums<VEC, CHUNKS>(norm_sums + bias_at, c, v);
      }
    }
  }
  // The bias in registers: the memory-efficient backward of rows up to kBackwardElements.
  constexpr bool kBiasRegisters = ME && BIAS && !kSharedSums;
  Pack<TP, VEC> g[CHUNKS], b[kBiasRegisters ? CHUNKS : 1];
  if (gamma != nullptr) load_block_params<TP, VEC, CHUNKS>(gamma, chunks, g);
  if constexpr (kBiasRegisters) {
    if (beta != nullptr) load_block_params<TP, VEC, CHUNKS>(beta, chunks, b);
  }
  // The bias's element i of chunk k (column chunk c), where the memory-efficient xhat needs it.
  auto bias_element = [&](int k, int c, int i) -> float {
    if constexpr (!ME || !BIAS) {
      return 0.f;
    } else if constexpr (kSharedSums) {
      return bias_at >= 0 ? norm_sums[bias_at + shared_sum_index<CHUNKS>(i, c)] : 0.f;
    } else {
      return beta != nullptr ? element(b[k], i) : 0.f;
    }
  };
  float acc_g[kAcc][VEC], acc_b[BIAS ? kAcc : 1][BIAS ? VEC : 1];
#pragma unroll
  for (int k = 0; k < kAcc; ++k) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      acc_g[k][i] = 0.f;
      if constexpr (BIAS) acc_b[k][i] = 0.f;
    }
  }
  const float inv_n = 1.f / static_cast<float>(hidden);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y; first < rows;
       first += step) {
    const int64_t row = first + threadIdx.y;
    const bool valid = row < rows;
    // The row's statistics, loaded by one lane per warp (a warp never spans two rows).
    float mu = 0.f, iv = 0.f;
    if (valid && threadIdx.x % 32 == 0) {
      iv = invvar[row];
      if (!rms && !ME) mu = mean[row];
    }
    mu = __shfl_sync(0xffffffffu, mu, 0);
    iv = __shfl_sync(0xffffffffu, iv, 0);
    const TOut* dyr = dy + row * hidden;
    const TS* sr = saved + row * hidden;
    Pack<TOut, VEC> d[CHUNKS];
    Pack<TS, VEC> s[CHUNKS];
    // The memory-efficient wide rows keep xhat for the second pass instead of dividing again
    // (the division's slow-path calls beside 32 elements per thread spill): the same values.
    constexpr bool kKeepXhat = ME && kSharedSums;
    float kept[kKeepXhat ? CHUNKS : 1][kKeepXhat ? VEC : 1];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = k * tpr + static_cast<int>(threadIdx.x);
      if (valid && c < chunks) {
        d[k] = reinterpret_cast<const Pack<TOut, VEC>*>(dyr)[c];
        s[k] = reinterpret_cast<const Pack<TS, VEC>*>(sr)[c];
        // With shared sums, each element's terms are added to its column's sums in place, one
        // float at a time (a register or two more than the chunk's).
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float dk = element(d[k], i);
          float xh, gk;
          resident_terms<ME>(dk, s[k], g[k], bias_element(k, c, i), i, mu, iv,
                             gamma != nullptr, BIAS && beta != nullptr, xh, gk);
          sum_g += gk;
          sum_gx += gk * xh;
          if constexpr (kKeepXhat) kept[k][i] = xh;
          if constexpr (kPartials) {
            acc_g[k][i] += dk * xh;
            if constexpr (BIAS) acc_b[k][i] += dk;
          }
          if constexpr (kSharedSums) {
            const int at = shared_sum_index<CHUNKS>(i, c);
            if (sums_g >= 0) norm_sums[sums_g + at] += dk * xh;
            if (sums_b >= 0) norm_sums[sums_b + at] += dk;
          }
        }
      }
    }
    row_sum(sum_g, sum_gx);
    if (!valid) continue;  // after the last block-wide sum of this row group
    const float mean_g = rms ? 0.f : sum_g * inv_n;
    const float proj = sum_gx * inv_n;
    TIn* dxr = dx + row * hidden;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = k * tpr + static_cast<int>(threadIdx.x);
      if (c < chunks) {
        Pack<TIn, VEC> out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float xh, gk;
          if constexpr (kKeepXhat) {
            xh = kept[k][i];
            gk = gamma != nullptr ? __fmul_rn(element(d[k], i), element(g[k], i))
                                  : element(d[k], i);
          } else {
            resident_terms<ME>(element(d[k], i), s[k], g[k], bias_element(k, c, i), i, mu, iv,
                               gamma != nullptr, BIAS && beta != nullptr, xh, gk);
          }
          out.v[i] = static_cast<TIn>((gk - mean_g - xh * proj) * iv);
        }
        reinterpret_cast<Pack<TIn, VEC>*>(dxr)[c] = out;
      }
    }
  }
  if constexpr (kSharedSums) {
    // Each thread writes its own columns' sums (no other thread touched them).
    if (part_g == nullptr) return;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
      const int c = k * tpr + static_cast<int>(threadIdx.x);
      if (c >= chunks) continue;
      float v[VEC];
      if (sums_g >= 0) {
        read_shared_sums<VEC, CHUNKS>(norm_sums + sums_g, c, v);
        store<VEC>(part_g + static_cast<int64_t>(blockIdx.x) * hidden, c, v);
      }
      if (sums_b >= 0) {
        read_shared_sums<VEC, CHUNKS>(norm_sums + sums_b, c, v);
        store<VEC>(part_b + static_cast<int64_t>(blockIdx.x) * hidden, c, v);
      }
    }
  } else if constexpr (kPartials) {
    if (part_g == nullptr) return;
    block_partials<VEC, kAcc, BIAS>(acc_g, acc_b, chunks, part_g, part_b, hidden);
  }
}

// --- host side -----------------------------------------------------------------------------

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Threads per row: a power of two in [32, 512] giving each thread about 4 chunks.
int threads_for(int64_t chunks) {
  int threads = 32;
  while (threads < kMaxThreads && threads * 4 < chunks) threads *= 2;
  return threads;
}

// Which kernels run the norms: AMP_FUSED_OPS_NORM_KERNELS=resident (the default), per_row
// (the earlier kernels), resident_column (the resident kernels, with the parameter gradients
// of rows over kBackwardElements per thread left to the column kernel, as on a device without
// the shared memory for them), or resident_generic (the resident kernels compiled for a bias
// run the norms without one too, their bias skipped at run time, as before the kernels without
// a bias existed): for comparing them on a GPU. Read at every call.
enum class NormKernels { kResident, kResidentColumn, kResidentGeneric, kPerRow };

NormKernels norm_kernels() {
  const char* value = std::getenv("AMP_FUSED_OPS_NORM_KERNELS");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "resident") == 0) {
    return NormKernels::kResident;
  }
  if (std::strcmp(value, "resident_column") == 0) return NormKernels::kResidentColumn;
  if (std::strcmp(value, "resident_generic") == 0) return NormKernels::kResidentGeneric;
  TORCH_CHECK(std::strcmp(value, "per_row") == 0, "AMP_FUSED_OPS_NORM_KERNELS=", value,
              " is not one of 'resident', 'per_row', 'resident_column', 'resident_generic'");
  return NormKernels::kPerRow;
}

// The block of the resident kernels: tpr threads per row, rpb rows at a time, each thread
// holding `chunks` chunks (a template parameter) of its row.
struct ResidentShape {
  int tpr;
  int rpb;
  int chunks;
};

// The shape for rows of n_chunks vectors of VEC elements, or nullopt when a thread would hold
// more than max_elements elements of a row (the registers they take; see kMaxElements).
std::optional<ResidentShape> resident_shape(int64_t n_chunks, int vec, int target_chunks,
                                            int max_elements) {
  int tpr = 32;
  while (tpr < kMaxThreads && tpr * target_chunks < n_chunks) tpr *= 2;
  const int64_t per_thread = (n_chunks + tpr - 1) / tpr;
  int chunks = 1;
  while (chunks < per_thread) chunks *= 2;
  if (chunks * vec > max_elements) return std::nullopt;
  return ResidentShape{tpr, std::max(1, kResidentBlock / tpr), chunks};
}

// Blocks of the resident kernels: one per row group, at most threads_per_sm threads' worth
// per SM (the blocks walk the remaining rows), and no more than fit in an SM's shared memory
// with `shared_bytes` of dynamic shared memory each.
unsigned resident_grid(int64_t rows, const ResidentShape& shape, int threads_per_sm,
                       size_t shared_bytes = 0) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t sms = props->multiProcessorCount;
  int64_t per_sm = std::max(1, threads_per_sm / (shape.tpr * shape.rpb));
  if (shared_bytes > 0) {
    // Each block also takes its static shared memory and the 1 KiB the runtime reserves.
    const size_t per_block = shared_bytes + kStaticSharedBound + 1024;
    per_sm = std::min<int64_t>(per_sm, std::max<size_t>(1, props->sharedMemPerMultiprocessor / per_block));
  }
  const int64_t groups = (rows + shape.rpb - 1) / shape.rpb;
  return static_cast<unsigned>(std::min(groups, per_sm * sms));
}

// Calls f(std::integral_constant<int, chunks>) for chunks in {1, 2, 4, 8}.
template <typename F>
void with_chunks(int chunks, F&& f) {
  switch (chunks) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    default:
      TORCH_INTERNAL_ASSERT(chunks == 8, "chunks per thread ", chunks);
      return f(std::integral_constant<int, 8>{});
  }
}

// Calls f(std::bool_constant<BIAS>): the resident kernels for a bias where the norm has one (or
// AMP_FUSED_OPS_NORM_KERNELS=resident_generic asks for them), else those without.
template <typename F>
void with_bias(bool has_bias, NormKernels kernels, F&& f) {
  if (has_bias || kernels == NormKernels::kResidentGeneric) return f(std::true_type{});
  return f(std::false_type{});
}

// Elements of a row per thread in the resident kernels at most: the forward keeps x, the
// weight and the bias in registers, the backward dy, the saved tensor and the weight, and up to
// kBackwardElements also two float32 sums per element (and the bias when memory-efficient).
constexpr int kMaxElements = 32;
// Threads per SM that the resident grids provide for: the forward fills an SM; the backward
// writes a partial per block, so it takes fewer, longer-lived blocks.
constexpr int kForwardThreadsPerSM = 2048;
constexpr int kBackwardThreadsPerSM = 1024;

// The dynamic shared memory a block of the resident backward may take on the current device:
// the opt-in most per block, less its static shared memory.
size_t dynamic_shared_most() {
  return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin - kStaticSharedBound;
}

// Lets Kernel launch on `device` with up to `bytes` of dynamic shared memory (over 48 KiB
// needs the kernel's opt-in attribute). Set once per kernel and device, to the device's most
// (the attribute is a limit: a launch still takes only what it asks for).
template <auto Kernel>
void allow_dynamic_shared(int device, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  static std::atomic<uint64_t> done{0};  // one bit per device below 64
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  const size_t most = dynamic_shared_most();
  TORCH_INTERNAL_ASSERT(bytes <= most, "dynamic shared memory ", bytes, " over ", most);
  C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(most)));
  done.fetch_or(bit, std::memory_order_release);
}

template <typename T>
const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// Calls f(Tag<TIn>, Tag<TP>, Tag<TOut>) for the supported dtype combinations: all equal, or
// float parameters with half / bfloat16 input and an output in either.
template <typename F>
void dispatch_types(at::ScalarType in, at::ScalarType p, at::ScalarType out, const char* op,
                    F&& f) {
  using at::kBFloat16;
  using at::kFloat;
  using at::kHalf;
  using H = at::Half;
  using B = at::BFloat16;
  if (in == kFloat && p == kFloat && out == kFloat) return f(Tag<float>{}, Tag<float>{}, Tag<float>{});
  if (in == kHalf && p == kHalf && out == kHalf) return f(Tag<H>{}, Tag<H>{}, Tag<H>{});
  if (in == kBFloat16 && p == kBFloat16 && out == kBFloat16) return f(Tag<B>{}, Tag<B>{}, Tag<B>{});
  if (in == kHalf && p == kFloat && out == kHalf) return f(Tag<H>{}, Tag<float>{}, Tag<H>{});
  if (in == kHalf && p == kFloat && out == kFloat) return f(Tag<H>{}, Tag<float>{}, Tag<float>{});
  if (in == kBFloat16 && p == kFloat && out == kBFloat16) return f(Tag<B>{}, Tag<float>{}, Tag<B>{});
  if (in == kBFloat16 && p == kFloat && out == kFloat) return f(Tag<B>{}, Tag<float>{}, Tag<float>{});
  TORCH_CHECK(false, op, ": unsupported dtypes (input ", in, ", parameters ", p, ", output ", out,
              "); supported: float32/float16/bfloat16 with parameters of the input's dtype, or "
              "float32 parameters with float16/bfloat16 input");
}

void check_params(const at::Tensor& x, const std::optional<at::Tensor>& gamma,
                  const std::optional<at::Tensor>& beta, const char* op) {
  const int64_t hidden = x.size(1);
  for (const auto* t : {&gamma, &beta}) {
    if (!t->has_value()) continue;
    const at::Tensor& p = t->value();
    TORCH_CHECK(p.is_cuda() && p.device() == x.device(), op,
                ": parameters must be on the input's device ", x.device(), ", got ", p.device());
    TORCH_CHECK(p.dim() == 1 && p.size(0) == hidden && p.is_contiguous(), op,
                ": parameters must be contiguous of shape (", hidden, "), got ", p.sizes());
  }
  if (gamma.has_value() && beta.has_value()) {
    TORCH_CHECK(gamma->scalar_type() == beta->scalar_type(), op, ": weight (",
                gamma->scalar_type(), ") and bias (", beta->scalar_type(),
                ") must have the same dtype");
  }
}

void check_rows(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous (rows, hidden) tensor, got sizes ", t.sizes());
  TORCH_CHECK(t.size(1) >= 1 && t.size(1) <= kMaxHidden, op, ": hidden size ", t.size(1),
              " is outside [1, ", kMaxHidden, "]; use torch.nn.functional.layer_norm instead");
  TORCH_CHECK(t.size(0) <= INT32_MAX, op, ": too many rows (", t.size(0), ")");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& gamma,
    const std::optional<at::Tensor>& beta, double eps, bool rms, bool mixed) {
  constexpr const char* op = "norm_forward";
  check_rows(x, "input", op);
  check_params(x, gamma, beta, op);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), hidden = x.size(1);
  const at::ScalarType pdt =
      gamma.has_value() ? gamma->scalar_type() : (beta.has_value() ? beta->scalar_type() : x.scalar_type());
  const at::ScalarType odt = mixed ? pdt : x.scalar_type();
  at::Tensor y = at::empty_like(x, x.options().dtype(odt));
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor invvar = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, mean, invvar};
  dispatch_types(x.scalar_type(), pdt, odt, op, [&](auto tin, auto tp, auto tout) {
    using TIn = typename decltype(tin)::type;
    using TP = typename decltype(tp)::type;
    using TOut = typename decltype(tout)::type;
    constexpr int VEC = 16 / sizeof(TIn);
    const TP* g = ptr_or_null<TP>(gamma);
    const TP* b = rms ? nullptr : ptr_or_null<TP>(beta);
    const bool vec = hidden % VEC == 0 && aligned(x.data_ptr()) && aligned(y.data_ptr()) &&
                     (g == nullptr || aligned(g)) && (b == nullptr || aligned(b));
    const auto stream = at::cuda::getCurrentCUDAStream();
    const NormKernels kernels = norm_kernels();
    const std::optional<ResidentShape> shape =
        vec && kernels != NormKernels::kPerRow ? resident_shape(hidden / VEC, VEC, 4, kMaxElements)
                                  : std::nullopt;
    if (shape.has_value()) {
      const dim3 block(shape->tpr, shape->rpb);
      const unsigned grid = resident_grid(rows, *shape, kForwardThreadsPerSM);
      with_bias(b != nullptr, kernels, [&](auto bias) {
        constexpr bool B = decltype(bias)::value;
        with_chunks(shape->chunks, [&](auto chunks) {
          constexpr int C = decltype(chunks)::value;
          if constexpr (C * VEC <= kMaxElements) {  // resident_shape never asks for more
            norm_forward_resident<TIn, TP, TOut, VEC, C, B><<<grid, block, 0, stream>>>(
                x.data_ptr<TIn>(), g, b, y.data_ptr<TOut>(), mean.data_ptr<float>(),
                invvar.data_ptr<float>(), rows, hidden, static_cast<float>(eps), rms);
          }
        });
      });
    } else if (vec) {
      norm_forward_kernel<TIn, TP, TOut, VEC><<<static_cast<unsigned>(rows), threads_for(hidden / VEC), 0, stream>>>(
          x.data_ptr<TIn>(), g, b, y.data_ptr<TOut>(), mean.data_ptr<float>(),
          invvar.data_ptr<float>(), hidden, static_cast<float>(eps), rms);
    } else {
      norm_forward_kernel<TIn, TP, TOut, 1><<<static_cast<unsigned>(rows), threads_for(hidden), 0, stream>>>(
          x.data_ptr<TIn>(), g, b, y.data_ptr<TOut>(), mean.data_ptr<float>(),
          invvar.data_ptr<float>(), hidden, static_cast<float>(eps), rms);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, mean, invvar};
}

// ME: memory_efficient (TS is then TOut, the saved output's dtype; else TIn), a template
// parameter: the kernels of either are compiled for the dtypes that take them only.
template <typename TIn, typename TP, typename TOut, typename TS, bool ME>
void launch_backward(const at::Tensor& dy, const at::Tensor& saved, const at::Tensor& mean,
                     const at::Tensor& invvar, const std::optional<at::Tensor>& gamma,
                     const std::optional<at::Tensor>& beta, bool rms, at::Tensor& dx,
                     at::Tensor& dgamma, at::Tensor& dbeta) {
  constexpr bool memory_efficient = ME;
  const int64_t rows = dy.size(0), hidden = dy.size(1);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const TP* g = ptr_or_null<TP>(gamma);
  const TP* b = ptr_or_null<TP>(beta);
  constexpr int VEC = 16 / (sizeof(TIn) > sizeof(TOut) ? sizeof(TIn) : sizeof(TOut));
  const bool vec = hidden % VEC == 0 && aligned(dy.data_ptr()) && aligned(saved.data_ptr()) &&
                   aligned(dx.data_ptr()) && (g == nullptr || aligned(g)) &&
                   (b == nullptr || aligned(b));
  const bool params = gamma.has_value() || beta.has_value();
  // Elements per thread the resident backward takes. The memory-efficient backward of float32
  // rows (an output of float32: 4 elements a chunk) stops at kBackwardElements: above, 32
  // float32 elements of the row and of the weight per thread beside the calls of the
  // division's slow path spill; those rows take the per-row kernels.
  constexpr int kElements = ME && VEC < 8 ? kBackwardElements : kMaxElements;
  const NormKernels kernels = norm_kernels();
  std::optional<ResidentShape> shape =
      vec && kernels != NormKernels::kPerRow
          ? resident_shape(hidden / VEC, VEC, std::max(1, kBackwardElements / VEC), kElements)
          : std::nullopt;
  // Rows over kBackwardElements per thread (one row per block: tpr is kMaxThreads) keep their
  // parameter-gradient sums in dynamic shared memory where the device has enough, else leave
  // them to the column kernel; the memory-efficient backward keeps its bias there too, and
  // without room for it takes the per-row kernels. shared_sums_floats each (hidden rounded up
  // to kMaxThreads * chunks * VEC).
  const bool wide = shape.has_value() && shape->chunks * VEC > kBackwardElements;
  const size_t per_array = wide ? static_cast<size_t>(kMaxThreads) * shape->chunks * VEC *
                                      sizeof(float)
                                : 0;
  const size_t sums_bytes = params ? per_array * ((g != nullptr) + (b != nullptr)) : 0;
  const size_t bias_bytes = memory_efficient && b != nullptr ? per_array : 0;
  const size_t shared_most = wide ? dynamic_shared_most() : 0;
  if constexpr (memory_efficient) {
    if (bias_bytes > shared_most) shape = std::nullopt;
  }
  if (shape.has_value()) {
    const dim3 block(shape->tpr, shape->rpb);
    const bool partials =
        params && (!wide || (sums_bytes + bias_bytes <= shared_most &&
                             kernels != NormKernels::kResidentColumn));
    const size_t shared_bytes = (partials ? sums_bytes : 0) + bias_bytes;
    TORCH_INTERNAL_ASSERT(shared_bytes == 0 || (shape->rpb == 1 && shape->tpr == kMaxThreads),
                          "shared sums with rows of ", shape->tpr, " threads, ", shape->rpb,
                          " per block");
    const unsigned grid = resident_grid(rows, *shape, kBackwardThreadsPerSM, shared_bytes);
    // The partials of the weight, then, where the kernel writes them, of the bias: grid x
    // hidden each (the register sums of the kernels for a bias, which resident_generic also
    // runs without one, are written either way; wide rows write the shared sums of a bias only).
    const bool bias_partials =
        b != nullptr || (kernels == NormKernels::kResidentGeneric && !wide);
    at::Tensor part = partials ? at::empty({bias_partials ? 2 : 1, grid, hidden},
                                           dy.options().dtype(at::kFloat))
                               : at::Tensor();
    float* part_g = partials ? part.data_ptr<float>() : nullptr;
    float* part_b = partials && bias_partials ? part_g + static_cast<int64_t>(grid) * hidden
                                              : nullptr;
    with_bias(b != nullptr, kernels, [&](auto bias) {
      constexpr bool kBias = decltype(bias)::value;
      with_chunks(shape->chunks, [&](auto chunks) {
        constexpr int C = decltype(chunks)::value;
        if constexpr (C * VEC > kElements) {  // resident_shape never asks for more
          return;
        } else {
          // Wide rows (over kBackwardElements per thread) always take the kernels for a bias:
          // their sums of dy are in shared memory, kept only where there is a bias, so that
          // dropping them saves no registers (and those without are not compiled).
          constexpr bool B = kBias || C * VEC > kBackwardElements;
          constexpr auto kernel =
              norm_backward_resident<TIn, TP, TOut, TS, VEC, C, ME, B>;
          allow_dynamic_shared<kernel>(dy.get_device(), shared_bytes);
          kernel<<<grid, block, shared_bytes, stream>>>(
              dy.data_ptr<TOut>(), saved.data_ptr<TS>(), mean.data_ptr<float>(),
              invvar.data_ptr<float>(), g, b, dx.data_ptr<TIn>(), part_g, part_b, rows, hidden,
              rms);
        }
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (partials) {
      norm_backward_params_final<TP><<<(hidden + 255) / 256, 256, 0, stream>>>(
          part_g, part_b, dgamma.numel() ? dgamma.data_ptr<TP>() : nullptr,
          dbeta.numel() ? dbeta.data_ptr<TP>() : nullptr, grid, hidden);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  } else if (vec) {
    norm_backward_input_kernel<TIn, TP, TOut, TS, VEC><<<static_cast<unsigned>(rows), threads_for(hidden / VEC), 0, stream>>>(
        dy.data_ptr<TOut>(), saved.data_ptr<TS>(), mean.data_ptr<float>(),
        invvar.data_ptr<float>(), g, b, dx.data_ptr<TIn>(), hidden, rms, memory_efficient);
  } else {
    norm_backward_input_kernel<TIn, TP, TOut, TS, 1><<<static_cast<unsigned>(rows), threads_for(hidden), 0, stream>>>(
        dy.data_ptr<TOut>(), saved.data_ptr<TS>(), mean.data_ptr<float>(),
        invvar.data_ptr<float>(), g, b, dx.data_ptr<TIn>(), hidden, rms, memory_efficient);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!params) return;
  // Enough row slices to fill the device about four times, each at least kRowLanes rows.
  const int64_t col_blocks = (hidden + kColumns - 1) / kColumns;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t slices = std::max<int64_t>(1, (4 * sms + col_blocks - 1) / col_blocks);
  slices = std::min<int64_t>({slices, (rows + kRowLanes - 1) / kRowLanes, 1024});
  at::Tensor part = at::empty({2, slices, hidden}, dy.options().dtype(at::kFloat));
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(slices));
  norm_backward_params_partial<TP, TOut, TS><<<grid, dim3(kColumns, kRowLanes), 0, stream>>>(
      dy.data_ptr<TOut>(), saved.data_ptr<TS>(), mean.data_ptr<float>(),
      invvar.data_ptr<float>(), g, b, part[0].data_ptr<float>(), part[1].data_ptr<float>(), rows,
      hidden, rms, memory_efficient);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  norm_backward_params_final<TP><<<(hidden + 255) / 256, 256, 0, stream>>>(
      part[0].data_ptr<float>(), part[1].data_ptr<float>(),
      dgamma.numel() ? dgamma.data_ptr<TP>() : nullptr,
      dbeta.numel() ? dbeta.data_ptr<TP>() : nullptr, slices, hidden);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& dy, const at::Tensor& saved, const at::Tensor& mean,
    const at::Tensor& invvar, const std::optional<at::Tensor>& gamma,
    const std::optional<at::Tensor>& beta, bool rms, bool memory_efficient,
    at::ScalarType input_dtype) {
  constexpr const char* op = "norm_backward";
  check_rows(dy, "grad_output", op);
  check_rows(saved, "saved tensor", op);
  TORCH_CHECK(saved.sizes() == dy.sizes() && saved.device() == dy.device(), op,
              ": saved tensor ", saved.sizes(), " and grad_output ", dy.sizes(),
              " must have the same shape and device");
  check_params(dy, gamma, beta, op);
  const int64_t rows = dy.size(0), hidden = dy.size(1);
  for (const at::Tensor* s : {&mean, &invvar}) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->numel() == rows && s->is_contiguous() &&
                    s->device() == dy.device(),
                op, ": mean and invvar must be contiguous float32 (", rows, ",) tensors on ",
                dy.device(), ", got ", s->scalar_type(), " ", s->sizes());
  }
  const c10::cuda::CUDAGuard guard(dy.device());
  // With rms, beta is ignored entirely (no shift, no gradient).
  const std::optional<at::Tensor> shift = rms ? std::nullopt : beta;
  const at::ScalarType pdt =
      gamma.has_value() ? gamma->scalar_type() : (shift.has_value() ? shift->scalar_type() : input_dtype);
  const at::ScalarType odt = dy.scalar_type();
  const at::ScalarType expected_saved = memory_efficient ? odt : input_dtype;
  TORCH_CHECK(saved.scalar_type() == expected_saved, op, ": saved tensor has dtype ",
              saved.scalar_type(), " but ", expected_saved, " was expected (",
              memory_efficient ? "the output's" : "the input's", " dtype)");
  at::Tensor dx = at::empty_like(dy, dy.options().dtype(input_dtype));
  at::Tensor dgamma = gamma.has_value() ? at::empty_like(*gamma) : dy.new_empty({0});
  at::Tensor dbeta = shift.has_value() ? at::empty_like(*shift) : dy.new_empty({0});
  if (rows == 0) {
    dgamma.zero_();
    dbeta.zero_();
    return {dx, dgamma, dbeta};
  }
  dispatch_types(input_dtype, pdt, odt, op, [&](auto tin, auto tp, auto tout) {
    using TIn = typename decltype(tin)::type;
    using TP = typename decltype(tp)::type;
    using TOut = typename decltype(tout)::type;
    if (memory_efficient) {
      launch_backward<TIn, TP, TOut, TOut, true>(dy, saved, mean, invvar, gamma, shift, rms, dx,
                                                 dgamma, dbeta);
    } else {
      launch_backward<TIn, TP, TOut, TIn, false>(dy, saved, mean, invvar, gamma, shift, rms, dx,
                                                 dgamma, dbeta);
    }
  });
  return {dx, dgamma, dbeta};
}

// --- the dispatcher ops ----------------------------------------------------------------------

bool kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Whether the kernels take these rows and parameters (else: the ATen reference). Parameters on
// another device are an error in either path.
bool kernels_take(const at::Tensor& rows, at::ScalarType input_dtype,
                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& shift,
                  const char* op) {
  for (const auto* t : {&weight, &shift}) {
    TORCH_CHECK(!t->has_value() || (*t)->device() == rows.device(), op,
                ": parameters must be on the input's device ", rows.device(), ", got ",
                (*t)->device());
  }
  if (rows.dim() != 2 || rows.size(1) < 1 || rows.size(1) > kMaxHidden ||
      rows.size(0) > INT32_MAX || !kernel_dtype(input_dtype)) {
    return false;
  }
  if (weight.has_value() && shift.has_value() && weight->scalar_type() != shift->scalar_type()) {
    return false;
  }
  const auto& present = weight.has_value() ? weight : shift;
  if (!present.has_value()) return true;
  const at::ScalarType p = present->scalar_type();
  return p == input_dtype || (p == at::kFloat && input_dtype != at::kFloat);
}

std::optional<at::Tensor> dense(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool rms, bool mixed,
    bool /*memory_efficient: what autograd saves, decided by the autograd kernel*/) {
  amp_fused_ops::norm_reference::check_floating(x, "input");
  if (weight.has_value()) amp_fused_ops::norm_reference::check_floating(*weight, "weight");
  if (bias.has_value()) amp_fused_ops::norm_reference::check_floating(*bias, "bias");
  amp_fused_ops::norm_reference::check_mixed(weight, mixed);
  const std::optional<at::Tensor> shift = rms ? std::nullopt : bias;
  if (!kernels_take(x, x.scalar_type(), weight, shift, "norm_forward")) {
    return amp_fused_ops::norm_reference::forward(x, weight, bias, eps, rms, mixed);
  }
  return layer_norm_fwd(x.contiguous(), dense(weight), dense(shift), eps, rms, mixed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& mean,
    const at::Tensor& invvar, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool rms, bool memory_efficient,
    at::ScalarType input_dtype) {
  const std::optional<at::Tensor> shift = rms ? std::nullopt : bias;
  if (!kernels_take(grad_out, input_dtype, weight, shift, "norm_backward")) {
    return amp_fused_ops::norm_reference::backward(grad_out, saved, mean, invvar, weight, bias,
                                                   rms, memory_efficient, input_dtype);
  }
  return layer_norm_bwd(grad_out.contiguous(), saved.contiguous(), mean.contiguous(),
                        invvar.contiguous(), dense(weight), dense(shift), rms, memory_efficient,
                        input_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, CUDA, m) {
  m.impl("norm_forward", TORCH_FN(norm_forward));
  m.impl("norm_backward", TORCH_FN(norm_backward));
}
