// Dropout on the Hopper kernels: the keep bits of a thread's wgmma accumulator elements under the
// rule of every backend (core/philox.hpp: one Philox4x32-10 call gives the words of keys
// 4(j/4) .. 4(j/4) + 3 of row i; an element is kept iff its word >= the threshold), each Philox
// call made by one lane only and its bits handed to the lanes holding the elements by shuffles.
//
// wgmma accumulator layout (m64nN): lane l of a warp holds accumulator rows l/4 and l/4 + 8 and
// columns 8t + 2(l % 4) + {0, 1} of every 8-column tile t, element [4t + 2hf + e2].
//   Forward (rows = queries, columns = keys): the 4 keys of a Philox call are the columns of a
//     lane pair (l, l ^ 1), for both rows: the even lane makes row hf = 0's call, the odd lane
//     row hf = 1's, one shuffle per tile step trades the halves.
//   Backward (P^T: rows = keys, columns = queries): the 4 keys of a call sit in the 4 lanes
//     l, l ^ 4, l ^ 8, l ^ 12 (rows l/4 .. of one 4-row group), which hold 4 calls between
//     them per 8-query tile (2 queries x the hf = 0 / hf = 1 key groups): lane x of the group
//     makes call x, and a 4 x 4 bit transpose over the group (two shuffle stages) hands every
//     lane the bits of its own elements.
// Included by the sm_90a kernels only.
#pragma once
#include <cstdint>

#include "core/philox.hpp"
#include "core/score_rules.hpp"

namespace flashport::gpu::sm90 {

// 1 / (1 - p): the scale of kept elements.
__device__ __forceinline__ float dropout_keep_scale(const ScoreRules& R) { return 1.0f / (1.0f - R.dropout_p); }

// Forward: the keep bits of this thread's two rows (query i_row0 and i_row0 + 8) for the
// kNTiles 8-key tiles of keys [n0, n0 + 8 kNTiles): bit 2t + e2 of keep[hf] is element
// [4t + 2hf + e2]. Row positions and keys are those of the sequence; h the query head.
template <int kNTiles>
__device__ __forceinline__ void fwd_keep_bits(uint32_t (&keep)[2], const ScoreRules& R, int b, int hq, int h,
                                              int i_row0, int n0) {
  static_assert(2 * kNTiles <= 32, "one keep word per row");
  const int lane = threadIdx.x & 31;
  const int odd = lane & 1;              // this lane's call: row hf = odd
  const int key_pair = (lane & 2) * 2;   // the call's first key in the tile: 0 or 4
  const uint64_t seed = R.rng_seed(), offset = R.rng_offset();
  const uint32_t threshold = R.dropout_threshold;
  const int i = i_row0 + 8 * odd;
  uint32_t mine = 0, theirs = 0;  // row `odd`'s bits of this lane's keys and of the partner's
  // Two calls per iteration: some overlap of their multiply chains, few live registers (the
  // consumer holds O, S and the in-flight P fragments here).
#pragma unroll 2
  for (int t = 0; t < kNTiles; ++t) {
    const Philox4 w = dropout_words(seed, offset, b, hq, h, i, n0 + 8 * t + key_pair);
    // The even lane holds keys +0, +1 of the call, the odd one +2, +3.
    const uint32_t m0 = odd ? w.x[2] : w.x[0], m1 = odd ? w.x[3] : w.x[1];
    const uint32_t p0 = odd ? w.x[0] : w.x[2], p1 = odd ? w.x[1] : w.x[3];
    mine |= (uint32_t(m0 >= threshold) | (uint32_t(m1 >= threshold) << 1)) << (2 * t);
    theirs |= (uint32_t(p0 >= threshold) | (uint32_t(p1 >= threshold) << 1)) << (2 * t);
  }
  const uint32_t got = __shfl_xor_sync(0xffffffffu, theirs, 1);  // the partner row's bits of my keys
  keep[0] = odd ? got : mine;
  keep[1] = odd ? mine : got;
}

// Forward: P elements of dropped positions to 0 (s: one tile of P, keys [n0, n0 + 8 kNTiles)).
// A row's keep word holds 16 tiles: wider tiles (D128's 160 keys: 20) go in equal chunks.
template <int kNTiles>
__device__ __forceinline__ void fwd_apply_dropout(float (&s)[4 * kNTiles], const ScoreRules& R, int b, int hq,
                                                  int h, int i_row0, int n0) {
  constexpr int kChunks = (kNTiles + 15) / 16, kChunkTiles = kNTiles / kChunks;
  static_assert(kChunks * kChunkTiles == kNTiles, "equal chunks of at most 16 tiles");
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    uint32_t keep[2];
    fwd_keep_bits<kChunkTiles>(keep, R, b, hq, h, i_row0, n0 + c * 8 * kChunkTiles);
#pragma unroll
    for (int t = 0; t < kChunkTiles; ++t)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2)
          if (!((keep[hf] >> (2 * t + e2)) & 1u)) s[4 * (c * kChunkTiles + t) + 2 * hf + e2] = 0.0f;
  }
}

