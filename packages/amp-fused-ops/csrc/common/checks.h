// The per-tensor preconditions of the multi-tensor ops, written once for the CPU launchers
// (csrc/cpu/multi_tensor_apply.h) and the CUDA launchers (csrc/cuda/multi_tensor_apply.cuh).
// The pure-PyTorch reference (src/amp_fused_ops/reference/_common.py) raises the same exception
// type with the same message for each mistake:
//
//   mistake                                   type          message (after "<op>: ")
//   chunk_size outside [1, 2**30]             ValueError    chunk_size must be an int in ...
//   noop_flag not one int32 element           ValueError    noop_flag must be a one-element ...
//   wrong number of lists                     ValueError    expected N tensor lists, got M
//   lists of different lengths                ValueError    tensor_lists[l] has K tensors ...
//   a tensor on another device than noop_flag RuntimeError  tensor_lists[l][i] is on D ...
//   a dtype the list does not accept          ValueError    tensor_lists[l][i] has dtype T; ...
//   two dtypes in one list                    ValueError    ... the tensors of one list ...
//   sizes differ at one position              ValueError    ... has K elements but ...
//   a written tensor shares memory with       ValueError    ... share memory; ...
//   another (check_overlap)
//   optimizer state of another dtype          ValueError    ... optimizer state must be ...
//   state lists of different dtypes           ValueError    ... the optimizer state lists ...
//
// Dtypes and devices are printed as Python prints them (torch.float16, cuda:0). Layout checks
// (dense, same strides at one position) belong to the compiled kernels only: the reference
// takes any layout. Host code only.
#pragma once

#include "aten_headers.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace amp_fused_ops {
namespace checks {

using TensorLists = std::vector<std::vector<at::Tensor>>;

// The dtype as Python prints it: "torch.float32".
inline std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "torch.float32";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kDouble:
      return "torch.float64";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default:
      return std::string("torch.") + c10::toString(type);
  }
}

inline std::string device_name(const at::Device& device) {
  std::ostringstream out;
  out << device;
  return out.str();
}

// "tensor_lists[l][i]"
inline std::string tensor_name(size_t list, size_t index) {
  return "tensor_lists[" + std::to_string(list) + "][" + std::to_string(index) + "]";
}

inline bool is_supported_float(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

constexpr const char* kFloatDtypes = "float32, float16, bfloat16";

inline void check_chunk_size(const char* op, int64_t chunk_size) {
  TORCH_CHECK_VALUE(chunk_size >= 1 && chunk_size <= (int64_t{1} << 30), op,
                    ": chunk_size must be an int in [1, 2**30], got ", chunk_size,
                    "; Apex's default is 2048 * 32");
}

inline void check_noop_flag_dtype(const char* op, const at::Tensor& noop_flag) {
  TORCH_CHECK_VALUE(noop_flag.scalar_type() == at::kInt && noop_flag.numel() == 1, op,
                    ": noop_flag must be a one-element int32 tensor, got dtype ",
                    dtype_name(noop_flag.scalar_type()), " with ", noop_flag.numel(),
                    " elements; create it with torch.zeros(1, dtype=torch.int32, device=...)");
}

// The number of lists is one of `counts`.
inline void check_list_count(const char* op, const TensorLists& lists,
                             std::initializer_list<size_t> counts) {
  bool ok = false;
  std::string expected;
  for (size_t count : counts) {
    ok = ok || lists.size() == count;
    expected += (expected.empty() ? "" : " or ") + std::to_string(count);
  }
  const char* noun = expected == "1" ? " tensor list, got " : " tensor lists, got ";
  TORCH_CHECK_VALUE(ok, op, ": expected ", expected, noun, lists.size());
}

// Every list holds as many tensors as the first; returns that number.
inline size_t check_list_lengths(const char* op, const TensorLists& lists) {
  const size_t n = lists.empty() ? 0 : lists[0].size();
  for (size_t l = 0; l < lists.size(); ++l) {
    TORCH_CHECK_VALUE(lists[l].size() == n, op, ": tensor_lists[", l, "] has ", lists[l].size(),
                      " tensors but tensor_lists[0] has ", n,
                      "; every list must hold one tensor per position");
  }
  return n;
}

inline void check_defined(const char* op, const at::Tensor& t, size_t list, size_t index) {
  TORCH_CHECK_TYPE(t.defined(), op, ": ", tensor_name(list, index),
                   " must be a tensor, got None");
}

inline void check_device(const char* op, const at::Tensor& t, size_t list, size_t index,
                         const at::Device& noop_device) {
  TORCH_CHECK(t.device() == noop_device, op, ": ", tensor_name(list, index), " is on ",
              device_name(t.device()), " but noop_flag is on ", device_name(noop_device),
              "; move all tensors of one call, noop_flag included, to the same device");
}

// `accepted` names the accepted dtypes in the message ("float32, float16, bfloat16").
inline void check_dtype(const char* op, const at::Tensor& t, size_t list, size_t index,
                        bool accepted, const char* accepted_names) {
  TORCH_CHECK_VALUE(accepted, op, ": ", tensor_name(list, index), " has dtype ",
                    dtype_name(t.scalar_type()), "; this list accepts ", accepted_names);
}

inline void check_numel(const char* op, const at::Tensor& t, const at::Tensor& first,
                        size_t list, size_t index) {
  TORCH_CHECK_VALUE(t.numel() == first.numel(), op, ": ", tensor_name(list, index), " has ",
                    t.numel(), " elements but ", tensor_name(0, index), " has ", first.numel(),
                    "; tensors at the same position must have the same number of elements");
}

// Kernels only: the elements are visited in memory order.
inline void check_dense(const char* op, const at::Tensor& t, size_t list, size_t index) {
  TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense(), op, ": ", tensor_name(list, index),
                    " is not dense in any memory format (sizes ", t.sizes(), ", strides ",
                    t.strides(), "); call .contiguous() on it first");
}

