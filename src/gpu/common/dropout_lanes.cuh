// Dropout keep bits of a thread's accumulator elements on NVIDIA GPUs, under the rule of every
// backend (core/philox.hpp: one Philox4x32-10 call gives the keep bytes of keys 16(j/16) ..
// 16(j/16) + 15 of row i). Each call is made by one lane only; its bits reach the lanes holding
// the elements by shuffles.
//
// Accumulator layout, the same per 8-column tile for wgmma (m64nN, the Hopper kernels) and
// mma.sync m16n8 (the forward main loop, fwd_kernel.cuh): lane l of a warp holds rows l/4 and
// l/4 + 8 and columns 8t + 2(l % 4) + {0, 1} of every 8-column tile t, element [4t + 2hf + e2]
// (mma.sync: tile t's register 2hf + e2).
//   Forward (rows = queries, columns = keys): a call's 16 keys are two tiles of one row, held by
//     the 4 lanes of a quad (2 + 2 keys each). A quad holds 2 rows x kNTiles / 2 calls: lane q
//     makes those of row q % 2 and every other call of that row, then hands each quad partner
//     its 4 bits of each of them (3 shuffles), in the bytes' top-bit order (fwd_keep_bit). The
//     mma.sync and fp32 forwards zero dropped fp32 P (fwd_zero_dropped), the Hopper forward its
//     packed 16-bit P, a pair at a time (fwd_drop_packed).
//   Backward (P^T: rows = keys, columns = queries): a call's 16 keys are the 16 rows of the
//     warp's slab, one query column: the 8 lanes l % 4 = c hold them for the columns 2c, 2c + 1
//     of every tile. Lane (r = l/4, c) makes the calls of its column pair whose index 2t + e2 is
//     r mod 8, and an 8 x 8 bit transpose over those 8 lanes (3 shuffle stages, 4 matrices a
//     word) hands every lane the bits of its own keys, in the bytes' top-bit order (bwd_keep_bit).
// CUDA only (32-lane warps; the AMD layouts of the shared forward keep their own code).
#pragma once
#include <cstdint>

#include "core/philox.hpp"
#include "core/score_rules.hpp"

namespace flashport::gpu {

// Per byte of x: bit 7 set iff the byte >= the threshold (t4: the threshold in every byte, t4_low:
// t4 & 0x7F7F7F7F); the other bits are garbage. d = (x | 0x80..) - t4_low borrows across no byte
// and has bit 7 set iff x's low 7 bits >= the threshold's; x >= t iff x's top bit is set and t's
// is not, or they are equal and d's is set: 3 instructions a word (a full-byte SIMD compare and a
// gather of 16 ordered bits took 9, before session 16).
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

// Forward: the keep bits of this thread's two rows for the kNTiles 8-key tiles of keys
// [n0, n0 + 8 kNTiles), n0 a multiple of 16, in the layout of fwd_keep_bit. (h_mine, i_mine): head
// and query of the row whose calls this lane makes, its row hf = lane % 2 (l/4 + 8 (l % 2)); rows
// may differ in head as well as query (the mma.sync forward's packed GQA rows). A call's 16 keys are two tiles of one row, held by the 4 lanes of a quad (2 + 2
// keys each): lane d holds keys 2d, 2d + 1 (bytes 2(d % 2) + {0, 1} of word d / 2) and 8 + 2d,
// 9 + 2d (the same bytes of word 2 + d / 2). So the top bits of words j and 2 + j, the second
// shifted down by one, hold what lanes 2j (low half) and 2j + 1 (high half) need at bits 7, 15,
// 6, 14 of their half; a lane's calls m = 0, 1, .. go 2m further down, side by side.
template <int kNTiles>
__device__ __forceinline__ void fwd_keep_bits(uint32_t (&keep)[2], const ScoreRules& R, int b, int hq, int h_mine,
                                              int i_mine, int n0) {
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
      const Philox4 w = dropout_words(seed, offset, b, hq, h_mine, i_mine, n0 + 16 * u);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t lo = bytes_ge_top_bits(w.x[j], t4, t4_low) & 0x80808080u;
        const uint32_t hi = (bytes_ge_top_bits(w.x[2 + j], t4, t4_low) >> 1) & 0x40404040u;
        to[j] |= (lo | hi) >> (2 * m);
      }
    }
  }
  // This lane's 16 bits of a word to[q / 2] that some quad lane made for lanes q & 2, (q & 2) + 1:
  // its half q % 2.
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

