// Synchronized batch-norm kernels (Apex's syncbn extension), without the collectives.
//
// The CUDA kernels of the dispatcher ops torch.ops.amp_fused_ops.syncbn_* (schemas and fake
// kernels in src/amp_fused_ops/ops/_kernel_ops.py, the PyTorch reference of every op in
// src/amp_fused_ops/reference/_syncbn.py, the Python functions in
// src/amp_fused_ops/syncbn/_kernels.py):
//   syncbn_welford_mean_var(x, channel_last) -> (mean, var_biased)
//   syncbn_welford_parallel(means, vars, counts, eps) -> (mean, var_biased, invstd)
//   syncbn_forward(x, mean, invstd, weight?, bias?, z?, fuse_relu, channel_last) -> y
//   syncbn_reduce(dy, x, mean, channel_last) -> (sum_dy, sum_dy_xmu)
//   syncbn_backward(dy, x, mean, invstd, weight?, sum_dy, sum_dy_xmu, count, channel_last) -> dx
// The kernels read x contiguous: channels-first (N, C, *) as (N, C, S), channels-last (*, C) as
// (R, C). x / dy / z / y are float32, float16 or bfloat16; statistics and sums are float32
// (the registered functions at the end make the arguments so). A float64 x (or dy) runs the
// fp32 ATen reference of ../common/syncbn_reference.h instead, as the ops do off CUDA.
//
// The per-channel reductions run in two steps: blocks reduce slices of the batch into
// (slices, C) partials (Welford states for the statistics, plain sums for the backward), and
// a second kernel merges the slices per channel. Channels-first blocks own one channel and
// one slice; channels-last blocks own 32 adjacent channels (coalesced rows) and one slice.
#include "../common/aten_headers.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "../common/ops_schema.h"
#include "../common/syncbn_reference.h"
#include "welford.cuh"

