// The row side of the Hopper forward (fwd_hopper_v3.cuh): the block's visible key range, the
// score hooks (softcap, ALiBi, masks), the online softmax
// over one tile of S in the wgmma accumulator layout, dropout (common/dropout_lanes.cuh), and the
// epilogue (sinks, LSE, O through a shared-memory staging tile).
//
// wgmma accumulator layout (m64nN, per warpgroup): warp w owns rows 16w..16w+15; a thread holds
// rows lane/4 (hf = 0) and lane/4 + 8 (hf = 1), columns 8t + 2(lane%4) + e2 of every 8-column tile
// t, at register 4t + 2hf + e2. The same registers, packed to 16 bits, are wgmma's A fragments.
#pragma once
#include <cstdint>
#include <type_traits>

#include "gpu/common/kernel_args.hpp"
#include "gpu/common/tile_io.cuh"
#include "gpu/common/tile_mma.hpp"
#include "gpu/common/dropout_lanes.cuh"
#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu/hopper/fwd_hopper_tma.cuh"
#include "gpu/hopper/hopper_store.cuh"

namespace flashport::gpu::sm90 {

// One block's query rows [m0, m0 + BM) of (sequence b, head); this thread's two rows. BN: keys per
// step. Tiles are numbered nb (keys [nb BN, nb BN + BN)); the visible ones are [n_lo, n_hi).
// Query block mb starts at row mb BM, or, when the call's visible keys end at a right edge (causal,
// windows with one), at mb BM - shift with shift = (-lq) mod BM: the blocks then end at the
// sequence's last row and a partial block sits at its first rows, which see the fewest keys,
// instead of its last (D64, BM = 192, causal S = 1k: 27 key tiles of work instead of 32). Rows
// above the sequence (i < 0) are computed from zero-filled or neighbouring q rows and never stored;
// each row's softmax and P V are its own.
// kLazyRescale: a row's reference max moves only when a tile's max passes it by more than
// kRescaleSlack (softmax), and a warp skips rescale_o when none of its rows moved. Two interleaved
// A/B runs over the forward grid on the H200 (bench/results/gpu_forward.md): D64 +0.3-5.6%, D256
// -1.4 to +7.8% (its O rescale is 128 multiplies a tile per 32 exponentials); D128 -0.6 to -4.9%
// and D192 -8.6 to +0.9% (the vote and branch cost more than their rescales save): the kernel
// takes it at D64 and D256 only (fwd_hopper_v3.cuh).
template <int BN, bool kLazyRescale>
struct HopperRows {
  static constexpr int kNTiles = BN / 8;  // 8-key accumulator tiles per step
  // How far (log2 units) a tile's row max may pass the row's reference max before O is rescaled.
  static constexpr float kRescaleSlack = 8.0f;

  const FwdArgs& a;
  int b, head, m0, lq, lk, i_min, i_max, n_lo, n_hi;
  int key_row0;  // key_align > 0: the cache row of the tiles' key 0 (the pad less rules.k_lo)
  KernelScoreRules rules;  // the score rules of this block's sequence (core/score_rules.hpp)
  int row_loc0, col_base;  // this thread's first row inside the block; its first column in a tile
  int64_t q_start;
  bool transformed;        // softcap / ALiBi / non-positive scale: scores scaled in the hooks
  float mul, slope;
  float row_max[2], row_sum[2];
  uint32_t keep_[2];  // dropout: the keep bits of the last softmax's tile (fwd_keep_bit layout)

