// Reference forward vs closed forms and vs the naive dense implementation (tests/reference/dense.hpp).
#include <cmath>
#include <cstring>
#include <string>

#include "harness.hpp"

namespace reftest {
namespace {

using flashport::test::close;

constexpr double kTol = 1e-12;  // fp64 oracle vs fp64 naive: both ~1e-15

struct Cfg {
  int64_t batch, sq, sk, hq, hkv, d, dv;
  bool causal = false, top_left = false;
  int64_t wl = -1, wr = -1;
  double softcap = 0.0;
  int alibi = 0;  // 0 none, 1 [Hq], 2 [B, Hq]
  bool sinks = false;
  float dropout = 0.0f;
  bool strided = false;
  bool default_scale = false;
  double input_std = 1.0;
};

std::string describe(const Cfg& c) {
  char buf[400];
  std::snprintf(buf, sizeof(buf),
                "B=%lld Sq=%lld Sk=%lld Hq=%lld Hkv=%lld D=%lld Dv=%lld causal=%d top_left=%d "
                "wl=%lld wr=%lld softcap=%g alibi=%d sinks=%d dropout=%g strided=%d default_scale=%d",
                (long long)c.batch, (long long)c.sq, (long long)c.sk, (long long)c.hq,
                (long long)c.hkv, (long long)c.d, (long long)c.dv, c.causal, c.top_left,
                (long long)c.wl, (long long)c.wr, c.softcap, c.alibi, c.sinks, c.dropout,
                c.strided, c.default_scale);
  return buf;
}

BatchedCall build(const Cfg& c) {
  BatchedCall call;
  refdense::Spec& s = call.spec;
  s.batch = c.batch;
  s.hq = c.hq;
  s.hkv = c.hkv;
  s.d = c.d;
  s.dv = c.dv;
  s.scale = rand_uniform(0.1, 0.6);
  s.causal = c.causal;
  s.top_left = c.top_left;
  s.window_left = c.wl;
  s.window_right = c.wr;
  s.softcap = c.softcap;
  if (c.alibi) {
    s.alibi = random_vec(c.alibi == 2 ? c.batch * c.hq : c.hq, 0.01, 0.5);
    s.alibi_per_batch = c.alibi == 2;
  }
  if (c.sinks) s.sinks = random_vec(c.hq, -2.0, 2.0);
  s.dropout_p = c.dropout;
  s.seed = test_rng()();
  s.offset = test_rng()() >> 8;
  call.strided = c.strided;
  call.default_scale = c.default_scale;
  call.make(c.sq, c.sk, c.input_std);
  return call;
}

void check_vs_dense(const Cfg& cfg) {
  SCOPED_TRACE(describe(cfg));
  BatchedCall call = build(cfg);
  fp_attn_params p = call.params();
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(call.out.guards_intact());
  EXPECT_TRUE(call.lse.guards_intact());
  EXPECT_TRUE(call.out.all_written());
  EXPECT_TRUE(call.lse.all_written());
  const refdense::Result r = call.dense();
  EXPECT_TRUE(close(call.out.to_double(), r.out_flat(), kTol, "out"));
  EXPECT_TRUE(close(call.lse.to_double(), r.lse_flat(), kTol, "lse"));
}

// ---- Closed forms --------------------------------------------------------------------------

// One query, two keys, D = 1: q = 1, k = (0, 1), v = (1, 3), scale 1.
//   s = (0, 1); lse = log(1 + e); out = (1 + 3e) / (1 + e).
struct Tiny {
  HostTensor q{FP_F64, {1, 1, 1, 1}}, k{FP_F64, {1, 2, 1, 1}}, v{FP_F64, {1, 2, 1, 1}};
  HostTensor out{FP_F64, {1, 1, 1, 1}}, lse{FP_F64, {1, 1, 1}};
  Tiny() {
    q.from_double({1.0});
    k.from_double({0.0, 1.0});
    v.from_double({1.0, 3.0});
    out.fill_poison();
    lse.fill_poison();
  }
  fp_attn_params params() const {
    fp_attn_params p = ref_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    p.softmax_scale = 1.0f;
    return p;
  }
};

TEST(ReferenceClosedForm, OneQueryTwoKeys) {
  Tiny t;
  fp_attn_params p = t.params();
  ASSERT_TRUE(FWD_OK(p));
  const double e = std::exp(1.0);
  EXPECT_NEAR(t.out.get({0, 0, 0, 0}), (1 + 3 * e) / (1 + e), 1e-15);
  EXPECT_NEAR(t.lse.get({0, 0, 0}), std::log(1 + e), 1e-15);
}

TEST(ReferenceClosedForm, SinkJoinsDenominatorOnly) {
  Tiny t;
  HostTensor sinks(FP_F32, {1});
  sinks.from_double({0.5});
  fp_attn_params p = t.params();
  p.sinks = sinks.view();
  ASSERT_TRUE(FWD_OK(p));
  const double e = std::exp(1.0), es = std::exp(0.5);
  EXPECT_NEAR(t.out.get({0, 0, 0, 0}), (1 + 3 * e) / (1 + e + es), 1e-15);
  EXPECT_NEAR(t.lse.get({0, 0, 0}), std::log(1 + e + es), 1e-15);
}

TEST(ReferenceClosedForm, SoftcapAndScale) {
  Tiny t;
  fp_attn_params p = t.params();
  p.softmax_scale = 2.0f;
  p.softcap = 1.5f;
  ASSERT_TRUE(FWD_OK(p));
  const double s1 = 1.5 * std::tanh(2.0 / 1.5);  // s0 = 0 stays 0
  const double e = std::exp(s1);
  EXPECT_NEAR(t.out.get({0, 0, 0, 0}), (1 + 3 * e) / (1 + e), 1e-15);
  EXPECT_NEAR(t.lse.get({0, 0, 0}), std::log(1 + e), 1e-15);
}

TEST(ReferenceClosedForm, AlibiDistanceBottomRight) {
  // Lq = 1, Lk = 2 => shift = 1: distances |0 + 1 - j| = (1, 0).
  Tiny t;
  HostTensor slopes(FP_F32, {1});
  slopes.from_double({0.25});
  fp_attn_params p = t.params();
  p.alibi_slopes = slopes.view();
  ASSERT_TRUE(FWD_OK(p));
  const double a = std::exp(0.0 - 0.25), b = std::exp(1.0);
  EXPECT_NEAR(t.out.get({0, 0, 0, 0}), (a + 3 * b) / (a + b), 1e-15);
  // Top-left: distances (0, 1).
  p.causal_align = FP_CAUSAL_TOP_LEFT;
  t.out.fill_poison();
  ASSERT_TRUE(FWD_OK(p));
  const double a2 = 1.0, b2 = std::exp(1.0 - 0.25);
  EXPECT_NEAR(t.out.get({0, 0, 0, 0}), (a2 + 3 * b2) / (a2 + b2), 1e-15);
}

TEST(ReferenceClosedForm, CausalAlignments) {
  // Lq = 1, Lk = 2, causal: bottom-right sees both keys, top-left only key 0 (out = v0, lse = 0).
  Tiny t;
  fp_attn_params p = t.params();
  p.causal = 1;
  ASSERT_TRUE(FWD_OK(p));
  const double e = std::exp(1.0);
  EXPECT_NEAR(t.out.get({0, 0, 0, 0}), (1 + 3 * e) / (1 + e), 1e-15);
  p.causal_align = FP_CAUSAL_TOP_LEFT;
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_EQ(t.out.get({0, 0, 0, 0}), 1.0);
  EXPECT_EQ(t.lse.get({0, 0, 0}), 0.0);
  // window_left = 0 bottom-right: only key 1.
  p.causal_align = FP_CAUSAL_BOTTOM_RIGHT;
  p.window_left = 0;
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_EQ(t.out.get({0, 0, 0, 0}), 3.0);
  EXPECT_EQ(t.lse.get({0, 0, 0}), 1.0);
}

TEST(ReferenceClosedForm, EmptyRowAndSinkOnlyRow) {
  // Top-left causal with window_left = 0 and Sq = 3 > Sk = 2: row 2 sees j in [2, 2] -> none.
  HostTensor q(FP_F64, {1, 3, 1, 2}), k(FP_F64, {1, 2, 1, 2}), v(FP_F64, {1, 2, 1, 2});
  HostTensor out(FP_F64, {1, 3, 1, 2}), lse(FP_F64, {1, 1, 3});
  q.fill_normal();
  k.fill_normal();
  v.fill_normal();
  out.fill_poison();
  lse.fill_poison();
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.lse = lse.view();
  p.causal = 1;
  p.causal_align = FP_CAUSAL_TOP_LEFT;
  p.window_left = 0;
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_EQ(out.get({0, 0, 0, 0}), v.get({0, 0, 0, 0}));  // row 0 sees key 0 only
  EXPECT_EQ(out.get({0, 1, 0, 1}), v.get({0, 1, 0, 1}));  // row 1 sees key 1 only
  EXPECT_EQ(out.get({0, 2, 0, 0}), 0.0);
  EXPECT_EQ(out.get({0, 2, 0, 1}), 0.0);
  EXPECT_EQ(lse.get({0, 0, 2}), -INFINITY);
  // With a sink the empty row has lse = sink and out = 0.
  HostTensor sinks(FP_F32, {1});
  sinks.from_double({0.75});
  p.sinks = sinks.view();
  out.fill_poison();
  lse.fill_poison();
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_EQ(out.get({0, 2, 0, 0}), 0.0);
  EXPECT_EQ(lse.get({0, 0, 2}), 0.75);
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(lse.guards_intact());
}

// ---- Dense comparisons, feature by feature ----------------------------------------------------

TEST(ReferenceVsDense, Plain) {
  for (int64_t s : {1, 3, 113}) {
    check_vs_dense({1, s, s, 2, 2, 16, 16});
    check_vs_dense({2, s, 3, 2, 1, 8, 8});
    check_vs_dense({1, 3, s, 1, 1, 5, 7});
  }
}

TEST(ReferenceVsDense, DefaultScaleAndStrides) {
  Cfg c{2, 7, 9, 4, 2, 12, 10};
  c.default_scale = true;
  check_vs_dense(c);
  c.strided = true;
  check_vs_dense(c);
  c.causal = true;
  check_vs_dense(c);
}

TEST(ReferenceVsDense, CausalBothAlignments) {
  for (bool tl : {false, true})
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{5, 5}, {3, 8}, {8, 3}, {1, 7}, {113, 113}, {113, 3}}) {
      Cfg c{2, sq, sk, 2, 1, 8, 6};
      c.causal = true;
      c.top_left = tl;
      check_vs_dense(c);
    }
}

