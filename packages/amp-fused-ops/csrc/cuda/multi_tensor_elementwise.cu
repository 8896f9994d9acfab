// multi_tensor_scale, multi_tensor_axpby, multi_tensor_l2norm, multi_tensor_unscale_l2norm.
//
// One functor per op over the shared launcher (multi_tensor_apply.cuh); the launcher is
// instantiated for every dtype combination the op accepts.
#include "../common/norm_math.h"
#include "../common/optim_math.h"
#include "multi_tensor_apply.cuh"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cuda {
namespace {

// [ins, outs]: out = in * scale; flags inf/nan inputs.
struct ScaleOp {
  static constexpr unsigned kStores = 0b10;
  static constexpr unsigned kLoads = 0b01;  // the outputs are only written
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  float scale;

  __device__ bool prepare(int, const int*) { return true; }
  __device__ void operator()(float (&x)[2], float (&)[2], bool& nonfinite) const {
    nonfinite = nonfinite || !is_finite(x[0]);
    x[1] = math::scale_math(x[0], scale);
  }
};

// [xs, ys, outs]: out = a * x + b * y; flags inf/nan in the checked inputs.
struct AxpbyOp {
  static constexpr unsigned kStores = 0b100;
  static constexpr unsigned kLoads = 0b011;  // the outputs are only written
  static constexpr int kReduce = 0;
  static constexpr bool kReduceMax = false;
  float a;
  float b;
  bool check_x;
  bool check_y;

  __device__ bool prepare(int, const int*) { return true; }
  __device__ void operator()(float (&x)[3], float (&)[2], bool& nonfinite) const {
    nonfinite = nonfinite || (check_x && !is_finite(x[0])) || (check_y && !is_finite(x[1]));
    x[2] = math::axpby_math(a, x[0], b, x[1]);
  }
};

// [xs]: per chunk, the sum of (x * inv_scale)**2 (inv_scale from the device, or 1).
struct SumOfSquaresOp {
  static constexpr unsigned kStores = 0;
  static constexpr int kReduce = 1;
  static constexpr bool kReduceMax = false;
  const float* inv_scale_ptr;  // nullptr: no scaling
  float inv_scale;

  __device__ bool prepare(int, const int*) {
    inv_scale = inv_scale_ptr != nullptr ? *inv_scale_ptr : 1.0f;
    return true;
  }
  __device__ void operator()(float (&x)[1], float (&acc)[2], bool&) const {
    acc[0] = math::sum_of_squares_step(acc[0], x[0], inv_scale);
  }
};

std::tuple<at::Tensor, at::Tensor> l2norms(const char* op, int64_t chunk_size,
                                           const at::Tensor& noop_flag,
                                           const TensorListsArg& lists,
                                           const at::Tensor* inv_scale, bool per_tensor) {
  const size_t n = check_tensor_lists(op, chunk_size, noop_flag, lists, 1);
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const auto options = noop_flag.options().dtype(at::kFloat);
  at::Tensor total = at::zeros({1}, options);
  at::Tensor per = at::zeros({per_tensor ? static_cast<int64_t>(n) : 0}, options);
  if (n == 0) {
    return {total, per};
  }
  at::Tensor scale;
  SumOfSquaresOp sum_op{nullptr, 1.0f};
  if (inv_scale != nullptr) {
    scale = device_scalar(op, "inv_scale", *inv_scale, noop_flag.device());
    sum_op.inv_scale_ptr = scale.data_ptr<float>();
  }
  const std::vector<int64_t> offsets = chunk_offsets(lists[0], chunk_size);
  at::Tensor partials = at::empty({std::max<int64_t>(offsets.back(), 1)}, options);
  const std::array<at::ScalarType, 1> types{lists[0][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using X = TypeAt<0, decltype(type_list)>;
    multi_tensor_apply<SumOfSquaresOp, X>(chunk_size, noop_flag, lists, sum_op,
                                          partials.data_ptr<float>());
  });
  int* noop = noop_flag.data_ptr<int>();
  segment_reduce<false>(partials.data_ptr<float>(), 1, 0, offsets, /*take_sqrt=*/true,
                        per_tensor ? per.data_ptr<float>() : nullptr, total.data_ptr<float>(),
                        noop, /*flag_per_tensor=*/false, /*flag_total=*/true);
  return {total, per};
}

}  // namespace

void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListsArg& tensor_lists, double scale) {
  constexpr const char* op = "multi_tensor_scale";
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 2) == 0) {
    return;
  }
  check_overlap(op, tensor_lists, {1}, {{0, 1}});  // outs[i] may be ins[i]
  const ScaleOp scale_op{static_cast<float>(scale)};
  const std::array<at::ScalarType, 2> types{tensor_lists[0][0].scalar_type(),
                                            tensor_lists[1][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using L = decltype(type_list);
    multi_tensor_apply<ScaleOp, TypeAt<0, L>, TypeAt<1, L>>(chunk_size, noop_flag,
                                                            tensor_lists, scale_op);
  });
}

void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const TensorListsArg& tensor_lists, double a, double b,
                        int64_t arg_to_check) {
  constexpr const char* op = "multi_tensor_axpby";
  TORCH_CHECK_VALUE(arg_to_check >= -1 && arg_to_check <= 1, op,
                    ": arg_to_check must be -1 (check x and y), 0 (x) or 1 (y), got ",
                    arg_to_check);
  if (check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3) == 0) {
    return;
  }
  check_overlap(op, tensor_lists, {2}, {{0, 2}, {1, 2}});  // outs[i] may be xs[i] or ys[i]
  const AxpbyOp axpby_op{static_cast<float>(a), static_cast<float>(b), arg_to_check != 1,
                         arg_to_check != 0};
  const std::array<at::ScalarType, 3> types{tensor_lists[0][0].scalar_type(),
                                            tensor_lists[1][0].scalar_type(),
                                            tensor_lists[2][0].scalar_type()};
  dispatch_float_types(op, types, [&](auto type_list) {
    using L = decltype(type_list);
    multi_tensor_apply<AxpbyOp, TypeAt<0, L>, TypeAt<1, L>, TypeAt<2, L>>(
        chunk_size, noop_flag, tensor_lists, axpby_op);
  });
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(int64_t chunk_size,
                                                       const at::Tensor& noop_flag,
                                                       const TensorListsArg& tensor_lists,
                                                       bool per_tensor) {
  return l2norms("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, nullptr,
                 per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag, const TensorListsArg& tensor_lists,
    const at::Tensor& inv_scale, bool per_tensor) {
  return l2norms("multi_tensor_unscale_l2norm", chunk_size, noop_flag, tensor_lists, &inv_scale,
                 per_tensor);
}

}  // namespace cuda
}  // namespace amp_fused_ops
