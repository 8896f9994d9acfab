// The CUDA execution model on the CPU, for running the unmodified kernels of csrc/cuda.
//
// A launch `kernel<<<grid, block, smem, stream>>>(args)` (rewritten by the build into
// `kernel % amp_emu::LaunchConfig(grid, block, smem, stream)(args)`) runs every block of the
// grid, one after another, on the calling thread; the threads of a block are fibers
// (ucontext) that switch only at __syncthreads and warp-synchronous intrinsics, so
// `__shared__` variables (statics in one section, AMP_EMU_SHARED_SECTION) belong to the block
// that runs. Warp shuffles go through a per-warp exchange. Warps are scheduled greedily in an
// order that changes from block to block, and the lanes of a warp in an order that changes
// each time the warp is resumed, so a missing __syncthreads or __syncwarp shows up as a wrong
// result. The orders are drawn from the schedule seed (AMP_EMULATION_SEED, 0 by default; a
// failure names it): one seed gives the same orders on every run.
//
// Before each block its shared memory is filled with 0xff bytes (a NaN in every float); the
// counting build also keeps a shadow byte per byte of shared memory, set by the block's
// writes, and a read of a byte the block has not written is an error (on the GPU it reads
// whatever an earlier block left).
//
// What a GPU punishes is an error here (a RuntimeError naming the kernel's source line):
// __syncthreads not reached by every thread of the block, or reached at different places;
// a shuffle whose mask names an exited or waiting lane, or which reads a lane outside it;
// a read of shared memory that the block has not written (counting build); block sizes and
// dynamic shared memory over the H100's limits or over 48 KiB without the kernel's
// cudaFuncSetAttribute; an access of dynamic shared memory past the launch's size (counting
// build); grid dimensions over CUDA's.
// Misaligned vector loads and stores are caught by the build (-fsanitize=alignment, reported
// through amp_emu's handler), out-of-bounds accesses by the AddressSanitizer build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// The section of every `__shared__` variable (amp_emu.h).
#define AMP_EMU_SHARED_SECTION "amp_emu_shared"

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

struct cudaDeviceProp {
  int multiProcessorCount;
  int maxThreadsPerBlock;
  int warpSize;
  size_t sharedMemPerBlock;
  size_t sharedMemPerBlockOptin;
  int major;
  int minor;
  size_t sharedMemPerMultiprocessor;
};

// The part of CUDA's error and function-attribute API that the kernels' launchers use.
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

struct amp_emu_stream;
using cudaStream_t = amp_emu_stream*;

// The running thread's coordinates (set by the scheduler whenever a fiber resumes).
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = 32;

namespace amp_emu {

// H100 (sm_90) limits and CUDA's launch limits.
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDimZ = 64;
constexpr size_t kMaxDynamicShared = 227 * 1024;  // with cudaFuncSetAttribute opt-in
constexpr size_t kDefaultDynamicShared = 48 * 1024;
constexpr uint64_t kMaxGridX = (uint64_t{1} << 31) - 1;
constexpr uint64_t kMaxGridYZ = 65535;

[[noreturn]] void fail(const std::string& message);

struct Dim {
  uint64_t x, y, z;
};

template <typename T>
Dim to_dim(const T& v, const char* what) {
  if constexpr (std::is_integral_v<T>) {
    if (v < 0 || static_cast<uint64_t>(v) > 0xffffffffull) {
      fail(std::string("launch: ") + what + " " + std::to_string(static_cast<long long>(v)) +
           " does not fit the unsigned int of a dim3");
    }
    return {static_cast<uint64_t>(v), 1, 1};
  } else {
    const dim3 d = v;
    return {d.x, d.y, d.z};
  }
}

struct LaunchConfig;

template <typename... A>
struct PendingLaunch {
  const LaunchConfig* config;
  std::tuple<A...> args;
};

struct LaunchConfig {
  Dim grid;
  Dim block;
  size_t shared_bytes;
  // The kernel function (its cudaFuncSetAttribute limits apply), set by operator% below.
  const void* function = nullptr;
  // The launch's kernel expression and source line (string literals), for error messages.
  const char* kernel = nullptr;
  const char* file = nullptr;
  int line = 0;
  template <typename G, typename B>
  LaunchConfig(const G& g, const B& b, size_t smem = 0, cudaStream_t = nullptr)
      : grid(to_dim(g, "grid")), block(to_dim(b, "block")), shared_bytes(smem) {}
  const LaunchConfig& named(const char* k, const char* f, int l) {
    kernel = k;
    file = f;
    line = l;
    return *this;
  }
  template <typename... A>
  PendingLaunch<std::decay_t<A>...> operator()(A&&... a) const {
    return {this, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...)};
  }
};

// Checks the configuration, then runs `body` once per thread of every block (or records it
// while a capture is open). `where` names the kernel for error messages.
void launch(const LaunchConfig& config, std::function<void()> body, const char* where);

template <typename F>
const char* kernel_name() {
  return __PRETTY_FUNCTION__;
}

// Counting of global-memory accesses on (true) or off for the running thread: off while the
// emulator itself works (its bookkeeping is not the kernel's traffic).
void thread_counting(bool on);