namespace {

using amp_fused_ops::cuda::warp_welford;
using amp_fused_ops::cuda::welford_add;
using amp_fused_ops::cuda::welford_merge;

constexpr int kThreads = 256;   // channels-first reduction block
constexpr int kColumns = 32;    // channels-last: channels per block
constexpr int kRowLanes = 8;    // channels-last: threads along rows
constexpr int64_t kMaxSlices = 1024;

// Reduction of (a, b, c) over the whole block into thread 0: Welford states when WELFORD
// (a = count, b = mean, c = m2), else sums of a and b (c unused).
template <bool WELFORD>
__device__ void block_reduce(float& a, float& b, float& c) {
  __shared__ float shared[3][kThreads / 32];
  if (WELFORD) {
    warp_welford(a, b, c);
  } else {
    for (int offset = 16; offset > 0; offset /= 2) {
      a += __shfl_xor_sync(0xffffffffu, a, offset);
      b += __shfl_xor_sync(0xffffffffu, b, offset);
    }
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    shared[0][warp] = a;
    shared[1][warp] = b;
    shared[2][warp] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a = shared[0][0];
    b = shared[1][0];
    c = shared[2][0];
    for (int w = 1; w < kThreads / 32; ++w) {
      if (WELFORD) {
        welford_merge(a, b, c, shared[0][w], shared[1][w], shared[2][w]);
      } else {
        a += shared[0][w];
        b += shared[1][w];
      }
    }
  }
}

// Channels-first partials. grid (C, slices), block kThreads. WELFORD: (count, mean, m2) of x;
// else (sum dy, sum dy * (x - mean)).
template <typename T, bool WELFORD>
__global__ void partial_channels_first(const T* __restrict__ x, const T* __restrict__ dy,
                                       const float* __restrict__ mean, float* __restrict__ pa,
                                       float* __restrict__ pb, float* __restrict__ pc, int64_t n,
                                       int64_t channels, int64_t spatial) {
  const int64_t c = blockIdx.x;
  const int64_t total = n * spatial;
  const int64_t per_slice = (total + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * per_slice;
  const int64_t end = begin + per_slice < total ? begin + per_slice : total;
  const float mu = WELFORD ? 0.f : mean[c];
  float a = 0.f, b = 0.f, cc = 0.f;
  for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
    const int64_t i = (e / spatial) * channels * spatial + c * spatial + e % spatial;
    const float v = static_cast<float>(x[i]);
    if (WELFORD) {
      welford_add(a, b, cc, v);
    } else {
      const float d = static_cast<float>(dy[i]);
      a += d;
      b += d * (v - mu);
    }
  }
  block_reduce<WELFORD>(a, b, cc);
  if (threadIdx.x == 0) {
    const int64_t out = blockIdx.y * channels + c;
    pa[out] = a;
    pb[out] = b;
    if (WELFORD) pc[out] = cc;
  }
}

// Channels-last partials. grid (ceil(C / kColumns), slices), block (kColumns, kRowLanes).
template <typename T, bool WELFORD>
__global__ void partial_channels_last(const T* __restrict__ x, const T* __restrict__ dy,
                                      const float* __restrict__ mean, float* __restrict__ pa,
                                      float* __restrict__ pb, float* __restrict__ pc,
                                      int64_t rows, int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  const int64_t per_slice = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * per_slice;
  const int64_t end = begin + per_slice < rows ? begin + per_slice : rows;
  float a = 0.f, b = 0.f, cc = 0.f;
  if (c < channels) {
    const float mu = WELFORD ? 0.f : mean[c];
    for (int64_t r = begin + threadIdx.y; r < end; r += kRowLanes) {
      const float v = static_cast<float>(x[r * channels + c]);
      if (WELFORD) {
        welford_add(a, b, cc, v);
      } else {
        const float d = static_cast<float>(dy[r * channels + c]);
        a += d;
        b += d * (v - mu);
      }
    }
  }
  __shared__ float sa[kRowLanes][kColumns + 1];
  __shared__ float sb[kRowLanes][kColumns + 1];
  __shared__ float sc[kRowLanes][kColumns + 1];
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  sc[threadIdx.y][threadIdx.x] = cc;
  __syncthreads();
  if (threadIdx.y != 0 || c >= channels) return;
  for (int i = 1; i < kRowLanes; ++i) {
    if (WELFORD) {
      welford_merge(a, b, cc, sa[i][threadIdx.x], sb[i][threadIdx.x], sc[i][threadIdx.x]);
    } else {
      a += sa[i][threadIdx.x];
      b += sb[i][threadIdx.x];
    }
  }
  const int64_t out = blockIdx.y * channels + c;
  pa[out] = a;
  pb[out] = b;
  if (WELFORD) pc[out] = cc;
}

// Merge (slices, C) partials per channel. WELFORD: (count, mean, m2) -> (mean, var_biased);
// else sums -> (sum a, sum b).
template <bool WELFORD>
__global__ void merge_partials(const float* __restrict__ pa, const float* __restrict__ pb,
                               const float* __restrict__ pc, float* __restrict__ out_a,
                               float* __restrict__ out_b, int64_t slices, int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float a = 0.f, b = 0.f, cc = 0.f;
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t i = s * channels + c;
    if (WELFORD) {
      welford_merge(a, b, cc, pa[i], pb[i], pc[i]);
    } else {
      a += pa[i];
      b += pb[i];
    }
  }
  if (WELFORD) {
    out_a[c] = b;                     // mean
    out_b[c] = a > 0.f ? cc / a : 0.f;  // biased variance
  } else {
    out_a[c] = a;
    out_b[c] = b;
  }
}

