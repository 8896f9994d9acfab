// Kernels that make the mistakes the emulator must catch (tests/test_emulation.py). Compiled
// into the emulated extension only, never into the CUDA one.
#include "../common/aten_headers.h"
#include <torch/library.h>

namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Sum of the block's thread indices through shared memory, one slot per warp; with
// `barrier` false the second __syncthreads is missing.
__global__ void warp_sums(float* out, bool barrier) {
  __shared__ float partial[32];
  float v = static_cast<float>(threadIdx.x);
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (unsigned w = 0; w < blockDim.x / 32; ++w) total += partial[w];
    out[blockIdx.x] = total;
  }
  if (barrier) __syncthreads();
  // Reuse of the shared slots: without the barrier above, warps may overwrite them before
  // thread 0 has read them.
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = -1.f;
}

__global__ void early_exit_before_barrier(float* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

__global__ void shuffle_with_exited_lanes(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1.f, 1);
}

__global__ void vector_copy(const float* in, float* out, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i + 4 <= n) {
    *reinterpret_cast<Vec<float, 4>*>(out + i) = *reinterpret_cast<const Vec<float, 4>*>(in + i);
  }
}

// In place: each element is loaded, then stored at the same address in the same basic block.
__global__ void scale_in_place(float* x, float s, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * s;
}

__global__ void nothing() {}

// The first `written` threads fill their slot; then every thread reads its own.
__global__ void shared_reads(float* out, int written) {
  __shared__ float slots[64];
  if (static_cast<int>(threadIdx.x) < written) slots[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slots[threadIdx.x];
}

// Only block 0 writes `value`: every other block reads what block 0 left (on the GPU, whatever
// the multiprocessor's shared memory held).
__global__ void shared_from_previous_block(float* out) {
  __shared__ float value;
  if (blockIdx.x == 0 && threadIdx.x == 0) value = 1.f;
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = value;
}

// Lane i reads the slot that lane i - 1 wrote. Without the __syncwarp between, only lanes that
// happen to run in index order (or in lockstep) see the write: a race on the GPU.
__global__ void lane_neighbours(float* scratch, float* out, bool sync, bool shared) {
  __shared__ float slots[32];
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float* slot = shared ? slots + lane : scratch + i;
  *slot = static_cast<float>(lane + 1);
  if (sync) __syncwarp();
  out[i] = lane == 0 ? 0.f : *(slot - 1);
}

// Dynamic shared memory: the first `written` threads fill their slot, then thread t reads slot
// t + offset. Kernel 0 never gets an attribute; kernel 1 gets the caller's.
template <int Kernel>
__global__ void dynamic_shared_reads(float* out, int written, int offset) {
  extern __shared__ float dynamic_slots[];
  const int t = static_cast<int>(threadIdx.x);
  if (t < written) dynamic_slots[t] = static_cast<float>(t + 1000 * static_cast<int>(blockIdx.x));
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = dynamic_slots[t + offset];
}

at::Tensor warp_sums_op(int64_t blocks, int64_t threads, bool barrier) {
  at::Tensor out = at::zeros({blocks});
  warp_sums<<<blocks, threads>>>(out.data_ptr<float>(), barrier);
  return out;
}

void early_exit_op() {
  at::Tensor out = at::zeros({64});
  early_exit_before_barrier<<<1, 64>>>(out.data_ptr<float>());
}

void shuffle_op() {
  at::Tensor out = at::zeros({32});
  shuffle_with_exited_lanes<<<1, 32>>>(out.data_ptr<float>());
}

void vector_copy_op(const at::Tensor& in, const at::Tensor& out) {
  const int64_t n = in.numel();
  vector_copy<<<(n / 4 + 127) / 128, 128>>>(in.data_ptr<float>(), out.data_ptr<float>(), n);
}

void scale_in_place_op(const at::Tensor& x, double s) {
  const int64_t n = x.numel();
  scale_in_place<<<(n + 127) / 128, 128>>>(x.data_ptr<float>(), static_cast<float>(s), n);
}

at::Tensor shared_reads_op(int64_t written) {
  at::Tensor out = at::zeros({2 * 64});
  shared_reads<<<2, 64>>>(out.data_ptr<float>(), static_cast<int>(written));
  return out;
}

at::Tensor shared_from_previous_block_op() {
  at::Tensor out = at::zeros({2});
  shared_from_previous_block<<<2, 32>>>(out.data_ptr<float>());
  return out;
}

at::Tensor lane_neighbours_op(int64_t blocks, bool sync, bool shared) {
  at::Tensor scratch = at::zeros({blocks * 32});
  at::Tensor out = at::zeros({blocks * 32});
  lane_neighbours<<<blocks, 32>>>(scratch.data_ptr<float>(), out.data_ptr<float>(), sync, shared);
  return out;
}

void launch_op(int64_t grid_x, int64_t grid_y, int64_t block_x, int64_t block_z,
               int64_t shared_bytes) {
  nothing<<<dim3(grid_x, grid_y), dim3(block_x, 1, block_z), shared_bytes>>>();
}

at::Tensor dynamic_shared_op(int64_t threads, int64_t written, int64_t offset,
                             int64_t shared_bytes, int64_t attribute) {
  at::Tensor out = at::zeros({2 * threads});
  if (attribute < 0) {
    dynamic_shared_reads<0><<<2, threads, shared_bytes>>>(out.data_ptr<float>(),
                                                           static_cast<int>(written),
                                                           static_cast<int>(offset));
    return out;
  }
  C10_CUDA_CHECK(cudaFuncSetAttribute(dynamic_shared_reads<1>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(attribute)));
  dynamic_shared_reads<1><<<2, threads, shared_bytes>>>(out.data_ptr<float>(),
                                                         static_cast<int>(written),
                                                         static_cast<int>(offset));
  return out;
}

}  // namespace

TORCH_LIBRARY(amp_emu_selftest, m) {
  m.def("warp_sums", &warp_sums_op);
  m.def("early_exit", &early_exit_op);
  m.def("shuffle", &shuffle_op);
  m.def("vector_copy", &vector_copy_op);
  m.def("scale_in_place", &scale_in_place_op);
  m.def("launch", &launch_op);
  m.def("shared_reads", &shared_reads_op);
  m.def("shared_from_previous_block", &shared_from_previous_block_op);
  m.def("lane_neighbours", &lane_neighbours_op);
  m.def("dynamic_shared", &dynamic_shared_op);
}
