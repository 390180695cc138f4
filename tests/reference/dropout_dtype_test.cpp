// Dropout mask properties, and low-precision inputs = fp64 on the upcast inputs, rounded once.
#include <cmath>
#include <string>

#include "harness.hpp"

namespace reftest {
namespace {

using flashport::test::close;

// q = 0 makes P uniform (1/Lk); v = identity (Dv = Lk) makes out[b, i, h, j] = keep(b,h,i,j) /
// ((1-p) Lk): the output spells out the dropout mask.
struct MaskProbe {
  int64_t B = 2, Sq = 48, Lk = 256, H = 3;
  HostTensor q, k, v, out;
  fp_attn_params p;
  MaskProbe(float drop, uint64_t seed, uint64_t offset) {
    q = HostTensor(FP_F64, {B, Sq, H, 4});
    k = HostTensor(FP_F64, {B, Lk, H, 4});
    v = HostTensor(FP_F64, {B, Lk, H, Lk});
    out = HostTensor(FP_F64, {B, Sq, H, Lk});
    q.fill_value(0.0);
    k.fill_normal();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < Lk; ++j)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < Lk; ++d) v.set({b, j, h, d}, d == j ? 1.0 : 0.0);
    out.fill_poison();
    p = ref_params();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.dropout_p = drop;
    p.dropout_seed = seed;
    p.dropout_offset = offset;
  }
  // 1 = kept, 0 = dropped, in (b, i, h, j) order; checks each value is exactly one of the two.
  std::vector<int> mask() {
    EXPECT_TRUE(FWD_OK(p));
    const double kept_value = 1.0 / (refdense::keep_rate(p.dropout_p) * double(Lk));
    std::vector<int> m;
    for (double x : out.to_double()) {
      EXPECT_TRUE(x == 0.0 || std::fabs(x - kept_value) <= 1e-15 * kept_value) << x;
      m.push_back(x != 0.0);
    }
    return m;
  }
};

