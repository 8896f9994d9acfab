// Shared "for each tensor, for each chunk" launcher of the C++ CPU multi-tensor kernels.
//
// Every op checks its tensor lists once (check_tensor_lists), cuts the tensors of the first
// list into chunks of at most `chunk_size` elements (make_chunks), and runs one functor per
// chunk with at::parallel_for over all chunks of all tensors, split between the threads by
// elements (for_each_chunk). Elements are visited in storage order, which is why every
// tensor must be dense (contiguous in some memory format) and every tensor at one list
// position must share one layout.
#pragma once

#include "../common/aten_headers.h"
#include <ATen/Parallel.h>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/norm_math.h"
#include "../common/stochastic_round.h"

namespace amp_fused_ops {
namespace cpu {

using TensorLists = std::vector<std::vector<at::Tensor>>;

// One slice [begin, end) of tensor `tensor` (an index into each list).
struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

using checks::is_supported_float;

// Checks the preconditions shared by every op (csrc/common/checks.h) after the CPU
// extension's own: noop_flag on the CPU. `op` names the op in the messages.
inline void check_tensor_lists(
    const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
    const TensorLists& lists, size_t depth) {
  TORCH_CHECK(noop_flag.device().is_cpu(), op,
              ": noop_flag must be a CPU tensor for the CPU extension, got device ",
              noop_flag.device());
  checks::check_tensor_lists(op, chunk_size, noop_flag, lists, depth);
}

// Cuts every tensor of `tensors` into chunks of at most `chunk_size` elements.
inline std::vector<Chunk> make_chunks(const std::vector<at::Tensor>& tensors,
                                      int64_t chunk_size) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t numel = tensors[i].numel();
    for (int64_t begin = 0; begin < numel; begin += chunk_size) {
      chunks.push_back({static_cast<int64_t>(i), begin, std::min(numel, begin + chunk_size)});
    }
  }
  return chunks;
}

// Work units of one chunk beyond its elements (tile loop, dtype dispatch, scalar copies):
// a launch of many tiny tensors is not counted as free.
constexpr int64_t kChunkOverhead = 256;
// Work units (about elements) per task: below this a launch runs on the calling thread, as
// torch's own elementwise kernels do (at::internal::GRAIN_SIZE).
constexpr int64_t kGrain = int64_t{1} << 15;

// Calls fn(chunk_index, chunk) for every chunk of the launch, in parallel on PyTorch's
// intra-op threads (at::parallel_for: torch.set_num_threads applies).
//
// The threads split the launch by work, not by chunk count: each chunk weighs its elements
// plus kChunkOverhead, at::parallel_for cuts [0, total work) into one contiguous range per
// thread, and a thread runs the chunks that *start* in its range. Every chunk thus runs once,
// on one thread, whole; a thread's share differs from the mean by at most one chunk. (Cutting
// the chunk indices instead gave one thread all the big tensors of a launch whose small
// tensors come last: 6 x 1M + 50 x 4K elements ran 1.6x faster on 2 threads instead of 2x.)
// A chunk is never split between threads, so per-chunk partials (the norms) are the same
// for any number of threads; the callers merge them in chunk order.
template <typename Fn>
void for_each_chunk(const std::vector<Chunk>& chunks, int64_t /*chunk_size*/, const Fn& fn) {
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  if (n_chunks == 0) return;
  // start[c]: the work before chunk c; start[n_chunks]: the whole launch.
  std::vector<int64_t> start(static_cast<size_t>(n_chunks) + 1, 0);
  for (int64_t c = 0; c < n_chunks; ++c) {
    start[c + 1] = start[c] + (chunks[c].end - chunks[c].begin) + kChunkOverhead;
  }
  const auto first = start.begin();
  const auto last = start.begin() + n_chunks;  // chunk starts only
  at::parallel_for(0, start[n_chunks], kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = std::lower_bound(first, last, begin) - first; c < n_chunks && start[c] < end;
         ++c) {
      fn(c, chunks[c]);
    }
  });
}