// Chan's merge of per-rank (mean, var_biased) with per-rank counts (world,), per channel.
__global__ void welford_parallel_kernel(const float* __restrict__ means,
                                        const float* __restrict__ vars,
                                        const float* __restrict__ counts, float* __restrict__ mean,
                                        float* __restrict__ var, float* __restrict__ invstd,
                                        int64_t world, int64_t channels, float eps) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float n = 0.f, mu = 0.f, m2 = 0.f;
  for (int64_t w = 0; w < world; ++w) {
    const float nw = counts[w];
    welford_merge(n, mu, m2, nw, means[w * channels + c], vars[w * channels + c] * nw);
  }
  const float v = n > 0.f ? m2 / n : 0.f;
  mean[c] = mu;
  var[c] = v;
  invstd[c] = rsqrtf(v + eps);
}

__device__ __forceinline__ int64_t channel_of(int64_t i, int64_t channels, int64_t spatial,
                                              bool channel_last) {
  return channel_last ? i % channels : (i / spatial) % channels;
}

template <typename T>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ z,
                               const float* __restrict__ mean, const float* __restrict__ invstd,
                               const float* __restrict__ weight, const float* __restrict__ bias,
                               T* __restrict__ y, int64_t numel, int64_t channels,
                               int64_t spatial, bool channel_last, bool fuse_relu) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const int64_t c = channel_of(i, channels, spatial, channel_last);
    float v = (static_cast<float>(x[i]) - mean[c]) * invstd[c];
    if (weight != nullptr) v *= weight[c];
    if (bias != nullptr) v += bias[c];
    if (z != nullptr) v += static_cast<float>(z[i]);
    if (fuse_relu) v = v > 0.f ? v : 0.f;
    y[i] = static_cast<T>(v);
  }
}

template <typename T>
__global__ void backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                const float* __restrict__ mean, const float* __restrict__ invstd,
                                const float* __restrict__ weight,
                                const float* __restrict__ sum_dy,
                                const float* __restrict__ sum_dy_xmu, T* __restrict__ dx,
                                int64_t numel, int64_t channels, int64_t spatial,
                                bool channel_last, float inv_count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const int64_t c = channel_of(i, channels, spatial, channel_last);
    const float inv = invstd[c];
    const float scale = weight != nullptr ? inv * weight[c] : inv;
    const float x_mu = static_cast<float>(x[i]) - mean[c];
    const float g = static_cast<float>(dy[i]) - sum_dy[c] * inv_count -
                    x_mu * inv * inv * sum_dy_xmu[c] * inv_count;
    dx[i] = static_cast<T>(g * scale);
  }
}

// --- host side -----------------------------------------------------------------------------

struct Layout {
  int64_t n;         // channels-first: batch; channels-last: rows
  int64_t channels;
  int64_t spatial;   // channels-first: product of the trailing dims; channels-last: 1
};

Layout layout_of(const at::Tensor& x, bool channel_last, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, ": input must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 2, op, ": input needs a batch and a channel dimension, got sizes ",
              x.sizes());
  TORCH_CHECK(x.is_contiguous(), op, ": input must be contiguous (channels-last inputs as a "
              "contiguous (..., C) tensor)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              op, ": input must be float32, float16 or bfloat16, got ", x.scalar_type());
  if (channel_last) {
    const int64_t channels = x.size(-1);
    return {channels ? x.numel() / channels : 0, channels, 1};
  }
  const int64_t n = x.size(0), channels = x.size(1);
  return {n, channels, n * channels ? x.numel() / (n * channels) : 0};
}

void check_vector(const at::Tensor& v, const at::Tensor& x, int64_t channels, const char* name,
                  const char* op) {
  TORCH_CHECK(v.device() == x.device() && v.dim() == 1 && v.size(0) == channels &&
                  v.is_contiguous(),
              op, ": ", name, " must be a contiguous (", channels, ",) tensor on ", x.device(),
              ", got ", v.sizes(), " on ", v.device());
}

void check_stat(const at::Tensor& v, const at::Tensor& x, int64_t channels, const char* name,
                const char* op) {
  check_vector(v, x, channels, name, op);
  TORCH_CHECK(v.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
              v.scalar_type());
}

