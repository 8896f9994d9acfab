// The SyncBN ops' arithmetic in ATen ops, fp32 math whatever the input dtype: the C++ twin of
// src/amp_fused_ops/reference/_syncbn.py, for the inputs the SyncBN kernels do not take
// (csrc/cuda/syncbn.cu hands float64 inputs here instead of raising). Same arguments and
// results as those functions; the tests compare both on the same inputs.
#pragma once

#include "aten_headers.h"
#include <ATen/TensorOperators.h>

#include <optional>
#include <tuple>
#include <vector>

namespace amp_fused_ops {
namespace syncbn_reference {

// Every dimension of x but its channel dimension.
inline std::vector<int64_t> reduced_dims(const at::Tensor& x, bool channel_last) {
  const int64_t channel = channel_last ? x.dim() - 1 : 1;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d != channel) dims.push_back(d);
  }
  return dims;
}

// A per-channel vector shaped to broadcast against x.
inline at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x, bool channel_last) {
  if (channel_last) return v.reshape({-1});
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = -1;
  return v.reshape(shape);
}

inline std::tuple<at::Tensor, at::Tensor> welford_mean_var(const at::Tensor& x,
                                                           bool channel_last) {
  if (x.numel() == 0) {
    const int64_t channels = channel_last ? x.size(x.dim() - 1) : x.size(1);
    const at::Tensor zeros = at::zeros({channels}, x.options().dtype(at::kFloat));
    return {zeros, zeros.clone()};
  }
  const at::Tensor xf = x.to(at::kFloat);
  const auto dims = reduced_dims(x, channel_last);
  const at::Tensor mean = xf.mean(dims);
  const at::Tensor var = (xf - per_channel(mean, x, channel_last)).square().mean(dims);
  return {mean, var};
}

// A per-channel statistic: one value per channel of x, on x's device (in the kernels' words;
// a one-element tensor would broadcast silently).
inline void check_vector(const at::Tensor& v, const at::Tensor& x, bool channel_last,
                         const char* name, const char* op) {
  const int64_t channels = channel_last ? x.size(-1) : x.size(1);
  TORCH_CHECK(v.dim() == 1 && v.size(0) == channels && v.device() == x.device(), op, ": ", name,
              " must be a contiguous (", channels, ",) tensor on ", x.device(), ", got ",
              v.sizes(), " on ", v.device());
}

inline at::Tensor forward(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                          const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& z, bool fuse_relu,
                          bool channel_last) {
  check_vector(mean, x, channel_last, "mean", "syncbn_forward");
  check_vector(invstd, x, channel_last, "invstd", "syncbn_forward");
  at::Tensor scale = invstd.to(at::kFloat);
  if (weight.has_value()) scale = scale * weight->to(at::kFloat);
  at::Tensor shift = -mean.to(at::kFloat) * scale;
  if (bias.has_value()) shift = shift + bias->to(at::kFloat);
  at::Tensor y = x.to(at::kFloat) * per_channel(scale, x, channel_last) +
                 per_channel(shift, x, channel_last);
  if (z.has_value()) y = y + z->to(at::kFloat);
  if (fuse_relu) y = y.clamp_min(0);
  return y.to(x.scalar_type());
}

inline std::tuple<at::Tensor, at::Tensor> reduce(const at::Tensor& dy, const at::Tensor& x,
                                                 const at::Tensor& mean, bool channel_last) {
  check_vector(mean, x, channel_last, "mean", "syncbn_reduce");
  const auto dims = reduced_dims(x, channel_last);
  const at::Tensor dyf = dy.to(at::kFloat);
  const at::Tensor x_mu = x.to(at::kFloat) - per_channel(mean.to(at::kFloat), x, channel_last);
  return {dyf.sum(dims), (dyf * x_mu).sum(dims)};
}

inline at::Tensor backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                           const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                           const at::Tensor& sum_dy, const at::Tensor& sum_dy_xmu,
                           int64_t count, bool channel_last) {
  constexpr const char* op = "syncbn_backward";
  check_vector(mean, x, channel_last, "mean", op);
  check_vector(invstd, x, channel_last, "invstd", op);
  check_vector(sum_dy, x, channel_last, "sum_dy", op);
  check_vector(sum_dy_xmu, x, channel_last, "sum_dy_xmu", op);
  const at::Tensor inv = invstd.to(at::kFloat);
  const at::Tensor scale = weight.has_value() ? inv * weight->to(at::kFloat) : inv;
  const at::Tensor mean_dy = sum_dy.to(at::kFloat) / static_cast<double>(count);
  const at::Tensor proj = sum_dy_xmu.to(at::kFloat) * inv * inv / static_cast<double>(count);
  const at::Tensor x_mu = x.to(at::kFloat) - per_channel(mean.to(at::kFloat), x, channel_last);
  const at::Tensor dx = dy.to(at::kFloat) - per_channel(mean_dy, x, channel_last) -
                        x_mu * per_channel(proj, x, channel_last);
  return (dx * per_channel(scale, x, channel_last)).to(x.scalar_type());
}

}  // namespace syncbn_reference
}  // namespace amp_fused_ops
