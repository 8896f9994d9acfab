// Shared multi-tensor launcher of the CUDA kernels of amp_fused_ops.
//
// Design (Apex's multi_tensor_apply, written our own way):
// - The host checks the tensor lists once (check_tensor_lists), cuts every tensor into chunks
//   of `chunk_size` elements and packs the addresses and sizes of a batch of tensors, and the
//   index of each tensor's first block, into a TensorListMetadata passed by value as a kernel
//   argument. One launch covers every chunk of up to MaxTensors<Depth> tensors, one block per
//   chunk; a block finds its tensor by a binary search over the first-block indices. Apex's
//   layout named the tensor and chunk of every block instead, which capped a launch at 320
//   blocks as well (a launch per 20M elements at 2048 * 32 elements per chunk, each with its
//   own tail of idle SMs); here the grid is bounded only by CUDA's 2**31 - 1 blocks.
//   Zero-size tensors take a slot and no block. (This layout is compiled with nvcc and
//   tested on the emulator; it has not run on a GPU yet.) AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT=apex
//   launches as Apex did, with the same kernel (LaunchLimits), for an A/B of the two.
// - One generic kernel (multi_tensor_kernel) runs one op functor per element: it loads the
//   element of every list the functor reads into float registers (not the lists it only
//   writes), calls the functor (fp32 math), and stores the lists the functor writes. The kernel is templated on the storage dtype of each list,
//   the functor is not: one functor per op serves every dtype combination.
// - 16-byte vectorized loads and stores when every pointer of the chunk is aligned to the
//   vector width, a scalar loop for the tail and for misaligned chunks.
// - Functors may reduce (sum or max) one or two values per chunk into `partials` (one slot per
//   chunk of the whole call, in chunk order); segment_reduce turns them into per-tensor and
//   total results without leaving the device.
// - The noop flag lives on the device: functors may read it (skip the step) or raise it
//   (inf/nan found). Nothing here synchronizes the host.
#pragma once

#include "../common/aten_headers.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <initializer_list>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/checks.h"
#include "../common/norm_math.h"

namespace amp_fused_ops {
namespace cuda {

using TensorLists = std::vector<std::vector<at::Tensor>>;

constexpr int kBlockSize = 512;  // threads per block of multi_tensor_kernel, at most

// Threads per block of the multi-tensor launches: kBlockSize, or 256 with
// AMP_FUSED_OPS_MULTI_TENSOR_BLOCK=256 (for comparing the two on a GPU; the kernels read
// blockDim, so the same code runs either way). Read at every launch.
inline int multi_tensor_block_size() {
  const char* value = std::getenv("AMP_FUSED_OPS_MULTI_TENSOR_BLOCK");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "512") == 0) return kBlockSize;
  TORCH_CHECK(std::strcmp(value, "256") == 0, "AMP_FUSED_OPS_MULTI_TENSOR_BLOCK=", value,
              " is not one of '512', '256'");
  return 256;
}

// Where one launch ends. By default a launch takes up to MaxTensors<Depth> tensors and every
// chunk of them. AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT=apex reproduces the launches of Apex's
// launcher (for comparing the two on a GPU): a launch ends after Apex's 110, 64, 48, 36 or 30
// tensors (lists of depth 1 to 5) or after 320 blocks, whichever comes first, and a tensor whose
// chunks do not all fit continues in the next launch. The kernel is the same (a continued
// tensor's first_block is negative: the chunks it took in earlier launches); each chunk is
// computed by one block either way, so the results are the same bit for bit. Read at every call.
struct LaunchLimits {
  int tensors;     // per launch, at most MaxTensors<Depth>
  int64_t blocks;  // per launch
};
constexpr int kApexMaxBlocks = 320;
constexpr int kApexMaxTensors[5] = {110, 64, 48, 36, 30};
constexpr int kVectorBytes = 16;
// CUDA's limit on the parameters of a kernel (4 KiB before CUDA 12.1 and before Volta), and the
// part of it the metadata may take: the rest holds the op functor, chunk_size, the noop flag
// and the partials pointer (multi_tensor_apply checks the sum for each op).
constexpr size_t kMaxKernelArgBytes = 4096;
constexpr size_t kMaxMetadataBytes = 3584;
// Blocks of one launch: CUDA's limit on gridDim.x.
constexpr int64_t kMaxGridBlocks = (int64_t{1} << 31) - 1;

