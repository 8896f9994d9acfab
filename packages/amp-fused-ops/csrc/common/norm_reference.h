// The LayerNorm / RMSNorm forward and backward in ATen ops, fp32 math whatever the dtypes: the
// C++ twin of src/amp_fused_ops/reference/_norm.py (norm_forward_reference,
// norm_backward_reference), for the inputs a norm kernel does not take (csrc/cuda/layer_norm.cu
// hands them here instead of raising). Same arguments and results as those functions; the
// tests compare both on the same inputs.
#pragma once

#include "aten_headers.h"
#include <ATen/TensorOperators.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace amp_fused_ops {
namespace norm_reference {

// Refuses integer, bool and complex tensors with the Python reference's TypeError (the dtype
// named as Python names it, e.g. torch.int64).
inline void check_floating(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()),
                   "norm_forward normalizes floating-point tensors; got ", name,
                   " of dtype torch.", c10::getDtypeNames(t.scalar_type()).first,
                   ". Convert it first, e.g. ", name, ".float().");
}

// The mixed variants output in the weight's dtype: they need one (every path says so alike).
inline void check_mixed(const std::optional<at::Tensor>& weight, bool mixed) {
  TORCH_CHECK_VALUE(!mixed || weight.has_value(),
                    "norm_forward: the mixed-dtype variant needs a weight");
}

// The output dtype: the weight's for the mixed variants, else the input's.
inline at::ScalarType output_dtype(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                   bool mixed) {
  return mixed && weight.has_value() ? weight->scalar_type() : x.scalar_type();
}

// (out, mean, invvar) of the rows of x (rows, hidden); mean and invvar fp32 (rows,), mean zeros
// for RMSNorm.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool rms, bool mixed) {
  const at::ScalarType odt = output_dtype(x, weight, mixed);
  const at::Tensor xf = x.to(at::kFloat);
  if (x.size(0) == 0) {
    const at::Tensor stats = at::zeros({0}, xf.options());
    return {at::empty_like(x, x.options().dtype(odt)), stats, stats.clone()};
  }
  at::Tensor mean, invvar, y;
  if (rms) {
    mean = at::zeros({x.size(0)}, xf.options());
    invvar = (xf.square().mean({1}) + eps).rsqrt();
    y = xf * invvar.unsqueeze(1);
  } else {
    mean = xf.mean({1});
    const at::Tensor centered = xf - mean.unsqueeze(1);
    invvar = (centered.square().mean({1}) + eps).rsqrt();
    y = centered * invvar.unsqueeze(1);
  }
  if (weight.has_value()) y = y * weight->to(at::kFloat);
  if (bias.has_value() && !rms) y = y + bias->to(at::kFloat);
  return {y.to(odt), mean, invvar};
}

// (grad_input, grad_weight, grad_bias) of forward; empty tensors for absent parameters (and
// always for RMSNorm's bias). With memory_efficient, `saved` is the output and the normalized
// input is recomputed as (out - bias) / weight.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& mean,
    const at::Tensor& invvar, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool rms, bool memory_efficient,
    at::ScalarType input_dtype) {
  const at::Tensor inv = invvar.unsqueeze(1);
  at::Tensor xhat = saved.to(at::kFloat);
  if (memory_efficient) {
    if (bias.has_value() && !rms) xhat = xhat - bias->to(at::kFloat);
    if (weight.has_value()) xhat = xhat / weight->to(at::kFloat);
  } else {
    xhat = (rms ? xhat : xhat - mean.unsqueeze(1)) * inv;
  }
  const at::Tensor dy = grad_out.to(at::kFloat);
  const at::Tensor g = weight.has_value() ? dy * weight->to(at::kFloat) : dy;
  const double hidden = static_cast<double>(xhat.size(1));
  const at::Tensor proj = (g * xhat).sum({1}, /*keepdim=*/true) / hidden;
  at::Tensor dx = g - xhat * proj;
  if (!rms) dx = dx - g.sum({1}, /*keepdim=*/true) / hidden;
  dx = (dx * inv).to(input_dtype);
  const at::Tensor dw = weight.has_value() ? (dy * xhat).sum({0}).to(weight->scalar_type())
                                           : grad_out.new_empty({0});
  const at::Tensor db = bias.has_value() && !rms ? dy.sum({0}).to(bias->scalar_type())
                                                 : grad_out.new_empty({0});
  return {dx, dw, db};
}

}  // namespace norm_reference
}  // namespace amp_fused_ops