template <typename K, typename... A>
void operator%(K* kernel, PendingLaunch<A...>&& pending) {
  LaunchConfig config = *pending.config;
  config.function = reinterpret_cast<const void*>(kernel);
  launch(config,
         [kernel, args = std::move(pending.args)]() {
           // The kernel's parameters and address on this thread's stack: the closure lives on
           // the heap, and reading it while counting would count as the kernel's traffic.
           std::tuple<A...> local = args;
           K* const function = kernel;
           thread_counting(true);
           std::apply([function](auto&... a) { function(a...); }, local);
           thread_counting(false);
         },
         kernel_name<K>());
}

// Intrinsics (called from inside a kernel).
void syncthreads(const char* file, int line);
enum class Shuffle { kIdx, kUp, kDown, kXor };
uint64_t shuffle_bits(unsigned mask, uint64_t bits, Shuffle kind, int arg, int width,
                      const char* name);
unsigned ballot(unsigned mask, bool predicate, const char* name);
void syncwarp(unsigned mask);

template <typename T>
T shuffle(unsigned mask, T value, Shuffle kind, int arg, int width, const char* name) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a register");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = shuffle_bits(mask, bits, kind, arg, width, name);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

cudaStream_t current_stream();
const cudaDeviceProp* device_properties();
// Sets the SM count device_properties() reports; returns the previous one.
int64_t set_multiprocessor_count(int64_t count);
// Sets the opt-in shared memory per block that device_properties() reports (at most the
// H100's 227 KiB, which launches are still checked against); returns the previous value.
int64_t set_shared_memory_per_block_optin(int64_t bytes);

// Dynamic shared memory: the build rewrites `extern __shared__ T name[];` into
// `T* const name = ::amp_emu::dynamic_shared<T>();`. One buffer of the H100's maximum, of
// which a block owns the launch's shared_bytes: poisoned before each block like the static
// shared memory, and (counting build) every access checked against the launch's size and
// every read against the block's writes.
void* dynamic_shared_base();
template <typename T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_base());
}
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes): launches
// of `function` may ask for up to `bytes` of dynamic shared memory (48 KiB without).
cudaError_t set_max_dynamic_shared(const void* function, int attribute, int bytes);

// Counters of the launches since the last reset (see amp_emu_runtime.cpp).
struct Counters {
  int64_t launches;
  int64_t blocks;  // blocks of every launch (grid x * y * z)
  int64_t bytes_read;
  int64_t bytes_written;
  int64_t vector_bytes_read;
  int64_t vector_bytes_written;
  int64_t threads;  // threads of every launch (blocks times threads per block)
};
Counters counters();
void reset_counters();
// The seed of the warp and lane orders: AMP_EMULATION_SEED when the first launch runs (0
// when unset), or the last set_schedule_seed.
uint64_t schedule_seed();
void set_schedule_seed(uint64_t seed);
// Capture: launches are recorded instead of run; replay runs them again, in order.
void capture_begin();
int64_t capture_end();  // returns the graph's id
void replay(int64_t graph);
void reset_graph(int64_t graph);

}  // namespace amp_emu

// CUDA's device-side API on the emulator.
template <typename T>
T __shfl_sync(unsigned mask, T v, int lane, int width = 32) {
  return amp_emu::shuffle(mask, v, amp_emu::Shuffle::kIdx, lane, width, "__shfl_sync");
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return amp_emu::shuffle(mask, v, amp_emu::Shuffle::kUp, static_cast<int>(delta), width,
                          "__shfl_up_sync");
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return amp_emu::shuffle(mask, v, amp_emu::Shuffle::kDown, static_cast<int>(delta), width,
                          "__shfl_down_sync");
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return amp_emu::shuffle(mask, v, amp_emu::Shuffle::kXor, lane_mask, width, "__shfl_xor_sync");
}
inline unsigned __ballot_sync(unsigned mask, int p) {
  return amp_emu::ballot(mask, p != 0, "__ballot_sync");
}
inline int __any_sync(unsigned mask, int p) {
  return amp_emu::ballot(mask, p != 0, "__any_sync") != 0;
}
inline int __all_sync(unsigned mask, int p) {
  return amp_emu::ballot(mask, p != 0, "__all_sync") == amp_emu::ballot(mask, true, "__all_sync");
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { amp_emu::syncwarp(mask); }

// CUDA's host API for a kernel's attributes (the C++ overload, which takes the kernel itself).
template <typename T>
cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attribute, int value) {
  return amp_emu::set_max_dynamic_shared(reinterpret_cast<const void*>(entry),
                                         static_cast<int>(attribute), value);
}

// Blocks run one at a time, so plain read-modify-writes are atomic.
template <typename T>
T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
template <typename T>
T atomicMax(T* address, T value) {
  const T old = *address;
  *address = old < value ? value : old;
  return old;
}
template <typename T>
T atomicMin(T* address, T value) {
  const T old = *address;
  *address = value < old ? value : old;
  return old;
}
template <typename T>
T atomicExch(T* address, T value) {
  const T old = *address;
  *address = value;
  return old;
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  const T old = *address;
  if (old == compare) *address = value;
  return old;
}
inline void __threadfence() {}
