// Dropout on the Hopper kernels: the keep bits of a thread's wgmma accumulator elements under the
// rule of every backend (core/philox.hpp: one Philox4x32-10 call gives the keep bytes of keys
// 16(j/16) .. 16(j/16) + 15 of row i). Each call is made by one lane only; its bits reach the
// lanes holding the elements by shuffles.
//
// wgmma accumulator layout (m64nN): lane l of a warp holds accumulator rows l/4 and l/4 + 8 and
// columns 8t + 2(l % 4) + {0, 1} of every 8-column tile t, element [4t + 2hf + e2].
//   Forward (rows = queries, columns = keys): a call's 16 keys are two tiles of one row, held by
//     the 4 lanes of a quad (2 + 2 keys each). A quad holds 2 rows x kNTiles / 2 calls: lane q
//     makes those of row q % 2 and every other call of that row, then hands each quad partner
//     its 4 bits of each of them (3 shuffles), in the bytes' top-bit order (fwd_keep_bit).
//   Backward (P^T: rows = keys, columns = queries): a call's 16 keys are the 16 rows of the
//     warp's slab, one query column: the 8 lanes l % 4 = c hold them for the columns 2c, 2c + 1
//     of every tile. Lane (r = l/4, c) makes the calls of its column pair whose index 2t + e2 is
//     r mod 8, and an 8 x 8 bit transpose over those 8 lanes (3 shuffle stages, 4 matrices a
//     word) hands every lane the bits of its own keys.
// Included by the sm_90a kernels only.
#pragma once
#include <cstdint>

#include "core/philox.hpp"
#include "core/score_rules.hpp"

namespace flashport::gpu::sm90 {

// In each 16-bit half of x, its 2-bit pairs g0..g7 (g0 lowest) to the order g0 g4 g1 g5 g2 g6 g3
// g7 by two swaps (nibble 1 <-> nibble 2, then the middle pairs of each byte): a call's bits of
// keys 2d, 2d + 1 (byte 0) and 8 + 2d, 9 + 2d (byte 1) side by side in nibble d.
__device__ __forceinline__ uint32_t interleave_key_pairs(uint32_t x) {
  uint32_t t = ((x >> 4) ^ x) & 0x00F000F0u;
  x ^= t ^ (t << 4);
  t = ((x >> 2) ^ x) & 0x0C0C0C0Cu;
  return x ^ t ^ (t << 2);
}

// Per byte of x: bit 7 set iff the byte >= the threshold (t4: the threshold in every byte, t4_low:
// t4 & 0x7F7F7F7F); the other bits are garbage. d = (x | 0x80..) - t4_low borrows across no byte
// and has bit 7 set iff x's low 7 bits >= the threshold's; x >= t iff x's top bit is set and t's
// is not, or they are equal and d's is set: 3 instructions a word (the full-byte compare and the
// bit gather of dropout_keep_bits16 take 9).
__device__ __forceinline__ uint32_t bytes_ge_top_bits(uint32_t x, uint32_t t4, uint32_t t4_low) {
  const uint32_t d = (x | 0x80808080u) - t4_low;
  return (x & ~t4) | (~(x ^ t4) & d);
}

// Forward keep-word layout: element [4t + 2hf + e2] (key 8t + 2(lane % 4) + e2 of row hf) of a
// thread is bit fwd_keep_bit(t, e2) of keep[hf]. A 16-key call u = t / 2 (u = 2m + half) lands in
// the word's 16-bit half `half`, at the positions its byte top bits take (fwd_keep_bits).
__host__ __device__ constexpr int fwd_keep_bit(int t, int e2) {
  return 16 * ((t >> 1) & 1) + 7 + 8 * e2 - (t & 1) - 2 * (t >> 2);
}

// Forward: the keep bits of this thread's two rows (query i_row0 and i_row0 + 8) for the
// kNTiles 8-key tiles of keys [n0, n0 + 8 kNTiles), n0 a multiple of 16, in the layout of
// fwd_keep_bit. A call's 16 keys are two tiles of one row, held by the 4 lanes of a quad (2 + 2
// keys each): lane d holds keys 2d, 2d + 1 (bytes 2(d % 2) + {0, 1} of word d / 2) and 8 + 2d,
// 9 + 2d (the same bytes of word 2 + d / 2). So the top bits of words j and 2 + j, the second
// shifted down by one, hold what lanes 2j (low half) and 2j + 1 (high half) need at bits 7, 15,
// 6, 14 of their half; a lane's calls m = 0, 1, .. go 2m further down, side by side.
template <int kNTiles>
__device__ __forceinline__ void fwd_keep_bits(uint32_t (&keep)[2], const ScoreRules& R, int b, int hq, int h,
                                              int i_row0, int n0) {
  static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "whole 16-key calls, one keep word per row");
  constexpr int kCalls = kNTiles / 2;  // per row
  const int q = threadIdx.x & 3;       // lane within the quad
  const int my_hf = q & 1, my_half = q >> 1;
  const uint64_t seed = R.rng_seed(), offset = R.rng_offset();
  const uint32_t t4 = R.dropout_threshold * 0x01010101u, t4_low = t4 & 0x7F7F7F7Fu;
  // to[j]: the bits of my calls (row my_hf, u = 2m + my_half) for quad lanes 2j (low half) and
  // 2j + 1 (high half).
  uint32_t to[2] = {0u, 0u};
#pragma unroll
  for (int m = 0; m < (kCalls + 1) / 2; ++m) {
    const int u = 2 * m + my_half;
    if (kCalls % 2 == 0 || u < kCalls) {
      const Philox4 w = dropout_words(seed, offset, b, hq, h, i_row0 + 8 * my_hf, n0 + 16 * u);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t lo = bytes_ge_top_bits(w.x[j], t4, t4_low) & 0x80808080u;
        const uint32_t hi = (bytes_ge_top_bits(w.x[2 + j], t4, t4_low) >> 1) & 0x40404040u;
        to[j] |= (lo | hi) >> (2 * m);
      }
    }
  }
  // Quad lane d's 16 bits of what lane `from` made: half d % 2 of to[d / 2].
  auto half_of = [&](uint32_t word) { return (word >> (16 * (q & 1))) & 0xFFFFu; };
  const uint32_t mine = half_of(q & 2 ? to[1] : to[0]);
  uint32_t got[4];