TEST(ReferenceVsDense, Windows) {
  for (bool tl : {false, true})
    for (auto [wl, wr] : {std::pair<int64_t, int64_t>{0, 0}, {2, -1}, {-1, 1}, {3, 2}, {0, 5}, {1, 0}}) {
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{6, 6}, {4, 11}, {11, 4}}) {
        Cfg c{1, sq, sk, 2, 2, 4, 4};
        c.wl = wl;
        c.wr = wr;
        c.top_left = tl;
        check_vs_dense(c);
      }
    }
  Cfg c{1, 9, 13, 2, 2, 4, 4};
  c.causal = true;
  c.wl = 3;  // local causal
  check_vs_dense(c);
}

// causal = 1 with a window is their intersection (flash_attn; transformers passes causal with
// window_size = (w - 1, w - 1)). The dense oracle spells the rule out independently.
TEST(ReferenceVsDense, CausalIntersectsWindow) {
  for (bool tl : {false, true})
    for (auto [wl, wr] : {std::pair<int64_t, int64_t>{3, 3}, {3, 0}, {-1, 3}, {3, -1}, {0, 7}, {1, 100}})
      for (auto [sq, sk] : {std::pair<int64_t, int64_t>{9, 9}, {4, 13}, {13, 4}, {1, 6}}) {
        Cfg c{2, sq, sk, 4, 2, 6, 5};
        c.causal = true;
        c.top_left = tl;
        c.wl = wl;
        c.wr = wr;
        check_vs_dense(c);
      }
}

