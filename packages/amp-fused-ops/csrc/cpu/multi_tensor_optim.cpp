// Multi-tensor SGD and Adagrad steps on CPU (semantics: src/amp_fused_ops/reference/_optim.py);
// the element math is csrc/common/optim_math.h, shared with the CUDA kernels.
//
// Every list may be float32, float16 or bfloat16 on its own: the functors run on float32 tiles
// (tile_in / tile_out of multi_tensor_apply.h) and results are rounded once, on store.
#include <optional>
#include <type_traits>

#include "../common/optim_math.h"
#include "multi_tensor_apply.h"
#include "../common/multi_tensor_ops.h"

namespace amp_fused_ops {
namespace cpu {
namespace {

using math::AdagradScalars;
using math::SgdScalars;

// One SGD step on float32 tiles (math::sgd_math); `param` and (with momentum) `buf` are
// updated in place. The flags are template parameters, so the loop has no branch.
template <bool kMomentum, bool kNesterov, bool kFirstRun, bool kWdAfterMomentum>
struct SgdFunctor {
  static void run(const float* grad, float* param, float* buf, int64_t n,
                  const SgdScalars& scalars) {
    const SgdScalars s = scalars;
    for (int64_t i = 0; i < n; ++i) {
      float p = param[i];
      float b = (kMomentum && !kFirstRun) ? buf[i] : 0.0f;
      math::sgd_math(s, kMomentum, kNesterov, kFirstRun, kWdAfterMomentum, grad[i], p, b);
      if (kMomentum) buf[i] = b;
      param[i] = p;
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

// One Adagrad step on float32 tiles (math::adagrad_math), `param` and `state_sum` in place.
template <bool kDecoupled>
struct AdagradFunctor {
  static void run(const float* grad, float* param, float* state_sum, int64_t n,
                  const AdagradScalars& scalars) {
    const AdagradScalars s = scalars;
    for (int64_t i = 0; i < n; ++i) {
      float p = param[i];
      float h = state_sum[i];
      math::adagrad_math(s, kDecoupled, grad[i], p, h);
      state_sum[i] = h;
      param[i] = p;
    }
  }
};

}  // namespace

void multi_tensor_sgd(int64_t chunk_size, const at::Tensor& noop_flag,
                      const std::vector<std::vector<at::Tensor>>& tensor_lists,
                      double weight_decay, double momentum, double dampening, double lr,
                      bool nesterov, bool first_run, bool wd_after_momentum, double scale,
                      std::optional<int64_t> sr_seed, int64_t sr_step) {
  constexpr const char* op = "multi_tensor_sgd";
  const size_t depth = tensor_lists.size();
  // [grads, params, momentum_bufs] or [grads, params, momentum_bufs, model_copies].
  checks::check_list_count(op, tensor_lists, {3, 4});
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, depth);
  if (sr_seed.has_value()) checks::check_stochastic_round(op, tensor_lists, 1, 3);
  const bool round = sr_seed.has_value();
  const math::StochasticRoundKey key = math::stochastic_round_key(sr_seed.value_or(0), sr_step);
  check_state_dtype(op, tensor_lists, 2, 1);
  if (depth == 4) {
    check_overlap(op, tensor_lists, {1, 2, 3});
  } else {
    check_overlap(op, tensor_lists, {1, 2});
  }
  // Apex's FusedSGD: a set flag (inf/nan found by the loss scaler) skips the step.
  if (noop_is_set(noop_flag)) return;
  const SgdScalars args{static_cast<float>(weight_decay), static_cast<float>(momentum),
                        static_cast<float>(dampening), static_cast<float>(lr),
                        static_cast<float>(scale)};
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
        if (round) stochastic_round_tile(key, c.tensor, offset, n, p);
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
  TORCH_CHECK_VALUE(mode == 0 || mode == 1, op,
                    ": mode must be 0 (L2 weight decay) or 1 (decoupled weight decay), got ", mode);
  check_tensor_lists(op, chunk_size, noop_flag, tensor_lists, 3);
  check_state_dtype(op, tensor_lists, 2, 1);
  check_overlap(op, tensor_lists, {1, 2});
  // As Apex: the noop flag is neither read nor set; inf/nan propagate.
  const AdagradScalars args{static_cast<float>(lr), static_cast<float>(epsilon),
                            static_cast<float>(weight_decay)};
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
