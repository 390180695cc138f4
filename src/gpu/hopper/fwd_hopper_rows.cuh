// The row side of the Hopper forward (fwd_hopper_v3.cuh): the block's visible key range, the
// score hooks (softcap, ALiBi, masks), the online softmax
// over one tile of S in the wgmma accumulator layout, dropout (dropout_hopper.cuh), and the
// epilogue (sinks, LSE, store).
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
#include "gpu/hopper/dropout_hopper.cuh"

namespace flashport::gpu::sm90 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// One block's query rows [m0, m0 + BM) of (sequence b, head); this thread's two rows. BN: keys per
// step. Tiles are numbered nb (keys [nb BN, nb BN + BN)); the visible ones are [n_lo, n_hi).
template <int BN>
struct HopperRows {
  static constexpr int kNTiles = BN / 8;  // 8-key accumulator tiles per step

  const FwdArgs& a;
  int b, head, m0, lq, lk, i_min, i_max, n_lo, n_hi;
  KernelScoreRules rules;  // the score rules of this block's sequence (core/score_rules.hpp)
  int row_loc0, col_base;  // this thread's first row inside the block; its first column in a tile
  int64_t q_start;
  bool transformed;        // softcap / ALiBi / non-positive scale: scores scaled in the hooks
  float mul, slope;
  float row_max[2], row_sum[2];

  __device__ __forceinline__ HopperRows(const FwdArgs& args, int b_, int head_, int m0_, int block_rows, int row_loc)
      : a(args), b(b_), head(head_), m0(m0_), row_loc0(row_loc) {
    const ScoreRules& R = a.rules;
    const FwdSeqLengths lengths(a, b);
    lq = lengths.lq, lk = lengths.lk;
    q_start = a.seq.q_start(b);
    rules = KernelScoreRules(R, lq, lk, a.scale_log2, a.softcap_in, a.softcap_out);
    const KernelScoreRules& S = rules;
    i_min = m0;
    i_max = (m0 + block_rows < lq ? m0 + block_rows : lq) - 1;
    const int key_lo = S.vis_lo(i_min), key_hi = S.vis_hi(i_max);
    n_lo = key_lo / BN;
    n_hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : n_lo;
    col_base = (threadIdx.x & 3) * 2;
    transformed = S.softcapped() || S.alibi() || !(*S.scale > 0.0f);
    mul = transformed ? 1.0f : *S.scale;
    slope = R.alibi ? -R.alibi_slope(b, head) * kLog2e : 0.0f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
  }
  // The block has no query rows: nothing to compute, nothing to store.
  __device__ __forceinline__ bool empty() const { return m0 >= lq; }

  // Split-KV: this block covers split `split` of `splits` contiguous ranges of the sequence's key
  // tiles (the mma.sync kernel's rule, in this kernel's BN). The range may miss the block's visible
  // keys entirely (n_lo >= n_hi): the block then still stores its rows' partials (O = 0,
  // LSE = -inf), which the combine skips.
  __device__ __forceinline__ void clip_to_split(int split, int splits) {
    if (splits <= 1) return;
    const int total = (lk + BN - 1) / BN;
    const int per = (total + splits - 1) / splits;
    const int s_lo = split * per, s_hi = s_lo + per < total ? s_lo + per : total;
    n_lo = n_lo > s_lo ? n_lo : s_lo;
    n_hi = n_hi < s_hi ? n_hi : s_hi;
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
      const float m_new = fmaxf(row_max[hf], mx * mul);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      corr[hf] = fast_exp2(row_max[hf] - m_use);
      row_max[hf] = m_new;
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
    // 1 / (1 - p)). The kernel runs its consumer loop in two copies, chosen once per call, so
    // calls without dropout run the loop they ran before.
    if constexpr (kDropout) fwd_apply_dropout<kNTiles>(s, a.rules, b, a.hq, head, m0 + row_loc0, n0);
  }

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

  template <int kPanels>
  __device__ __forceinline__ static void rescale_o(float (&o)[kPanels][32], const float (&corr)[2]) {
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
  // kDropout: O also scaled by 1 / (1 - p) (the softmax zeroed the dropped P).
  template <typename Elem, int kPanels, bool kDropout = false>
  __device__ __forceinline__ void epilogue(const float (&o)[kPanels][32], int split = 0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = m0 + row_loc0 + hf * 8;
      float l = row_sum[hf];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      float mx = row_max[hf];
      if (i >= lq) continue;
      const float o_scale =
          a.rules.sinks != nullptr && split == 0 ? fold_sink(a.rules.sinks[head] * kLog2e, mx, l) : 1.0f;
      float inv = l > 0.0f ? o_scale / l : 0.0f;
      if constexpr (kDropout) inv *= dropout_keep_scale(a.rules);  // kept elements of P scaled by 1 / (1 - p)
      const float lse = l > 0.0f ? (mx + __log2f(l)) * kLn2 : -INFINITY;
      if (a.splits > 1) {
        const int64_t row = (int64_t(b) * a.hq + head) * a.seq.sq + i;
        float* part = a.ws_o + (int64_t(split) * a.ws_rows + row) * a.dv;
        // Padded columns (Dv below the instance's head dim) are not stored; the full-width
        // epilogue keeps its unguarded, fully unrolled stores.
        auto store_part = [&](auto guard) {
#pragma unroll
          for (int p = 0; p < kPanels; ++p)
#pragma unroll
            for (int t = 0; t < 8; ++t) {
              const int col = p * 64 + t * 8 + col_base;  // 4-byte stores: the caller's workspace need not be 8-aligned
              if (decltype(guard)::value && col >= a.dv) continue;
              part[col] = o[p][4 * t + 2 * hf] * inv;
              part[col + 1] = o[p][4 * t + 2 * hf + 1] * inv;
            }
        };
        if (a.dv == kPanels * 64) store_part(std::false_type{});
        else store_part(std::true_type{});
        if ((lane & 3) == 0) a.ws_lse[int64_t(split) * a.ws_rows + row] = lse;
        continue;
      }
      typename Elem::T* dst = static_cast<typename Elem::T*>(a.out) + a.out_addr.at(b, q_start, i, head);
      auto store_out = [&](auto guard) {
#pragma unroll
        for (int p = 0; p < kPanels; ++p)
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            const int col = p * 64 + t * 8 + col_base;
            if (decltype(guard)::value && col >= a.dv) continue;  // padded columns (Dv even here: 16-byte strides)
            const float v0 = o[p][4 * t + 2 * hf] * inv, v1 = o[p][4 * t + 2 * hf + 1] * inv;
            if (a.out_vec_ok) {
              *reinterpret_cast<uint32_t*>(dst + col) = Elem::pack(v0, v1);
            } else {
              dst[col] = Elem::from_float(v0);
              dst[col + 1] = Elem::from_float(v1);
            }
          }
      };
      if (a.dv == kPanels * 64) store_out(std::false_type{});
      else store_out(std::true_type{});
      if (a.lse != nullptr && (lane & 3) == 0) a.lse[a.lse_addr.at(b, q_start, head, i)] = lse;
    }
  }
};

}  // namespace flashport::gpu::sm90