// The same call with window_right = w (any w >= -1) and with window_right = 0 gives identical
// bits: the causal edge replaces the right window.
TEST(ReferenceVsDense, CausalWindowRightIsTheDiagonal) {
  for (bool tl : {false, true}) {
    Cfg c{2, 11, 17, 4, 2, 8, 8};
    c.causal = true;
    c.top_left = tl;
    c.wl = 4;
    c.wr = 0;
    BatchedCall call = build(c);
    fp_attn_params p = call.params();
    ASSERT_TRUE(FWD_OK(p));
    const auto out0 = call.out.to_double(), lse0 = call.lse.to_double();
    for (int32_t wr : {-1, 1, 4, 50}) {
      call.out.fill_poison();
      call.lse.fill_poison();
      p.window_right = wr;
      ASSERT_TRUE(FWD_OK(p));
      EXPECT_EQ(call.out.to_double(), out0) << "window_right " << wr;
      EXPECT_EQ(call.lse.to_double(), lse0) << "window_right " << wr;
    }
  }
}

TEST(ReferenceVsDense, Softcap) {
  Cfg c{2, 5, 9, 2, 2, 8, 8};
  c.softcap = 2.5;
  c.input_std = 3.0;  // scores large enough to saturate tanh
  check_vs_dense(c);
  c.causal = true;
  c.softcap = 30.0;
  check_vs_dense(c);
}

