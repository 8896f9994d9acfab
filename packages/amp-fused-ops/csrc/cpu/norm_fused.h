// The fused CPU kernels of the norm ops (csrc/cpu/norm_ops.cpp registers them): the backward
// of every norm but the float32 LayerNorm, and RMSNorm's forward, each in one pass over a row
// in float32, the rows split between the intra-op threads. Included by norm_ops.cpp only.
#pragma once

#include "../common/aten_headers.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../common/norm_reference.h"
#include "multi_tensor_apply.h"

namespace amp_fused_ops {
namespace norm_fused {

using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The dtypes of the fused kernels (and of ATen's fused CPU LayerNorm).
inline bool native_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// t in `dtype`, without a dispatcher call when it already is (the common case: these calls
// are the host cost of a norm on a small input).
inline at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// --- fused_backward: the norm's backward in one pass over each row ---------------------------
//
// Per row: xhat from the saved input and the row's statistics (or, memory-efficient, from the
// saved output as (y - bias) / weight), g = dy * weight, the row sums of g and g * xhat, then
// dx = (g - mean(g) - xhat * mean(g * xhat)) * invvar (RMSNorm: no mean(g)), as the CUDA
// kernels and the reference compute it, in float32. The rows are cut into kMaxTasks ranges or
// fewer (fewer for very wide rows: kSumsBytes), a number that depends on the shape only, so
// the results do not depend on the thread count; each range sums its rows' parameter
// gradients into its own float32 buffers (a tile of kTileRows rows at a time, each tile's sum
// then added to the range's, which keeps each float32 sum short), and the ranges' sums are
// added in order at the end.
// The loops over a row are plain float32 loops that the compiler vectorizes; the row sums keep
// kLanes partial sums for that.

constexpr int64_t kMaxTasks = 32;
// The tasks' float32 sums take at most this many bytes (4 rows of hidden floats per task): very
// wide rows get fewer tasks.
constexpr int64_t kSumsBytes = int64_t{64} << 20;
constexpr int64_t kTileRows = 64;
constexpr int64_t kLanes = 16;

// n elements of a row as float32 and back (the loaders the rows' dtypes pick), on the
// optimizers' conversions (multi_tensor_apply.h: F16C for float16, a bfloat16 rounding that
// vectorizes).
template <typename T>
inline void load_row(const void* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(static_cast<const float*>(src), n, dst);
  } else {
    cpu::convert_n(static_cast<const T*>(src), dst, n);
  }
}

template <typename T>
inline void store_row(const float* src, void* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(src, n, static_cast<float*>(dst));
  } else {
    cpu::convert_n(src, static_cast<T*>(dst), n);
  }
}

using LoadRow = void (*)(const void*, float*, int64_t);
using StoreRow = void (*)(const float*, void*, int64_t);

inline LoadRow row_loader(at::ScalarType t) {
  if (t == at::kBFloat16) return load_row<at::BFloat16>;
  if (t == at::kHalf) return load_row<at::Half>;
  return load_row<float>;
}

inline StoreRow row_storer(at::ScalarType t) {
  if (t == at::kBFloat16) return store_row<at::BFloat16>;
  if (t == at::kHalf) return store_row<at::Half>;
  return store_row<float>;
}

// One row's first pass, over the row as float32 (x: the saved row, turned into xhat in place;
// d: dy), in one loop: g = dy * weight into g, the row sums of g and g * xhat (kLanes partial
// sums each, so that the loop vectorizes), and, with tiles, dy * xhat and dy added to the
// tile's sums. mu and s: the row's mean (0 for RMSNorm) and invvar, unless memory-efficient
// (ME; w, b: the float32 parameters, HasW / HasB: present).
struct RowSums {
  float g;
  float gx;
};

template <bool ME, bool HasW, bool HasB, bool Tiles>
RowSums first_pass(float* __restrict__ x, const float* __restrict__ d, float* __restrict__ g,
                   const float* __restrict__ w, const float* __restrict__ b, float mu, float s,
                   float* __restrict__ tile_w, float* __restrict__ tile_b, int64_t n) {
  float lanes_g[kLanes] = {}, lanes_gx[kLanes] = {};
  const auto element = [&](int64_t i, int64_t j) {
    float xh = x[i];
    if constexpr (ME) {
      if constexpr (HasB) xh -= b[i];
      if constexpr (HasW) xh /= w[i];
    } else {
      xh = (xh - mu) * s;
    }
    float gi = d[i];
    if constexpr (HasW) gi = gi * w[i];
    x[i] = xh;
    g[i] = gi;
    lanes_g[j] += gi;
    lanes_gx[j] += gi * xh;
    if constexpr (Tiles) {
      tile_w[i] += d[i] * xh;
      tile_b[i] += d[i];
    }
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) element(i + j, j);
  }
  for (int64_t j = 0; i + j < n; ++j) element(i + j, j);
  RowSums sums{0.f, 0.f};
  for (int64_t j = 0; j < kLanes; ++j) {
    sums.g += lanes_g[j];
    sums.gx += lanes_gx[j];
  }
  return sums;
}