// Calls fn(T{}) with T the C++ type of `type` (float, c10::Half or c10::BFloat16).
template <typename Fn>
decltype(auto) dispatch_float(at::ScalarType type, const char* op, const Fn& fn) {
  switch (type) {
    case at::kFloat:
      return fn(float{});
    case at::kHalf:
      return fn(c10::Half{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    default:
      TORCH_CHECK_VALUE(false, op, ": unsupported dtype ", type,
                        "; supported dtypes are float32, float16 and bfloat16");
  }
}

// Pointer to the first element of `t`, as T (the caller dispatched on t's dtype).
template <typename T>
T* data_as(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

inline void set_noop(const at::Tensor& noop_flag) { noop_flag.data_ptr<int32_t>()[0] = 1; }

// 1 when x is finite, 0 for inf and nan (x - x is nan for both), without a branch, so that
// loops which track finiteness still vectorize.
inline int finite_bit(float x) { return static_cast<int>(x - x == 0.0f); }

inline bool noop_is_set(const at::Tensor& noop_flag) {
  return noop_flag.data_ptr<int32_t>()[0] != 0;
}

// Checks that every tensor of the lists `which` is float32 (optimizer state).
using checks::check_fp32_lists;
using checks::check_overlap;
using checks::check_state_dtype;
using checks::check_state_lists;

// The value of a one-element CPU tensor of any number dtype, as a double; `name` names the
// argument in the messages.
inline double scalar_value(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.defined(), op, ": ", name, " is undefined (None)");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name,
              " must be a CPU tensor for the CPU extension, got device ", t.device());
  TORCH_CHECK_VALUE(t.numel() == 1, op, ": ", name, " must have one element, got ", t.numel());
  return t.item<double>();
}

// --- float32 tiles --------------------------------------------------------------------------
//
// The optimizer ops run one float32 functor whatever the storage dtypes: a chunk is walked in
// tiles of at most kTile elements, and each list's tile is either a pointer straight into a
// float32 tensor or a stack buffer holding the converted float16 / bfloat16 values. This keeps
// one instantiation of each functor instead of one per combination of list dtypes (up to 81
// for four lists), and the conversion loops stay in L1.

constexpr int64_t kTile = 512;

template <typename T>
inline void convert_n(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void convert_n(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// float32 -> bfloat16 with round-to-nearest-even and a quiet nan, as c10::BFloat16 does, but
// without the branch on nan that keeps c10's conversion from vectorizing.
template <>
inline void convert_n<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint16_t out = src[i] != src[i] ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
    dst[i] = c10::BFloat16(out, c10::BFloat16::from_bits());
  }
}

#if defined(__F16C__) && defined(__AVX__)
// float16 <-> float32 with the F16C instructions, 8 at a time (IEEE conversions with
// round-to-nearest-even, the results of c10::Half's conversions); c10::Half converts one value
// at a time.
template <>
inline void convert_n<c10::Half>(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void convert_n<c10::Half>(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), half);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}
#endif

// Float32 values of elements [offset, offset + n) of `t` (n <= kTile): a pointer into `t`
// when it is float32, else `buffer` (filled with the converted values when `load`).
inline float* tile_in(const at::Tensor& t, int64_t offset, int64_t n, float* buffer,
                      bool load = true) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return data_as<float>(t) + offset;
    case at::kHalf:
      if (load) convert_n(data_as<c10::Half>(t) + offset, buffer, n);
      return buffer;
    case at::kBFloat16:
      if (load) convert_n(data_as<c10::BFloat16>(t) + offset, buffer, n);
      return buffer;
    default:
      TORCH_CHECK_VALUE(false, "unsupported dtype ", t.scalar_type());
  }
}

