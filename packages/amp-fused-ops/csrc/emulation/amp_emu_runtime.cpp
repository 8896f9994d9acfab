// The emulator's scheduler, checks, counters and capture (see amp_emu_runtime.h).
#include "amp_emu_runtime.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <torch/library.h>

#include <cerrno>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
extern "C" {
void __asan_poison_memory_region(void const volatile* addr, size_t size);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                     size_t* size_old);
}
#define AMP_EMU_ASAN 1
#else
#define AMP_EMU_ASAN 0
#endif

// Functions that the sanitizers of either build leave alone (the counting hooks' own work).
#define AMP_EMU_UNCOUNTED __attribute__((no_sanitize_address, no_sanitize_thread))

// The linker's bounds of the section of the __shared__ variables (weak: a module without any
// has no section, and both are null).
extern "C" char __start_amp_emu_shared[] __attribute__((weak));
extern "C" char __stop_amp_emu_shared[] __attribute__((weak));

uint3 threadIdx{0, 0, 0};
uint3 blockIdx{0, 0, 0};
dim3 blockDim{1, 1, 1};
dim3 gridDim{1, 1, 1};

namespace amp_emu {

void find_module_range();

namespace {

constexpr size_t kStackBytes = AMP_EMU_ASAN ? 512 * 1024 : 128 * 1024;

enum class State { kReady, kRunning, kWaitBlock, kWaitWarp, kDone };

struct Fiber {
  ucontext_t context;
  char* stack;
  uint3 index;
  int warp;
  int lane;
  State state;
  bool counting;  // global-memory accesses of this thread are counted
  uint64_t wait_generation;
  // Counting: the aligned 16-byte segment this thread is walking through, if any.
  uintptr_t segment;
  int segment_bytes;
  bool segment_store;
};

struct Warp {
  uint64_t slots[32];
  unsigned pending_mask;
  unsigned arrived;
  uint64_t generation;
  int threads;  // lanes that exist (the last warp of a block may be partial)
};

struct BlockBarrier {
  int arrived;
  uint64_t generation;
  const char* file;
  int line;
};

struct Scheduler {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  BlockBarrier barrier{};
  ucontext_t home;
  Fiber* current = nullptr;
  std::exception_ptr error;
  const std::function<void()>* body = nullptr;
  const char* kernel = "";
  char* stacks = nullptr;
  size_t stack_count = 0;
#if AMP_EMU_ASAN
  const void* home_bottom = nullptr;
  size_t home_size = 0;
#endif
};

Scheduler& scheduler() {
  static Scheduler s;
  return s;
}

std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// --- counters -------------------------------------------------------------------------------

Counters g_counters{};
bool g_count_only = false;  // launches are checked and counted, their blocks not run
bool g_counting = false;  // true while a fiber runs (host code is not counted)
uintptr_t g_stack_lo = 0, g_stack_hi = 0;  // the fibers' stacks
uintptr_t g_home_lo = 0, g_home_hi = 0;    // the launching thread's stack

// --- schedule seed --------------------------------------------------------------------------

constexpr const char* kSeedEnv = "AMP_EMULATION_SEED";
bool g_seed_read = false;
uint64_t g_seed = 0;

std::string seed_note() {
  return " [schedule seed " + std::to_string(g_seed) + "; " + kSeedEnv + "=" +
         std::to_string(g_seed) + " repeats this order of warps and lanes]";
}

// --- shared memory ----------------------------------------------------------------------------

// The section of the __shared__ variables, and one shadow byte per byte of it: 1 once the
// running block has written the byte (kept by the counting build's hooks only).
uintptr_t g_shared_lo = 0;
size_t g_shared_size = 0;
uint8_t* g_shared_written = nullptr;
constexpr unsigned char kSharedPoison = 0xff;  // every float and half a NaN, every int -1

// Dynamic shared memory: one buffer of the most a launch may ask for; the running launch owns
// its first g_dynamic_bytes (the launch's shared_bytes), with a shadow byte each as above.
alignas(16) unsigned char g_dynamic[kMaxDynamicShared];
uint8_t g_dynamic_written[kMaxDynamicShared];
size_t g_dynamic_bytes = 0;
// The dynamic shared memory a kernel may ask for (cudaFuncSetAttribute), by kernel function.
std::map<const void*, size_t> g_dynamic_limits;

// Before each block: the block's shared memory is poison, none of it written. (The section
// is every kernel's shared variables, a few hundred KiB at most, and the dynamic part is the
// launch's: four memsets per block.)
AMP_EMU_UNCOUNTED void poison_shared() {
  std::memset(g_dynamic, kSharedPoison, g_dynamic_bytes);
  std::memset(g_dynamic_written, 0, g_dynamic_bytes);
  if (g_shared_size == 0) return;
  std::memset(reinterpret_cast<void*>(g_shared_lo), kSharedPoison, g_shared_size);
  std::memset(g_shared_written, 0, g_shared_size);
}

// The launch's dynamic shared memory: its first `bytes` of the buffer, the rest out of bounds
// for the AddressSanitizer build.
void own_dynamic_shared(size_t bytes) {
  g_dynamic_bytes = bytes;
#if AMP_EMU_ASAN
  __asan_unpoison_memory_region(g_dynamic, bytes);
  __asan_poison_memory_region(g_dynamic + bytes, kMaxDynamicShared - bytes);
#endif
}

void find_shared_section() {
  if (g_shared_written != nullptr || __start_amp_emu_shared == nullptr) return;
  g_shared_lo = reinterpret_cast<uintptr_t>(__start_amp_emu_shared);
  g_shared_size = static_cast<size_t>(__stop_amp_emu_shared - __start_amp_emu_shared);
  g_shared_written = new uint8_t[g_shared_size + 1]();
}

// --- capture --------------------------------------------------------------------------------

struct Recorded {
  LaunchConfig config;
  std::function<void()> body;
  std::string where;
};
bool g_capturing = false;
std::vector<Recorded> g_recording;
std::vector<std::unique_ptr<std::vector<Recorded>>> g_graphs;

std::string short_name(const char* pretty) {
  // "const char* amp_emu::kernel_name() [with F = void(...)]" -> the F part.
  std::string s(pretty);
  const size_t at = s.find("F = ");
  if (at != std::string::npos) s = s.substr(at + 4);
  if (!s.empty() && s.back() == ']') s.pop_back();
  return s.size() > 200 ? s.substr(0, 200) + "..." : s;
}

std::string block_name() {
  std::ostringstream out;
  out << "block (" << blockIdx.x << ", " << blockIdx.y << ", " << blockIdx.z << ")";
  return out.str();
}

void switch_to_fiber(Scheduler& s, Fiber& f) {
  s.current = &f;
  f.state = State::kRunning;
  threadIdx = f.index;
  g_counting = f.counting;
#if AMP_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
  swapcontext(&s.home, &f.context);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  swapcontext(&s.home, &f.context);
#endif
  g_counting = false;
  s.current = nullptr;
}

void switch_to_home(Scheduler& s, Fiber& f, bool exiting) {
#if AMP_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, s.home_bottom, s.home_size);
  swapcontext(&f.context, &s.home);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)exiting;
  swapcontext(&f.context, &s.home);
#endif
}

void fiber_main() {
  Scheduler& s = scheduler();
  Fiber& f = *s.current;
#if AMP_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.home_bottom, &s.home_size);
#endif
  try {
    (*s.body)();
  } catch (...) {
    if (!s.error) s.error = std::current_exception();
  }
  g_counting = false;
  f.counting = false;
  f.state = State::kDone;
  switch_to_home(s, f, /*exiting=*/true);
}

// Turns counting off for the running thread while an intrinsic does the emulator's work.
struct CountingPause {
  Fiber& fiber;
  bool saved;
  // g_counting goes off before the fiber's fields (heap memory) are touched.
  explicit CountingPause(Fiber& f) : fiber(f), saved(pause_and_read(f)) { fiber.counting = false; }
  static bool pause_and_read(Fiber& f) {
    g_counting = false;
    return f.counting;
  }
  ~CountingPause() {
    fiber.counting = saved;
    g_counting = saved;
  }
};

Fiber& current_fiber(const char* what) {
  Scheduler& s = scheduler();
  if (s.current == nullptr) {
    fail(std::string(what) + " called outside a kernel");
  }
  return *s.current;
}

void wait(Fiber& f, State state, uint64_t generation) {
  f.state = state;
  f.wait_generation = generation;
  switch_to_home(scheduler(), f, /*exiting=*/false);
  if (scheduler().error) {
    // Another thread of the block failed: unwind this one too (caught in fiber_main).
    throw std::runtime_error("amp_emu: aborted");
  }
}

bool runnable(const Scheduler& s, const Fiber& f) {
  switch (f.state) {
    case State::kReady:
      return true;
    case State::kWaitBlock:
      return s.barrier.generation != f.wait_generation;
    case State::kWaitWarp:
      return s.warps[f.warp].generation != f.wait_generation;
    default:
      return false;
  }
}

// Why no thread of the block can go on: the error a GPU would hang or misbehave on.
[[noreturn]] void deadlock(const Scheduler& s, int threads) {
  int done = 0, at_barrier = 0;
  std::ostringstream out;
  for (int t = 0; t < threads; ++t) {
    done += s.fibers[t].state == State::kDone;
    at_barrier += s.fibers[t].state == State::kWaitBlock;
  }
  for (size_t w = 0; w < s.warps.size(); ++w) {
    const Warp& warp = s.warps[w];
    if (warp.pending_mask == 0 || warp.arrived == warp.pending_mask) continue;
    for (int lane = 0; lane < 32; ++lane) {
      if (((warp.pending_mask >> lane) & 1u) && !((warp.arrived >> lane) & 1u)) {
        const int t = static_cast<int>(w) * 32 + lane;
        const char* why = t >= threads                             ? "does not exist"
                          : s.fibers[t].state == State::kDone      ? "has exited"
                          : s.fibers[t].state == State::kWaitBlock ? "waits at __syncthreads"
                                                                   : "is elsewhere";
        out << "amp_emu: " << s.kernel << ", " << block_name() << ": a warp-synchronous "
            << "intrinsic of warp " << w << " has mask 0x" << std::hex << warp.pending_mask
            << std::dec << ", which names lane " << lane << " that " << why
            << " (an inactive lane in the mask is undefined behaviour on the GPU)";
        fail(out.str());
      }
    }
  }
  out << "amp_emu: " << s.kernel << ", " << block_name() << ": __syncthreads() at "
      << (s.barrier.file ? s.barrier.file : "?") << ":" << s.barrier.line << " reached by "
      << at_barrier << " of " << threads << " threads; " << done
      << " had exited (every thread of the block must reach it)";
  fail(out.str());
}

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

void run_block(Scheduler& s, int threads, uint64_t block_index) {
  const int warps = (threads + 31) / 32;
  s.warps.assign(warps, Warp{});
  for (int w = 0; w < warps; ++w) s.warps[w].threads = std::min(32, threads - 32 * w);
  s.barrier = BlockBarrier{};
  for (int t = 0; t < threads; ++t) {
    Fiber& f = s.fibers[t];
    f.index = {static_cast<unsigned>(t % blockDim.x),
               static_cast<unsigned>((t / blockDim.x) % blockDim.y),
               static_cast<unsigned>(t / (blockDim.x * blockDim.y))};
    f.warp = t / 32;
    f.lane = t % 32;
    f.state = State::kReady;
    f.counting = false;
    f.segment_bytes = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
  }
  poison_shared();
  // Warps run greedily (each as far as it can go) in an order that varies per block; within a
  // warp, each pass over its runnable lanes takes them in a new order. Both orders come from
  // the schedule seed and the block's index only, so one seed repeats them.
  std::vector<int> order(warps);
  for (int w = 0; w < warps; ++w) order[w] = w;
  uint64_t seed = mix(block_index + 0x9e3779b97f4a7c15ull + g_seed * 0x2545f4914f6cdd1dull);
  for (int w = warps - 1; w > 0; --w) {
    seed = mix(seed);
    std::swap(order[w], order[seed % static_cast<uint64_t>(w + 1)]);
  }
  int lanes[32];
  for (;;) {
    bool progressed = false, all_done = true;
    for (int w : order) {
      const int first = 32 * w;
      const int count = std::min(threads, first + 32) - first;
      bool any = true;
      while (any) {
        any = false;
        for (int i = 0; i < count; ++i) lanes[i] = i;
        for (int i = count - 1; i > 0; --i) {
          seed = mix(seed);
          std::swap(lanes[i], lanes[seed % static_cast<uint64_t>(i + 1)]);
        }
        for (int i = 0; i < count; ++i) {
          Fiber& f = s.fibers[first + lanes[i]];
          if (!runnable(s, f)) continue;
          switch_to_fiber(s, f);
          any = progressed = true;
          if (s.error) return;
        }
      }
    }
    for (int t = 0; t < threads; ++t) all_done = all_done && s.fibers[t].state == State::kDone;
    if (all_done) return;
    if (!progressed) deadlock(s, threads);
  }
}

// Finishes the fibers of a failed block so that their stacks hold no live frames.
void drain(Scheduler& s, int threads) {
  for (int pass = 0; pass < 4; ++pass) {
    for (int t = 0; t < threads; ++t) {
      Fiber& f = s.fibers[t];
      if (f.state == State::kWaitBlock || f.state == State::kWaitWarp) switch_to_fiber(s, f);
    }
  }
}

void ensure_stacks(Scheduler& s, size_t threads) {
  if (s.stack_count >= threads) return;
  if (s.stacks != nullptr) munmap(s.stacks, s.stack_count * kStackBytes);
  const size_t count = kMaxThreadsPerBlock;
  void* mem = mmap(nullptr, count * kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) fail("amp_emu: cannot map the fibers' stacks");
  s.stacks = static_cast<char*>(mem);
  s.stack_count = count;
  s.fibers.assign(count, Fiber{});
  for (size_t t = 0; t < count; ++t) s.fibers[t].stack = s.stacks + t * kStackBytes;
  g_stack_lo = reinterpret_cast<uintptr_t>(s.stacks);
  g_stack_hi = g_stack_lo + count * kStackBytes;
}

void run(const LaunchConfig& config, const std::function<void()>& body, const char* where) {
  Scheduler& s = scheduler();
  const Dim g = config.grid, b = config.block;
  const uint64_t threads = b.x * b.y * b.z;
  std::ostringstream out;
  out << "amp_emu: launch of " << where << " with grid (" << g.x << ", " << g.y << ", " << g.z
      << ") and block (" << b.x << ", " << b.y << ", " << b.z << ")";
  const std::string launch_name = out.str();
  if (g.x == 0 || g.y == 0 || g.z == 0 || threads == 0) {
    fail(launch_name + ": an empty grid or block is an invalid configuration on the GPU");
  }
  if (g.x > kMaxGridX || g.y > kMaxGridYZ || g.z > kMaxGridYZ) {
    fail(launch_name + ": grid dimensions over CUDA's limits (2**31 - 1, 65535, 65535)");
  }
  if (threads > kMaxThreadsPerBlock || b.z > kMaxBlockDimZ) {
    fail(launch_name + ": block over the H100's limits (1024 threads, z <= 64)");
  }
  size_t dynamic_limit = kDefaultDynamicShared;
  if (const auto it = g_dynamic_limits.find(config.function); it != g_dynamic_limits.end()) {
    dynamic_limit = std::max(dynamic_limit, it->second);
  }
  if (config.shared_bytes > dynamic_limit) {
    fail(launch_name + ": " + std::to_string(config.shared_bytes) +
         " bytes of dynamic shared memory, over the kernel's limit of " +
         std::to_string(dynamic_limit) +
         " (over 48 KiB needs cudaFuncSetAttribute(kernel, "
         "cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); the H100's maximum is 227 KiB)");
  }
  ++g_counters.launches;
  g_counters.blocks += static_cast<int64_t>(g.x * g.y * g.z);
  g_counters.threads += static_cast<int64_t>(g.x * g.y * g.z) * static_cast<int64_t>(threads);
  if (g_count_only) {
    return;
  }
  find_module_range();
  find_shared_section();
  own_dynamic_shared(config.shared_bytes);
  schedule_seed();
  ensure_stacks(s, threads);
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* addr = nullptr;
    size_t size = 0;
    pthread_attr_getstack(&attr, &addr, &size);
    g_home_lo = reinterpret_cast<uintptr_t>(addr);
    g_home_hi = g_home_lo + size;
    pthread_attr_destroy(&attr);
  }
  blockDim = dim3(static_cast<unsigned>(b.x), static_cast<unsigned>(b.y),
                  static_cast<unsigned>(b.z));
  gridDim = dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y),
                 static_cast<unsigned>(g.z));
  s.body = &body;
  s.kernel = where;
  s.error = nullptr;
  uint64_t block_index = 0;
  for (uint64_t z = 0; z < g.z; ++z) {
    for (uint64_t y = 0; y < g.y; ++y) {
      for (uint64_t x = 0; x < g.x; ++x, ++block_index) {
        blockIdx = {static_cast<unsigned>(x), static_cast<unsigned>(y),
                    static_cast<unsigned>(z)};
        try {
          run_block(s, static_cast<int>(threads), block_index);
        } catch (...) {
          if (!s.error) s.error = std::current_exception();
        }
        if (s.error) {
          drain(s, static_cast<int>(threads));
          std::exception_ptr error = s.error;
          s.error = nullptr;
          // The emulator's own errors name the schedule seed that produced them.
          try {
            std::rethrow_exception(error);
          } catch (const std::runtime_error& e) {
            if (std::strncmp(e.what(), "amp_emu", 7) != 0) throw;
            fail(e.what() + seed_note());
          }
        }
      }
    }
  }
}

}  // namespace