// Tensors per launch by list depth: as many as fit kMaxMetadataBytes at 8 bytes per address,
// 8 per size and 4 per first-block index (static_assert below).
template <int Depth>
struct MaxTensors;
template <>
struct MaxTensors<1> {
  static constexpr int value = 178;
};
template <>
struct MaxTensors<2> {
  static constexpr int value = 127;
};
template <>
struct MaxTensors<3> {
  static constexpr int value = 99;
};
template <>
struct MaxTensors<4> {
  static constexpr int value = 81;
};
template <>
struct MaxTensors<5> {
  static constexpr int value = 68;
};

// What one launch needs to know: the tensors of this batch and where each one's blocks begin.
template <int Depth>
struct TensorListMetadata {
  void* addresses[Depth][MaxTensors<Depth>::value];
  int64_t sizes[MaxTensors<Depth>::value];
  // Block of each tensor's chunk 0, increasing; for a tensor continued from the previous
  // launch (only under AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT=apex), minus the chunks it took there.
  int first_block[MaxTensors<Depth>::value];
  int tensors;          // tensors of this batch
  int start_tensor;     // index (in the caller's lists) of this batch's tensor 0
  int64_t first_chunk;  // index (among all chunks of the call) of this launch's block 0
};

static_assert(sizeof(TensorListMetadata<1>) <= kMaxMetadataBytes, "metadata too large");
static_assert(sizeof(TensorListMetadata<2>) <= kMaxMetadataBytes, "metadata too large");
static_assert(sizeof(TensorListMetadata<3>) <= kMaxMetadataBytes, "metadata too large");
static_assert(sizeof(TensorListMetadata<4>) <= kMaxMetadataBytes, "metadata too large");
static_assert(sizeof(TensorListMetadata<5>) <= kMaxMetadataBytes, "metadata too large");
// One more tensor would not fit: the counts above are the most the budget allows.
static_assert(sizeof(TensorListMetadata<1>) + 20 > kMaxMetadataBytes, "room for more tensors");
static_assert(sizeof(TensorListMetadata<2>) + 28 > kMaxMetadataBytes, "room for more tensors");
static_assert(sizeof(TensorListMetadata<3>) + 36 > kMaxMetadataBytes, "room for more tensors");
static_assert(sizeof(TensorListMetadata<4>) + 44 > kMaxMetadataBytes, "room for more tensors");
static_assert(sizeof(TensorListMetadata<5>) + 52 > kMaxMetadataBytes, "room for more tensors");

// The smallest power of two >= n (n >= 1).
constexpr int ceil_pow2(int n) { return n <= 1 ? 1 : 2 * ceil_pow2((n + 1) / 2); }
static_assert(ceil_pow2(1) == 1 && ceil_pow2(68) == 128 && ceil_pow2(128) == 128 &&
                  ceil_pow2(129) == 256 && ceil_pow2(178) == 256,
              "ceil_pow2");

// The batch tensor of block `block`: the last tensor whose first block is <= block (the last
// of equal entries, so a zero-size tensor, which shares the next tensor's first block, is never
// chosen). A binary search with a fixed number of steps (8 for 178 tensors), unrolled into
// selects: a loop with a data-dependent trip count raised the kernels' register use, and made
// ptxas spill in some instantiations, on sm_90.
template <int Depth>
__device__ __forceinline__ int tensor_of_block(const TensorListMetadata<Depth>& meta, int block) {
  int found = 0;  // first_block[0] <= 0 <= block
#pragma unroll
  for (int step = ceil_pow2(MaxTensors<Depth>::value) / 2; step > 0; step /= 2) {
    const int next = found + step;
    if (next < meta.tensors && meta.first_block[next] <= block) {
      found = next;
    }
  }
  return found;
}

// ---------------------------------------------------------------------------------------
// Host-side checks
// ---------------------------------------------------------------------------------------

using checks::check_fp32_lists;
using checks::check_overlap;
using checks::check_state_dtype;
using checks::check_state_lists;
using checks::is_supported_float;