// Writes `values` into elements [offset, offset + n) of `t`, rounded to its dtype, unless
// they already live there (a float32 tile returned by tile_in for `t`).
inline void tile_out(const at::Tensor& t, int64_t offset, int64_t n, const float* values) {
  switch (t.scalar_type()) {
    case at::kFloat: {
      float* dst = data_as<float>(t) + offset;
      if (dst != values) std::copy(values, values + n, dst);
      return;
    }
    case at::kHalf:
      convert_n(values, data_as<c10::Half>(t) + offset, n);
      return;
    case at::kBFloat16:
      convert_n(values, data_as<c10::BFloat16>(t) + offset, n);
      return;
    default:
      TORCH_CHECK_VALUE(false, "unsupported dtype ", t.scalar_type());
  }
}

// Rounds the float32 tile of elements [offset, offset + n) of tensor `tensor` stochastically to
// bfloat16 values in place (csrc/common/stochastic_round.h); tile_out then stores them exactly.
inline void stochastic_round_tile(const math::StochasticRoundKey& key, int64_t tensor,
                                  int64_t offset, int64_t n, float* values) {
  const math::StochasticRoundKey k = key;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits =
        math::stochastic_round_bits(k, static_cast<uint32_t>(tensor), offset + i);
    values[i] = math::stochastic_round_bf16(values[i], bits);
  }
}

// Calls fn(offset, n) for the tiles of chunk `c`.
template <typename Fn>
inline void for_each_tile(const Chunk& c, const Fn& fn) {
  for (int64_t offset = c.begin; offset < c.end; offset += kTile) {
    fn(offset, std::min(kTile, c.end - offset));
  }
}

// --- per-tensor reductions (element math: csrc/common/norm_math.h) --------------------------

template <typename T>
struct SumOfSquaresFunctor {
  static constexpr int64_t kLanes = 16;    // independent accumulators (vector lanes)
  static constexpr int64_t kBlock = 2048;  // elements per block; blocks add into the total

  // Sum of (x * scale)**2 in float32, blocked so that rounding error grows with n / kBlock
  // only. An inf or nan element makes the sum inf or nan.
  static float run(const T* x, int64_t n, float scale) {
    float total = 0.0f;
    for (int64_t block = 0; block < n; block += kBlock) {
      const int64_t end = std::min(n, block + kBlock);
      float lanes[kLanes] = {};
      int64_t i = block;
      for (; i + kLanes <= end; i += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) {
          lanes[j] = math::sum_of_squares_step(lanes[j], static_cast<float>(x[i + j]), scale);
        }
      }
      float tail = 0.0f;
      for (; i < end; ++i) {
        tail = math::sum_of_squares_step(tail, static_cast<float>(x[i]), scale);
      }
      for (int64_t width = kLanes / 2; width > 0; width /= 2) {  // pairwise lane sum
        for (int64_t j = 0; j < width; ++j) {
          lanes[j] = math::combine_partials<false>(lanes[j], lanes[j + width]);
        }
      }
      total = math::combine_partials<false>(total, lanes[0] + tail);
    }
    return total;
  }
};

template <typename T>
struct MaxAbsFunctor {
  // max |x| in float32; nan when an element is nan (as torch's inf-norm).
  static float run(const T* x, int64_t n) {
    float best = 0.0f;
    for (int64_t i = 0; i < n; ++i) best = math::max_abs_step(best, static_cast<float>(x[i]));
    return best;
  }
};


// Sums one float per chunk into one double per tensor, in chunk order (the result does not
// depend on the number of threads).
inline std::vector<double> sum_per_tensor(const std::vector<Chunk>& chunks,
                                          const std::vector<float>& partials,
                                          size_t n_tensors) {
  std::vector<double> sums(n_tensors, 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) {
    double& sum = sums[chunks[c].tensor];
    sum = math::combine_partials<false, double>(sum, partials[c]);
  }
  return sums;
}

}  // namespace cpu
}  // namespace amp_fused_ops