void check_like(const at::Tensor& t, const at::Tensor& x, const char* name, const char* op) {
  TORCH_CHECK(t.device() == x.device() && t.sizes() == x.sizes() &&
                  t.scalar_type() == x.scalar_type() && t.is_contiguous(),
              op, ": ", name, " must be a contiguous tensor like the input (", x.sizes(), " ",
              x.scalar_type(), "), got ", t.sizes(), " ", t.scalar_type());
}

// A per-channel parameter as a contiguous float32 tensor (C elements: the cast is cheap).
std::optional<at::Tensor> as_float(const std::optional<at::Tensor>& p, const at::Tensor& x,
                                   int64_t channels, const char* name, const char* op) {
  if (!p.has_value()) return std::nullopt;
  TORCH_CHECK(p->device() == x.device() && p->dim() == 1 && p->size(0) == channels, op, ": ",
              name, " must be a (", channels, ",) tensor on ", x.device(), ", got ", p->sizes(),
              " on ", p->device());
  return p->to(at::kFloat).contiguous();
}

const float* ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

#define AMP_SYNCBN_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// Per-channel reduction of x (WELFORD) or of (dy, x - mean): two float32 (C,) results.
template <bool WELFORD>
std::tuple<at::Tensor, at::Tensor> reduce_channels(const at::Tensor& x, const at::Tensor* dy,
                                                   const float* mean, const Layout& l,
                                                   bool channel_last, const char* op) {
  auto opts = x.options().dtype(at::kFloat);
  at::Tensor out_a = at::zeros({l.channels}, opts);
  at::Tensor out_b = at::zeros({l.channels}, opts);
  const int64_t elements = l.n * l.spatial;  // per channel
  if (l.channels == 0 || elements == 0) return {out_a, out_b};
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t col_blocks = channel_last ? (l.channels + kColumns - 1) / kColumns : l.channels;
  const int64_t lanes = channel_last ? kRowLanes : kThreads * 4;
  int64_t slices = (4 * sms + col_blocks - 1) / col_blocks;
  slices = std::min<int64_t>(std::min<int64_t>(slices, (elements + lanes - 1) / lanes), kMaxSlices);
  slices = std::max<int64_t>(slices, 1);
  at::Tensor part = at::empty({3, slices, l.channels}, opts);
  float* pa = part[0].data_ptr<float>();
  float* pb = part[1].data_ptr<float>();
  float* pc = part[2].data_ptr<float>();
  AMP_SYNCBN_DISPATCH(x.scalar_type(), "syncbn_reduce_channels", [&] {
    const scalar_t* dyp = dy != nullptr ? dy->data_ptr<scalar_t>() : nullptr;
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(slices));
    if (channel_last) {
      partial_channels_last<scalar_t, WELFORD><<<grid, dim3(kColumns, kRowLanes), 0, stream>>>(
          x.data_ptr<scalar_t>(), dyp, mean, pa, pb, pc, l.n, l.channels);
    } else {
      partial_channels_first<scalar_t, WELFORD><<<grid, kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), dyp, mean, pa, pb, pc, l.n, l.channels, l.spatial);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  merge_partials<WELFORD><<<(l.channels + 255) / 256, 256, 0, stream>>>(
      pa, pb, pc, out_a.data_ptr<float>(), out_b.data_ptr<float>(), slices, l.channels);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out_a, out_b};
}

unsigned elementwise_blocks(int64_t numel) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (numel + 255) / 256;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 32)));
}

