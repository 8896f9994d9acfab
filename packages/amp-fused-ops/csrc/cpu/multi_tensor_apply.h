// Shared "for each tensor, for each chunk" launcher of the C++ CPU multi-tensor kernels.
//
// Every op checks its tensor lists once (check_tensor_lists), cuts the tensors of the first
// list into chunks of at most `chunk_size` elements (make_chunks), and runs one functor per
// chunk with at::parallel_for over all chunks of all tensors (for_each_chunk). Elements are
// visited in storage order, which is why every tensor must be dense (contiguous in some
// memory format) and every tensor at one list position must share one layout.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <string>
#include <vector>

namespace amp_fused_ops {
namespace cpu {

using TensorLists = std::vector<std::vector<at::Tensor>>;

// One slice [begin, end) of tensor `tensor` (an index into each list).
struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// True when the tensor's elements fill one dense block of memory in some memory format.
inline bool is_dense(const at::Tensor& t) {
  return t.is_contiguous() || t.is_contiguous(at::MemoryFormat::ChannelsLast) ||
         t.is_contiguous(at::MemoryFormat::ChannelsLast3d);
}

inline bool is_supported_float(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// Checks the preconditions shared by every op; `op` names the op in the messages.
inline void check_tensor_lists(
    const char* op, int64_t chunk_size, const at::Tensor& noop_flag,
    const TensorLists& lists, size_t depth) {
  TORCH_CHECK(chunk_size > 0, op, ": chunk_size must be positive, got ", chunk_size);
  TORCH_CHECK(noop_flag.device().is_cpu(), op,
              ": noop_flag must be a CPU tensor for the CPU extension, got device ",
              noop_flag.device());
  TORCH_CHECK(noop_flag.scalar_type() == at::kInt && noop_flag.numel() == 1, op,
              ": noop_flag must be an int32 tensor with one element, got dtype ",
              noop_flag.scalar_type(), " and ", noop_flag.numel(), " elements");
  TORCH_CHECK(lists.size() == depth, op, ": expected ", depth, " tensor lists, got ",
              lists.size());
  const size_t n = lists[0].size();
  for (size_t l = 0; l < depth; ++l) {
    TORCH_CHECK(lists[l].size() == n, op, ": all tensor lists must have the same length, ",
                "but list 0 has ", n, " tensors and list ", l, " has ", lists[l].size());
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& first = lists[0][i];
    bool all_contiguous = true;
    for (size_t l = 0; l < depth; ++l) {
      const at::Tensor& t = lists[l][i];
      TORCH_CHECK(t.defined(), op, ": tensor ", i, " of list ", l, " is undefined (None)");
      TORCH_CHECK(t.device().is_cpu(), op, ": tensor ", i, " of list ", l,
                  " is on device ", t.device(),
                  "; the CPU extension takes CPU tensors only");
      TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": tensor ", i, " of list ", l,
                  " has dtype ", t.scalar_type(), "; supported dtypes are float32, float16 ",
                  "and bfloat16");
      TORCH_CHECK(t.numel() == first.numel(), op, ": tensor ", i, " of list ", l, " has ",
                  t.numel(), " elements but tensor ", i, " of list 0 has ", first.numel(),
                  "; tensors at one position must have the same number of elements");
      TORCH_CHECK(is_dense(t), op, ": tensor ", i, " of list ", l,
                  " is not contiguous in any memory format (sizes ", t.sizes(),
                  ", strides ", t.strides(), "); call .contiguous() on it first");
      all_contiguous = all_contiguous && t.is_contiguous();
    }
    if (!all_contiguous) {
      // Storage order differs from logical order: all layouts must agree element by element.
      for (size_t l = 1; l < depth; ++l) {
        const at::Tensor& t = lists[l][i];
        TORCH_CHECK(t.sizes() == first.sizes() && t.strides() == first.strides(), op,
                    ": tensor ", i, " of list ", l, " (sizes ", t.sizes(), ", strides ",
                    t.strides(), ") and tensor ", i, " of list 0 (sizes ", first.sizes(),
                    ", strides ", first.strides(), ") have different memory layouts; ",
                    "give them the same memory_format or call .contiguous() on both");
      }
    }
  }
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

// Calls fn(chunk_index, chunk) for every chunk, in parallel over chunks. The grain keeps
// about 32K elements per task so that small chunk sizes do not pay one task per chunk.
template <typename Fn>
void for_each_chunk(const std::vector<Chunk>& chunks, int64_t chunk_size, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / chunk_size);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), grain,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t c = begin; c < end; ++c) {
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
      TORCH_CHECK(false, op, ": unsupported dtype ", type,
                  "; supported dtypes are float32, float16 and bfloat16");
  }
}

// Pointer to the first element of `t`, as T (the caller dispatched on t's dtype).
template <typename T>
T* data_as(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

inline void set_noop(const at::Tensor& noop_flag) { noop_flag.data_ptr<int32_t>()[0] = 1; }

}  // namespace cpu
}  // namespace amp_fused_ops
