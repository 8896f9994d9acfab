// Elementwise multi-tensor ops on CPU: scale, axpby and the L2 norms.
//
// Each op is a functor templated on the element types of its lists, run by the shared
// launcher of multi_tensor_apply.h. Math is float32: half and bfloat16 are converted on load
// and store. The loops are plain loops written so that gcc/clang vectorize them at -O3
// (finiteness is tracked with an integer AND of `x - x == 0`, which is false for inf/nan,
// instead of a branch); no at::vec and no -march flags, so a cached build runs on any CPU
// of the same architecture.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "../common/optim_math.h"
#include "multi_tensor_apply.h"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

template <typename in_t, typename out_t>
struct ScaleFunctor {
  // Returns false when an input is inf or nan.
  static bool run(const in_t* in, out_t* out, int64_t n, float scale) {
    int finite = 1;
    for (int64_t i = 0; i < n; ++i) {
      const float x = static_cast<float>(in[i]);
      finite &= finite_bit(x);
      out[i] = static_cast<out_t>(math::scale_math(x, scale));
    }
    return finite != 0;
  }
};

template <typename x_t, typename y_t, typename out_t>
struct AxpbyFunctor {
  // Returns false when a checked input (see arg_to_check) is inf or nan.
  static bool run(const x_t* x, const y_t* y, out_t* out, int64_t n, float a, float b,
                  int64_t arg_to_check) {
    int finite_x = 1;
    int finite_y = 1;
    for (int64_t i = 0; i < n; ++i) {
      const float xi = static_cast<float>(x[i]);
      const float yi = static_cast<float>(y[i]);
      finite_x &= finite_bit(xi);
      finite_y &= finite_bit(yi);
      out[i] = static_cast<out_t>(math::axpby_math(a, xi, b, yi));
    }
    if (arg_to_check == 0) return finite_x != 0;
    if (arg_to_check == 1) return finite_y != 0;
    return (finite_x & finite_y) != 0;
  }
};

}  // namespace

void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const std::vector<std::vector<at::Tensor>>& tensor_lists,
                        double scale) {
  constexpr const char* op = "multi_tensor_scale";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 2);
  check_overlap(op, tensor_lists, {1}, {{0, 1}});  // outs[i] may be ins[i]
  const auto& ins = tensor_lists[0];
  const auto& outs = tensor_lists[1];
  const auto chunks = make_chunks(ins, chunk_size);
  const float scale_f = static_cast<float>(scale);
  std::atomic<bool> nonfinite{false};
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    const at::Tensor& in = ins[c.tensor];
    const at::Tensor& out = outs[c.tensor];
    const bool finite = dispatch_float(in.scalar_type(), op, [&](auto in_tag) {
      using in_t = decltype(in_tag);
      return dispatch_float(out.scalar_type(), op, [&](auto out_tag) {
        using out_t = decltype(out_tag);
        return ScaleFunctor<in_t, out_t>::run(data_as<in_t>(in) + c.begin,
                                              data_as<out_t>(out) + c.begin,
                                              c.end - c.begin, scale_f);
      });
    });
    if (!finite) nonfinite.store(true, std::memory_order_relaxed);
  });
  if (nonfinite.load()) set_noop(noop_flag);
}

