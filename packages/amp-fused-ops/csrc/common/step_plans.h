// Step plans: a param group's tensor lists kept by a backend's compiled kernels across steps.
//
// An optimizer step that passes its lists to a multi-tensor op pays for every tensor it
// passes: the dispatcher converts each list element from Python and back (about 80 ns per
// tensor on a current x86 host), which for Adam's four lists of a 100-param model is most of
// the step's host time. The params and the optimizer state of a group stay the same tensors
// from one step to the next, so the optimizers of amp-optimizers store them here once, under
// an integer handle (multi_tensor_plan_set), and per step ask for the gradients to be read
// from the params (multi_tensor_plan_gather) and the step to run on the stored lists
// (multi_tensor_adam_plan, multi_tensor_sgd_plan). Python decides when a plan is stale and
// replaces it; the gather only confirms that what it reads still matches the plan
// (docs/design.rst, decision 13).
//
// Each backend module (CPU, CUDA, the emulated CUDA build) keeps its own table: the ops
// dispatch on their first tensor argument, on the plan's device, so a plan is always served by
// the module that stored it. Host code only.
#pragma once

#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "aten_headers.h"

namespace amp_fused_ops {
namespace {

// One bucket's lists: [grads, params, state...], as the multi-tensor launchers take them.
using BucketLists = std::vector<std::vector<at::Tensor>>;

struct StepPlanLists {
  at::Device device{at::kCPU};
  std::vector<at::Tensor> params;         // the group's params, in the group's order
  std::vector<int64_t> bucket_of;         // each param's bucket; -1: no gradient when planned
  std::vector<at::ScalarType> dtypes;     // each param's dtype when planned
  std::vector<BucketLists> buckets;       // one per bucket; grads filled by a gather
};

using StepPlanTable = std::unordered_map<int64_t, std::shared_ptr<StepPlanLists>>;

std::mutex& step_plan_mutex() {
  static std::mutex mutex;
  return mutex;
}

StepPlanTable& step_plan_table() {
  static StepPlanTable table;
  return table;
}

std::shared_ptr<StepPlanLists> find_step_plan(int64_t plan) {
  std::lock_guard<std::mutex> lock(step_plan_mutex());
  const auto found = step_plan_table().find(plan);
  return found == step_plan_table().end() ? nullptr : found->second;
}

void clear_gradients(StepPlanLists& plan) {
  for (auto& lists : plan.buckets) lists[0].clear();
}

// multi_tensor_plan_set(Tensor device_tensor, int plan, Tensor[] params, int[] buckets,
//                       Tensor[] state, int state_lists) -> ()
//
// `buckets[i]`: the bucket of params[i] (0, 1, ...) or -1 for a param without a gradient.
// `state`: `state_lists` columns one after the other, each with one tensor per param of a
// bucket, in the params' order (Adam: all exp_avgs, then all exp_avg_sqs).
void plan_set(const at::Tensor& device_tensor, int64_t plan, at::TensorList params,
              at::IntArrayRef buckets, at::TensorList state, int64_t state_lists) {
  constexpr const char* op = "multi_tensor_plan_set";
  TORCH_CHECK_VALUE(buckets.size() == params.size(), op, ": ", params.size(), " params but ",
                    buckets.size(), " bucket indexes");
  TORCH_CHECK_VALUE(state_lists >= 0, op, ": state_lists must be >= 0, got ", state_lists);
  auto lists = std::make_shared<StepPlanLists>();
  lists->device = device_tensor.device();
  int64_t planned = 0;
  int64_t bucket_count = 0;
  for (const int64_t b : buckets) {
    TORCH_CHECK_VALUE(b >= -1 && b <= bucket_count, op,
                      ": bucket indexes must count up from 0 in order of first use, or be -1; "
                      "got ", b, " after ", bucket_count, " buckets");
    if (b == bucket_count) ++bucket_count;
    if (b >= 0) ++planned;
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(state.size()) == planned * state_lists, op, ": ",
                    planned, " params in buckets and ", state_lists, " state lists need ",
                    planned * state_lists, " state tensors, got ", state.size());
  lists->buckets.resize(bucket_count);
  for (auto& bucket : lists->buckets) bucket.resize(2 + state_lists);
  int64_t row = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.defined(), op, ": params[", i, "] is undefined");
    lists->params.push_back(p);
    lists->bucket_of.push_back(buckets[i]);
    lists->dtypes.push_back(p.scalar_type());
    if (buckets[i] < 0) continue;
    TORCH_CHECK(p.device() == lists->device, op, ": params[", i, "] is on ", p.device(),
                " but the plan is for ", lists->device);
    auto& bucket = lists->buckets[buckets[i]];
    bucket[1].push_back(p);
    for (int64_t c = 0; c < state_lists; ++c) {
      const at::Tensor& s = state[c * planned + row];
      TORCH_CHECK(s.defined() && s.device() == lists->device, op, ": state tensor ", c,
                  " of params[", i, "] must be defined and on ", lists->device);
      bucket[2 + c].push_back(s);
    }
    ++row;
  }
  std::lock_guard<std::mutex> lock(step_plan_mutex());
  step_plan_table()[plan] = std::move(lists);
}

