// Stochastic rounding of float32 results to bfloat16, written once for the CUDA functors
// (csrc/cuda), the CPU loops (csrc/cpu) and the CUDA-on-CPU emulator. The pure-PyTorch
// reference (src/amp_fused_ops/reference/_stochastic_round.py) computes the same bits with int64
// tensors.
//
// Rounding: x's float32 bits plus 16 random bits, then the low 16 bits cleared. x rounds up (away
// from zero) to the next bfloat16 with probability (its distance from the bfloat16 below) /
// (the gap between the two), so E[round(x)] = x. inf and nan are returned unchanged (the store's
// conversion keeps them); a finite x above the largest bfloat16 rounds to inf with probability
// proportional to its distance from that largest value, as if inf were the next bfloat16.
//
// The random bits are a pure function of (seed, step, tensor, offset): Philox4x32-10 (Salmon et
// al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) keyed by the 64-bit seed, on the
// counter (offset low 32 bits, offset high 32 bits, tensor, step low 32 bits); the top 16 bits
// of its first output word are the element's. `tensor` is the index of the element's tensor in
// the launch's lists and `offset` its index inside that tensor, so the bits depend neither on
// the chunk size nor on which thread or block handles the element.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <cstring>

namespace amp_fused_ops {
namespace math {

// The key of one launch: the seed and the step (only the step's low 32 bits enter the counter).
struct StochasticRoundKey {
  uint32_t seed_lo;
  uint32_t seed_hi;
  uint32_t step;
};

inline StochasticRoundKey stochastic_round_key(int64_t seed, int64_t step) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return {static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32),
          static_cast<uint32_t>(static_cast<uint64_t>(step))};
}

C10_HOST_DEVICE inline void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

// The first output word of Philox4x32-10 on counter (c0, c1, c2, c3) with key (k0, k1).
C10_HOST_DEVICE inline uint32_t philox4x32_10_first(uint32_t c0, uint32_t c1, uint32_t c2,
                                                    uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u;
  constexpr uint32_t kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u;
  constexpr uint32_t kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, hi0, lo0);
    philox_mulhilo(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return c0;
}

// The 16 random bits of element `offset` of tensor `tensor`, in [0, 65536).
C10_HOST_DEVICE inline uint32_t stochastic_round_bits(const StochasticRoundKey& key,
                                                      uint32_t tensor, int64_t offset) {
  const uint64_t o = static_cast<uint64_t>(offset);
  return philox4x32_10_first(static_cast<uint32_t>(o), static_cast<uint32_t>(o >> 32), tensor,
                             key.step, key.seed_lo, key.seed_hi) >>
         16;
}

// x rounded stochastically to a bfloat16 value (returned as float32, its low 16 bits zero, so
// that the store's conversion to bfloat16 is exact); `bits` in [0, 65536).
C10_HOST_DEVICE inline float stochastic_round_bf16(float x, uint32_t bits) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7F800000u) == 0x7F800000u) {
    return x;  // inf or nan: the conversion keeps them
  }
  // Carries go into the exponent: the largest finite values may round up to inf.
  u = (u + bits) & 0xFFFF0000u;
  float out;
  std::memcpy(&out, &u, sizeof(out));
  return out;
}

}  // namespace math
}  // namespace amp_fused_ops
