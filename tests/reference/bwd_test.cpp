// Reference backward vs central finite differences of L = sum(dout * out), where out comes from
// the independent naive dense forward (tests/reference/dense.hpp), all in fp64.
#include <cmath>
#include <string>

#include "harness.hpp"

namespace reftest {
namespace {

using flashport::test::close;

struct BwdCfg {
  int64_t batch = 2, sq = 4, sk = 6, hq = 4, hkv = 2, d = 4, dv = 3;
  bool causal = false, top_left = false;
  int64_t wl = -1, wr = -1;
  double softcap = 0.0;
  int alibi = 0;
  bool sinks = false;
  float dropout = 0.0f;
  const char* name = "";
};

// Logical copies of q, k, v in fp64 with getters, so single elements can be perturbed.
struct Logical {
  int64_t s = 0, h = 0, d = 0;
  std::vector<double> x;
  double& at(int64_t b, int64_t r, int64_t hh, int64_t dd) { return x[((b * s + r) * h + hh) * d + dd]; }
  refdense::Getter getter() const {
    return [this](int64_t b, int64_t r, int64_t hh, int64_t dd) {
      return x[((b * s + r) * h + hh) * d + dd];
    };
  }
};

double loss(const refdense::Spec& spec, const Logical& q, const Logical& k, const Logical& v,
            const std::vector<double>& dout) {
  const auto r = refdense::forward(spec, q.getter(), k.getter(), v.getter());
  const auto o = r.out_flat();
  double l = 0.0;
  for (size_t i = 0; i < o.size(); ++i) l += dout[i] * o[i];
  return l;
}

// Central differences of loss() w.r.t. every entry of `x`.
template <class Eval>
std::vector<double> fd_grad(std::vector<double>& x, Eval eval, double step = 1e-5) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + step;
    const double lp = eval();
    x[i] = keep - step;
    const double lm = eval();
    x[i] = keep;
    g[i] = (lp - lm) / (2 * step);
  }
  return g;
}

void check_bwd(const BwdCfg& c) {
  SCOPED_TRACE(std::string("variant ") + c.name);
  BatchedCall call;
  refdense::Spec& s = call.spec;
  s.batch = c.batch;
  s.hq = c.hq;
  s.hkv = c.hkv;
  s.d = c.d;
  s.dv = c.dv;
  s.scale = 0.45;
  s.causal = c.causal;
  s.top_left = c.top_left;
  s.window_left = c.wl;
  s.window_right = c.wr;
  s.softcap = c.softcap;
  if (c.alibi) {
    s.alibi = random_vec(c.alibi == 2 ? c.batch * c.hq : c.hq, 0.05, 0.5);
    s.alibi_per_batch = c.alibi == 2;
  }
  if (c.sinks) s.sinks = random_vec(c.hq, -1.0, 1.0);
  s.dropout_p = c.dropout;
  s.seed = test_rng()();
  s.offset = 1000;
  call.make(c.sq, c.sk, c.softcap > 0 ? 2.0 : 1.0);
  fp_attn_params fp = call.params();
  ASSERT_TRUE(FWD_OK(fp));

  HostTensor dout(FP_F64, {c.batch, c.sq, c.hq, c.dv});
  dout.fill_normal();
  HostTensor dq(FP_F64, {c.batch, c.sq, c.hq, c.d}), dk(FP_F64, {c.batch, c.sk, c.hkv, c.d}),
      dv(FP_F64, {c.batch, c.sk, c.hkv, c.dv}), dsinks(FP_F32, {c.hq});
  for (HostTensor* t : {&dq, &dk, &dv, &dsinks}) t->fill_poison();
  fp_attn_bwd_params bp;
  fp_attn_bwd_params_init(&bp);
  bp.fwd = fp;
  bp.dout = dout.view();
  bp.dq = dq.view();
  bp.dk = dk.view();
  bp.dv = dv.view();
  if (c.sinks) bp.d_sinks = dsinks.view();
  bp.deterministic = 1;
  ASSERT_TRUE(BWD_OK(bp));
  for (HostTensor* t : {&dq, &dk, &dv}) {
    EXPECT_TRUE(t->guards_intact());
    EXPECT_TRUE(t->all_written());
  }
  EXPECT_TRUE(dsinks.guards_intact());

  Logical q{c.sq, c.hq, c.d, call.q.to_double()}, k{c.sk, c.hkv, c.d, call.k.to_double()},
      v{c.sk, c.hkv, c.dv, call.v.to_double()};
  const std::vector<double> g = dout.to_double();
  refdense::Spec spec = s;
  auto eval = [&] { return loss(spec, q, k, v, g); };
  // FD truncation ~ step^2 and cancellation ~ 1e-16 / step: both far below 1e-7.
  EXPECT_TRUE(close(dq.to_double(), fd_grad(q.x, eval), 1e-7, "dq"));
  EXPECT_TRUE(close(dk.to_double(), fd_grad(k.x, eval), 1e-7, "dk"));
  EXPECT_TRUE(close(dv.to_double(), fd_grad(v.x, eval), 1e-7, "dv"));
  if (c.sinks) {
    EXPECT_TRUE(dsinks.all_written());
    // d_sinks is fp32: compare at fp32 resolution.
    EXPECT_TRUE(close(dsinks.to_double(), fd_grad(spec.sinks, eval), 1e-6, "d_sinks"));
  }

  // Bit-identical on repeat, with or without `deterministic`.
  const auto dq1 = dq.to_double(), dk1 = dk.to_double(), dv1 = dv.to_double();
  bp.deterministic = 0;
  for (HostTensor* t : {&dq, &dk, &dv}) t->fill_poison();
  ASSERT_TRUE(BWD_OK(bp));
  EXPECT_EQ(dq.to_double(), dq1);
  EXPECT_EQ(dk.to_double(), dk1);
  EXPECT_EQ(dv.to_double(), dv1);
}