[[noreturn]] void fail(const std::string& message) { throw std::runtime_error(message); }

void launch(const LaunchConfig& config, std::function<void()> body, const char* where) {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  // The kernel, the base name of the source file and the line of the launch, and the kernel's
  // type: "multi_tensor_kernel<Op, Ts...> (launched at <file>:429) of type void(...)"
  std::string name = short_name(where);
  if (config.kernel != nullptr) {
    name = std::string(config.kernel) + " (launched at " + config.file + ":" +
           std::to_string(config.line) + ") of type " + name;
  }
  if (g_capturing) {
    g_recording.push_back({config, std::move(body), name});
    return;
  }
  run(config, body, name.c_str());
}

uint64_t schedule_seed() {
  if (!g_seed_read) {
    g_seed_read = true;
    const char* text = std::getenv(kSeedEnv);
    if (text != nullptr && *text != '\0') {
      char* end = nullptr;
      errno = 0;
      const unsigned long long value = std::strtoull(text, &end, 10);
      if (errno != 0 || *end != '\0' || *text == '-') {
        fail(std::string("amp_emu: ") + kSeedEnv + "=" + text +
             " is not an unsigned 64-bit integer; set it to a number such as 0 or 12345, or "
             "unset it");
      }
      g_seed = value;
    }
  }
  return g_seed;
}