// Checks the preconditions every op shares (csrc/common/checks.h, one dtype per list included)
// after the CUDA extension's own: noop_flag on a CUDA device. Returns the number of tensors per
// list.
inline size_t check_tensor_lists(const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
                                 const TensorLists& lists, size_t depth) {
  TORCH_CHECK(noop_flag.defined() && noop_flag.is_cuda(), op,
              ": noop_flag must be a CUDA tensor for the CUDA extension, got device ",
              noop_flag.defined() ? noop_flag.device() : at::Device(at::kCPU));
  return checks::check_tensor_lists(op, chunk_size, noop_flag, lists, depth);
}

// A one-element scalar argument (lr, step, inv_scale, ...) as a float32 tensor on `device`.
inline at::Tensor device_scalar(const char* op, const char* name, const at::Tensor& value,
                                const at::Device& device) {
  TORCH_CHECK_TYPE(value.defined(), op, ": ", name, " is undefined (None)");
  TORCH_CHECK_VALUE(value.numel() == 1, op, ": ", name, " must have one element, got ",
                    value.numel());
  TORCH_CHECK_VALUE(value.is_floating_point() || at::isIntegralType(value.scalar_type(), false), op,
                    ": ", name, " must be a real number tensor, got dtype ", value.scalar_type());
  return value.reshape({}).to(device, at::kFloat);
}

// The bias correction 1 - beta**step in double on the host, as the reference computes it in
// Python (the callers round it to float); 1 without bias correction.
inline double bias_correction_of(double beta, int64_t step, bool on) {
  return on ? 1.0 - std::pow(beta, static_cast<double>(step)) : 1.0;
}

// Number of chunks of every tensor of `tensors`, and the total.
inline std::vector<int64_t> chunk_offsets(const std::vector<at::Tensor>& tensors,
                                          int64_t chunk_size) {
  std::vector<int64_t> offsets(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    offsets[i + 1] = offsets[i] + (tensors[i].numel() + chunk_size - 1) / chunk_size;
  }
  return offsets;
}

// ---------------------------------------------------------------------------------------
// Dtype dispatch: fn(TypeList<T0, ..., TK-1>{}) for the C++ types of K dtypes
// ---------------------------------------------------------------------------------------

template <typename... Ts>
struct TypeList {};

// TypeAt<I, TypeList<Ts...>>: the I-th type of the list.
template <size_t I, typename L>
struct TypeAtImpl;
template <size_t I, typename... Ts>
struct TypeAtImpl<I, TypeList<Ts...>> {
  using type = std::tuple_element_t<I, std::tuple<Ts...>>;
};
template <size_t I, typename L>
using TypeAt = typename TypeAtImpl<I, L>::type;

template <size_t K, size_t I, typename Fn, typename... Ts>
void dispatch_float_types(const char* op, const std::array<at::ScalarType, K>& types, Fn& fn) {
  if constexpr (I == K) {
    fn(TypeList<Ts...>{});
  } else {
    switch (types[I]) {
      case at::kFloat:
        dispatch_float_types<K, I + 1, Fn, Ts..., float>(op, types, fn);
        break;
      case at::kHalf:
        dispatch_float_types<K, I + 1, Fn, Ts..., at::Half>(op, types, fn);
        break;
      case at::kBFloat16:
        dispatch_float_types<K, I + 1, Fn, Ts..., at::BFloat16>(op, types, fn);
        break;
      default:
        TORCH_CHECK_VALUE(false, op, ": unsupported dtype ", types[I],
                          "; supported dtypes are float32, float16 and bfloat16");
    }
  }
}

template <size_t K, typename Fn>
void dispatch_float_types(const char* op, const std::array<at::ScalarType, K>& types, Fn fn) {
  dispatch_float_types<K, 0, Fn>(op, types, fn);
}

// ---------------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------------

__device__ __forceinline__ bool is_finite(float x) { return isfinite(x); }

// Two partials of a sum of squares (kMax false) or of a NaN-propagating max of |x| (kMax
// true): the combination the CPU loops use too (csrc/common/norm_math.h).
template <bool kMax>
__device__ __forceinline__ float combine(float a, float b) {
  return math::combine_partials<kMax>(a, b);
}

