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
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// Ten rounds; the key is bumped by the Weyl constants before every round but the first.
FP_HD Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, c.x[0], hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, c.x[2], hi1, lo1);
    c = Philox4{{hi1 ^ c.x[1] ^ k0, lo1, hi0 ^ c.x[3] ^ k1, lo0}};
  }
  return c;
}

// Elements with a Philox word below this threshold are dropped: floor(p * 2^32).
FP_HD uint32_t dropout_threshold(float p) {
  const double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

// The four Philox words for keys j = 4*(j/4) .. 4*(j/4)+3 of row i of (batch b, query head h).
//   counter = { j/4, i, lo32(offset + b*Hq + h), hi32(offset + b*Hq + h) },  key = seed.
// Row i and key j are positions inside the sequence (varlen: relative to its start).
FP_HD Philox4 dropout_words(uint64_t seed, uint64_t offset, int64_t b, int64_t hq, int64_t h,
                            int64_t i, int64_t j) {
  const uint64_t stream = offset + static_cast<uint64_t>(b * hq + h);
  Philox4 c{{static_cast<uint32_t>(j >> 2), static_cast<uint32_t>(i),
             static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

FP_HD bool dropout_keep(uint64_t seed, uint64_t offset, uint32_t threshold, int64_t b, int64_t hq,
                        int64_t h, int64_t i, int64_t j) {
  return dropout_words(seed, offset, b, hq, h, i, j).x[j & 3] >= threshold;
}

}  // namespace flashport