TEST(ReferenceVsDense, Alibi) {
  for (int kind : {1, 2})
    for (bool tl : {false, true}) {
      Cfg c{3, 6, 10, 4, 2, 8, 8};
      c.alibi = kind;
      c.top_left = tl;
      check_vs_dense(c);
      c.causal = true;
      check_vs_dense(c);
    }
}

TEST(ReferenceVsDense, Sinks) {
  Cfg c{2, 7, 7, 4, 4, 8, 8};
  c.sinks = true;
  check_vs_dense(c);
  c.causal = true;
  c.wl = 2;
  check_vs_dense(c);
}

TEST(ReferenceVsDense, GqaRatios) {
  for (int64_t hkv : {8, 4, 1}) {  // groups 1, 2, 8
    Cfg c{2, 5, 6, 8, hkv, 8, 4};
    check_vs_dense(c);
    c.causal = true;
    check_vs_dense(c);
  }
}

TEST(ReferenceVsDense, HeadDims) {
  for (auto [d, dv] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {32, 8}, {64, 128}, {256, 256}}) {
    Cfg c{1, 3, 5, 2, 1, d, dv};
    check_vs_dense(c);
  }
}

TEST(ReferenceVsDense, EmptyRows) {
  // Bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key.
  Cfg c{2, 9, 4, 2, 1, 4, 4};
  c.causal = true;
  check_vs_dense(c);
  BatchedCall call = build(c);
  fp_attn_params p = call.params();
  ASSERT_TRUE(FWD_OK(p));
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(call.lse.get({1, 1, i}), -INFINITY) << "row " << i;
    for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(call.out.get({1, i, 1, d}), 0.0);
  }
  EXPECT_TRUE(std::isfinite(call.lse.get({1, 1, 5})));
  // Top-left, Sq > Sk, window (0, 0): rows 2..5 would see key j = i, which does not exist.
  Cfg w{1, 6, 2, 2, 2, 4, 4};
  w.wl = 0;
  w.wr = 0;
  w.top_left = true;
  check_vs_dense(w);
  Cfg none{1, 6, 2, 2, 2, 4, 4};
  none.causal = true;  // rows 0..3 empty
  none.sinks = true;
  check_vs_dense(none);
}

TEST(ReferenceVsDense, Dropout) {
  for (float pdrop : {0.1f, 0.5f, 0.9f}) {
    Cfg c{2, 6, 11, 4, 2, 8, 8};
    c.dropout = pdrop;
    check_vs_dense(c);
    c.causal = true;
    c.sinks = true;
    check_vs_dense(c);
  }
}

TEST(ReferenceVsDense, RandomCombinations) {
  const int64_t sizes[] = {1, 2, 3, 7, 16, 33};
  for (int it = 0; it < 60; ++it) {
    Cfg c{rand_int(1, 3), sizes[rand_int(0, 5)], sizes[rand_int(0, 5)], 0, 0, rand_int(1, 40), rand_int(1, 40)};
    const int64_t groups[] = {1, 2, 3};
    c.hkv = rand_int(1, 2);
    c.hq = c.hkv * groups[rand_int(0, 2)];
    c.causal = rand_int(0, 2) == 0;
    c.top_left = rand_int(0, 1) == 1;
    if (rand_int(0, 2) == 0) c.wl = rand_int(0, 5);
    if (!c.causal && rand_int(0, 2) == 0) c.wr = rand_int(0, 5);
    if (rand_int(0, 2) == 0) c.softcap = rand_uniform(0.5, 20.0);
    c.alibi = static_cast<int>(rand_int(0, 2));
    c.sinks = rand_int(0, 1) == 1;
    if (rand_int(0, 2) == 0) c.dropout = static_cast<float>(rand_uniform(0.05, 0.7));
    c.strided = rand_int(0, 1) == 1;
    c.default_scale = rand_int(0, 3) == 0;
    check_vs_dense(c);
    if (::testing::Test::HasFailure()) break;
  }
}

// ---- Splits -------------------------------------------------------------------------------