#pragma unroll
  for (int x = 1; x < 4; ++x)  // the partner q ^ x gets to[(q ^ x) / 2], whole; it takes its half
    got[x] = half_of(__shfl_xor_sync(0xffffffffu, (q ^ x) & 2 ? to[1] : to[0], x));
  // Row my_hf: my calls (half my_half) and partner q ^ 2's; the other row: partners q ^ 1 (same
  // half as mine) and q ^ 3.
  const int sh_mine = 16 * my_half, sh_other = 16 - sh_mine;
  const uint32_t same = (mine << sh_mine) | (got[2] << sh_other);
  const uint32_t other = (got[1] << sh_mine) | (got[3] << sh_other);
  keep[0] = my_hf ? other : same;
  keep[1] = my_hf ? same : other;
}

// Forward: P elements of dropped positions to 0 (s: one tile of P; keep: fwd_keep_bits of its
// keys; dropout's key tiles hold at most 128 keys: one keep word per row).
template <int kNTiles>
__device__ __forceinline__ void fwd_apply_dropout(float (&s)[4 * kNTiles], const ScoreRules& R, int b, int hq,
                                                  int h, int i_row0, int n0) {
  uint32_t keep[2];
  fwd_keep_bits<kNTiles>(keep, R, b, hq, h, i_row0, n0);
#pragma unroll
  for (int t = 0; t < kNTiles; ++t)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2)
        if (!((keep[hf] >> fwd_keep_bit(t, e2)) & 1u)) s[4 * t + 2 * hf + e2] = 0.0f;
}

// Backward: the keep bits of this thread's elements of P^T (keys key0 and key0 + 8, queries
// q0 + 8t + 2(lane % 4) + {0, 1}, t < kQTiles): bit 4t + 2hf + e2 of the bit string `keep`
// (32 bits a word) is element [4t + 2hf + e2]. key0: this lane's hf = 0 key (row l/4 of its
// warp's 16-aligned slab of 16 keys).
template <int kQTiles>
__device__ __forceinline__ void bwd_keep_bits(uint32_t (&keep)[(4 * kQTiles + 31) / 32], const ScoreRules& R, int b,
                                              int hq, int h, int q0, int key0) {
  static_assert(kQTiles % 4 == 0 && kQTiles <= 16, "whole calls per lane, 64 keep bits");
  constexpr int kCalls = kQTiles / 4;  // per lane: 8 lanes share a column pair's 2 kQTiles calls
  constexpr int kWords = (kCalls + 1) / 2;
  const int lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;
  const uint64_t seed = R.rng_seed(), offset = R.rng_offset();
  // Word w: calls m = 2w, 2w + 1 of this lane (query q0 + 8t + 2c + e2 with 2t + e2 = 8m + r),
  // each call's 16 bits (bit k: key key0 - r + k) at bit 16(m % 2), i.e. two bytes: keys 0..7
  // (hf 0), 8..15 (hf 1). A word is exchanged as soon as it is made: one word of state.
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    uint32_t x = 0u, p;
    // One call per iteration: the kernels make these bits while their products run, with dK, dV
    // and the products' register operands live.
#pragma unroll 1
    for (int m = 2 * w; m < 2 * w + 2 && m < kCalls; ++m) {
      const int k2 = 8 * m + r;
      const Philox4 wd = dropout_words(seed, offset, b, hq, h, q0 + 8 * (k2 >> 1) + 2 * c + (k2 & 1), key0 - r);
      x |= dropout_keep_bits16(wd, R.dropout_threshold) << (16 * (m & 1));
    }
    // Byte (m, hf) of lane r' is row r' of an 8 x 8 bit matrix (bit k: key k + 8hf). Transposed
    // over the lanes r (xor 4, 8, 16 on the lane), lane r's byte holds bit r' = call r''s bit of
    // its key.
    p = __shfl_xor_sync(0xffffffffu, x, 4);
    x = (r & 1) ? ((x & 0xAAAAAAAAu) | ((p & 0xAAAAAAAAu) >> 1)) : ((x & 0x55555555u) | ((p & 0x55555555u) << 1));
    p = __shfl_xor_sync(0xffffffffu, x, 8);
    x = (r & 2) ? ((x & 0xCCCCCCCCu) | ((p & 0xCCCCCCCCu) >> 2)) : ((x & 0x33333333u) | ((p & 0x33333333u) << 2));
    p = __shfl_xor_sync(0xffffffffu, x, 16);
    x = (r & 4) ? ((x & 0xF0F0F0F0u) | ((p & 0xF0F0F0F0u) >> 4)) : ((x & 0x0F0F0F0Fu) | ((p & 0x0F0F0F0Fu) << 4));
    // Bit r' of byte (m, hf) is element [4t + 2hf + e2] with t = 4m + r'/2, e2 = r' % 2: in each
    // call's 16 bits the 2-bit pairs p of the hf 0 byte go to bits 4p + {0, 1}, those of hf 1 to
    // 4p + {2, 3}.
    keep[w] = interleave_key_pairs(x);
  }
#pragma unroll
  for (int w = kWords; w < (4 * kQTiles + 31) / 32; ++w) keep[w] = 0u;
}

}  // namespace flashport::gpu::sm90