  // key_align > 0 (a paged cache with a left pad, fwd_hopper.hpp kv_key_align): the key tiles
  // start pad % key_align rows before the sequence's first key, so that every TMA box lies in one
  // page; lk and the rules count those hidden rows as keys (SeqScoreRules::start_keys_early).
  __device__ __forceinline__ HopperRows(const FwdArgs& args, int b_, int head_, int mb, int block_rows, int row_loc,
                                        int key_align)
      : a(args), b(b_), head(head_), row_loc0(row_loc) {
    const ScoreRules& R = a.rules;
    const FwdSeqLengths lengths(a, b);
    lq = lengths.lq, lk = lengths.lk;
    q_start = a.seq.q_start(b);
    rules = KernelScoreRules(R, lq, lk, a.scale_log2, a.softcap_in, a.softcap_out);
    key_row0 = 0;
    if (key_align > 0) {
      const int pad = int(a.seq.k_pad(b)), early = pad % key_align;
      rules.start_keys_early(early);
      lk = rules.lk;
      key_row0 = pad - early;
    }
    const KernelScoreRules& S = rules;
    const int shift = R.window_right >= 0 ? (block_rows - lq % block_rows) % block_rows : 0;
    m0 = mb * block_rows - shift;
    i_min = m0 > 0 ? m0 : 0;
    i_max = (m0 + block_rows < lq ? m0 + block_rows : lq) - 1;
    tiles_seen_by(i_min, i_max, n_lo, n_hi);
    col_base = (threadIdx.x & 3) * 2;
    transformed = S.softcapped() || S.alibi() || !(*S.scale > 0.0f);
    mul = transformed ? 1.0f : *S.scale;
    slope = R.alibi ? -R.alibi_slope(b, head) * kLog2e : 0.0f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
  }
  // The key tiles [lo, hi) that rows [i_first, i_last] see (hi = lo: none).
  __device__ __forceinline__ void tiles_seen_by(int i_first, int i_last, int& lo, int& hi) const {
    const int key_lo = rules.vis_lo(i_first), key_hi = rules.vis_hi(i_last);
    lo = key_lo / BN;
    hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : lo;
  }
  // The block has no query rows: nothing to compute, nothing to store.
  __device__ __forceinline__ bool empty() const { return m0 >= lq; }

  // Split-KV: this block covers split `split` of `splits` contiguous ranges of the sequence's key
  // tiles (the mma.sync kernel's rule, in this kernel's BN). The range may miss the block's visible
  // keys entirely (n_lo >= n_hi): the block then still stores its rows' partials (O = 0,
  // LSE = -inf), which the combine skips.
  __device__ __forceinline__ void clip_to_split(int split, int splits) {
    clip_key_blocks_to_split(n_lo, n_hi, lk, BN, split, splits);
  }

  // A consumer warpgroup's own rows [m0 + first, + count): [n_lo, n_hi) narrows to the key tiles
  // of the block's range that some of them see (empty, n_lo = n_hi, when none do), lead and trail
  // count the block's tiles above and below, and the mask test narrows to the rows (i_min, i_max;
  // the block's stay when the rows lie outside the sequence). Call after clip_to_split, on a
  // block with keys.
  __device__ __forceinline__ void narrow_to_rows(int first, int count, int& lead, int& trail) {
    const int first_row = max(m0 + first, 0), last_row = min(m0 + first + count, lq) - 1;
    int lo = n_hi, hi = n_hi;  // none: every tile leads
    if (first_row <= last_row) {
      i_min = first_row, i_max = last_row;
      int seen_lo, seen_hi;
      tiles_seen_by(i_min, i_max, seen_lo, seen_hi);
      if (seen_hi > seen_lo) {
        lo = min(max(n_lo, seen_lo), n_hi);
        hi = max(min(n_hi, seen_hi), lo);
      }
    }
    lead = n_hi - hi, trail = lo - n_lo;
    n_lo = lo, n_hi = hi;
  }

  // Key tile nb holds V rows outside the keys [rules.k_lo, lk): rows past the last key, or before a
  // left pad's first (key_align > 0). A KV cache's rows there may hold anything (NaN; 0 * NaN is
  // not 0), so those rows are zeroed before P V reads them (fwd_hopper_v3.cuh: warp 1 zeroes, the
  // consumers wait for it on these tiles only). The k_lo test folds away where k_lo is 0.
  __device__ __forceinline__ bool tile_has_rows_outside_keys(int nb) const {
    return (rules.k_lo > 0 && rules.k_lo > nb * BN) || lk - nb * BN < BN;
  }