void set_schedule_seed(uint64_t seed) {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  g_seed_read = true;
  g_seed = seed;
}

void thread_counting(bool on) {
  // Off first, on last: the emulator's own writes (to the fiber, on the heap) are not counted.
  g_counting = false;
  Scheduler& s = scheduler();
  if (s.current != nullptr) s.current->counting = on;
  g_counting = on && s.current != nullptr;
}

void syncthreads(const char* file, int line) {
  Fiber& f = current_fiber("__syncthreads");
  const CountingPause pause(f);
  Scheduler& s = scheduler();
  BlockBarrier& b = s.barrier;
  if (b.arrived == 0) {
    b.file = file;
    b.line = line;
  } else if (b.line != line || std::strcmp(b.file, file) != 0) {
    std::ostringstream out;
    out << "amp_emu: " << s.kernel << ", " << block_name() << ": thread (" << f.index.x << ", "
        << f.index.y << ", " << f.index.z << ") reached __syncthreads() at " << file << ":"
        << line << " while others wait at " << b.file << ":" << b.line
        << " (divergent barriers are undefined behaviour on the GPU)";
    fail(out.str());
  }
  const int threads = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  if (++b.arrived == threads) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  wait(f, State::kWaitBlock, b.generation);
}

namespace {
void warp_barrier(Fiber& f, unsigned mask, const char* name) {
  Scheduler& s = scheduler();
  Warp& w = s.warps[f.warp];
  if (((mask >> f.lane) & 1u) == 0) {
    std::ostringstream out;
    out << "amp_emu: " << s.kernel << ", " << block_name() << ": lane " << f.lane << " of warp "
        << f.warp << " calls " << name << " with mask 0x" << std::hex << mask
        << ", which does not name the calling lane";
    fail(out.str());
  }
  if (w.pending_mask == 0) {
    w.pending_mask = mask;
  } else if (w.pending_mask != mask) {
    std::ostringstream out;
    out << "amp_emu: " << s.kernel << ", " << block_name() << ": lanes of warp " << f.warp
        << " call " << name << " with different masks (0x" << std::hex << w.pending_mask
        << " and 0x" << mask << ")";
    fail(out.str());
  }
  w.arrived |= 1u << f.lane;
  if (w.arrived == mask) {
    w.arrived = 0;
    w.pending_mask = 0;
    ++w.generation;
    return;
  }
  wait(f, State::kWaitWarp, w.generation);
}
}  // namespace

