// Elementwise multi-tensor ops on CPU: scale, axpby and the L2 norm.
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

#include "multi_tensor_apply.h"
#include "multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

inline int finite_bit(float x) { return static_cast<int>(x - x == 0.0f); }

template <typename in_t, typename out_t>
struct ScaleFunctor {
  // Returns false when an input is inf or nan.
  static bool run(const in_t* in, out_t* out, int64_t n, float scale) {
    int finite = 1;
    for (int64_t i = 0; i < n; ++i) {
      const float x = static_cast<float>(in[i]);
      finite &= finite_bit(x);
      out[i] = static_cast<out_t>(x * scale);
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
      out[i] = static_cast<out_t>(a * xi + b * yi);
    }
    if (arg_to_check == 0) return finite_x != 0;
    if (arg_to_check == 1) return finite_y != 0;
    return (finite_x & finite_y) != 0;
  }
};

template <typename T>
struct SumOfSquaresFunctor {
  static constexpr int64_t kLanes = 16;    // independent accumulators (vector lanes)
  static constexpr int64_t kBlock = 2048;  // elements per block; blocks add into the total

  // Sum of x*x in float32, blocked so that rounding error grows with n / kBlock only.
  static float run(const T* x, int64_t n) {
    float total = 0.0f;
    for (int64_t block = 0; block < n; block += kBlock) {
      const int64_t end = std::min(n, block + kBlock);
      float lanes[kLanes] = {};
      int64_t i = block;
      for (; i + kLanes <= end; i += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) {
          const float v = static_cast<float>(x[i + j]);
          lanes[j] += v * v;
        }
      }
      float tail = 0.0f;
      for (; i < end; ++i) {
        const float v = static_cast<float>(x[i]);
        tail += v * v;
      }
      for (int64_t width = kLanes / 2; width > 0; width /= 2) {  // pairwise lane sum
        for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
      }
      total += lanes[0] + tail;
    }
    return total;
  }
};

}  // namespace

void multi_tensor_scale(int64_t chunk_size, const at::Tensor& noop_flag,
                        const std::vector<std::vector<at::Tensor>>& tensor_lists,
                        double scale) {
  constexpr const char* op = "multi_tensor_scale";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 2);
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
  TORCH_CHECK(arg_to_check >= -1 && arg_to_check <= 1, op,
              ": arg_to_check must be -1 (check x and y), 0 (x) or 1 (y), got ", arg_to_check);
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3);
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

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(
    int64_t chunk_size, const at::Tensor& noop_flag,
    const std::vector<std::vector<at::Tensor>>& tensor_lists, bool per_tensor) {
  constexpr const char* op = "multi_tensor_l2norm";
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 1);
  const auto& xs = tensor_lists[0];
  const auto chunks = make_chunks(xs, chunk_size);
  // One partial sum per chunk, merged below in chunk order: the result does not depend on
  // the number of threads.
  std::vector<float> partials(chunks.size(), 0.0f);
  for_each_chunk(chunks, chunk_size, [&](int64_t index, const Chunk& c) {
    const at::Tensor& x = xs[c.tensor];
    partials[index] = dispatch_float(x.scalar_type(), op, [&](auto tag) {
      using T = decltype(tag);
      return SumOfSquaresFunctor<T>::run(data_as<T>(x) + c.begin, c.end - c.begin);
    });
  });
  const auto options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  // Chunk partials are float32; merging them in double costs nothing and keeps large
  // tensors with small chunks accurate.
  std::vector<double> per_tensor_sums(xs.size(), 0.0);
  bool nonfinite = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    nonfinite = nonfinite || !std::isfinite(partials[c]);
    per_tensor_sums[chunks[c].tensor] += partials[c];
  }
  if (nonfinite) set_noop(noop_flag);
  double total = 0.0;
  for (double sum : per_tensor_sums) total += sum;
  at::Tensor total_norm = at::full({1}, static_cast<float>(std::sqrt(total)), options);
  at::Tensor norms = at::empty({per_tensor ? static_cast<int64_t>(xs.size()) : 0}, options);
  if (per_tensor) {
    float* out = norms.data_ptr<float>();
    for (size_t i = 0; i < xs.size(); ++i) {
      out[i] = static_cast<float>(std::sqrt(per_tensor_sums[i]));
    }
  }
  return {total_norm, norms};
}

}  // namespace cpu
}  // namespace amp_fused_ops
