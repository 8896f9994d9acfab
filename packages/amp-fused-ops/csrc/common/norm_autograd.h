// The autograd formula of the norm op, as a C++ autograd kernel: norm_forward records one
// norm_backward as its gradient (the same formula as src/amp_fused_ops/normalization/_ops.py,
// which serves the devices without a compiled extension).
//
// Included by one source per backend (csrc/cpu/norm_ops.cpp, csrc/cuda/norm_autograd.cpp),
// which registers norm_forward_autograd for its Autograd key: a training step then crosses
// the dispatcher once per direction (the op, then its backward op), with no Python between
// the call and the kernel. The kernel redispatches below autograd, so the dispatcher still
// picks the device kernel (and autocast, functionalization and tracing work as for ATen ops).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <optional>
#include <tuple>

#include "ops_schema.h"

namespace amp_fused_ops {
namespace norm_autograd {

using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using ForwardSignature = Stats(const at::Tensor&, const std::optional<at::Tensor>&,
                               const std::optional<at::Tensor>&, double, bool, bool, bool);
using BackwardSignature = Stats(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const std::optional<at::Tensor>&,
                                const std::optional<at::Tensor>&, bool, bool, at::ScalarType);

inline const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(AMP_FUSED_OPS_NS_NAME "::norm_forward", "")
                             .typed<ForwardSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(AMP_FUSED_OPS_NS_NAME "::norm_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

inline std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Whether backward may recompute the normalized input from the output (Apex's
// memory_efficient), so that the output is saved instead of the input: not where a weight is
// zero (that column's output has lost it), and not where the values are unknown (fake,
// functional or meta tensors: torch.compile and other tracing; `captured`: a call captured
// into a CUDA graph, which each replay runs on the values the weight holds then). Otherwise
// reads the weight on the host.
inline bool saves_output(bool memory_efficient, const at::Tensor& weight, bool captured) {
  if (!memory_efficient) return false;
  if (!weight.defined()) return true;
  const c10::DispatchKeySet keys = weight.key_set();
  if (captured || weight.is_meta() || keys.has(c10::DispatchKey::Python) ||
      keys.has(c10::DispatchKey::Functionalize)) {
    return false;
  }
  return !weight.eq(0).any().item<bool>();
}

// The capture probe of a backend without graphs (the CPU).
inline bool never_captured(const at::Tensor&) { return false; }

class NormFunction : public torch::autograd::Function<NormFunction> {
 public:
  // Absent parameters are nullopt (an undefined tensor is not a valid input of a Function).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x,
                                                const std::optional<at::Tensor>& weight,
                                                const std::optional<at::Tensor>& bias,
                                                double eps, bool rms, bool mixed,
                                                bool memory_efficient, bool captured) {
    Stats result;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      result = forward_op().call(x, weight, bias, eps, rms, mixed, memory_efficient);
    }
    auto& [out, mean, invvar] = result;
    const at::Tensor w = weight.value_or(at::Tensor());
    const bool from_output = saves_output(memory_efficient, w, captured);
    ctx->save_for_backward({from_output ? out : x, mean, invvar, w, bias.value_or(at::Tensor())});
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["memory_efficient"] = from_output;
    ctx->saved_data["input_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->mark_non_differentiable({mean, invvar});
    // No zero gradients made for mean and invvar (they have none): backward reads out's only.
    ctx->set_materialize_grads(false);
    return {out, mean, invvar};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return torch::autograd::variable_list(8);
    const auto saved = ctx->get_saved_variables();
    const bool rms = ctx->saved_data["rms"].toBool();
    const auto input_dtype =
        static_cast<at::ScalarType>(ctx->saved_data["input_dtype"].toInt());
    const at::Tensor& weight = saved[3];
    const at::Tensor& bias = saved[4];
    auto [dx, dw, db] = backward_op().call(
        grads[0].contiguous(), saved[0], saved[1], saved[2], present(weight), present(bias), rms,
        ctx->saved_data["memory_efficient"].toBool(), input_dtype);
    return {dx,
            weight.defined() ? dw : at::Tensor(),
            bias.defined() && !rms ? db : at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

// The norm is differentiable once (as torch.autograd.function.once_differentiable makes a
// Python Function): norm_backward has no formula of its own.
constexpr const char* kOnce =
    "amp_fused_ops::norm_forward is differentiable once: its backward (norm_backward) has no "
    "gradient of its own. For double backward (create_graph=True, e.g. a gradient penalty) "
    "use torch.nn.LayerNorm / torch.nn.RMSNorm for this layer";

inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

// norm_backward's kernel for an Autograd key: the op below autograd; under grad mode, with an
// input that requires grad (a backward with create_graph=True), its results carry an error
// node, so that differentiating them raises instead of giving a silently partial gradient.
inline Stats norm_backward_autograd(const at::Tensor& grad_out, const at::Tensor& saved,
                                    const at::Tensor& mean, const at::Tensor& invvar,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias, bool rms,
                                    bool memory_efficient, at::ScalarType input_dtype) {
  Stats result;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    result = backward_op().call(grad_out, saved, mean, invvar, weight, bias, rms,
                                memory_efficient, input_dtype);
  }
  if (!at::GradMode::is_enabled() ||
      !(requires_grad(grad_out) || requires_grad(saved) ||
        requires_grad(weight.value_or(at::Tensor())) || requires_grad(bias.value_or(at::Tensor())))) {
    return result;
  }
  // The error node takes inputs that require grad (aliases of the results), as Python's
  // once_differentiable does.
  torch::autograd::variable_list aliases;
  for (const at::Tensor& t : {std::get<0>(result), std::get<1>(result), std::get<2>(result)}) {
    at::Tensor alias = t.detach();
    alias.set_requires_grad(true);
    aliases.push_back(std::move(alias));
  }
  const auto error = std::make_shared<torch::autograd::DelayedError>(kOnce, 3);
  auto wrapped = error->apply(std::move(aliases));
  return {wrapped[0], wrapped[1], wrapped[2]};
}

// norm_forward's kernel for an Autograd key. Captured(x): whether the call is being captured
// into a graph on x's device (never_captured, or the CUDA one of csrc/cuda/norm_autograd.cpp);
// asked only where the answer matters (memory_efficient with a weight).
template <bool (*Captured)(const at::Tensor&)>
Stats norm_forward_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps, bool rms,
                            bool mixed, bool memory_efficient) {
  if (!at::GradMode::is_enabled() ||
      !(requires_grad(x) || requires_grad(weight.value_or(at::Tensor())) ||
        requires_grad(bias.value_or(at::Tensor())))) {
    // No gradient asked for: the op below autograd, without a node, its saved tensors and its
    // context (as the Python formula of normalization/_ops.py does).
    const at::AutoDispatchBelowADInplaceOrView below;
    return forward_op().call(x, weight, bias, eps, rms, mixed, memory_efficient);
  }
  const bool captured = memory_efficient && weight.has_value() && Captured(x);
  auto out = NormFunction::apply(x, weight, bias, eps, rms, mixed, memory_efficient, captured);
  return {out[0], out[1], out[2]};
}

}  // namespace norm_autograd
}  // namespace amp_fused_ops
