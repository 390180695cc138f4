// The score rules of one call: everything between q.k and the softmax (scale, softcap, the
// causal/window visible-key range, ALiBi, sinks, dropout state), one device-callable struct that
// the reference and the kernels read. Included by problem.hpp (Problem::rules).
//
// SeqScoreRules is the same rules for one sequence, in the caller's units: built once per work
// tile, it answers every question a main loop asks of a score (which keys row i sees, whether a
// tile needs the mask at all, the score after scale / softcap and its derivative, the ALiBi bias).
// The fp64 reference instantiates it with int64 positions and natural-log scores, the kernels with
// int positions and log2 scores; every kernel keeps its own loop shape and calls these pieces.
#pragma once
#include <cmath>
#include <cstdint>

#include "hd.hpp"

namespace flashport {

// log2(e) and ln(2): the kernels' softmax runs in base 2 (exp2 of scores scaled by log2(e)); the
// LSE they return is natural-log (the log2 sum times ln(2)).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// tanh of a softcapped score. fp64 (reference): the library's. fp32 (kernels): through exp,
// relative error ~1e-6; the MUFU tanh of fast-math is ~1e-3, too coarse for softcaps of 30-50
// where it scales the score error.
FP_HD double softcap_tanh(double x) { return std::tanh(x); }
FP_HD float softcap_tanh(float x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  const float e = __expf(-2.0f * fabsf(x));
  return copysignf((1.0f - e) / (1.0f + e), x);
#else
  const float e = std::exp(-2.0f * std::fabs(x));
  return std::copysign((1.0f - e) / (1.0f + e), x);
#endif
}

// A 64-bit value from its 32-bit words {lo, hi}: the layout of fp_attn_params.dropout_rng.
FP_HD uint64_t u64_from_words(const uint32_t* w) { return uint64_t(w[0]) | (uint64_t(w[1]) << 32); }

// The score rules of one call (everything between q.k and the softmax).
struct ScoreRules {
  float scale = 1.0f;     // softmax_scale, resolved
  float softcap = 0.0f;   // 0 = off
  int64_t window_left = -1, window_right = -1;  // resolved: causal => window_right = 0
  bool top_left = false;  // causal_align
  const float* alibi = nullptr;   // [Hq] or [B, Hq]
  int64_t alibi_batch_stride = 0; // 0 for [Hq]
  const float* sinks = nullptr;   // [Hq]
  float dropout_p = 0.0f;
  uint32_t dropout_threshold = 0;  // core/philox.hpp: the 8-bit keep threshold
  float dropout_scale = 1.0f;      // the factor of kept elements, 1 / (keep rate)
  uint64_t dropout_seed = 0, dropout_offset = 0;
  // Device-resident {seed lo, seed hi, offset lo, offset hi} (fp_attn_params.dropout_rng on a GPU),
  // read by the kernel; null when the scalars above hold the state (always so on the CPU: the
  // resolver reads a host-memory dropout_rng into them).
  const uint32_t* dropout_rng = nullptr;

  FP_HD int64_t shift(int64_t lq, int64_t lk) const { return top_left ? 0 : lk - lq; }
  FP_HD float alibi_slope(int64_t b, int64_t h) const {
    return alibi ? alibi[b * alibi_batch_stride + h] : 0.0f;
  }
  FP_HD bool has_dropout() const { return dropout_p > 0.0f; }
  // The Philox seed and offset of this call (device-resident state when dropout_rng is set).
  FP_HD uint64_t rng_seed() const { return dropout_rng ? u64_from_words(dropout_rng) : dropout_seed; }
  FP_HD uint64_t rng_offset() const { return dropout_rng ? u64_from_words(dropout_rng + 2) : dropout_offset; }
};

// The score rules of one sequence (lq queries, lk keys), built once per work tile. I: positions
// (int64 in the reference, int in the kernels' hot loops). T: scores (double in natural-log units
// in the reference; float in log2 units in the kernels, whose exp is exp2).
//
// The score constants and the call's rules are held by address and read where used: a kernel
// points them at its __grid_constant__ arguments, so they stay constant-bank operands and the
// compiled loops are those of the hand-written rules this replaced (same SASS). The shapes below
// are chosen for that: a kernel tests one element as `j < vis_lo(i) || j >= vis_hi(i)` at the call
// (a bool-returning helper costs a select per element), and tile_needs_mask takes the tile index.
template <typename I, typename T>
struct SeqScoreRules {
  const ScoreRules* rules = nullptr;
  I lq = 0, lk = 0;
  I shift = 0;          // row i's diagonal key is i + shift (bottom-right aligned: lk - lq)
  I wl = -1, wr = -1;   // window left / right; < 0: unbounded (causal: wr = 0)
  // Keys below k_lo are hidden from every row: 0, or a forward whose key tiles start k_lo rows
  // before the sequence's first key (start_keys_early). The backward's block ranges (rows_lo,
  // rows_end, query_blocks, last_key_block) assume 0.
  I k_lo = 0;
  // raw q.k -> score: *softcap_out * tanh(raw * *softcap_in) with softcap (*softcap_in > 0), else
  // raw * *scale. Natural-log units: scale, scale / softcap, softcap.
  const T* scale = nullptr;
  const T* softcap_in = nullptr;
  const T* softcap_out = nullptr;