uint64_t shuffle_bits(unsigned mask, uint64_t bits, Shuffle kind, int arg, int width,
                      const char* name) {
  Fiber& f = current_fiber(name);
  const CountingPause pause(f);
  Scheduler& s = scheduler();
  Warp& w = s.warps[f.warp];
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
    fail(std::string("amp_emu: ") + name + ": width " + std::to_string(width) +
         " is not a power of two in [1, 32]");
  }
  w.slots[f.lane] = bits;
  warp_barrier(f, mask, name);
  const int base = f.lane / width * width;
  int src = f.lane;
  switch (kind) {
    case Shuffle::kIdx:
      src = base + ((arg % width) + width) % width;
      break;
    case Shuffle::kUp:
      src = f.lane - arg >= base ? f.lane - arg : f.lane;
      break;
    case Shuffle::kDown:
      src = f.lane + arg < base + width ? f.lane + arg : f.lane;
      break;
    case Shuffle::kXor:
      src = (f.lane ^ arg) < base + width && (f.lane ^ arg) >= base ? (f.lane ^ arg) : f.lane;
      break;
  }
  if (((mask >> src) & 1u) == 0) {
    std::ostringstream out;
    out << "amp_emu: " << s.kernel << ", " << block_name() << ": lane " << f.lane << " of warp "
        << f.warp << " reads lane " << src << " with " << name << ", but mask 0x" << std::hex
        << mask << " does not name it (the value is undefined on the GPU)";
    fail(out.str());
  }
  const uint64_t out = w.slots[src];
  warp_barrier(f, mask, name);  // nobody overwrites a slot before every lane has read
  return out;
}

