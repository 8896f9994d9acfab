// Declarations of the C++ CPU multi-tensor ops, with Apex's amp_C signatures.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace amp_fused_ops {
namespace cpu {

// out = in * scale for [ins, outs]; sets noop_flag to 1 if any input is inf or nan.
void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const std::vector<std::vector<at::Tensor>>& tensor_lists, double scale);

// out = a * x + b * y for [xs, ys, outs]; sets noop_flag to 1 if a checked input (x for
// arg_to_check 0, y for 1, both for -1) is inf or nan.
void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const std::vector<std::vector<at::Tensor>>& tensor_lists, double a,
                        double b, int64_t arg_to_check);

// Total L2 norm (float32, shape [1]) and per-tensor norms (float32, shape [n], or empty when
// per_tensor is false) of [xs]; sets noop_flag to 1 if a partial sum is inf or nan.
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const std::vector<std::vector<at::Tensor>>& tensor_lists, bool per_tensor);

// One Adam / AdamW step in place on [grads, params, exp_avgs, exp_avg_sqs]; does nothing
// when noop_flag is nonzero on entry.
void multi_tensor_adam(int64_t chunk_size, const at::Tensor& noop_flag,
                       const std::vector<std::vector<at::Tensor>>& tensor_lists, double lr,
                       double beta1, double beta2, double eps, int64_t step, int64_t mode,
                       int64_t bias_correction, double weight_decay);

}  // namespace cpu
}  // namespace amp_fused_ops
