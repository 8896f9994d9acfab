// The CPU kernels of the norm ops torch.ops.amp_fused_ops.norm_forward / norm_backward (schemas
// in src/amp_fused_ops/ops/_kernel_ops.py) and their autograd kernel for CPU tensors.
//
// A LayerNorm forward runs on ATen's fused CPU kernel (native_layer_norm), which keeps fp32
// statistics and math for half inputs with float32 parameters, the ops' contract, and so does
// the backward of a float32 LayerNorm (native_layer_norm_backward). RMSNorm's forward and the
// other backwards of float32 / float16 / bfloat16 rows (half rows, whose parameter gradients
// ATen's backward sums in half precision; RMSNorm; the memory-efficient backward) run the
// kernels of norm_fused.h: one pass over each row in fp32. What none of them takes (float64,
// half rows without parameters or of one element in the LayerNorm forward, ...) runs the fp32
// ATen reference of ../common/norm_reference.h, as src/amp_fused_ops/reference/_norm.py
// (norm_forward_aten) does without this extension.
#include "../common/aten_headers.h"
#include <ATen/ops/native_layer_norm.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "../common/norm_autograd.h"
#include "norm_fused.h"
#include "../common/norm_reference.h"
#include "../common/ops_schema.h"

namespace amp_fused_ops {
namespace {

using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using norm_fused::as_dtype;
using norm_fused::native_dtype;

// Whether ATen's fused CPU LayerNorm computes the ops' result for these rows. Rows of one
// element are all bias: ATen's backward leaves an fp32 rounding residue in their (exactly
// zero) input gradient, the reference does not. A half input needs a parameter: ATen keeps
// fp32 statistics only in its mixed-type kernel (half input, float32 parameters).
bool aten_takes(const at::Tensor& rows, const std::optional<at::Tensor>& weight,
                const std::optional<at::Tensor>& bias, bool rms) {
  if (rms || !rows.is_cpu() || rows.dim() != 2 || rows.numel() == 0 || rows.size(1) < 2 ||
      !native_dtype(rows.scalar_type())) {
    return false;
  }
  if (rows.scalar_type() != at::kFloat && !weight.has_value() && !bias.has_value()) {
    return false;
  }
  for (const auto* p : {&weight, &bias}) {
    if (p->has_value() && (!(*p)->is_cpu() || !native_dtype((*p)->scalar_type()))) return false;
  }
  return true;
}

std::optional<at::Tensor> as_float(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(as_dtype(*t, at::kFloat)) : std::nullopt;
}

Stats norm_forward_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, double eps, bool rms, bool mixed,
                       bool /*memory_efficient: what autograd saves*/) {
  norm_reference::check_floating(x, "input");
  if (weight.has_value()) norm_reference::check_floating(*weight, "weight");
  if (bias.has_value()) norm_reference::check_floating(*bias, "bias");
  norm_reference::check_mixed(weight, mixed);
  if (rms && norm_fused::fused_rms_takes(x, weight)) {
    return norm_fused::fused_rms_forward(x, weight, eps, mixed);
  }
  if (!aten_takes(x, weight, bias, rms)) {
    return norm_reference::forward(x, weight, bias, eps, rms, mixed);
  }
  // float32 parameters: ATen's mixed-type kernel (fp32 statistics and math for half x); the
  // mixed variants output in the parameters' dtype, so they normalize an fp32 copy of x.
  const at::Tensor source = mixed ? as_dtype(x, at::kFloat) : x;
  auto [out, mean, rstd] =
      at::native_layer_norm(source, {x.size(1)}, as_float(weight), as_float(bias), eps);
  return {as_dtype(out, norm_reference::output_dtype(x, weight, mixed)), mean.view(-1),
          rstd.view(-1)};
}

Stats norm_backward_cpu(const at::Tensor& grad_out, const at::Tensor& saved,
                        const at::Tensor& mean, const at::Tensor& invvar,
                        const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, bool rms, bool memory_efficient,
                        at::ScalarType input_dtype) {
  const bool aten_float = !memory_efficient && input_dtype == at::kFloat &&
                          saved.scalar_type() == at::kFloat &&
                          grad_out.scalar_type() == at::kFloat &&
                          aten_takes(saved, weight, bias, rms);
  if (!aten_float) {
    if (norm_fused::fused_takes(grad_out, saved, mean, invvar, weight,
                                rms ? std::nullopt : bias, input_dtype)) {
      return norm_fused::fused_backward(grad_out, saved, mean, invvar, weight, bias, rms,
                                        memory_efficient, input_dtype);
    }
    return norm_reference::backward(grad_out, saved, mean, invvar, weight, bias, rms,
                                    memory_efficient, input_dtype);
  }
  // float32 rows: ATen's backward, with float32 parameters (it sums the parameters' gradients
  // in the input's dtype, which for half rows would break the ops' fp32 contract).
  const std::array<bool, 3> mask = {true, weight.has_value(), bias.has_value()};
  auto [dx, dw, db] = at::native_layer_norm_backward(
      grad_out, saved, {saved.size(1)}, mean.view({-1, 1}), invvar.view({-1, 1}),
      as_float(weight), as_float(bias), mask);
  return {dx,
          weight.has_value() ? as_dtype(dw, weight->scalar_type()) : grad_out.new_empty({0}),
          bias.has_value() ? as_dtype(db, bias->scalar_type()) : grad_out.new_empty({0})};
}

}  // namespace
}  // namespace amp_fused_ops

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, CPU, m) {
  m.impl("norm_forward", TORCH_FN(amp_fused_ops::norm_forward_cpu));
  m.impl("norm_backward", TORCH_FN(amp_fused_ops::norm_backward_cpu));
}

TORCH_LIBRARY_IMPL(AMP_FUSED_OPS_NS, AutogradCPU, m) {
  m.impl("norm_forward",
         TORCH_FN(amp_fused_ops::norm_autograd::norm_forward_autograd<
                  amp_fused_ops::norm_autograd::never_captured>));
  m.impl("norm_backward", TORCH_FN(amp_fused_ops::norm_autograd::norm_backward_autograd));
}