unsigned ballot(unsigned mask, bool predicate, const char* name) {
  Fiber& f = current_fiber(name);
  const CountingPause pause(f);
  Warp& w = scheduler().warps[f.warp];
  w.slots[f.lane] = predicate ? 1 : 0;
  warp_barrier(f, mask, name);
  unsigned out = 0;
  for (int lane = 0; lane < 32; ++lane) {
    if (((mask >> lane) & 1u) && w.slots[lane] != 0) out |= 1u << lane;
  }
  warp_barrier(f, mask, name);
  return out;
}

void syncwarp(unsigned mask) {
  Fiber& f = current_fiber("__syncwarp");
  const CountingPause pause(f);
  warp_barrier(f, mask, "__syncwarp");
}

cudaStream_t current_stream() { return nullptr; }

namespace {
// An H100's (sm_90) properties; the SM count can be changed (set_multiprocessor_count).
cudaDeviceProp g_device{132, 1024, 32, 48 * 1024, 227 * 1024, 9, 0, 228 * 1024};
}  // namespace

const cudaDeviceProp* device_properties() { return &g_device; }

int64_t set_shared_memory_per_block_optin(int64_t bytes) {
  if (bytes < static_cast<int64_t>(kDefaultDynamicShared) ||
      bytes > static_cast<int64_t>(kMaxDynamicShared)) {
    fail("amp_emu: set_shared_memory_per_block_optin(" + std::to_string(bytes) +
         "): the size is in [49152, 232448] bytes (48 to 227 KiB)");
  }
  const int64_t previous = static_cast<int64_t>(g_device.sharedMemPerBlockOptin);
  g_device.sharedMemPerBlockOptin = static_cast<size_t>(bytes);
  return previous;
}

void* dynamic_shared_base() { return g_dynamic; }

cudaError_t set_max_dynamic_shared(const void* function, int attribute, int bytes) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) {
    fail("amp_emu: cudaFuncSetAttribute: attribute " + std::to_string(attribute) +
         " is not emulated (only cudaFuncAttributeMaxDynamicSharedMemorySize)");
  }
  if (bytes < 0 || static_cast<size_t>(bytes) > g_device.sharedMemPerBlockOptin) {
    // The GPU answers cudaErrorInvalidValue, which C10_CUDA_CHECK raises.
    fail("amp_emu: cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, " +
         std::to_string(bytes) + "): over the device's " +
         std::to_string(g_device.sharedMemPerBlockOptin) +
         " bytes of opt-in shared memory per block (cudaErrorInvalidValue)");
  }
  const std::lock_guard<std::mutex> lock(launch_mutex());
  g_dynamic_limits[function] = static_cast<size_t>(bytes);
  return cudaSuccess;
}

int64_t set_multiprocessor_count(int64_t count) {
  if (count < 1 || count > 1024) {
    fail("amp_emu: set_multiprocessor_count(" + std::to_string(count) +
         "): the count is an integer in [1, 1024]");
  }
  const int64_t previous = g_device.multiProcessorCount;
  g_device.multiProcessorCount = static_cast<int>(count);
  return previous;
}

Counters counters() { return g_counters; }
void reset_counters() { g_counters = Counters{}; }
void set_count_only(bool on) { g_count_only = on; }
bool count_only() { return g_count_only; }

void capture_begin() {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  if (g_capturing) fail("amp_emu: a capture is already open");
  g_capturing = true;
  g_recording.clear();
}