void multi_tensor_axpby(int64_t chunk_size, const at::Tensor& noop_flag,
                        const std::vector<std::vector<at::Tensor>>& tensor_lists, double a,
                        double b, int64_t arg_to_check) {
  constexpr const char* op = "multi_tensor_axpby";
  TORCH_CHECK_VALUE(arg_to_check >= -1 && arg_to_check <= 1, op,
                    ": arg_to_check must be -1 (check x and y), 0 (x) or 1 (y), got ",
                    arg_to_check);
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3);
  check_overlap(op, tensor_lists, {2}, {{0, 2}, {1, 2}});  // outs[i] may be xs[i] or ys[i]
  const auto& xs = tensor_lists[0];
  const auto& ys = tensor_lists[1];
  const auto& outs = tensor_lists[2];
  const auto chunks = make_chunks(xs, chunk_size);
  const float a_f = static_cast<float>(a);
  const float b_f = static_cast<float>(b);
  std::atomic<bool> nonfinite{false};
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    const at::Tensor& x = xs[c.tensor];
    const at::Tensor& y = ys[c.tensor];
    const at::Tensor& out = outs[c.tensor];
    const bool finite = dispatch_float(x.scalar_type(), op, [&](auto x_tag) {
      using x_t = decltype(x_tag);
      return dispatch_float(y.scalar_type(), op, [&](auto y_tag) {
        using y_t = decltype(y_tag);
        return dispatch_float(out.scalar_type(), op, [&](auto out_tag) {
          using out_t = decltype(out_tag);
          return AxpbyFunctor<x_t, y_t, out_t>::run(
              data_as<x_t>(x) + c.begin, data_as<y_t>(y) + c.begin,
              data_as<out_t>(out) + c.begin, c.end - c.begin, a_f, b_f, arg_to_check);
        });
      });
    });
    if (!finite) nonfinite.store(true, std::memory_order_relaxed);
  });
  if (nonfinite.load()) set_noop(noop_flag);
}

namespace {

// Norms of x * scale: the body of multi_tensor_l2norm and multi_tensor_unscale_l2norm.
std::tuple<at::Tensor, at::Tensor> l2norms(const char* op, int64_t chunk_size,
                                           const at::Tensor& noop_flag,
                                           const TensorLists& tensor_lists, float scale,
                                           bool per_tensor) {
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 1);
  const auto& xs = tensor_lists[0];
  const auto chunks = make_chunks(xs, chunk_size);
  // One partial sum per chunk, merged in chunk order: the result does not depend on the
  // number of threads.
  std::vector<float> partials(chunks.size(), 0.0f);
  for_each_chunk(chunks, chunk_size, [&](int64_t index, const Chunk& c) {
    const at::Tensor& x = xs[c.tensor];
    partials[index] = dispatch_float(x.scalar_type(), op, [&](auto tag) {
      using T = decltype(tag);
      return SumOfSquaresFunctor<T>::run(data_as<T>(x) + c.begin, c.end - c.begin, scale);
    });
  });
  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  // Chunk partials are float32; merging them in double costs nothing and keeps large
  // tensors with small chunks accurate.
  const std::vector<double> sums = sum_per_tensor(chunks, partials, xs.size());
  double total = 0.0;
  for (double sum : sums) total += sum;
  // The sum of squares is a float32, as the reference's: one above FLT_MAX is inf (flagged)
  // even when its square root would fit.
  const float total_sq = static_cast<float>(total);
  if (!std::isfinite(total_sq)) set_noop(noop_flag);
  at::Tensor total_norm = at::full({1}, std::sqrt(total_sq), options);
  at::Tensor norms = at::empty({per_tensor ? static_cast<int64_t>(xs.size()) : 0}, options);
  if (per_tensor) {
    float* out = norms.data_ptr<float>();
    for (size_t i = 0; i < xs.size(); ++i) out[i] = static_cast<float>(std::sqrt(sums[i]));
  }
  return {total_norm, norms};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const std::vector<std::vector<at::Tensor>>& tensor_lists, bool per_tensor) {
  return l2norms("multi_tensor_l2norm", chunk_size, noop_flag, tensor_lists, 1.0f, per_tensor);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const std::vector<std::vector<at::Tensor>>& tensor_lists, const at::Tensor& inv_scale,
    bool per_tensor) {
  constexpr const char* op = "multi_tensor_unscale_l2norm";
  const double scale = scalar_value(op, "inv_scale", inv_scale);
  return l2norms(op, chunk_size, noop_flag, tensor_lists, static_cast<float>(scale), per_tensor);
}

}  // namespace cpu
}  // namespace amp_fused_ops
