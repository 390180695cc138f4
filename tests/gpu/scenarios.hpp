// Scenario lists that several GPU suites run, each written once: a suite passes the case it starts
// from (its dtype) and its check (forward, backward, fp32, Hopper). Random draws (rand_int) happen
// in the same order as the checks, so a failure's describe() names the case that ran.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "gpu_harness.hpp"

namespace gputest {

// A new case of a random 16-bit dtype (the start of most fp16/bf16 scenarios).
inline Case rand_dtype_case() {
  Case c;
  c.dtype = rand_dtype();
  return c;
}

// (D, Dv) pairs of the Dq != Dv suites: Dv half of D, Dv above D, a padded D, Dv of one MMA tile.
inline constexpr std::pair<int64_t, int64_t> kDqDvPairs[] = {{64, 32}, {128, 64}, {40, 200}, {192, 128}, {256, 8}};

// A Dq != Dv case: B = 2, GQA 4:2, 100 x 300, causal or not at random.
inline void set_dq_dv_case(Case& c, int64_t d, int64_t dv) {
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = dv, c.sq = 100, c.sk = 300;
  c.causal = rand_int(0, 1);
}

// GQA ratios (MHA, 4:1, 8:1, 4:1 with 12 heads) at D = 128, Sq random in 1..300, Sk = 517, causal
// or not at random.
template <typename MakeCase, typename Check>
void for_each_gqa_case(MakeCase make_case, Check check) {
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}, {8, 1}, {12, 3}}) {
    Case c = make_case();
    c.batch = 2, c.hq = hq, c.hkv = hkv, c.d = 128, c.dv = 128, c.sq = rand_int(1, 300), c.sk = 517;
    c.causal = rand_int(0, 1);
    check(c);
  }
}

// Varlen with 1..5 sequences of random lengths (queries 1..300, keys 1..400), four variants (MHA /
// GQA 4:1, D 64 / 128, causal, ALiBi, sinks), each checked whole and split three ways.
template <typename MakeCase, typename Check>
void for_each_random_varlen_case(MakeCase make_case, Check check) {
  for (int rep = 0; rep < 4; ++rep) {
    Case c = make_case();
    c.varlen = true;
    const int64_t nb = rand_int(1, 5);
    for (int64_t b = 0; b < nb; ++b) {
      c.lq.push_back(rand_int(1, 300));
      c.lk.push_back(rand_int(1, 400));
    }
    c.hq = 4, c.hkv = rep % 2 ? 1 : 4, c.d = rep < 2 ? 64 : 128, c.dv = c.d;
    c.causal = rep & 1;
    c.sinks = rep == 3;
    c.alibi = rep == 2;
    check(c);
    c.splits = 3;
    check(c);
  }
}

// (Sq, Sk) of the causal and window suites: square, more keys than rows, more rows than keys (rows
// without keys under bottom-right alignment), a single row, keys shorter than one tile.
inline constexpr std::pair<int64_t, int64_t> kCausalWindowShapes[] = {
    {300, 300}, {100, 400}, {400, 100}, {1, 64}, {65, 1}};

// The shape of one causal / window case: B = 2, GQA 4:2, D = Dv = 64, Sq x Sk.
inline void set_causal_window_shape(Case& c, int64_t sq, int64_t sk) {
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = sq, c.sk = sk;
}

// Both causal alignments x kCausalWindowShapes, each checked causal, then with a random window
// (left 0..70, right -1..40), then with that window's right edge at 0. make_case(): a new case of
// the suite's dtype.
template <typename MakeCase, typename Check>
void for_each_causal_window_case(MakeCase make_case, Check check) {
  for (bool top_left : {false, true}) {
    for (auto [sq, sk] : kCausalWindowShapes) {
      Case c = make_case();
      set_causal_window_shape(c, sq, sk);
      c.causal = true, c.top_left = top_left;
      check(c);
      c.causal = false;
      c.wl = static_cast<int32_t>(rand_int(0, 70)), c.wr = static_cast<int32_t>(rand_int(-1, 40));
      check(c);
      c.wr = 0;
      check(c);
    }
  }
}

// For head dims 64, 128, 256 (B = 2, GQA 4:2, 150 x 333): softcap (inputs of std 3), ALiBi with
// causal, ALiBi per batch, sinks, sinks with rows that see no key (400 x 100 causal), and all of
// them with a window and a non-default scale.
template <typename MakeCase, typename Check>
void for_each_score_feature_case(MakeCase make_case, Check check) {
  for (int64_t d : {64, 128, 256}) {
    Case base = make_case();
    base.batch = 2, base.hq = 4, base.hkv = 2, base.d = d, base.dv = d, base.sq = 150, base.sk = 333;
    Case c = base;
    c.softcap = 30.0f, c.input_std = 3.0;
    check(c);
    c = base;
    c.alibi = true, c.causal = true;
    check(c);
    c = base;
    c.alibi = true, c.alibi_per_batch = true;
    check(c);
    c = base;
    c.sinks = true;
    check(c);
    c = base;
    c.sinks = true, c.causal = true, c.sq = 400, c.sk = 100;  // rows with no key: sink only
    check(c);
    c = base;
    c.scale = 0.3f;
    c.softcap = 5.0f, c.alibi = true, c.sinks = true, c.causal = true, c.wl = 50;
    check(c);
  }
}

// The dropout rates of the dropout suites: light and heavy.
inline constexpr float kDropoutRates[] = {0.1f, 0.5f};

// A dropout forward case: B = 2, GQA 4:1, odd lengths 131 x 257, causal at D = 128.
inline void set_dropout_fwd_case(Case& c, int64_t d, float p) {
  c.batch = 2, c.hq = 4, c.hkv = 1, c.d = d, c.dv = d, c.sq = 131, c.sk = 257, c.dropout = p;
  c.causal = d == 128;
}

// A dropout backward case: B = 2, GQA 4:2, 130 x 260, causal or not at random.
inline void set_dropout_bwd_case(Case& c, int64_t d, float p) {
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 130, c.sk = 260;
  c.dropout = p;
  c.causal = rand_int(0, 1);
}

// Masks of the Hopper suites: causal in both alignments, then windows (left only with right 0,
// left and right, the diagonal alone top-left, right only, causal with a left window).
struct MaskVariant {
  bool causal, top_left;
  int32_t wl, wr;
  void apply(Case& c) const { c.causal = causal, c.top_left = top_left, c.wl = wl, c.wr = wr; }
};
inline constexpr MaskVariant kMaskVariants[] = {{true, false, -1, -1}, {true, true, -1, -1},  {false, false, 100, 0},
                                                {false, false, 37, 200}, {false, true, 0, 0}, {false, false, -1, 5},
                                                {true, false, 300, -1}};
// The first n of kMaskVariants (the shorter suites run the causal and plain-window ones).
inline std::span<const MaskVariant> mask_variants(size_t n = std::size(kMaskVariants)) {
  return std::span<const MaskVariant>(kMaskVariants).first(n);
}

// Varlen lengths of the Hopper forward suites: one-row and empty sequences (of queries and of keys),
// tails of query blocks and key tiles in both directions.
inline void set_awkward_varlen(Case& c) {
  c.varlen = true;
  c.lq = {1, 3, 113, 1025, 200, 0, 130};
  c.lk = {1, 113, 3, 1025, 700, 5, 0};
}

}  // namespace gputest