int64_t capture_end() {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  if (!g_capturing) fail("amp_emu: capture_end() without capture_begin()");
  g_capturing = false;
  g_graphs.push_back(std::make_unique<std::vector<Recorded>>(std::move(g_recording)));
  g_recording.clear();
  return static_cast<int64_t>(g_graphs.size()) - 1;
}

void replay(int64_t graph) {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  if (graph < 0 || graph >= static_cast<int64_t>(g_graphs.size()) || !g_graphs[graph]) {
    fail("amp_emu: no captured graph " + std::to_string(graph));
  }
  for (const Recorded& r : *g_graphs[graph]) run(r.config, r.body, r.where.c_str());
}

void reset_graph(int64_t graph) {
  const std::lock_guard<std::mutex> lock(launch_mutex());
  if (graph >= 0 && graph < static_cast<int64_t>(g_graphs.size())) g_graphs[graph].reset();
}

// Counting (the build with -fsanitize=thread, hooks below): every access
// of a running kernel thread that is not to its stack, the launching thread's stack or this
// module's statics (the __shared__ variables) is a global-memory access.
namespace {
uintptr_t g_module_lo = 0, g_module_hi = 0;

AMP_EMU_UNCOUNTED inline bool global_access(uintptr_t a) {
  if (a >= g_stack_lo && a < g_stack_hi) return false;
  if (a >= g_home_lo && a < g_home_hi) return false;
  if (a >= g_module_lo && a < g_module_hi) return false;
  return true;
}

// A read of shared memory that the running block has not written: the thread, the block, the
// section offset and the reading instruction (as module+offset, for addr2line).
[[noreturn]] __attribute__((noinline)) void uninitialised_shared_read(size_t offset, size_t n,
                                                                      const void* pc,
                                                                      bool dynamic) {
  g_counting = false;  // the message's own memory accesses are not the kernel's
  const Scheduler& s = scheduler();
  std::ostringstream out;
  out << "amp_emu: " << s.kernel << ", " << block_name() << ": thread (" << threadIdx.x << ", "
      << threadIdx.y << ", " << threadIdx.z << ") reads " << n
      << " byte(s) of __shared__ memory (offset " << offset
      << (dynamic ? " of the dynamic shared memory" : " of the shared section") << ") that "
      << "no thread of this block has written (uninitialised shared memory holds whatever an "
      << "earlier block left on the GPU)";
  Dl_info info;
  if (pc != nullptr && dladdr(pc, &info) != 0 && info.dli_fname != nullptr) {
    out << "; the read is at " << info.dli_fname << "+0x" << std::hex
        << (reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(info.dli_fbase))
        << std::dec << " (addr2line -Cfie <that file> <offset> names the line)";
  }
  fail(out.str());
}

// An access of dynamic shared memory past the launch's size: on the GPU, an illegal address.
[[noreturn]] __attribute__((noinline)) void dynamic_shared_overrun(size_t offset, size_t n,
                                                                   bool store) {
  g_counting = false;
  const Scheduler& s = scheduler();
  std::ostringstream out;
  out << "amp_emu: " << s.kernel << ", " << block_name() << ": thread (" << threadIdx.x << ", "
      << threadIdx.y << ", " << threadIdx.z << ") " << (store ? "writes " : "reads ") << n
      << " byte(s) at offset " << offset << " of dynamic shared memory, past the launch's "
      << g_dynamic_bytes << " bytes";
  fail(out.str());
}

AMP_EMU_UNCOUNTED void shared_access(uintptr_t a, size_t n, bool store, const void* pc) {
  if (a - reinterpret_cast<uintptr_t>(g_dynamic) < kMaxDynamicShared) {
    const size_t offset = a - reinterpret_cast<uintptr_t>(g_dynamic);
    if (offset + n > g_dynamic_bytes) dynamic_shared_overrun(offset, n, store);
    uint8_t* written = g_dynamic_written + offset;
    if (store) {
      std::memset(written, 1, n);
      return;
    }
    for (size_t i = 0; i < n; ++i) {
      if (written[i] == 0) uninitialised_shared_read(offset + i, n - i, pc, true);
    }
    return;
  }
  const size_t offset = a - g_shared_lo;
  n = std::min(n, g_shared_size - offset);
  uint8_t* written = g_shared_written + offset;
  if (store) {
    for (size_t i = 0; i < n; ++i) written[i] = 1;
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    if (written[i] == 0) uninitialised_shared_read(offset + i, n - i, pc, false);
  }
}

AMP_EMU_UNCOUNTED void count(uintptr_t a, size_t n, bool store, const void* pc) {
  if (!g_counting) return;
  if (a - g_shared_lo < g_shared_size ||
      a - reinterpret_cast<uintptr_t>(g_dynamic) < kMaxDynamicShared) {
    shared_access(a, n, store, pc);
    return;
  }
  if (!global_access(a)) return;
  (store ? g_counters.bytes_written : g_counters.bytes_read) += static_cast<int64_t>(n);
  Fiber* f = scheduler().current;
  if (f == nullptr) return;
  // A vector access: one thread walks an aligned 16-byte segment in one sequence.
  if (f->segment_bytes > 0 && f->segment_store == store &&
      a == f->segment + static_cast<uintptr_t>(f->segment_bytes) && (a & ~uintptr_t{15}) == f->segment) {
    f->segment_bytes += static_cast<int>(n);
  } else if ((a & 15u) == 0) {
    f->segment = a;
    f->segment_bytes = static_cast<int>(n);
    f->segment_store = store;
  } else {
    f->segment_bytes = 0;
    return;
  }
  if (f->segment_bytes == 16) {
    (store ? g_counters.vector_bytes_written : g_counters.vector_bytes_read) += 16;
    f->segment_bytes = 0;
  }
}

}  // namespace