// Reduces `value` over the block; the result is valid in thread 0. Uses `shared` (32 floats).
template <bool kMax>
__device__ float block_reduce(float value, float* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) {
    value = combine<kMax>(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) {
    shared[warp] = value;
  }
  __syncthreads();
  if (warp == 0) {
    value = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) {
      value = combine<kMax>(value, __shfl_down_sync(0xffffffffu, value, offset));
    }
  }
  return value;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Bytes of the narrowest list a thread moves per vector step: kVectorBytes, unless the op
// declares `static constexpr int kVectorBytes` (fewer live registers for an op of many lists).
template <typename Op, typename = void>
struct VectorBytes : std::integral_constant<int, kVectorBytes> {};
template <typename Op>
struct VectorBytes<Op, std::void_t<decltype(Op::kVectorBytes)>>
    : std::integral_constant<int, Op::kVectorBytes> {};

// Elements per thread and vector step: VectorBytes of the narrowest dtype.
template <typename Op, typename... Ts>
constexpr int vector_width() {
  constexpr size_t bytes = VectorBytes<Op>::value;
  size_t smallest = bytes;
  ((smallest = sizeof(Ts) < smallest ? sizeof(Ts) : smallest), ...);
  return static_cast<int>(bytes / smallest);
}

template <typename T, int N>
__device__ __forceinline__ bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N) == 0;
}

// The op functor interface (see the functors in the .cu files):
//   static constexpr unsigned kStores;   bit l set: list l is written back
//   static constexpr unsigned kLoads;    optional, bit l set: list l is read (default: every
//                                        list); a list an op only writes (an output) is left
//                                        out, its x[l] starts at 0 and is not read from memory
//   static constexpr int kReduce;        0, 1 or 2 values reduced per chunk into partials
//   static constexpr bool kReduceMax;    reduce with max (else sum)
//   __device__ bool prepare(int tensor, const int* noop);   per block; false: skip the chunk
//   __device__ void operator()(float (&x)[Depth], float (&acc)[2], bool& nonfinite) const;
// `nonfinite` set by any thread raises the noop flag at the end of the block.

// An op that declares `static constexpr bool kIndexed = true` is called as
// op(x, acc, nonfinite, offset), with `offset` the element's index inside its tensor (its
// tensor's index in the call is prepare()'s first argument): per-element random bits.
template <typename Op, typename = void>
struct IsIndexed : std::false_type {};
template <typename Op>
struct IsIndexed<Op, std::void_t<decltype(Op::kIndexed)>>
    : std::integral_constant<bool, Op::kIndexed> {};

template <typename Op, int Depth>
__device__ __forceinline__ void call_op(const Op& op, float (&x)[Depth], float (&acc)[2],
                                        bool& nonfinite, int64_t offset) {
  if constexpr (IsIndexed<Op>::value) {
    op(x, acc, nonfinite, offset);
  } else {
    op(x, acc, nonfinite);
  }
}

// An op may also declare `__device__ bool stores(int list) const` to skip, at run time, a list
// its kStores names (SGD without momentum leaves its buffers alone).
template <typename Op, typename = void>
struct HasStoreFilter : std::false_type {};
template <typename Op>
struct HasStoreFilter<Op, std::void_t<decltype(std::declval<const Op&>().stores(0))>>
    : std::true_type {};

template <size_t I, typename Op>
__device__ __forceinline__ bool should_store(const Op& op) {
  if constexpr (((Op::kStores >> I) & 1u) == 0) {
    return false;
  } else if constexpr (HasStoreFilter<Op>::value) {
    return op.stores(static_cast<int>(I));
  } else {
    return true;
  }
}

// Which lists an op reads: its kLoads when it declares one, else every list.
template <typename Op, typename = void>
struct LoadMask {
  static constexpr unsigned value = ~0u;
};
template <typename Op>
struct LoadMask<Op, std::void_t<decltype(Op::kLoads)>> {
  static constexpr unsigned value = Op::kLoads;
};

template <size_t I, typename Op>
constexpr bool should_load() {
  return ((LoadMask<Op>::value >> I) & 1u) != 0;
}

template <size_t I, int N, typename T, typename Op, int Depth>
__device__ __forceinline__ void load_vector(float (&x)[N][Depth], void* const (&p)[Depth],
                                            int64_t i) {
  if constexpr (should_load<I, Op>()) {
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(static_cast<const T*>(p[I]) + i);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      x[j][I] = static_cast<float>(v.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      x[j][I] = 0.0f;
    }
  }
}