// Forward: the dropped elements of a thread's kNTiles tiles to 0, given fwd_keep_bits of their
// keys. elem(t, e) is element e = 2hf + e2 of tile t (each kernel's own accumulator storage).
template <int kNTiles, typename ElemRef>
__device__ __forceinline__ void fwd_zero_dropped(const uint32_t (&keep)[2], ElemRef&& elem) {
#pragma unroll
  for (int t = 0; t < kNTiles; ++t)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2)
        if (!((keep[hf] >> fwd_keep_bit(t, e2)) & 1u)) elem(t, 2 * hf + e2) = 0.0f;
}

// Forward, on packed P (the Hopper forward): the mask of accumulator tile t's 16-bit pair of row
// hf (elements e2 = 0, 1 in the low, high half): 0xFFFF where the element is kept. fwd_keep_bit's
// two bits of the pair, shifted to the top bits of bytes 2((t >> 1) & 1) + e2, whose signs one
// PRMT replicates over their halves. Dropped halves become +0, the bits of a zeroed element.
__host__ __device__ __forceinline__ uint32_t fwd_pair_keep_mask(uint32_t keep, int t) {
  const uint32_t k = keep << ((t & 1) + 2 * (t >> 2));
  const uint32_t b0 = 2u * uint32_t((t >> 1) & 1);
#if defined(__CUDA_ARCH__)
  const uint32_t sel = (b0 | 8u) | ((b0 | 8u) << 4) | (((b0 + 1u) | 8u) << 8) | (((b0 + 1u) | 8u) << 12);
  uint32_t m;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(m) : "r"(k), "r"(sel));
  return m;
#else
  return (((k >> (8 * b0 + 7)) & 1u) ? 0x0000FFFFu : 0u) | (((k >> (8 * b0 + 15)) & 1u) ? 0xFFFF0000u : 0u);
#endif
}