TEST(ReferenceBwd, Plain) { check_bwd({.name = "plain"}); }
TEST(ReferenceBwd, NoGqaAndMqa) {
  check_bwd({.hkv = 4, .name = "mha"});
  check_bwd({.hkv = 1, .name = "mqa"});
}
TEST(ReferenceBwd, DqkDiffers) { check_bwd({.d = 5, .dv = 2, .name = "d5dv2"}); }
TEST(ReferenceBwd, Causal) {
  check_bwd({.causal = true, .name = "causal br"});
  check_bwd({.sq = 7, .sk = 4, .causal = true, .top_left = true, .name = "causal tl Sq>Sk"});
  check_bwd({.sq = 7, .sk = 4, .causal = true, .name = "causal br Sq>Sk (empty rows)"});
}
TEST(ReferenceBwd, CausalIntersectsWindow) {
  for (bool tl : {false, true}) {
    check_bwd({.sq = 6, .sk = 6, .causal = true, .top_left = tl, .wl = 2, .wr = 2, .name = "causal (w, w)"});
    check_bwd({.sq = 4, .sk = 7, .causal = true, .top_left = tl, .wl = 2, .wr = 0, .name = "causal (w, 0)"});
    check_bwd({.sq = 7, .sk = 4, .causal = true, .top_left = tl, .wl = -1, .wr = 2, .name = "causal (-1, w)"});
    check_bwd({.sq = 5, .sk = 6, .causal = true, .top_left = tl, .wl = 1, .wr = -1, .name = "causal (w, -1)"});
  }
}
TEST(ReferenceBwd, Window) { check_bwd({.wl = 1, .wr = 2, .name = "window"}); }
TEST(ReferenceBwd, Softcap) { check_bwd({.softcap = 1.7, .name = "softcap"}); }
TEST(ReferenceBwd, Alibi) {
  check_bwd({.alibi = 1, .name = "alibi [Hq]"});
  check_bwd({.causal = true, .alibi = 2, .name = "alibi [B,Hq] causal"});
}
TEST(ReferenceBwd, Sinks) {
  check_bwd({.sinks = true, .name = "sinks"});
  check_bwd({.sq = 6, .sk = 3, .causal = true, .sinks = true, .name = "sinks with sink-only rows"});
}
TEST(ReferenceBwd, Dropout) {
  check_bwd({.dropout = 0.3f, .name = "dropout"});
  check_bwd({.causal = true, .softcap = 3.0, .sinks = true, .dropout = 0.5f, .name = "dropout+all"});
}
TEST(ReferenceBwd, Everything) {
  check_bwd({.batch = 2, .sq = 5, .sk = 7, .hq = 8, .hkv = 2, .d = 3, .dv = 4, .causal = true,
             .wl = 3, .softcap = 2.0, .alibi = 2, .sinks = true, .dropout = 0.2f, .name = "all"});
}

// Rows that see no key get dq = 0 and contribute nothing (no NaN from lse = -inf).
TEST(ReferenceBwd, EmptyRowsGiveZeroGradients) {
  BatchedCall call;
  call.spec.batch = 1;
  call.spec.hq = 2;
  call.spec.hkv = 1;
  call.spec.d = 4;
  call.spec.dv = 4;
  call.spec.scale = 0.5;
  call.spec.causal = true;
  call.make(6, 2);
  fp_attn_params fp = call.params();
  ASSERT_TRUE(FWD_OK(fp));
  HostTensor dout(FP_F64, {1, 6, 2, 4}), dq(FP_F64, {1, 6, 2, 4}), dk(FP_F64, {1, 2, 1, 4}),
      dv(FP_F64, {1, 2, 1, 4});
  dout.fill_normal();
  for (HostTensor* t : {&dq, &dk, &dv}) t->fill_poison();
  fp_attn_bwd_params bp;
  fp_attn_bwd_params_init(&bp);
  bp.fwd = fp;
  bp.dout = dout.view();
  bp.dq = dq.view();
  bp.dk = dk.view();
  bp.dv = dv.view();
  ASSERT_TRUE(BWD_OK(bp));
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(dq.get({0, i, h, d}), 0.0);
  for (double x : dk.to_double()) EXPECT_TRUE(std::isfinite(x));
  for (double x : dv.to_double()) EXPECT_TRUE(std::isfinite(x));
}