template <size_t I, typename T, typename Op, int Depth>
__device__ __forceinline__ void load_scalar(float (&x)[Depth], void* const (&p)[Depth],
                                            int64_t i) {
  if constexpr (should_load<I, Op>()) {
    x[I] = static_cast<float>(static_cast<const T*>(p[I])[i]);
  } else {
    x[I] = 0.0f;
  }
}

template <size_t I, int N, typename T, typename Op, int Depth>
__device__ __forceinline__ void store_vector(const Op& op, const float (&x)[N][Depth],
                                             void* const (&p)[Depth], int64_t i) {
  if (should_store<I>(op)) {
    Vec<T, N> v;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      v.v[j] = static_cast<T>(x[j][I]);
    }
    *reinterpret_cast<Vec<T, N>*>(static_cast<T*>(p[I]) + i) = v;
  }
}

template <size_t I, typename T, typename Op, int Depth>
__device__ __forceinline__ void store_scalar(const Op& op, const float (&x)[Depth],
                                             void* const (&p)[Depth], int64_t i) {
  if (should_store<I>(op)) {
    static_cast<T*>(p[I])[i] = static_cast<T>(x[I]);
  }
}

// The elements [0, n) of one chunk (p: the chunk's start in every list, `begin` its offset in
// its tensor) through `op`.
template <typename Op, typename... Ts, size_t... I>
__device__ __forceinline__ void run_chunk(void* const (&p)[sizeof...(Ts)], int64_t n,
                                          int64_t begin, const Op& op, float (&acc)[2],
                                          bool& nonfinite, std::index_sequence<I...>) {
  constexpr int Depth = sizeof...(Ts);
  constexpr int N = vector_width<Op, Ts...>();
  const bool all_aligned = (aligned<Ts, N>(p[I]) && ...);
  int64_t vector_end = 0;
  if (all_aligned) {
    vector_end = n - n % N;
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * N; i < vector_end;
         i += static_cast<int64_t>(blockDim.x) * N) {
      float x[N][Depth];
      (load_vector<I, N, Ts, Op>(x, p, i), ...);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        call_op(op, x[j], acc, nonfinite, begin + i + j);
      }
      (store_vector<I, N, Ts, Op>(op, x, p, i), ...);
    }
  }
  for (int64_t i = vector_end + threadIdx.x; i < n; i += blockDim.x) {
    float x[Depth];
    (load_scalar<I, Ts, Op>(x, p, i), ...);
    call_op(op, x, acc, nonfinite, begin + i);
    (store_scalar<I, Ts, Op>(op, x, p, i), ...);
  }
}

template <typename... Ts, size_t... I>
__device__ __forceinline__ void chunk_pointers(void* (&p)[sizeof...(Ts)],
                                               const TensorListMetadata<sizeof...(Ts)>& meta,
                                               int local, int64_t begin,
                                               std::index_sequence<I...>) {
  ((p[I] = static_cast<Ts*>(meta.addresses[I][local]) + begin), ...);
}

// One block per chunk: the chunk's elements through `op`, vectorized where aligned.
template <typename Op, typename... Ts>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_kernel(int64_t chunk_size, int* noop, TensorListMetadata<sizeof...(Ts)> meta,
                        Op op_arg, float* partials) {
  constexpr int Depth = sizeof...(Ts);
  static_assert(Op::kReduce >= 0 && Op::kReduce <= 2 && (Op::kReduceMax || Op::kReduce >= 0),
                "an op reduces 0, 1 or 2 values per chunk");
  static_assert((~LoadMask<Op>::value & ~Op::kStores & ((1u << Depth) - 1u)) == 0,
                "every list is read or written (a list an op neither loads nor stores)");
  using Index = std::index_sequence_for<Ts...>;
  const int block = static_cast<int>(blockIdx.x);
  const int local = tensor_of_block(meta, block);
  const int64_t begin = static_cast<int64_t>(block - meta.first_block[local]) * chunk_size;
  const int64_t left = meta.sizes[local] - begin;
  const int64_t n = left < chunk_size ? left : chunk_size;

  Op op = op_arg;
  float acc[2] = {0.0f, 0.0f};
  bool nonfinite = false;
  // prepare() reads nothing that changes during this launch, so the whole block agrees.
  if (op.prepare(meta.start_tensor + local, noop)) {
    void* p[Depth];
    chunk_pointers<Ts...>(p, meta, local, begin, Index{});
    run_chunk<Op, Ts...>(p, n, begin, op, acc, nonfinite, Index{});
    if (nonfinite) {
      *noop = 1;  // benign race: every writer writes 1
    }
  }
  if constexpr (Op::kReduce > 0) {
    __shared__ float shared[32];
    const int64_t slot = (meta.first_chunk + blockIdx.x) * Op::kReduce;
#pragma unroll
    for (int k = 0; k < Op::kReduce; ++k) {
      const float total = block_reduce<Op::kReduceMax>(acc[k], shared);
      if (threadIdx.x == 0) {
        partials[slot + k] = total;
      }
    }
  }
}