using FirstPass = RowSums (*)(float*, const float*, float*, const float*, const float*, float,
                              float, float*, float*, int64_t);

template <bool ME, bool HasW, bool HasB>
FirstPass first_pass_tiles(bool tiles) {
  return tiles ? first_pass<ME, HasW, HasB, true> : first_pass<ME, HasW, HasB, false>;
}

template <bool ME>
FirstPass first_pass_params(bool has_w, bool has_b, bool tiles) {
  if (has_w) {
    return has_b ? first_pass_tiles<ME, true, true>(tiles) : first_pass_tiles<ME, true, false>(tiles);
  }
  return has_b ? first_pass_tiles<ME, false, true>(tiles) : first_pass_tiles<ME, false, false>(tiles);
}

// The first pass for these parameters (chosen once per call).
inline FirstPass first_pass_for(bool memory_efficient, bool has_w, bool has_b, bool tiles) {
  return memory_efficient ? first_pass_params<true>(has_w, has_b, tiles)
                          : first_pass_params<false>(has_w, has_b, tiles);
}

// Whether fused_backward takes these tensors: CPU rows of float32 / float16 / bfloat16,
// float32 statistics of one per row, parameters of one of those dtypes.
inline bool fused_takes(const at::Tensor& grad_out, const at::Tensor& saved,
                        const at::Tensor& mean, const at::Tensor& invvar,
                        const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, at::ScalarType input_dtype) {
  if (!grad_out.is_cpu() || !saved.is_cpu() || grad_out.dim() != 2 ||
      saved.sizes() != grad_out.sizes() || grad_out.size(1) < 1 ||
      !native_dtype(grad_out.scalar_type()) || !native_dtype(saved.scalar_type()) ||
      !native_dtype(input_dtype)) {
    return false;
  }
  for (const at::Tensor* stats : {&mean, &invvar}) {
    if (!stats->is_cpu() || stats->scalar_type() != at::kFloat ||
        stats->numel() != grad_out.size(0)) {
      return false;
    }
  }
  for (const auto* p : {&weight, &bias}) {
    if (p->has_value() && (!(*p)->is_cpu() || !native_dtype((*p)->scalar_type()) ||
                           (*p)->numel() != grad_out.size(1))) {
      return false;
    }
  }
  return true;
}

inline Stats fused_backward(const at::Tensor& grad_out, const at::Tensor& saved_rows,
                            const at::Tensor& mean_rows, const at::Tensor& invvar_rows,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, bool rms,
                            bool memory_efficient, at::ScalarType input_dtype) {
  const at::Tensor dy = grad_out.contiguous();
  const at::Tensor saved = saved_rows.contiguous();
  const at::Tensor mean = mean_rows.contiguous();
  const at::Tensor invvar = invvar_rows.contiguous();
  const std::optional<at::Tensor> shift = rms ? std::nullopt : bias;
  const at::Tensor w =
      weight.has_value() ? as_dtype(*weight, at::kFloat).contiguous() : at::Tensor();
  const at::Tensor b =
      shift.has_value() ? as_dtype(*shift, at::kFloat).contiguous() : at::Tensor();
  const int64_t rows = dy.size(0), n = dy.size(1);
  at::Tensor dx = at::empty({rows, n}, dy.options().dtype(input_dtype));
  const bool params = weight.has_value() || shift.has_value();
  const int64_t most_tasks = std::max<int64_t>(1, kSumsBytes / (4 * n * int64_t{sizeof(float)}));
  const int64_t tasks = std::max<int64_t>(
      1, std::min({kMaxTasks, most_tasks, (rows + kTileRows - 1) / kTileRows}));
  const int64_t per_task = (rows + tasks - 1) / tasks;
  // Per task: the weight's and the bias's gradient sums, then the same of the current tile.
  at::Tensor sums = at::zeros({params ? tasks : 0, 4, n}, dy.options().dtype(at::kFloat));
  const LoadRow load_dy = row_loader(dy.scalar_type());
  const LoadRow load_saved = row_loader(saved.scalar_type());
  const StoreRow store_dx = row_storer(input_dtype);
  const char* dy_base = static_cast<const char*>(dy.data_ptr());
  const char* saved_base = static_cast<const char*>(saved.data_ptr());
  char* dx_base = static_cast<char*>(dx.data_ptr());
  const int64_t dy_row = n * dy.element_size(), saved_row = n * saved.element_size(),
                dx_row = n * dx.element_size();
  const float* mu = mean.data_ptr<float>();
  const float* iv = invvar.data_ptr<float>();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* sums_p = params ? sums.data_ptr<float>() : nullptr;
  const float inv_n = 1.f / static_cast<float>(n);
  // In the memory-efficient pass the bias is subtracted only where there is one (b is null
  // for RMSNorm).
  const FirstPass pass = first_pass_for(memory_efficient, wp != nullptr,
                                        memory_efficient && bp != nullptr, sums_p != nullptr);
  at::parallel_for(0, tasks, 1, [&](int64_t first_task, int64_t last_task) {
    std::vector<float> xs(n), ds(n), gs(n);
    for (int64_t t = first_task; t < last_task; ++t) {
      float* total_w = sums_p != nullptr ? sums_p + t * 4 * n : nullptr;
      float* total_b = total_w != nullptr ? total_w + n : nullptr;
      float* tile_w = total_w != nullptr ? total_w + 2 * n : nullptr;
      float* tile_b = total_w != nullptr ? total_w + 3 * n : nullptr;
      const int64_t begin = t * per_task, end = std::min(rows, begin + per_task);
      for (int64_t r = begin; r < end; ++r) {
        load_saved(saved_base + r * saved_row, xs.data(), n);
        load_dy(dy_base + r * dy_row, ds.data(), n);
        float* x = xs.data();
        const float* g = gs.data();
        const RowSums row = pass(x, ds.data(), gs.data(), wp, bp,
                                 rms || memory_efficient ? 0.f : mu[r], iv[r], tile_w, tile_b, n);
        const float sum_g = row.g, sum_gx = row.gx;
        if (total_w != nullptr && ((r - begin + 1) % kTileRows == 0 || r + 1 == end)) {
          for (int64_t i = 0; i < n; ++i) {
            total_w[i] += tile_w[i];
            total_b[i] += tile_b[i];
            tile_w[i] = 0.f;
            tile_b[i] = 0.f;
          }
        }
        const float mean_g = rms ? 0.f : sum_g * inv_n, proj = sum_gx * inv_n, s = iv[r];
        for (int64_t i = 0; i < n; ++i) x[i] = (g[i] - mean_g - x[i] * proj) * s;
        store_dx(x, dx_base + r * dx_row, n);
      }
    }
  });
  at::Tensor dw = grad_out.new_empty({0}), db = grad_out.new_empty({0});
  if (params) {
    // The tasks' sums added in task order (whatever thread ran which).
    const auto total = [&](const std::optional<at::Tensor>& param, int64_t which) {
      if (!param.has_value()) return grad_out.new_empty({0});
      at::Tensor sum = at::zeros({n}, dy.options().dtype(at::kFloat));
      float* out = sum.data_ptr<float>();
      for (int64_t t = 0; t < tasks; ++t) {
        const float* part = sums_p + (t * 4 + which) * n;
        for (int64_t i = 0; i < n; ++i) out[i] += part[i];
      }
      return as_dtype(sum, param->scalar_type());
    };
    dw = total(weight, 0);
    db = total(shift, 1);
  }
  return {dx, dw, db};
}