// seqused_k in the backward: cache rows past Lk[b] get zero gradients; the rest equals a call
// over exactly the used rows.
TEST(ReferenceBwd, SequsedKEqualsTrimmedCall) {
  const int64_t B = 2, Sq = 3, cap = 7, H = 2, D = 4;
  const std::vector<int32_t> used = {4, 7};
  HostTensor q(FP_F64, {B, Sq, H, D}), k(FP_F64, {B, cap, H, D}), v(FP_F64, {B, cap, H, D});
  HostTensor out(FP_F64, {B, Sq, H, D}), lse(FP_F64, {B, H, Sq}), dout(FP_F64, {B, Sq, H, D});
  HostTensor dq(FP_F64, q.shape()), dk(FP_F64, k.shape()), dv(FP_F64, v.shape());
  for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_normal();
  for (HostTensor* t : {&dq, &dk, &dv}) t->fill_poison();
  HostTensor su = HostTensor::i32({B}, used);
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.lse = lse.view();
  p.seqused_k = su.view();
  p.causal = 1;
  ASSERT_TRUE(FWD_OK(p));
  fp_attn_bwd_params bp;
  fp_attn_bwd_params_init(&bp);
  bp.fwd = p;
  bp.dout = dout.view();
  bp.dq = dq.view();
  bp.dk = dk.view();
  bp.dv = dv.view();
  ASSERT_TRUE(BWD_OK(bp));
  EXPECT_TRUE(dk.all_written());
  EXPECT_TRUE(dv.all_written());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lk = used[b];
    auto take = [&](const HostTensor& src, int64_t rows, int64_t heads) {
      HostTensor t(FP_F64, {1, rows, heads, D});
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < D; ++d) t.set({0, r, h, d}, src.get({b, r, h, d}));
      return t;
    };
    HostTensor qb = take(q, Sq, H), kb = take(k, lk, H), vb = take(v, lk, H), ob = take(out, Sq, H),
               gb = take(dout, Sq, H);
    HostTensor lb(FP_F64, {1, H, Sq});
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Sq; ++i) lb.set({0, h, i}, lse.get({b, h, i}));
    HostTensor dqb(FP_F64, qb.shape()), dkb(FP_F64, kb.shape()), dvb(FP_F64, vb.shape());
    fp_attn_bwd_params bb = bp;
    bb.fwd.seqused_k = fp_tensor{};
    bb.fwd.q = qb.view();
    bb.fwd.k = kb.view();
    bb.fwd.v = vb.view();
    bb.fwd.out = ob.view();
    bb.fwd.lse = lb.view();
    bb.dout = gb.view();
    bb.dq = dqb.view();
    bb.dk = dkb.view();
    bb.dv = dvb.view();
    ASSERT_TRUE(BWD_OK(bb));
    EXPECT_TRUE(take(dq, Sq, H).bitwise_equal(dqb));
    EXPECT_TRUE(take(dk, lk, H).bitwise_equal(dkb));
    EXPECT_TRUE(take(dv, lk, H).bitwise_equal(dvb));
    for (int64_t j = lk; j < cap; ++j)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          EXPECT_EQ(dk.get({b, j, h, d}), 0.0);
          EXPECT_EQ(dv.get({b, j, h, d}), 0.0);
        }
  }
}

// The backward uses the given LSE (as FlashAttention does): P = exp(s - lse).
TEST(ReferenceBwd, UsesTheGivenLse) {
  BatchedCall call;
  call.spec.batch = 1;
  call.spec.hq = 1;
  call.spec.hkv = 1;
  call.spec.d = 3;
  call.spec.dv = 3;
  call.spec.scale = 0.5;
  call.make(3, 4);
  fp_attn_params fp = call.params();
  ASSERT_TRUE(FWD_OK(fp));
  HostTensor dout(FP_F64, {1, 3, 1, 3}), dq(FP_F64, {1, 3, 1, 3}), dk(FP_F64, {1, 4, 1, 3}),
      dv(FP_F64, {1, 4, 1, 3});
  dout.fill_normal();
  fp_attn_bwd_params bp;
  fp_attn_bwd_params_init(&bp);
  bp.fwd = fp;
  bp.dout = dout.view();
  bp.dq = dq.view();
  bp.dk = dk.view();
  bp.dv = dv.view();
  ASSERT_TRUE(BWD_OK(bp));
  const auto dv1 = dv.to_double();
  // Shifting the LSE by log 2 halves every P, hence dv.
  for (int64_t i = 0; i < 3; ++i) call.lse.set({0, 0, i}, call.lse.get({0, 0, i}) + std::log(2.0));
  ASSERT_TRUE(BWD_OK(bp));
  const auto dv2 = dv.to_double();
  for (size_t i = 0; i < dv1.size(); ++i) EXPECT_NEAR(dv2[i], 0.5 * dv1[i], 1e-14 * (1 + std::fabs(dv1[i])));
}

}  // namespace
}  // namespace reftest
