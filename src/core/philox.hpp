// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") and the one
// dropout rule every backend uses, so the reference, CPU and GPU keep identical elements.
#pragma once
#include <cstdint>

#include "hd.hpp"

namespace flashport {

struct Philox4 {
  uint32_t x[4];
};

FP_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  // One IMAD.WIDE.U32 whose register pair is (lo, hi). From the 64-bit product and its shift,
  // ptxas (CUDA 13.0, sm_90a) also adds a zeroed uniform register to hi: two more instructions a
  // round, a fifth of a call.
  asm("{\n.reg .b64 p;\nmul.wide.u32 p, %2, %3;\nmov.b64 {%1, %0}, p;\n}" : "=r"(hi), "=r"(lo) : "r"(a), "r"(b));
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

// The round multipliers and the key's Weyl increments (also read by the CPU backend's SIMD form,
// cpu_kernels.inc dropout_mask_rows).
inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

// Ten rounds; the key is bumped by the Weyl constants before every round but the first.
FP_HD Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kPhiloxM0, c.x[0], hi0, lo0);
    philox_mulhilo(kPhiloxM1, c.x[2], hi1, lo1);
    c = Philox4{{hi1 ^ c.x[1] ^ k0, lo1, hi0 ^ c.x[3] ^ k1, lo0}};
  }
  return c;
}

// The dropout rule. One Philox call gives 16 keep bytes, those of keys 16(j/16) .. 16(j/16) + 15
// of row i: key j's byte is byte j % 4 of word (j / 4) % 4, and the element is kept iff that byte
// >= the threshold round(p * 256), clamped to [1, 255] when p > 0 (as FlashAttention-2, p runs at
// 1/256 resolution: a quarter of the Philox work of one 32-bit word per key). Kept elements are
// scaled by 1 / (1 - threshold / 256), the inverse of the actual keep rate, so the expectation
// of every output is exact.
FP_HD uint32_t dropout_threshold(float p) {
  if (!(p > 0.0f)) return 0;
  const double t = static_cast<double>(p) * 256.0 + 0.5;
  return t < 1.0 ? 1u : t >= 255.0 ? 255u : static_cast<uint32_t>(t);
}
FP_HD float dropout_keep_scale(uint32_t threshold) { return 256.0f / static_cast<float>(256u - threshold); }

// The Philox words of keys 16(j/16) .. 16(j/16) + 15 of row i of (batch b, query head h):
//   counter = { j/16, i, lo32(offset + b*Hq + h), hi32(offset + b*Hq + h) },  key = seed.
// Row i and key j are positions inside the sequence (varlen: relative to its start).
FP_HD Philox4 dropout_words(uint64_t seed, uint64_t offset, int64_t b, int64_t hq, int64_t h,
                            int64_t i, int64_t j) {
  const uint64_t stream = offset + static_cast<uint64_t>(b * hq + h);
  Philox4 c{{static_cast<uint32_t>(j >> 4), static_cast<uint32_t>(i),
             static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Key j's keep byte of its call's words (selects, not an indexed pick: no Philox state goes
// through local memory or scratch).
FP_HD uint32_t dropout_byte(const Philox4& w, int64_t j) {
  const uint32_t word = (j & 8) ? ((j & 4) ? w.x[3] : w.x[2]) : ((j & 4) ? w.x[1] : w.x[0]);
  return (word >> (8 * (j & 3))) & 0xFFu;
}

FP_HD bool dropout_keep(uint64_t seed, uint64_t offset, uint32_t threshold, int64_t b, int64_t hq,
                        int64_t h, int64_t i, int64_t j) {
  return dropout_byte(dropout_words(seed, offset, b, hq, h, i, j), j) >= threshold;
}

}  // namespace flashport