TEST(ReferenceSplits, ForcedSplitsEqualUnsplit) {
  for (int variant = 0; variant < 4; ++variant) {
    Cfg c{2, 5, 37, 4, 2, 8, 6};
    c.causal = variant & 1;
    c.sinks = variant >= 2;
    c.alibi = variant == 3 ? 1 : 0;
    c.dropout = variant == 3 ? 0.3f : 0.0f;
    BatchedCall call = build(c);
    fp_attn_params p = call.params();
    p.num_splits = 1;
    ASSERT_TRUE(FWD_OK(p));
    const auto out1 = call.out.to_double(), lse1 = call.lse.to_double();
    for (int32_t n = 2; n <= 5; ++n) {
      SCOPED_TRACE("num_splits " + std::to_string(n) + " variant " + std::to_string(variant));
      fp_selection sel;
      p.num_splits = n;
      ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
      EXPECT_EQ(sel.backend, FP_BACKEND_REFERENCE);
      EXPECT_EQ(sel.num_splits, n);
      EXPECT_EQ(sel.workspace_bytes, 0u);
      call.out.fill_poison();
      call.lse.fill_poison();
      ASSERT_TRUE(FWD_OK(p));
      EXPECT_TRUE(close(call.out.to_double(), out1, kTol, "out"));
      EXPECT_TRUE(close(call.lse.to_double(), lse1, kTol, "lse"));
      EXPECT_TRUE(call.out.guards_intact());
    }
  }
}

TEST(ReferenceSplits, MoreSplitsThanKeysClampAndStayExact) {
  Cfg c{1, 4, 3, 2, 1, 4, 4};
  c.causal = true;
  BatchedCall call = build(c);
  fp_attn_params p = call.params();
  p.num_splits = 64;
  fp_selection sel;
  ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
  EXPECT_EQ(sel.num_splits, 3);  // the reference's key block is one key
  ASSERT_TRUE(FWD_OK(p));
  const refdense::Result r = call.dense();
  EXPECT_TRUE(close(call.out.to_double(), r.out_flat(), kTol, "out"));
  EXPECT_TRUE(close(call.lse.to_double(), r.lse_flat(), kTol, "lse"));
}

TEST(ReferenceSplits, HeuristicAndOffMeanUnsplit) {
  Cfg c{1, 4, 30, 2, 1, 4, 4};
  BatchedCall call = build(c);
  fp_attn_params p = call.params();
  fp_selection sel;
  for (int32_t n : {0, 1}) {
    p.num_splits = n;
    ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
    EXPECT_EQ(sel.num_splits, 1);
    EXPECT_STREQ(sel.kernel, "reference_fp64");
  }
}

// ---- Device and LSE dtype ------------------------------------------------------------------

TEST(ReferenceDevice, RefusesNonCpuTensors) {
  Cfg c{1, 2, 2, 1, 1, 4, 4};
  BatchedCall call = build(c);
  fp_attn_params p = call.params();
  for (fp_tensor* t : {&p.q, &p.k, &p.v, &p.out, &p.lse}) t->device_type = FP_DEVICE_CUDA;
  const fp_status st = fp_attn_fwd(&p);
  EXPECT_NE(st, FP_OK);
  EXPECT_EQ(call.out.poisoned_count(), call.out.numel());  // nothing written
}

TEST(ReferenceLse, Fp32LseIsTheRoundedFp64Lse) {
  Cfg c{2, 5, 7, 2, 1, 8, 8};
  c.sinks = true;
  BatchedCall call = build(c);
  fp_attn_params p = call.params();
  ASSERT_TRUE(FWD_OK(p));
  HostTensor lse32(FP_F32, {2, 2, 5});
  lse32.fill_poison();
  p.lse = lse32.view();
  ASSERT_TRUE(FWD_OK(p));
  const auto l64 = call.lse.to_double(), l32 = lse32.to_double();
  for (size_t i = 0; i < l64.size(); ++i) EXPECT_EQ(l32[i], static_cast<double>(static_cast<float>(l64[i])));
  // No LSE requested: out unchanged.
  const auto out1 = call.out.to_double();
  p.lse = fp_tensor{};
  call.out.fill_poison();
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_EQ(call.out.to_double(), out1);
}

// The Philox4x32-10 block function against the Random123 known-answer vectors.
TEST(ReferenceDropoutRule, PhiloxKnownAnswers) {
  struct Kat {
    uint32_t ctr[4], key[2], expect[4];
  } kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdcceb, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    flashport::Philox4 c{{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}};
    const flashport::Philox4 r = flashport::philox4x32_10(c, k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.x[i], k.expect[i]) << "word " << i;
  }
}

}  // namespace
}  // namespace reftest
