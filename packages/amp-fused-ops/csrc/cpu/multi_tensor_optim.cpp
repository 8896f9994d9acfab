// Multi-tensor SGD and Adagrad steps on CPU (semantics: _reference_optim.py).
//
// Every list may be float32, float16 or bfloat16 on its own: the functors run on float32 tiles
// (tile_in / tile_out of multi_tensor_apply.h) and results are rounded once, on store.
#include <type_traits>

#include "multi_tensor_apply.h"
#include "multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

struct SgdArgs {
  float weight_decay;
  float momentum;
  float dampening;
  float lr;
  float scale;
  bool decay;  // weight_decay != 0: the reference adds no wd * p term (0 * inf) otherwise
};

// One SGD step on float32 tiles; `param` and (with momentum) `buf` are updated in place.
//   g = grad * scale (+ wd * p unless kWdAfterMomentum)
//   buf = g on the first run, else momentum * buf + (1 - dampening) * g     (kMomentum)
//   g = g + momentum * buf (kNesterov) or buf                                (kMomentum)
//   g += wd * p (kWdAfterMomentum);  p -= lr * g
template <bool kMomentum, bool kNesterov, bool kFirstRun, bool kWdAfterMomentum>
struct SgdFunctor {
  static void run(const float* grad, float* param, float* buf, int64_t n, const SgdArgs& a) {
    const float buf_grad_scale = 1.0f - a.dampening;
    for (int64_t i = 0; i < n; ++i) {
      const float p = param[i];
      float g = grad[i] * a.scale;
      if (!kWdAfterMomentum && a.decay) g += a.weight_decay * p;
      if (kMomentum) {
        const float b = kFirstRun ? g : buf[i] * a.momentum + buf_grad_scale * g;
        buf[i] = b;
        g = kNesterov ? g + a.momentum * b : b;
      }
      if (kWdAfterMomentum && a.decay) g += a.weight_decay * p;
      param[i] = p - a.lr * g;
    }
  }
};

// Calls fn(SgdFunctor<...>{}) for the flags given at run time.
template <typename Fn>
void dispatch_sgd(bool momentum, bool nesterov, bool first_run, bool wd_after, const Fn& fn) {
  auto with_wd = [&](auto m, auto n, auto f) {
    if (wd_after) {
      fn(SgdFunctor<decltype(m)::value, decltype(n)::value, decltype(f)::value, true>{});
    } else {
      fn(SgdFunctor<decltype(m)::value, decltype(n)::value, decltype(f)::value, false>{});
    }
  };
  using T = std::true_type;
  using F = std::false_type;
  if (!momentum) return with_wd(F{}, F{}, F{});
  if (nesterov) {
    return first_run ? with_wd(T{}, T{}, T{}) : with_wd(T{}, T{}, F{});
  }
  return first_run ? with_wd(T{}, F{}, T{}) : with_wd(T{}, F{}, F{});
}

struct AdagradArgs {
  float lr;
  float epsilon;
  float weight_decay;
  bool decay;  // weight_decay != 0
};

// One Adagrad step on float32 tiles, `param` and `state_sum` in place:
//   g = grad (+ wd * p in L2 mode); h += g * g; p -= lr * (g / (sqrt(h) + eps) (+ wd * p)).
template <bool kDecoupled>
struct AdagradFunctor {
  static void run(const float* grad, float* param, float* state_sum, int64_t n,
                  const AdagradArgs& a) {
    for (int64_t i = 0; i < n; ++i) {
      const float p = param[i];
      float g = grad[i];
      if (!kDecoupled && a.decay) g += a.weight_decay * p;
      const float h = state_sum[i] + g * g;
      float update = g / (std::sqrt(h) + a.epsilon);
      if (kDecoupled && a.decay) update += a.weight_decay * p;
      state_sum[i] = h;
      param[i] = p - a.lr * update;
    }
  }
};

}  // namespace

void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const std::vector<std::vector<at::Tensor>>& tensor_lists,
                      double weight_decay, double momentum, double dampening, double lr,
                      bool nesterov, bool first_run, bool wd_after_momentum, double scale) {
  constexpr const char* op = "multi_tensor_sgd";
  const size_t depth = tensor_lists.size();
  TORCH_CHECK(depth == 3 || depth == 4, op,
              ": expected 3 tensor lists [grads, params, momentum_bufs] or 4 [grads, params, ",
              "momentum_bufs, model_copies], got ", depth);
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, depth);
  // Apex's FusedSGD: a set flag (inf/nan found by the loss scaler) skips the step.
  if (noop_is_set(noop_flag)) return;
  const SgdArgs args{static_cast<float>(weight_decay), static_cast<float>(momentum),
                     static_cast<float>(dampening), static_cast<float>(lr),
                     static_cast<float>(scale), weight_decay != 0.0};
  const bool use_momentum = momentum != 0.0;
  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& bufs = tensor_lists[2];
  const auto chunks = make_chunks(grads, chunk_size);
  dispatch_sgd(use_momentum, nesterov, first_run, wd_after_momentum, [&](auto functor) {
    using Functor = decltype(functor);
    for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
      float g_tile[kTile], p_tile[kTile], b_tile[kTile];
      for_each_tile(c, [&](int64_t offset, int64_t n) {
        const float* g = tile_in(grads[c.tensor], offset, n, g_tile);
        float* p = tile_in(params[c.tensor], offset, n, p_tile);
        // The buffer is only read after the first run, and only touched with momentum.
        float* b = use_momentum ? tile_in(bufs[c.tensor], offset, n, b_tile, !first_run)
                                : nullptr;
        Functor::run(g, p, b, n, args);
        tile_out(params[c.tensor], offset, n, p);
        if (use_momentum) tile_out(bufs[c.tensor], offset, n, b);
        if (depth == 4) tile_out(tensor_lists[3][c.tensor], offset, n, p);
      });
    });
  });
}

void multi_tensor_adagrad(int64_t chunk_size, const at::Tensor& noop_flag,
                          const std::vector<std::vector<at::Tensor>>& tensor_lists, double lr,
                          double epsilon, int64_t mode, double weight_decay) {
  constexpr const char* op = "multi_tensor_adagrad";
  TORCH_CHECK(mode == 0 || mode == 1, op,
              ": mode must be 0 (L2 weight decay) or 1 (decoupled weight decay), got ", mode);
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3);
  // As Apex: the noop flag is neither read nor set; inf/nan propagate.
  const AdagradArgs args{static_cast<float>(lr), static_cast<float>(epsilon),
                         static_cast<float>(weight_decay), weight_decay != 0.0};
  const auto& grads = tensor_lists[0];
  const auto& params = tensor_lists[1];
  const auto& sums = tensor_lists[2];
  const auto chunks = make_chunks(grads, chunk_size);
  for_each_chunk(chunks, chunk_size, [&](int64_t, const Chunk& c) {
    float g_tile[kTile], p_tile[kTile], h_tile[kTile];
    for_each_tile(c, [&](int64_t offset, int64_t n) {
      const float* g = tile_in(grads[c.tensor], offset, n, g_tile);
      float* p = tile_in(params[c.tensor], offset, n, p_tile);
      float* h = tile_in(sums[c.tensor], offset, n, h_tile);
      if (mode == 1) {
        AdagradFunctor<true>::run(g, p, h, n, args);
      } else {
        AdagradFunctor<false>::run(g, p, h, n, args);
      }
      tile_out(params[c.tensor], offset, n, p);
      tile_out(sums[c.tensor], offset, n, h);
    });
  });
}

}  // namespace cpu
}  // namespace amp_fused_ops