// Forward: the dropped elements of P, packed to 16 bits (pa[ks][r]: tile 2ks + r / 2, row r % 2,
// as HopperRows::pack_p), to 0 given fwd_keep_bits of their keys: a shift, a PRMT and an AND a
// pair instead of a bit test and a select an element.
template <int kNTiles>
__device__ __forceinline__ void fwd_drop_packed(const uint32_t (&keep)[2], uint32_t (&pa)[kNTiles / 2][4]) {
#pragma unroll
  for (int ks = 0; ks < kNTiles / 2; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[ks][r] &= fwd_pair_keep_mask(keep[r & 1], 2 * ks + (r >> 1));
}

// Backward keep-bit layout: element [e] = [4t + 2hf + e2] of a thread (query q0 + 8t + 2(lane % 4)
// + e2, key key0 + 8hf) is bit bwd_keep_bit(e) of the bit string `keep` (32 bits a word): call
// m = t / 4 of the 8 lanes sharing the column pair (word m / 2), made by lane r' = 2(t % 4) + e2
// (bwd_keep_bits).
__host__ __device__ constexpr int bwd_keep_bit(int e) {
  const int t = e >> 2, hf = (e >> 1) & 1, e2 = e & 1, m = t >> 2;
  return 32 * (m >> 1) + 8 * e2 + 16 * (t & 1) + (1 - ((t >> 1) & 1)) + 2 * (1 - hf) + 4 * (1 - (m & 1));
}
// Whether element e is kept, from the bwd_keep_bits words.
template <int kWords>
__device__ __forceinline__ bool bwd_kept(const uint32_t (&keep)[kWords], int e) {
  const int at = bwd_keep_bit(e);
  return (keep[at / 32] >> (at % 32)) & 1u;
}

// Backward: the keep bits of this thread's elements of P^T (keys key0 and key0 + 8, queries
// q0 + 8t + 2(lane % 4) + {0, 1}, t < kQTiles), in the layout of bwd_keep_bit. key0: this lane's
// hf = 0 key (row l/4 of its warp's 16-aligned slab of 16 keys). Every lane of the warp takes part
// (shuffles): the Hopper backward and the mma.sync backward (mma/bwd_kernel.cuh) on NVIDIA.
template <int kQTiles>
__device__ __forceinline__ void bwd_keep_bits(uint32_t (&keep)[(4 * kQTiles + 31) / 32], const ScoreRules& R, int b,
                                              int hq, int h, int q0, int key0) {
  static_assert((kQTiles % 4 == 0 || kQTiles < 4) && kQTiles <= 16, "whole calls per lane, 64 keep bits");
  // Per lane: 8 lanes share a column pair's 2 kQTiles calls (below 4 tiles, lanes r >= 2 kQTiles
  // make none: the mma.sync backward's D256 tile, 2 query tiles a warp).
  constexpr int kCalls = (kQTiles + 3) / 4;
  constexpr int kWords = (kCalls + 1) / 2;
  const int lane = threadIdx.x & 31;
  const int r = lane >> 2, c = lane & 3;
  const uint64_t seed = R.rng_seed(), offset = R.rng_offset();
  const uint32_t t4 = R.dropout_threshold * 0x01010101u, t4_low = t4 & 0x7F7F7F7Fu;
  // Word w: calls m = 2w, 2w + 1 of this lane (query q0 + 8t + 2c + e2 with 2t + e2 = 8m + r).
  // A call's key k = 4j + b (word j, byte b of its Philox words) at bit 8b + 7 - j - 4(m % 2): the
  // verdicts stay in their bytes' top bits (bytes_ge_top_bits), the words one bit apart, the two
  // calls 4 apart. So bit p of the word holds key offset k' = k - 8hf with k' bit 0 = p bit 3,
  // k' bit 1 = p bit 4, k' bit 2 = !p bit 0, hf = !p bit 1, m % 2 = !p bit 2. A word is exchanged
  // as soon as it is made: one word of state.
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    uint32_t x = 0u, p;
    // One call per iteration: the kernels make these bits while their products run, with dK, dV
    // and the products' register operands live.
#pragma unroll 1
    for (int m = 2 * w; m < 2 * w + 2 && m < kCalls; ++m) {
      const int k2 = 8 * m + r;
      if (kQTiles % 4 != 0 && k2 >= 2 * kQTiles) break;
      const Philox4 wd = dropout_words(seed, offset, b, hq, h, q0 + 8 * (k2 >> 1) + 2 * c + (k2 & 1), key0 - r);
      uint32_t v = bytes_ge_top_bits(wd.x[0], t4, t4_low) & 0x80808080u;
      v |= (bytes_ge_top_bits(wd.x[1], t4, t4_low) >> 1) & 0x40404040u;
      v |= (bytes_ge_top_bits(wd.x[2], t4, t4_low) >> 2) & 0x20202020u;
      v |= (bytes_ge_top_bits(wd.x[3], t4, t4_low) >> 3) & 0x10101010u;
      x |= v >> (4 * (m & 1));
    }
    // Lane r' holds row r' (its call) of 8 x 8 bit matrices (column k', one per (hf, m % 2)).
    // Transposed over the lanes r (xor 4, 8, 16 on the lane swap the blocks where r's bit s and
    // k''s bit s differ: positions 8 apart, 16 apart, and 1 apart with k' bit 2 set at the lower
    // one), lane r holds at column r' call r''s bit of its key r + 8hf.
    p = __shfl_xor_sync(0xffffffffu, x, 4);
    x = (r & 1) ? ((x & 0xFF00FF00u) | ((p & 0xFF00FF00u) >> 8)) : ((x & 0x00FF00FFu) | ((p & 0x00FF00FFu) << 8));
    p = __shfl_xor_sync(0xffffffffu, x, 8);
    x = (r & 2) ? ((x & 0xFFFF0000u) | ((p & 0xFFFF0000u) >> 16)) : ((x & 0x0000FFFFu) | ((p & 0x0000FFFFu) << 16));
    p = __shfl_xor_sync(0xffffffffu, x, 16);
    x = (r & 4) ? ((x & 0x55555555u) | ((p & 0x55555555u) << 1)) : ((x & 0xAAAAAAAAu) | ((p & 0xAAAAAAAAu) >> 1));
    keep[w] = x;
  }
#pragma unroll
  for (int w = kWords; w < (4 * kQTiles + 31) / 32; ++w) keep[w] = 0u;
}

}  // namespace flashport::gpu