  // Feature hooks, masking and the online softmax of tile nb (base 2): S becomes P (fp32), corr
  // the factor the running O must be scaled by; kDropout: the call's dropout (a.rules) on P.
  template <bool kDropout = false>
  __device__ __forceinline__ void softmax(float (&s)[BN / 2], int nb, float (&corr)[2]) {
    const int n0 = nb * BN;
    const KernelScoreRules& S = rules;
    const bool need_mask = S.tile_needs_mask(nb, BN, i_min, i_max);
    if (transformed) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + row_loc0 + hf * 8;
        const int base = S.diagonal(i) - n0;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            float& v = s[4 * t + 2 * hf + e2];
            v = S.score(v);
            v += S.alibi_bias_at(slope, base - (t * 8 + col_base + e2));
          }
      }
    }
    if (need_mask) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + row_loc0 + hf * 8;
        const int lo = S.vis_lo(i) - n0, hi = S.vis_hi(i) - n0;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int j = t * 8 + col_base + e2;
            if (j < lo || j >= hi) s[4 * t + 2 * hf + e2] = -INFINITY;
          }
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < kNTiles; ++t) mx = fmaxf(mx, fmaxf(s[4 * t + 2 * hf], s[4 * t + 2 * hf + 1]));
      mx = fmaxf(mx, shfl_xor(mx, 1));
      mx = fmaxf(mx, shfl_xor(mx, 2));
      // Lazy rescale: the row's reference max moves only when the tile's max passes it by more
      // than kRescaleSlack (log2 units), so after the first tiles O and the sum are rarely
      // rescaled (corr = 1). Exact: P, the sum and the LSE all use the same reference; P stays
      // below 2^kRescaleSlack, which 16-bit P and the fp32 sums hold without loss.
      float m_use;
      if constexpr (kLazyRescale) {
        const float m_tile = mx * mul;
        const bool bump = m_tile > row_max[hf] + kRescaleSlack;  // the first tile with a key: -inf + 8
        const float m_new = bump ? m_tile : row_max[hf];
        m_use = m_new == -INFINITY ? 0.0f : m_new;
        corr[hf] = bump ? fast_exp2(row_max[hf] - m_use) : 1.0f;
        row_max[hf] = m_new;
      } else {
        const float m_new = fmaxf(row_max[hf], mx * mul);
        m_use = m_new == -INFINITY ? 0.0f : m_new;
        corr[hf] = fast_exp2(row_max[hf] - m_use);
        row_max[hf] = m_new;
      }
      float sum = 0.0f;