// The limits of one launch of lists of depth Depth (see LaunchLimits).
template <int Depth>
LaunchLimits launch_limits() {
  static_assert(kApexMaxTensors[Depth - 1] <= MaxTensors<Depth>::value,
                "Apex's tensors per launch fit the metadata");
  const char* value = std::getenv("AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "batch") == 0) {
    return {MaxTensors<Depth>::value, kMaxGridBlocks};
  }
  TORCH_CHECK(std::strcmp(value, "apex") == 0, "AMP_FUSED_OPS_MULTI_TENSOR_LAYOUT=", value,
              " is not one of 'batch', 'apex'");
  return {kApexMaxTensors[Depth - 1], kApexMaxBlocks};
}

// Launches multi_tensor_kernel<Op, Ts...> over `lists` (already checked): one launch per batch
// of MaxTensors<Depth> consecutive tensors, one block per chunk of the batch. A zero-size tensor
// takes a slot of its batch and no block (its first_block equals the next tensor's, and
// tensor_of_block picks the last of equal entries); a batch of zero-size tensors only is not
// launched. `partials`, when the op reduces, holds Op::kReduce floats per chunk of the call.
template <typename Op, typename... Ts>
void multi_tensor_apply(int64_t chunk_size, const at::Tensor& noop_flag, const TensorLists& lists,
                        const Op& op, float* partials = nullptr) {
  constexpr int Depth = sizeof...(Ts);
  static_assert(Depth >= 1 && Depth <= 5, "multi_tensor_apply supports 1 to 5 lists");
  static_assert(sizeof(TensorListMetadata<Depth>) + sizeof(Op) + 3 * sizeof(void*) <=
                    kMaxKernelArgBytes,
                "the kernel's parameters exceed CUDA's 4 KiB: make the op functor smaller");
  TORCH_INTERNAL_ASSERT(lists.size() == static_cast<size_t>(Depth));
  const size_t n = lists[0].size();
  if (n == 0) {
    return;
  }
  // Every block index of a launch, and so every chunk index of a tensor, fits an int and
  // CUDA's grid: checked once for the whole call.
  const int64_t total_chunks = chunk_offsets(lists[0], chunk_size).back();
  TORCH_CHECK_VALUE(total_chunks <= kMaxGridBlocks, "multi_tensor_apply: ", total_chunks,
                    " chunks of ", chunk_size, " elements exceed CUDA's ", kMaxGridBlocks,
                    " blocks per launch; use a larger chunk_size");
  const c10::cuda::CUDAGuard guard(noop_flag.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int* noop = noop_flag.data_ptr<int>();

  const LaunchLimits limits = launch_limits<Depth>();
  TensorListMetadata<Depth> meta{};
  int blocks = 0;  // in the current launch
  int64_t chunks_done = 0;
  const int threads = multi_tensor_block_size();
  auto launch = [&]() {
    if (blocks > 0) {
      multi_tensor_kernel<Op, Ts...>
          <<<blocks, threads, 0, stream>>>(chunk_size, noop, meta, op, partials);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    chunks_done += blocks;
    blocks = 0;
    meta.tensors = 0;
  };
  // Tensor t into the current launch, its chunk `first` onward (first > 0: it continues).
  auto add = [&](size_t t, int64_t first) {
    if (meta.tensors == 0) {
      meta.start_tensor = static_cast<int>(t);
      meta.first_chunk = chunks_done;
    }
    const int local = meta.tensors++;
    for (int l = 0; l < Depth; ++l) {
      meta.addresses[l][local] = lists[l][t].data_ptr();
    }
    meta.sizes[local] = lists[0][t].numel();
    meta.first_block[local] = blocks - static_cast<int>(first);
  };
  for (size_t t = 0; t < n; ++t) {
    int64_t chunks = (lists[0][t].numel() + chunk_size - 1) / chunk_size;
    add(t, 0);
    // Only under a block limit (the default one is never reached, checked above): the chunks
    // that do not fit continue in the next launch. A full launch is launched at once, so the
    // current one has room (blocks < limits.blocks) here.
    for (int64_t first = 0; blocks + chunks > limits.blocks;) {
      const int64_t taken = limits.blocks - blocks;
      blocks += static_cast<int>(taken);
      chunks -= taken;
      first += taken;
      launch();
      add(t, first);
    }
    blocks += static_cast<int>(chunks);
    if (meta.tensors == limits.tensors || blocks == limits.blocks) {
      launch();
    }
  }
  launch();
}

// ---------------------------------------------------------------------------------------
// Per-tensor and total results from the per-chunk partials
// ---------------------------------------------------------------------------------------

// Segments per reduction launch: as many as the 4 KiB of kernel parameters hold.
constexpr int kMaxSegments = 1000;

struct Segments {
  int begin[kMaxSegments + 1];  // chunk ranges [begin[s], begin[s + 1])
  int first;                    // output index of segment 0
};
// segment_reduce_kernel's parameters: the segments and six scalars and pointers.
static_assert(sizeof(Segments) + 64 <= kMaxKernelArgBytes, "Segments too large for a kernel arg");

// out[first + s] = reduce(partials[c * stride + component] for c in segment s), optionally
// its square root; raises the noop flag when a result is inf or nan (if noop is given).
template <bool kMax>
__global__ void segment_reduce_kernel(const float* partials, int stride, int component,
                                      Segments segments, bool take_sqrt, float* out,
                                      int* noop) {
  __shared__ float shared[32];
  const int s = blockIdx.x;
  float value = 0.0f;  // identity of sum, and of max over absolute values
  for (int c = segments.begin[s] + threadIdx.x; c < segments.begin[s + 1]; c += blockDim.x) {
    value = combine<kMax>(value, partials[static_cast<int64_t>(c) * stride + component]);
  }
  value = block_reduce<kMax>(value, shared);
  if (threadIdx.x == 0) {
    const float result = take_sqrt ? sqrtf(value) : value;
    out[segments.first + s] = result;
    if (noop != nullptr && !isfinite(result)) {
      *noop = 1;
    }
  }
}

// Reduces the chunks of each tensor (offsets from chunk_offsets) into out[0..n), and, when
// `total` is given, all chunks into total[0]. Raises the noop flag on a non-finite result
// of the kinds named by flag_per_tensor / flag_total.
template <bool kMax>
void segment_reduce(const float* partials, int stride, int component,
                    const std::vector<int64_t>& offsets, bool take_sqrt, float* per_tensor,
                    float* total, int* noop, bool flag_per_tensor, bool flag_total) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  constexpr int threads = 256;
  const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
  TORCH_CHECK_VALUE(offsets.back() < (int64_t{1} << 31), "segment_reduce: too many chunks (",
                    offsets.back(), "); use a larger chunk_size");
  if (per_tensor != nullptr) {
    for (int64_t first = 0; first < n; first += kMaxSegments) {
      const int count = static_cast<int>(std::min<int64_t>(kMaxSegments, n - first));
      Segments segments{};
      segments.first = static_cast<int>(first);
      for (int s = 0; s <= count; ++s) {
        segments.begin[s] = static_cast<int>(offsets[first + s]);
      }
      segment_reduce_kernel<kMax><<<count, threads, 0, stream>>>(
          partials, stride, component, segments, take_sqrt, per_tensor,
          flag_per_tensor ? noop : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (total != nullptr) {
    Segments all{};
    all.first = 0;
    all.begin[0] = 0;
    all.begin[1] = static_cast<int>(offsets.back());
    segment_reduce_kernel<kMax><<<1, threads, 0, stream>>>(
        partials, stride, component, all, take_sqrt, total, flag_total ? noop : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace amp_fused_ops