TEST(ReferenceDropout, KeptFractionAndDocumentedIndexRule) {
  for (float drop : {0.1f, 0.5f, 0.83f}) {
    SCOPED_TRACE("p " + std::to_string(drop));
    const uint64_t seed = test_rng()(), offset = test_rng()() >> 4;
    MaskProbe probe(drop, seed, offset);
    const auto m = probe.mask();
    double kept = 0;
    for (int x : m) kept += x;
    const double n = static_cast<double>(m.size());
    const double frac = kept / n, sigma = std::sqrt(drop * (1 - drop) / n);
    EXPECT_NEAR(frac, 1.0 - drop, 5 * sigma);
    // Every element follows the documented (batch, query head, row, key) rule.
    refdense::Spec s;
    s.hq = probe.H;
    s.dropout_p = drop;
    s.seed = seed;
    s.offset = offset;
    int64_t mismatches = 0, idx = 0;
    for (int64_t b = 0; b < probe.B; ++b)
      for (int64_t i = 0; i < probe.Sq; ++i)
        for (int64_t h = 0; h < probe.H; ++h)
          for (int64_t j = 0; j < probe.Lk; ++j) mismatches += m[idx++] != int(refdense::kept(s, b, h, i, j));
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(ReferenceDropout, ReproducibleAndSensitiveToSeedAndOffset) {
  const float drop = 0.4f;
  const auto a = MaskProbe(drop, 123, 456).mask();
  const auto a2 = MaskProbe(drop, 123, 456).mask();
  EXPECT_EQ(a, a2);
  for (auto [seed, offset] : {std::pair<uint64_t, uint64_t>{123, 457}, {124, 456}, {123ull << 32, 456}, {123, 456ull << 32}}) {
    const auto b = MaskProbe(drop, seed, offset).mask();
    double differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    // Independent masks differ in a fraction 2p(1-p) = 0.48 of places.
    EXPECT_NEAR(differ / a.size(), 2 * drop * (1 - drop), 0.02) << seed << " " << offset;
  }
}

TEST(ReferenceDropout, ZeroProbabilityEqualsNoDropout) {
  BatchedCall call;
  call.spec.batch = 2;
  call.spec.hq = 2;
  call.spec.hkv = 1;
  call.spec.d = 8;
  call.spec.dv = 8;
  call.spec.scale = 0.3;
  call.make(5, 9);
  fp_attn_params p = call.params();
  ASSERT_TRUE(FWD_OK(p));
  const HostTensor out0 = call.out, lse0 = call.lse;
  p.dropout_p = 0.0f;
  p.dropout_seed = 999;
  p.dropout_offset = 12345;
  call.out.fill_poison();
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(call.out.bitwise_equal(out0));
  // Dropout changes out but never the LSE (that of the undropped softmax).
  p.dropout_p = 0.5f;
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_FALSE(call.out.bitwise_equal(out0));
  EXPECT_TRUE(call.lse.bitwise_equal(lse0));
}

// Mean of the dropped output over many seeds approaches the undropped output (1 / keep rate scaling).
TEST(ReferenceDropout, UnbiasedInExpectation) {
  BatchedCall call;
  call.spec.batch = 1;
  call.spec.hq = 1;
  call.spec.hkv = 1;
  call.spec.d = 4;
  call.spec.dv = 4;
  call.spec.scale = 0.5;
  call.make(2, 6);
  fp_attn_params p = call.params();
  ASSERT_TRUE(FWD_OK(p));
  const auto clean = call.out.to_double();
  std::vector<double> mean(clean.size(), 0.0);
  const int trials = 4000;
  p.dropout_p = 0.3f;
  for (int t = 0; t < trials; ++t) {
    p.dropout_seed = 1000 + t;
    ASSERT_TRUE(FWD_OK(p));
    const auto o = call.out.to_double();
    for (size_t i = 0; i < o.size(); ++i) mean[i] += o[i] / trials;
  }
  // Standard error per element <= sqrt(p/(1-p)) * max|v| / sqrt(trials) ~ 0.02 * 3.
  EXPECT_TRUE(close(mean, clean, 0.1, "mean of dropped out"));
}

// ---- Storage dtypes ------------------------------------------------------------------------------

HostTensor convert(const HostTensor& t, fp_dtype dt) {
  HostTensor r(dt, t.shape());
  r.from_double(t.to_double());
  return r;
}

TEST(ReferenceDtypes, LowPrecisionEqualsFp64OnUpcastInputsRoundedOnce) {
  for (fp_dtype dt : {FP_F32, FP_F16, FP_BF16}) {
    SCOPED_TRACE(flashport::dtype_name(dt));
    BatchedCall low;
    refdense::Spec& s = low.spec;
    s.batch = 2;
    s.hq = 4;
    s.hkv = 2;
    s.d = 24;
    s.dv = 16;
    s.scale = 0.25;
    s.causal = true;
    s.softcap = 5.0;
    s.alibi = random_vec(4, 0.05, 0.3);
    s.sinks = random_vec(4, -1, 1);
    s.dropout_p = 0.2f;
    s.seed = 42;
    low.dtype = dt;
    low.lse_dtype = FP_F32;
    low.make(7, 11);
    fp_attn_params pl = low.params();
    ASSERT_TRUE(FWD_OK(pl));
    EXPECT_TRUE(low.out.all_written());
    EXPECT_TRUE(low.out.guards_intact());

    HostTensor q64 = convert(low.q, FP_F64), k64 = convert(low.k, FP_F64), v64 = convert(low.v, FP_F64);
    HostTensor o64(FP_F64, low.out.shape()), l64(FP_F32, low.lse.shape());
    fp_attn_params ph = pl;
    ph.q = q64.view();
    ph.k = k64.view();
    ph.v = v64.view();
    ph.out = o64.view();
    ph.lse = l64.view();
    ASSERT_TRUE(FWD_OK(ph));
    EXPECT_TRUE(low.out.bitwise_equal(convert(o64, dt)));
    EXPECT_TRUE(low.lse.bitwise_equal(l64));
    // And within the dtype's tolerance of the exact result, of course.
    EXPECT_TRUE(close(low.out.to_double(), o64.to_double(), flashport::test::tolerance(dt), "out"));

    // Backward: grads in dt equal the fp64 grads of the upcast inputs (out, lse as given), rounded.
    HostTensor dout(dt, low.out.shape());
    dout.fill_normal();
    HostTensor dq(dt, low.q.shape()), dk(dt, low.k.shape()), dv(dt, low.v.shape());
    HostTensor ds(FP_F32, {4}), ds64(FP_F32, {4});
    for (HostTensor* t : {&dq, &dk, &dv, &ds}) t->fill_poison();
    fp_attn_bwd_params bl;
    fp_attn_bwd_params_init(&bl);
    bl.fwd = pl;
    bl.dout = dout.view();
    bl.dq = dq.view();
    bl.dk = dk.view();
    bl.dv = dv.view();
    bl.d_sinks = ds.view();
    ASSERT_TRUE(BWD_OK(bl));
    HostTensor out_up = convert(low.out, FP_F64), dout64 = convert(dout, FP_F64);
    HostTensor dq64(FP_F64, low.q.shape()), dk64(FP_F64, low.k.shape()), dv64(FP_F64, low.v.shape());
    fp_attn_bwd_params bh = bl;
    bh.fwd = ph;
    bh.fwd.out = out_up.view();
    bh.fwd.lse = low.lse.view();
    bh.dout = dout64.view();
    bh.dq = dq64.view();
    bh.dk = dk64.view();
    bh.dv = dv64.view();
    bh.d_sinks = ds64.view();
    ASSERT_TRUE(BWD_OK(bh));
    EXPECT_TRUE(dq.bitwise_equal(convert(dq64, dt)));
    EXPECT_TRUE(dk.bitwise_equal(convert(dk64, dt)));
    EXPECT_TRUE(dv.bitwise_equal(convert(dv64, dt)));
    EXPECT_TRUE(ds.bitwise_equal(ds64));
    for (HostTensor* t : {&dq, &dk, &dv, &ds}) {
      EXPECT_TRUE(t->guards_intact());
      EXPECT_TRUE(t->all_written());
    }
  }
}

TEST(ReferenceDtypes, HalfRotaryTables) {
  // rotary tables in q's dtype (f16) are accepted and used as their stored values.
  const int64_t B = 1, cap = 6, H = 1, D = 4;
  HostTensor kc(FP_F16, {B, cap, H, D}), vc(FP_F16, {B, cap, H, D}), q(FP_F16, {B, 1, H, D});
  HostTensor kn(FP_F16, {B, 1, H, D}), vn(FP_F16, {B, 1, H, D}), out(FP_F16, {B, 1, H, D});
  HostTensor cos16(FP_F16, {cap, 2}), sin16(FP_F16, {cap, 2});
  for (HostTensor* t : {&kc, &vc, &q, &kn, &vn}) t->fill_normal();
  cos16.fill_uniform(-1, 1);
  sin16.fill_uniform(-1, 1);
  out.fill_poison();
  HostTensor used = HostTensor::i32({1}, {3});
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = kc.view();
  p.v = vc.view();
  p.out = out.view();
  p.seqused_k = used.view();
  p.k_new = kn.view();
  p.v_new = vn.view();
  p.rotary_cos = cos16.view();
  p.rotary_sin = sin16.view();
  HostTensor lse(FP_F32, {B, H, 1}), lse64(FP_F32, {B, H, 1});
  lse.fill_poison();
  p.lse = lse.view();
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(out.all_written());
  // Appended row 3 = k_new rotated at position 3 with the f16 table values, rounded to f16.
  for (int64_t t = 0; t < 2; ++t) {
    const double c = cos16.get({3, t}), s = sin16.get({3, t});
    const double x0 = kn.get({0, 0, 0, t}), x1 = kn.get({0, 0, 0, t + 2});
    HostTensor r(FP_F16, {2});
    r.from_double({x0 * c - x1 * s, x0 * s + x1 * c});
    EXPECT_EQ(kc.get({0, 3, 0, t}), r.get({0}));
    EXPECT_EQ(kc.get({0, 3, 0, t + 2}), r.get({1}));
  }
  // q is rotated (non-causal: at position seqused_k = 3) and rounded to f16, like the appended
  // keys; then attention is fp64 on those stored values, rounded once.
  HostTensor q64(FP_F64, {B, 1, H, D}), k64(FP_F64, {B, cap, H, D}), v64(FP_F64, {B, cap, H, D});
  k64.from_double(kc.to_double());
  v64.from_double(vc.to_double());
  for (int64_t t = 0; t < 2; ++t) {
    const double c = cos16.get({3, t}), s = sin16.get({3, t});
    const double x0 = q.get({0, 0, 0, t}), x1 = q.get({0, 0, 0, t + 2});
    HostTensor r(FP_F16, {2});
    r.from_double({x0 * c - x1 * s, x0 * s + x1 * c});
    q64.set({0, 0, 0, t}, r.get({0}));
    q64.set({0, 0, 0, t + 2}, r.get({1}));
  }
  HostTensor out64(FP_F64, {B, 1, H, D});
  HostTensor used4 = HostTensor::i32({1}, {4});
  fp_attn_params ph = ref_params();
  ph.q = q64.view();
  ph.k = k64.view();
  ph.v = v64.view();
  ph.out = out64.view();
  ph.seqused_k = used4.view();
  ph.lse = lse64.view();
  ASSERT_TRUE(FWD_OK(ph));
  EXPECT_TRUE(out.bitwise_equal(convert(out64, FP_F16)));
  EXPECT_TRUE(lse.bitwise_equal(lse64));  // f32 LSE: sensitive to the rounding of q
}

}  // namespace
}  // namespace reftest