std::tuple<at::Tensor, at::Tensor> syncbn_welford_mean_var(const at::Tensor& x,
                                                           bool channel_last) {
  constexpr const char* op = "syncbn_welford_mean_var";
  const Layout l = layout_of(x, channel_last, op);
  const c10::cuda::CUDAGuard guard(x.device());
  return reduce_channels<true>(x, nullptr, nullptr, l, channel_last, op);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> syncbn_welford_parallel(
    const at::Tensor& means, const at::Tensor& vars, const at::Tensor& counts, double eps) {
  constexpr const char* op = "syncbn_welford_parallel";
  TORCH_CHECK(means.is_cuda() && means.dim() == 2 && means.is_contiguous() &&
                  means.scalar_type() == at::kFloat,
              op, ": means must be a contiguous float32 CUDA tensor (world, C), got ",
              means.sizes(), " ", means.scalar_type(), " on ", means.device());
  TORCH_CHECK(vars.sizes() == means.sizes() && vars.device() == means.device() &&
                  vars.is_contiguous() && vars.scalar_type() == at::kFloat,
              op, ": vars must be a contiguous float32 tensor like means ", means.sizes());
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == means.size(0) &&
                  counts.device() == means.device() && counts.scalar_type() == at::kFloat &&
                  counts.is_contiguous(),
              op, ": counts must be a contiguous float32 (", means.size(0), ",) tensor, got ",
              counts.sizes(), " ", counts.scalar_type());
  const c10::cuda::CUDAGuard guard(means.device());
  const int64_t world = means.size(0), channels = means.size(1);
  auto opts = means.options();
  at::Tensor mean = at::empty({channels}, opts), var = at::empty({channels}, opts),
             invstd = at::empty({channels}, opts);
  if (channels == 0) return {mean, var, invstd};
  welford_parallel_kernel<<<(channels + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      means.data_ptr<float>(), vars.data_ptr<float>(), counts.data_ptr<float>(),
      mean.data_ptr<float>(), var.data_ptr<float>(), invstd.data_ptr<float>(), world, channels,
      static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {mean, var, invstd};
}

at::Tensor syncbn_forward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                          const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& z, bool fuse_relu,
                          bool channel_last) {
  constexpr const char* op = "syncbn_forward";
  const Layout l = layout_of(x, channel_last, op);
  check_stat(mean, x, l.channels, "mean", op);
  check_stat(invstd, x, l.channels, "invstd", op);
  if (z.has_value()) check_like(*z, x, "z", op);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto w = as_float(weight, x, l.channels, "weight", op);
  const auto b = as_float(bias, x, l.channels, "bias", op);
  at::Tensor y = at::empty_like(x);
  const int64_t numel = x.numel();
  if (numel == 0) return y;
  AMP_SYNCBN_DISPATCH(x.scalar_type(), op, [&] {
    forward_kernel<scalar_t><<<elementwise_blocks(numel), 256, 0,
                               at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), z.has_value() ? z->data_ptr<scalar_t>() : nullptr,
        mean.data_ptr<float>(), invstd.data_ptr<float>(), ptr(w), ptr(b),
        y.data_ptr<scalar_t>(), numel, l.channels, l.spatial, channel_last, fuse_relu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> syncbn_reduce(const at::Tensor& dy, const at::Tensor& x,
                                                 const at::Tensor& mean, bool channel_last) {
  constexpr const char* op = "syncbn_reduce";
  const Layout l = layout_of(x, channel_last, op);
  check_like(dy, x, "grad_output", op);
  check_stat(mean, x, l.channels, "mean", op);
  const c10::cuda::CUDAGuard guard(x.device());
  return reduce_channels<false>(x, &dy, mean.data_ptr<float>(), l, channel_last, op);
}

at::Tensor syncbn_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                           const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                           const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                           int64_t count, bool channel_last) {
  constexpr const char* op = "syncbn_backward";
  const Layout l = layout_of(x, channel_last, op);
  check_like(dy, x, "grad_output", op);
  check_stat(mean, x, l.channels, "mean", op);
  check_stat(invstd, x, l.channels, "invstd", op);
  check_stat(sum_dy, x, l.channels, "sum_dy", op);
  check_stat(sum_dy_xmu, x, l.channels, "sum_dy_xmu", op);
  TORCH_CHECK(count > 0, op, ": count (elements per channel over the whole batch) must be "
              "positive, got ", count);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto w = as_float(weight, x, l.channels, "weight", op);
  at::Tensor dx = at::empty_like(x);
  const int64_t numel = x.numel();
  if (numel == 0) return dx;
  AMP_SYNCBN_DISPATCH(x.scalar_type(), op, [&] {
    backward_kernel<scalar_t><<<elementwise_blocks(numel), 256, 0,
                                at::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), mean.data_ptr<float>(),
        invstd.data_ptr<float>(), ptr(w), sum_dy.data_ptr<float>(),
        sum_dy_xmu.data_ptr<float>(), dx.data_ptr<scalar_t>(), numel, l.channels, l.spatial,
        channel_last, static_cast<float>(1.0 / static_cast<double>(count)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

// --- the dispatcher ops: the arguments made contiguous, statistics float32 ------------------

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

std::optional<at::Tensor> dense(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

// Inputs the kernels do not take (float64) that the reference does: it serves them.
bool reference_input(const at::Tensor& t) { return t.scalar_type() == at::kDouble; }

void check_batched(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 2, op, ": input needs a batch and a channel dimension, got sizes ",
              x.sizes());
}

std::tuple<at::Tensor, at::Tensor> op_welford_mean_var(const at::Tensor& x, bool channel_last) {
  if (reference_input(x)) {
    check_batched(x, "syncbn_welford_mean_var");
    return amp_fused_ops::syncbn_reference::welford_mean_var(x, channel_last);
  }
  return syncbn_welford_mean_var(x.contiguous(), channel_last);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> op_welford_parallel(const at::Tensor& means,
                                                                   const at::Tensor& vars,
                                                                   const at::Tensor& counts,
                                                                   double eps) {
  return syncbn_welford_parallel(f32(means), f32(vars), f32(counts), eps);
}

at::Tensor op_forward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                      const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& z,
                      bool fuse_relu, bool channel_last) {
  if (reference_input(x)) {
    check_batched(x, "syncbn_forward");
    return amp_fused_ops::syncbn_reference::forward(x, mean, invstd, weight, bias, z, fuse_relu,
                                                    channel_last);
  }
  return syncbn_forward(x.contiguous(), f32(mean), f32(invstd), weight, bias, dense(z),
                        fuse_relu, channel_last);
}

std::tuple<at::Tensor, at::Tensor> op_reduce(const at::Tensor& dy, const at::Tensor& x,
                                             const at::Tensor& mean, bool channel_last) {
  if (reference_input(x) || reference_input(dy)) {
    check_batched(x, "syncbn_reduce");
    return amp_fused_ops::syncbn_reference::reduce(dy, x, mean, channel_last);
  }
  return syncbn_reduce(dy.contiguous(), x.contiguous(), f32(mean), channel_last);
}

at::Tensor op_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                       const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                       const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu, int64_t count,
                       bool channel_last) {
  if (reference_input(x) || reference_input(dy)) {
    check_batched(x, "syncbn_backward");
    TORCH_CHECK(count > 0, "syncbn_backward: count (elements per channel over the whole batch) "
                "must be positive, got ", count);
    return amp_fused_ops::syncbn_reference::backward(dy, x, mean, invstd, weight, sum_dy,
                                                     sum_dy_xmu, count, channel_last);
  }
  return syncbn_backward(dy.contiguous(), x.contiguous(), f32(mean), f32(invstd), weight,
                         f32(sum_dy), f32(sum_dy_xmu), count, channel_last);
}

}  // namespace

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, CUDA, m) {
  m.impl("syncbn_welford_mean_var", TORCH_FN(op_welford_mean_var));
  m.impl("syncbn_welford_parallel", TORCH_FN(op_welford_parallel));
  m.impl("syncbn_forward", TORCH_FN(op_forward));
  m.impl("syncbn_reduce", TORCH_FN(op_reduce));
  m.impl("syncbn_backward", TORCH_FN(op_backward));
}