#pragma unroll
      for (int t = 0; t < kNTiles; ++t)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          float& v = s[4 * t + 2 * hf + e2];
          v = fast_exp2(fmaf(v, mul, -m_use));
          sum += v;
        }
      row_sum[hf] = row_sum[hf] * corr[hf] + sum;
    }
    // Dropout after the sums (the LSE is the undropped softmax's; the epilogue scales O by
    // 1 / (keep rate)): the tile's keep bits here, applied to P once packed (drop_packed). The
    // kernel runs its consumer loop in two copies, chosen once per call, so calls without dropout
    // run the loop they ran before.
    if constexpr (kDropout)
      fwd_keep_bits<kNTiles>(keep_, a.rules, b, a.hq, head, m0 + row_loc0 + 8 * int(threadIdx.x & 1), n0);
  }
  // Dropout: the last softmax's dropped elements of packed P to 0.
  __device__ __forceinline__ void drop_packed(uint32_t (&pa)[BN / 16][4]) const { fwd_drop_packed<kNTiles>(keep_, pa); }

  // P (fp32 accumulators) to 16-bit A fragments: k-step ks takes accumulator tiles 2ks, 2ks + 1.
  template <typename Elem>
  __device__ __forceinline__ static void pack_p(const float (&s)[BN / 2], uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      pa[ks][0] = Elem::pack(s[8 * ks + 0], s[8 * ks + 1]);
      pa[ks][1] = Elem::pack(s[8 * ks + 2], s[8 * ks + 3]);
      pa[ks][2] = Elem::pack(s[8 * ks + 4], s[8 * ks + 5]);
      pa[ks][3] = Elem::pack(s[8 * ks + 6], s[8 * ks + 7]);
    }
  }

  // Lazy rescale: skipped by the whole warp when none of its rows moved its reference max (the
  // usual case after the first tiles); warp-uniform, so the loop stays branch-free.
  template <int kPanels>
  __device__ __forceinline__ static void rescale_o(float (&o)[kPanels][32], const float (&corr)[2]) {
    if constexpr (kLazyRescale) {
      if (!__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) return;
    }
#pragma unroll
    for (int p = 0; p < kPanels; ++p)
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        o[p][4 * t + 0] *= corr[0];
        o[p][4 * t + 1] *= corr[0];
        o[p][4 * t + 2] *= corr[1];
        o[p][4 * t + 3] *= corr[1];
      }
  }

  // Finish the row sums, add the sink (split 0 only), normalise, store O (and the LSE, natural
  // log); with split-KV (a.splits > 1) the normalised fp32 partial and its LSE go to the workspace
  // (ws_o [split][row][dv], ws_lse [split][row], row = (b Hq + head) Sq + i) for the combine.
  // kDropout: O also scaled by 1 / (keep rate) (drop_packed zeroed the dropped P). O goes through
  // this warpgroup's staging tile (store_tile_staged, hopper_store.cuh) where 16-byte stores are
  // allowed, else straight from the registers (store_direct). Every thread of the warpgroup calls
  // it (named barriers).
  template <typename Elem, int kPanels, bool kDropout = false>
  __device__ __forceinline__ void epilogue(const float (&o)[kPanels][32], int split, const OutStage& stage) {
    const int lane = threadIdx.x & 31;
    float inv[2], lse[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float l = row_sum[hf];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      float mx = row_max[hf];
      const float o_scale =
          a.rules.sinks != nullptr && split == 0 ? fold_sink(a.rules.sinks[head] * kLog2e, mx, l) : 1.0f;
      inv[hf] = l > 0.0f ? o_scale / l : 0.0f;
      if constexpr (kDropout) inv[hf] *= a.rules.dropout_scale;  // kept elements of P scaled by 1 / (keep rate)
      lse[hf] = l > 0.0f ? (mx + __log2f(l)) * kLn2 : -INFINITY;
    }
    const int wg_row0 = row_loc0 & ~63;       // this warpgroup's first row in the block
    const int rows = lq - (m0 + wg_row0);      // its rows inside the sequence: [row_lo, rows)
    const int row_lo = m0 + wg_row0 < 0 ? -(m0 + wg_row0) : 0;
    if (a.splits > 1) {
      const int64_t row0 = (int64_t(b) * a.hq + head) * a.seq.sq + m0 + wg_row0;
      float* part = a.ws_o + (int64_t(split) * a.ws_rows + row0) * a.dv;
      // The caller's workspace need not be 16-byte aligned (then 4-byte stores).
      if (((reinterpret_cast<uintptr_t>(a.ws_o) & 15) | uintptr_t(a.dv & 3)) == 0)
        store_tile_staged<Elem, HopperTileV3::kOutStageRowBytes>(o, inv, part, a.dv, row_lo, rows, a.dv, stage);
      else
        store_direct<Elem>(o, inv, part, a.dv, row_lo, rows, a.dv, false);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + row_loc0 + hf * 8;
        if (i >= 0 && i < lq && (lane & 3) == 0) a.ws_lse[int64_t(split) * a.ws_rows + row0 + (row_loc0 & 63) + hf * 8] = lse[hf];
      }
      return;
    }
    // Rows i of this sequence and head at dst + (i - first row) * row_stride (batched and packed alike).
    typename Elem::T* dst =
        static_cast<typename Elem::T*>(a.out) + a.out_addr.at(b, q_start, m0 + wg_row0, head);
    if (a.out_vec16_ok)
      store_tile_staged<Elem, HopperTileV3::kOutStageRowBytes>(o, inv, dst, a.out_addr.row_stride, row_lo, rows, a.dv, stage);
    else
      store_direct<Elem>(o, inv, dst, a.out_addr.row_stride, row_lo, rows, a.dv, a.out_vec_ok);
    if (a.lse != nullptr && (lane & 3) == 0) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = m0 + row_loc0 + hf * 8;
        if (i >= 0 && i < lq) a.lse[a.lse_addr.at(b, q_start, head, i)] = lse[hf];
      }
    }
  }

  // The same stores from the registers, where 16-byte stores are not allowed: column pairs as one
  // 4-byte store when `pairs` (16-bit Out, 4-byte aligned), else element by element. The
  // full-width tile keeps its unguarded, fully unrolled stores.
  template <typename Elem, typename Out, int kPanels>
  __device__ __forceinline__ void store_direct(const float (&o)[kPanels][32], const float (&inv)[2], Out* dst,
                                               int64_t row_stride, int row_lo, int rows, int cols, bool pairs) const {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = (row_loc0 & 63) + hf * 8;
      if (r < row_lo || r >= rows) continue;
      Out* row = dst + r * row_stride;
      auto store = [&](auto guard) {
        constexpr bool kGuard = decltype(guard)::value;
#pragma unroll
        for (int p = 0; p < kPanels; ++p)
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            const int col = p * 64 + t * 8 + col_base;
            const float v0 = o[p][4 * t + 2 * hf] * inv[hf], v1 = o[p][4 * t + 2 * hf + 1] * inv[hf];
            if constexpr (sizeof(Out) == 4) {
              if (!kGuard || col < cols) row[col] = v0;
              if (!kGuard || col + 1 < cols) row[col + 1] = v1;
            } else if (pairs && (!kGuard || col + 1 < cols)) {
              *reinterpret_cast<uint32_t*>(row + col) = Elem::pack(v0, v1);
            } else {
              if (!kGuard || col < cols) row[col] = Elem::from_float(v0);
              if (!kGuard || col + 1 < cols) row[col + 1] = Elem::from_float(v1);
            }
          }
      };
      if (cols == kPanels * 64) store(std::false_type{});
      else store(std::true_type{});
    }
  }
};

}  // namespace flashport::gpu::sm90