// multi_tensor_plan_gather(Tensor device_tensor, int plan) -> bool
//
// Reads each planned param's gradient into its bucket. False (and nothing kept) when the plan
// is unknown to this module or the params no longer match it: a param gained or lost its
// gradient, a gradient is not dense, or a param's dtype or device changed.
bool plan_gather(const at::Tensor& /*device_tensor*/, int64_t plan) {
  const std::shared_ptr<StepPlanLists> lists = find_step_plan(plan);
  if (!lists) return false;
  clear_gradients(*lists);
  for (size_t i = 0; i < lists->params.size(); ++i) {
    const at::Tensor& p = lists->params[i];
    // TensorImpl::grad(): what Python's `p.grad` reads, without its non-leaf warning.
    const at::Tensor& grad = p.unsafeGetTensorImpl()->grad();
    const int64_t b = lists->bucket_of[i];
    const bool matches =
        b < 0 ? !grad.defined()
              : grad.defined() && grad.layout() == at::kStrided &&
                    p.scalar_type() == lists->dtypes[i] && p.device() == lists->device;
    if (!matches) {
      clear_gradients(*lists);
      return false;
    }
    if (b >= 0) lists->buckets[b][0].push_back(grad);
  }
  return true;
}

// multi_tensor_plan_release(Tensor device_tensor, int plan) -> ()
//
// Drops the gradients a gather read and no op stepped (a step that took another path).
void plan_release(const at::Tensor& /*device_tensor*/, int64_t plan) {
  const std::shared_ptr<StepPlanLists> lists = find_step_plan(plan);
  if (lists) clear_gradients(*lists);
}

// multi_tensor_plan_drop(Tensor device_tensor, int plan) -> ()
void plan_drop(const at::Tensor& /*device_tensor*/, int64_t plan) {
  std::shared_ptr<StepPlanLists> dropped;  // released outside the lock
  std::lock_guard<std::mutex> lock(step_plan_mutex());
  const auto found = step_plan_table().find(plan);
  if (found == step_plan_table().end()) return;
  dropped = std::move(found->second);
  step_plan_table().erase(found);
}

// The lists of one bucket of a gathered plan, for an op of the plan's optimizer
// ([grads, params, state...] with `state_lists` state lists); the bucket's gradients are
// released when the guard goes (after the op, also when it throws).
class GatheredBucket {
 public:
  GatheredBucket(const char* op, int64_t plan, int64_t bucket, size_t state_lists)
      : plan_(find_step_plan(plan)) {
    TORCH_CHECK_VALUE(plan_ != nullptr, op, ": no step plan ", plan,
                      " on this device (multi_tensor_plan_set stores one)");
    TORCH_CHECK_VALUE(bucket >= 0 && bucket < static_cast<int64_t>(plan_->buckets.size()), op,
                      ": step plan ", plan, " has ", plan_->buckets.size(),
                      " buckets, got bucket ", bucket);
    BucketLists& lists = plan_->buckets[bucket];
    TORCH_CHECK_VALUE(lists.size() == 2 + state_lists, op, ": step plan ", plan, " holds ",
                      lists.size() - 2, " state lists, the op needs ", state_lists);
    TORCH_CHECK_VALUE(lists[0].size() == lists[1].size(), op, ": bucket ", bucket,
                      " of step plan ", plan,
                      " holds no gradients; call multi_tensor_plan_gather first");
    lists_ = &lists;
  }
  GatheredBucket(const GatheredBucket&) = delete;
  GatheredBucket& operator=(const GatheredBucket&) = delete;
  ~GatheredBucket() { (*lists_)[0].clear(); }

  const BucketLists& lists() const { return *lists_; }

 private:
  std::shared_ptr<StepPlanLists> plan_;  // keeps the lists alive while the op runs
  BucketLists* lists_ = nullptr;
};

}  // namespace
}  // namespace amp_fused_ops