inline void check_same_layout(const char* op, const at::Tensor& t, const at::Tensor& first,
                              size_t list, size_t index) {
  TORCH_CHECK_VALUE(t.sizes() == first.sizes() && t.strides() == first.strides(), op, ": ",
                    tensor_name(list, index), " (sizes ", t.sizes(), ", strides ", t.strides(),
                    ") and ", tensor_name(0, index), " (sizes ", first.sizes(), ", strides ",
                    first.strides(), ") have different memory layouts; give them the same ",
                    "memory_format or call .contiguous() on both");
}

// The tensors of one list share one dtype: the kernels dispatch on the first tensor of each
// list (as Apex's do), and the optimizers launch one call per (device, dtype) group.
inline void check_list_dtypes(const char* op, const TensorLists& lists) {
  for (size_t l = 0; l < lists.size(); ++l) {
    for (size_t i = 1; i < lists[l].size(); ++i) {
      const at::ScalarType type = lists[l][i].scalar_type();
      const at::ScalarType first = lists[l][0].scalar_type();
      TORCH_CHECK_VALUE(type == first, op, ": ", tensor_name(l, i), " has dtype ",
                        dtype_name(type), " but ", tensor_name(l, 0), " has dtype ",
                        dtype_name(first),
                        "; the tensors of one list must share one dtype (group them by dtype)");
    }
  }
}

// The checks every op shares, after the extension's own check of noop_flag's device: lists,
// then per position and list: defined, device, dtype (float32, float16, bfloat16), elements,
// layout; then one dtype per list. Returns the number of tensors per list.
inline size_t check_tensor_lists(const char* op, int64_t chunk_size,
                                 const at::Tensor& noop_flag, const TensorLists& lists,
                                 size_t depth) {
  check_chunk_size(op, chunk_size);
  check_noop_flag_dtype(op, noop_flag);
  check_list_count(op, lists, {depth});
  const size_t n = check_list_lengths(op, lists);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& first = lists[0][i];
    bool all_contiguous = true;
    for (size_t l = 0; l < depth; ++l) {
      const at::Tensor& t = lists[l][i];
      check_defined(op, t, l, i);
      check_device(op, t, l, i, noop_flag.device());
      check_dtype(op, t, l, i, is_supported_float(t.scalar_type()), kFloatDtypes);
      check_numel(op, t, first, l, i);
      check_dense(op, t, l, i);
      all_contiguous = all_contiguous && t.is_contiguous();
    }
    if (!all_contiguous) {
      for (size_t l = 1; l < depth; ++l) check_same_layout(op, lists[l][i], first, l, i);
    }
  }
  check_list_dtypes(op, lists);
  return n;
}

// Every tensor of the lists `which` is float32.
inline void check_fp32_lists(const char* op, const TensorLists& lists,
                             std::initializer_list<size_t> which) {
  for (size_t l : which) {
    for (size_t i = 0; i < lists[l].size(); ++i) {
      check_dtype(op, lists[l][i], l, i, lists[l][i].scalar_type() == at::kFloat, "float32");
    }
  }
}

// Optimizer state (list `state`) is float32 or the dtype of the param at its position.
inline void check_state_dtype(const char* op, const TensorLists& lists, size_t state,
                              size_t param) {
  for (size_t i = 0; i < lists[state].size(); ++i) {
    const at::ScalarType s = lists[state][i].scalar_type();
    const at::ScalarType p = lists[param][i].scalar_type();
    TORCH_CHECK_VALUE(s == at::kFloat || s == p, op, ": ", tensor_name(state, i), " has dtype ",
                      dtype_name(s), " but ", tensor_name(param, i), " has dtype ",
                      dtype_name(p), "; optimizer state must be float32 or the params' dtype");
  }
}

// The optimizer state lists [first, last] share one dtype (the kernels read them as one
// type), and that dtype is float32 or the dtype of the params (list `param`). Call after
// check_tensor_lists (one dtype per list).
inline void check_state_lists(const char* op, const TensorLists& lists, size_t first,
                              size_t last, size_t param) {
  if (lists[first].empty()) return;
  const at::ScalarType state = lists[first][0].scalar_type();
  for (size_t l = first + 1; l <= last; ++l) {
    const at::ScalarType type = lists[l][0].scalar_type();
    TORCH_CHECK_VALUE(type == state, op, ": ", tensor_name(l, 0), " has dtype ",
                      dtype_name(type), " but ", tensor_name(first, 0), " has dtype ",
                      dtype_name(state), "; the optimizer state lists must share one dtype");
  }
  check_state_dtype(op, lists, first, param);
}