// Backward: the keep bits of this thread's elements of P^T (keys key0 and key0 + 8, queries
// q0 + 8t + 2(lane % 4) + {0, 1}, t < kQTiles): bit 4t + 2hf + e2 of the bit string `keep`
// (32 bits a word) is element [4t + 2hf + e2]. key0: this lane's hf = 0 key (rows l/4 of its
// warp's 16; 4-aligned groups of keys, so key0 - (l/4) % 4 starts this lane's group).
template <int kQTiles>
__device__ __forceinline__ void bwd_keep_bits(uint32_t (&keep)[(4 * kQTiles + 31) / 32], const ScoreRules& R, int b,
                                              int hq, int h, int q0, int key0) {
  constexpr int kWords = (4 * kQTiles + 31) / 32;
  static_assert(kQTiles <= 16, "64 keep bits");
  const int lane = threadIdx.x & 31;
  const int x = (lane >> 2) & 3;  // this lane's key within its group, and the call it makes
  const int col_base = (lane & 3) * 2;
  const uint64_t seed = R.rng_seed(), offset = R.rng_offset();
  const uint32_t threshold = R.dropout_threshold;
  // Call x: query e2 = x & 1 of the lane's pair, keys of row group hf = x >> 1.
  const int key_group = key0 - x + 8 * (x >> 1);
  const int i_base = q0 + col_base + (x & 1);
  // One call per iteration: the kernels make these bits while their dV, dK, dQ products run, with
  // dK, dV and the products' register operands live (unrolled by 2, D64 and D128 spilled).
  uint64_t bits = 0;
#pragma unroll 1
  for (int t = 0; t < kQTiles; ++t) {
    const Philox4 wd = dropout_words(seed, offset, b, hq, h, i_base + 8 * t, key_group);
    const uint64_t nib = uint64_t(wd.x[0] >= threshold) | (uint64_t(wd.x[1] >= threshold) << 1) |
                         (uint64_t(wd.x[2] >= threshold) << 2) | (uint64_t(wd.x[3] >= threshold) << 3);
    bits |= nib << (4 * t);
  }
#pragma unroll
  for (int w = 0; w < kWords; ++w) keep[w] = uint32_t(bits >> (32 * w));
  // Nibble t of lane x: bit k = call x's bit of key k. Transpose the 4 x 4 bits of every nibble
  // over the group's lanes (stage 0: lanes x ^ 1 swap bit 0, stage 1: x ^ 2, bit 1), after which
  // bit k of lane x is call k's bit of key x: element [4t + k] of this lane.
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    uint32_t v = keep[w];
    uint32_t p = __shfl_xor_sync(0xffffffffu, v, 4);
    v = (x & 1) ? ((v & 0xAAAAAAAAu) | ((p & 0xAAAAAAAAu) >> 1)) : ((v & 0x55555555u) | ((p & 0x55555555u) << 1));
    p = __shfl_xor_sync(0xffffffffu, v, 8);
    v = (x & 2) ? ((v & 0xCCCCCCCCu) | ((p & 0xCCCCCCCCu) >> 2)) : ((v & 0x33333333u) | ((p & 0x33333333u) << 2));
    keep[w] = v;
  }
}

}  // namespace flashport::gpu::sm90