// RMSNorm's forward in one pass over each row, in float32: invvar = 1 / sqrt(mean(x^2) + eps),
// y = x * invvar * weight (rounded after each product, as the reference computes it). Rows of
// CPU float32 / float16 / bfloat16 with a weight of one of those dtypes (or none).
inline bool fused_rms_takes(const at::Tensor& x, const std::optional<at::Tensor>& weight) {
  if (!x.is_cpu() || x.dim() != 2 || x.size(1) < 1 || !native_dtype(x.scalar_type())) {
    return false;
  }
  return !weight.has_value() || (weight->is_cpu() && native_dtype(weight->scalar_type()) &&
                                 weight->numel() == x.size(1));
}

inline Stats fused_rms_forward(const at::Tensor& x_rows, const std::optional<at::Tensor>& weight,
                               double eps, bool mixed) {
  const at::Tensor x = x_rows.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor w =
      weight.has_value() ? as_dtype(*weight, at::kFloat).contiguous() : at::Tensor();
  const at::ScalarType out_dtype = norm_reference::output_dtype(x, weight, mixed);
  at::Tensor y = at::empty({rows, n}, x.options().dtype(out_dtype));
  at::Tensor invvar = at::empty({rows}, x.options().dtype(at::kFloat));
  const LoadRow load_x = row_loader(x.scalar_type());
  const StoreRow store_y = row_storer(y.scalar_type());
  const char* x_base = static_cast<const char*>(x.data_ptr());
  char* y_base = static_cast<char*>(y.data_ptr());
  const int64_t x_row = n * x.element_size(), y_row = n * y.element_size();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  float* iv = invvar.data_ptr<float>();
  const float eps_f = static_cast<float>(eps), n_f = static_cast<float>(n);
  const int64_t grain = std::max<int64_t>(1, 32768 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(n);
    float* v = xs.data();
    for (int64_t r = begin; r < end; ++r) {
      load_x(x_base + r * x_row, v, n);
      float lanes[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) lanes[j] += v[i + j] * v[i + j];
      }
      for (int64_t j = 0; i + j < n; ++j) lanes[j] += v[i + j] * v[i + j];
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
      const float s = 1.f / std::sqrt(sum / n_f + eps_f);
      iv[r] = s;
      for (int64_t k = 0; k < n; ++k) v[k] *= s;
      if (wp != nullptr) {
        for (int64_t k = 0; k < n; ++k) v[k] *= wp[k];
      }
      store_y(v, y_base + r * y_row, n);
    }
  });
  return {y, at::zeros({rows}, x.options().dtype(at::kFloat)), invvar};
}

}  // namespace norm_fused
}  // namespace amp_fused_ops