// The address range of this module's loaded segments (its statics included).
int find_module(dl_phdr_info* info, size_t, void* data) {
  const uintptr_t marker = reinterpret_cast<uintptr_t>(data);
  uintptr_t lo = UINTPTR_MAX, hi = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    lo = std::min<uintptr_t>(lo, info->dlpi_addr + ph.p_vaddr);
    hi = std::max<uintptr_t>(hi, info->dlpi_addr + ph.p_vaddr + ph.p_memsz);
  }
  if (marker >= lo && marker < hi) {
    g_module_lo = lo;
    g_module_hi = hi;
    return 1;
  }
  return 0;
}

void find_module_range() {
  static const bool found = [] {
    dl_iterate_phdr(find_module, reinterpret_cast<void*>(&g_module_lo));
    return true;
  }();
  (void)found;
}

}  // namespace amp_emu

// The counting build is compiled with -fsanitize=thread and no ThreadSanitizer runtime: the
// compiler calls __tsan_readN / __tsan_writeN before every memory access, and these are the
// hooks. (AddressSanitizer's pass, used before, leaves out the check of a store to an address
// that a load of the same basic block already checked, so in-place kernels counted no
// writes; ThreadSanitizer's pass instruments every access.) The atomics that the compiler
// routes through __tsan_atomicN_* are done here, sequentially consistent whatever the order
// asked for. None of these functions is instrumented, or each would call itself.
#if defined(AMP_EMU_COUNTING)
// The instruction after the instrumented access's call: where a bad read is reported.
#define AMP_EMU_CALLER __builtin_return_address(0)
#define AMP_EMU_HOOK(SIZE)                                                                   \
  extern "C" AMP_EMU_UNCOUNTED void __tsan_read##SIZE(void* a) {                             \
    amp_emu::count(reinterpret_cast<uintptr_t>(a), SIZE, false, AMP_EMU_CALLER);             \
  }                                                                                          \
  extern "C" AMP_EMU_UNCOUNTED void __tsan_write##SIZE(void* a) {                            \
    amp_emu::count(reinterpret_cast<uintptr_t>(a), SIZE, true, AMP_EMU_CALLER);              \
  }                                                                                          \
  extern "C" AMP_EMU_UNCOUNTED void __tsan_unaligned_read##SIZE(void* a) {                   \
    amp_emu::count(reinterpret_cast<uintptr_t>(a), SIZE, false, AMP_EMU_CALLER);             \
  }                                                                                          \
  extern "C" AMP_EMU_UNCOUNTED void __tsan_unaligned_write##SIZE(void* a) {                  \
    amp_emu::count(reinterpret_cast<uintptr_t>(a), SIZE, true, AMP_EMU_CALLER);              \
  }
AMP_EMU_HOOK(1)
AMP_EMU_HOOK(2)
AMP_EMU_HOOK(4)
AMP_EMU_HOOK(8)
AMP_EMU_HOOK(16)
extern "C" AMP_EMU_UNCOUNTED void __tsan_read_range(void* a, long n) {
  amp_emu::count(reinterpret_cast<uintptr_t>(a), static_cast<size_t>(n), false, AMP_EMU_CALLER);
}
extern "C" AMP_EMU_UNCOUNTED void __tsan_write_range(void* a, long n) {
  amp_emu::count(reinterpret_cast<uintptr_t>(a), static_cast<size_t>(n), true, AMP_EMU_CALLER);
}
extern "C" AMP_EMU_UNCOUNTED void __tsan_init() {}
extern "C" AMP_EMU_UNCOUNTED void __tsan_func_entry(void*) {}
extern "C" AMP_EMU_UNCOUNTED void __tsan_func_exit(void*) {}
extern "C" AMP_EMU_UNCOUNTED void __tsan_vptr_update(void*, void*) {}
extern "C" AMP_EMU_UNCOUNTED void __tsan_vptr_read(void*) {}