// The memory one tensor spans, for check_overlap: [begin, end) in bytes, from its first
// element to one past its last (strides are never negative in PyTorch).
struct Span {
  uintptr_t begin;
  uintptr_t end;
  size_t list;
  size_t index;
};

// Whether `a` and `b` are one view of the same memory: same first element, dtype, element
// count and layout (two contiguous tensors of different shapes are one view as well).
inline bool same_view(const at::Tensor& a, const at::Tensor& b) {
  if (a.data_ptr() != b.data_ptr() || a.scalar_type() != b.scalar_type() ||
      a.numel() != b.numel()) {
    return false;
  }
  return (a.is_contiguous() && b.is_contiguous()) ||
         (a.sizes() == b.sizes() && a.strides() == b.strides());
}

// Refuses memory shared by two tensors of the call where one of them is written: the kernels
// read and write the lists as independent arrays, chunk by chunk, in any order.
//
// `written` are the lists the op writes. `in_place` are the pairs (a, b) of lists where
// tensor_lists[a][i] may be tensor_lists[b][i] itself (an elementwise update in place: each
// element is read before it is written, by the same thread); any other sharing that involves
// a written tensor (a partial overlap, two written tensors at one or two positions, a written
// tensor and an input at another position) is refused. Read-only tensors may share memory.
// The first offending pair in order of address is named (the reference finds the same).
inline void check_overlap(const char* op, const TensorLists& lists,
                          std::initializer_list<size_t> written,
                          std::initializer_list<std::pair<size_t, size_t>> in_place = {}) {
  auto is_written = [&](size_t list) {
    for (size_t w : written) {
      if (w == list) return true;
    }
    return false;
  };
  auto may_alias = [&](size_t a, size_t b) {
    for (const auto& pair : in_place) {
      if ((pair.first == a && pair.second == b) || (pair.first == b && pair.second == a)) {
        return true;
      }
    }
    return false;
  };
  std::vector<Span> spans;
  for (size_t l = 0; l < lists.size(); ++l) {
    for (size_t i = 0; i < lists[l].size(); ++i) {
      const at::Tensor& t = lists[l][i];
      if (t.numel() == 0 || !t.has_storage() || t.device().is_meta()) continue;
      int64_t last = 0;  // offset of the last element, in elements
      for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
      const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
      const auto end = begin + static_cast<uintptr_t>((last + 1) * t.element_size());
      spans.push_back({begin, end, l, i});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) {
    if (x.begin != y.begin) return x.begin < y.begin;
    if (x.list != y.list) return x.list < y.list;
    return x.index < y.index;
  });
  for (size_t k = 0; k < spans.size(); ++k) {
    for (size_t j = k + 1; j < spans.size() && spans[j].begin < spans[k].end; ++j) {
      const Span& x = spans[k];
      const Span& y = spans[j];
      if (!is_written(x.list) && !is_written(y.list)) continue;
      const bool same_position = x.index == y.index;
      const bool pair = same_position && x.list != y.list && may_alias(x.list, y.list);
      if (pair && same_view(lists[x.list][x.index], lists[y.list][y.index])) continue;
      // Named in list order, then position order.
      const bool x_first = x.list < y.list || (x.list == y.list && x.index < y.index);
      const Span& first = x_first ? x : y;
      const Span& second = x_first ? y : x;
      const char* fix =
          pair ? "only the very same tensor may be updated in place; pass it in both lists, or "
                 "tensors that do not overlap"
          : same_position ? "every list needs tensors of its own"
                          : "a tensor the op writes may not overlap any other tensor of the call; "
                            "pass tensors of their own (clone the shared ones)";
      TORCH_CHECK_VALUE(false, op, ": ", tensor_name(first.list, first.index), " and ",
                        tensor_name(second.list, second.index), " share memory; ", fix);
    }
  }
}

// Stochastic rounding (sr_seed given) rounds to bfloat16: every tensor of list `params` must be
// bfloat16, and the op must have no list of model copies (`depth` lists only).
inline void check_stochastic_round(const char* op, const TensorLists& lists, size_t params,
                                   size_t depth) {
  TORCH_CHECK_VALUE(lists.size() == depth, op,
                    ": stochastic rounding (sr_seed) rounds the params themselves; pass ", depth,
                    " tensor lists (no model copies), got ", lists.size());
  for (size_t i = 0; i < lists[params].size(); ++i) {
    TORCH_CHECK_VALUE(lists[params][i].scalar_type() == at::kBFloat16, op,
                      ": stochastic rounding (sr_seed) needs bfloat16 params, got ",
                      lists[params][i].scalar_type(), " for ", tensor_name(params, i),
                      "; pass sr_seed=None for other dtypes");
  }
}

}  // namespace checks
}  // namespace amp_fused_ops
