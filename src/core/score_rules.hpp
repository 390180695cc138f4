// The score rules of one call: everything between q.k and the softmax (scale, softcap, the
// causal/window visible-key range, ALiBi, sinks, dropout state), one device-callable struct that
// the reference and the kernels read. Included by problem.hpp (Problem::rules).
#pragma once
#include <cstdint>

#include "hd.hpp"

namespace flashport {

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
  uint32_t dropout_threshold = 0;
  uint64_t dropout_seed = 0, dropout_offset = 0;
  // Device-resident {seed lo, seed hi, offset lo, offset hi} (fp_attn_params.dropout_rng on a GPU),
  // read by the kernel; null when the scalars above hold the state (always so on the CPU: the
  // resolver reads a host-memory dropout_rng into them).
  const uint32_t* dropout_rng = nullptr;

  FP_HD int64_t shift(int64_t lq, int64_t lk) const { return top_left ? 0 : lk - lq; }
  // Visible keys of row i: [lo, hi) intersected with [0, lk).
  FP_HD int64_t key_lo(int64_t i, int64_t shift_) const {
    const int64_t lo = window_left >= 0 ? i + shift_ - window_left : 0;
    return lo < 0 ? 0 : lo;
  }
  FP_HD int64_t key_hi(int64_t i, int64_t shift_, int64_t lk) const {
    const int64_t hi = window_right >= 0 ? i + shift_ + window_right + 1 : lk;
    return hi > lk ? lk : (hi < 0 ? 0 : hi);
  }
  FP_HD float alibi_slope(int64_t b, int64_t h) const {
    return alibi ? alibi[b * alibi_batch_stride + h] : 0.0f;
  }
  FP_HD bool has_dropout() const { return dropout_p > 0.0f; }
  // The Philox seed and offset of this call (device-resident state when dropout_rng is set).
  FP_HD uint64_t rng_seed() const { return dropout_rng ? u64_from_words(dropout_rng) : dropout_seed; }
  FP_HD uint64_t rng_offset() const { return dropout_rng ? u64_from_words(dropout_rng + 2) : dropout_offset; }
};

}  // namespace flashport