#define AMP_EMU_ATOMIC(BITS, T)                                                               \
  extern "C" AMP_EMU_UNCOUNTED T __tsan_atomic##BITS##_load(const volatile void* a, int) {    \
    return __atomic_load_n(static_cast<const volatile T*>(a), __ATOMIC_SEQ_CST);              \
  }                                                                                           \
  extern "C" AMP_EMU_UNCOUNTED void __tsan_atomic##BITS##_store(volatile void* a, T v, int) { \
    __atomic_store_n(static_cast<volatile T*>(a), v, __ATOMIC_SEQ_CST);                       \
  }                                                                                           \
  AMP_EMU_ATOMIC_RMW(BITS, T, exchange, __atomic_exchange_n)                                  \
  AMP_EMU_ATOMIC_RMW(BITS, T, fetch_add, __atomic_fetch_add)                                  \
  AMP_EMU_ATOMIC_RMW(BITS, T, fetch_sub, __atomic_fetch_sub)                                  \
  AMP_EMU_ATOMIC_RMW(BITS, T, fetch_and, __atomic_fetch_and)                                  \
  AMP_EMU_ATOMIC_RMW(BITS, T, fetch_or, __atomic_fetch_or)                                    \
  AMP_EMU_ATOMIC_RMW(BITS, T, fetch_xor, __atomic_fetch_xor)                                  \
  AMP_EMU_ATOMIC_RMW(BITS, T, fetch_nand, __atomic_fetch_nand)                                \
  extern "C" AMP_EMU_UNCOUNTED bool __tsan_atomic##BITS##_compare_exchange_strong(            \
      volatile void* a, void* expected, T desired, int, int) {                                \
    return __atomic_compare_exchange_n(static_cast<volatile T*>(a), static_cast<T*>(expected), \
                                       desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);   \
  }                                                                                           \
  extern "C" AMP_EMU_UNCOUNTED bool __tsan_atomic##BITS##_compare_exchange_weak(              \
      volatile void* a, void* expected, T desired, int, int) {                                \
    return __atomic_compare_exchange_n(static_cast<volatile T*>(a), static_cast<T*>(expected), \
                                       desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);   \
  }                                                                                           \
  extern "C" AMP_EMU_UNCOUNTED T __tsan_atomic##BITS##_compare_exchange_val(                  \
      volatile void* a, T expected, T desired, int, int) {                                    \
    __atomic_compare_exchange_n(static_cast<volatile T*>(a), &expected, desired, false,       \
                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                          \
    return expected;                                                                          \
  }
#define AMP_EMU_ATOMIC_RMW(BITS, T, NAME, BUILTIN)                                         \
  extern "C" AMP_EMU_UNCOUNTED T __tsan_atomic##BITS##_##NAME(volatile void* a, T v, int) { \
    return BUILTIN(static_cast<volatile T*>(a), v, __ATOMIC_SEQ_CST);                      \
  }
AMP_EMU_ATOMIC(8, unsigned char)
AMP_EMU_ATOMIC(16, unsigned short)
AMP_EMU_ATOMIC(32, unsigned int)
AMP_EMU_ATOMIC(64, unsigned long)
extern "C" AMP_EMU_UNCOUNTED void __tsan_atomic_thread_fence(int) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
extern "C" AMP_EMU_UNCOUNTED void __tsan_atomic_signal_fence(int) {
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
}
#endif

// UBSan's report of a misaligned (or null) pointer use: in the emulator it is an error of the
// kernel that made it (the GPU raises "misaligned address" for a vector access).
namespace {
struct SourceLocation {
  const char* file;
  uint32_t line;
  uint32_t column;
};
struct TypeDescriptor {
  uint16_t kind;
  uint16_t info;
  char name[1];
};
struct TypeMismatchData {
  SourceLocation location;
  const TypeDescriptor* type;
  unsigned char log_alignment;
  unsigned char check_kind;
};
void type_mismatch(TypeMismatchData* data, uintptr_t pointer) {
  const uintptr_t alignment = uintptr_t{1} << data->log_alignment;
  std::ostringstream out;
  out << "amp_emu: " << data->location.file << ":" << data->location.line << ": ";
  if (pointer == 0) {
    out << "null pointer use of type " << data->type->name;
  } else if ((pointer & (alignment - 1)) != 0) {
    out << "misaligned access: address 0x" << std::hex << pointer << std::dec << " of type "
        << data->type->name << " needs alignment " << alignment;
  } else {
    out << "access of type " << data->type->name << " to an object too small for it";
  }
  amp_emu::fail(out.str());
}
}  // namespace

extern "C" void __ubsan_handle_type_mismatch_v1(TypeMismatchData* data, uintptr_t pointer) {
  type_mismatch(data, pointer);
}
extern "C" void __ubsan_handle_type_mismatch_v1_abort(TypeMismatchData* data,
                                                      uintptr_t pointer) {
  type_mismatch(data, pointer);
}

namespace {
std::vector<int64_t> counters_op() {
  const amp_emu::Counters c = amp_emu::counters();
  return {c.launches,          c.bytes_read, c.bytes_written, c.vector_bytes_read,
          c.vector_bytes_written, c.blocks,     c.threads};
}
int64_t schedule_seed_op() { return static_cast<int64_t>(amp_emu::schedule_seed()); }
void set_schedule_seed_op(int64_t seed) {
  if (seed < 0) {
    amp_emu::fail("amp_emu: set_schedule_seed(" + std::to_string(seed) +
                  "): the seed is a non-negative integer");
  }
  amp_emu::set_schedule_seed(static_cast<uint64_t>(seed));
}
bool counting_op() {
#if defined(AMP_EMU_COUNTING)
  return true;
#else
  return false;
#endif
}
}  // namespace

TORCH_LIBRARY(amp_emu, m) {
  m.def("counters", &counters_op);
  m.def("counting", &counting_op);
  m.def("reset_counters", &amp_emu::reset_counters);
  m.def("set_count_only", &amp_emu::set_count_only);
  m.def("count_only", &amp_emu::count_only);
  m.def("capture_begin", &amp_emu::capture_begin);
  m.def("capture_end", &amp_emu::capture_end);
  m.def("replay", &amp_emu::replay);
  m.def("reset_graph", &amp_emu::reset_graph);
  m.def("schedule_seed", &schedule_seed_op);
  m.def("set_schedule_seed", &set_schedule_seed_op);
  m.def("set_multiprocessor_count", &amp_emu::set_multiprocessor_count);
  m.def("set_shared_memory_per_block_optin", &amp_emu::set_shared_memory_per_block_optin);
}