  SeqScoreRules() = default;
  FP_HD SeqScoreRules(const ScoreRules& r, I lq_, I lk_, const T& scale_, const T& softcap_in_,
                      const T& softcap_out_)
      : rules(&r), lq(lq_), lk(lk_), shift(r.top_left ? I(0) : lk_ - lq_),
        wl(static_cast<I>(r.window_left)), wr(static_cast<I>(r.window_right)), scale(&scale_),
        softcap_in(&softcap_in_), softcap_out(&softcap_out_) {}

  // The same rules over keys renumbered j + off, the first off of them hidden: a forward whose
  // key tiles start off rows before the sequence's first key (a paged cache's left pad rounded
  // down to a whole TMA box: fwd_hopper.hpp kv_key_align). Distances to the diagonal are kept.
  FP_HD void start_keys_early(I off) {
    lk += off;
    shift += off;
    k_lo = off;
  }

  // ---- visible keys (causal / window / key length) -------------------------------------------
  // Row i sees keys [vis_lo(i), vis_hi(i)) (none when vis_hi <= vis_lo).
  FP_HD I vis_lo(I i) const {
    const I lo = wl >= 0 ? i + shift - wl : k_lo;
    return lo < k_lo ? k_lo : lo;
  }
  FP_HD I vis_hi(I i) const {
    const I hi = wr >= 0 ? i + shift + wr + 1 : lk;
    return hi > lk ? lk : (hi < 0 ? I(0) : hi);
  }
  // Whether some key of tile nb (keys [nb bn, nb bn + bn)) is hidden from some row of
  // [i_first, i_last]: a key past lk or below k_lo, right of the first row's window or left of the
  // last row's. False: the tile skips the mask.
  FP_HD bool tile_needs_mask(I nb, I bn, I i_first, I i_last) const {
    const I n0 = nb * bn;
    return n0 + bn > lk || (k_lo > 0 && n0 < k_lo) || (wr >= 0 && n0 + bn - 1 > i_first + shift + wr) ||
           (wl >= 0 && n0 < i_last + shift - wl);
  }
  // The rows that see some key of [n0, n1) lie in [rows_lo(n0), rows_end(n1)) (a backward key
  // block's query range).
  FP_HD I rows_lo(I n0) const {
    const I i = wr >= 0 ? n0 - shift - wr : I(0);
    return i < 0 ? I(0) : i;
  }
  FP_HD I rows_end(I n1) const {
    const I i = wl >= 0 ? n1 + wl - shift : lq;
    return i > lq ? lq : i;
  }
  // The query blocks (bm rows each) with a row that sees some key of the backward's key block
  // [n0, n0 + bn): [first, first + count), a contiguous range (rows_lo / rows_end).
  struct QueryBlocks {
    I first, count;
  };
  FP_HD QueryBlocks query_blocks(I n0, I bn, I bm) const {
    const I n1 = n0 + bn < lk ? n0 + bn : lk;
    const I i_first = rows_lo(n0), i_end = rows_end(n1);
    const I m_lo = i_first / bm;
    const I m_hi = i_end > i_first ? (i_end + bm - 1) / bm : m_lo;
    return {m_lo, m_hi - m_lo};
  }
  // The last key block (bn keys each) that some row of query block m (rows [m bm, m bm + bm) cut
  // to lq) sees. The blocks seen by a query block are a contiguous range (both ends of a key
  // block's row range grow with it): a backward's deterministic dQ order counts down to here.
  FP_HD I last_key_block(I m, I bm, I bn) const {
    const I last = (lk - 1) / bn;
    if (wr < 0) return last;
    const I top = (m + 1) * bm < lq ? (m + 1) * bm : lq;  // rows_lo(n bn) < top
    const I x = top + shift + wr;                          // n bn < x
    const I n = x <= 0 ? I(-1) : (x + bn - 1) / bn - 1;
    return n < last ? n : last;
  }

  // ---- the score of q.k ----------------------------------------------------------------------
  FP_HD bool softcapped() const { return *softcap_in > T(0); }
  FP_HD bool alibi() const { return rules->alibi != nullptr; }
  // (Both test softcap_in, not softcapped(): one inline level less keeps the kernels' SASS.)
  FP_HD T score(T raw) const {
    return *softcap_in > T(0) ? *softcap_out * softcap_tanh(raw * *softcap_in) : raw * *scale;
  }
  // The score and its derivative relative to the plain scale's: 1 - tanh^2 with softcap, else 1.
  struct WithGrad {
    T score, dtanh;
  };
  FP_HD WithGrad score_grad(T raw) const {
    if (*softcap_in > T(0)) {
      const T th = softcap_tanh(raw * *softcap_in);
      return {*softcap_out * th, T(1) - th * th};
    }
    return {raw * *scale, T(1)};
  }
  // ALiBi: the bias of (row i, key j) is -slope |i + shift - j| (neg_slope = -slope, in the
  // score's units). Kernels hoist diagonal(i) - n0 per row and pass each column's distance.
  FP_HD I diagonal(I i) const { return i + shift; }
  static FP_HD T alibi_bias_at(T neg_slope, I dist) { return neg_slope * T(dist < 0 ? -dist : dist); }
  FP_HD T alibi_bias(T neg_slope, I i, I j) const { return alibi_bias_at(neg_slope, diagonal(i) - j); }
};

// The kernels' form: int positions, log2-unit scores.
using KernelScoreRules = SeqScoreRules<int, float>;

}  // namespace flashport
