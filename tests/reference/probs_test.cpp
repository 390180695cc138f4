// fp_attn_probs on the reference backend: probs[b, h, i, j] = exp(s_ij - lse_i) over the visible
// keys, negated where dropout drops the element, 0 elsewhere; checked against the dense
// implementation's probabilities (tests/reference/dense.hpp), against the forward's output
// (out = sum_j kept(P) / keep rate * v_j), on varlen and KV-cache layouts, and its bad inputs.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "harness.hpp"

namespace reftest {
namespace {

using flashport::test::close;

// The expected probs tensor [B, Hq, sq_max, sk_max] (flattened) from the dense probabilities.
std::vector<double> dense_probs(const refdense::Spec& s, const refdense::Getter& q,
                                const refdense::Getter& k, int64_t sq_max, int64_t sk_max) {
  std::vector<double> r(s.batch * s.hq * sq_max * sk_max, 0.0);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.hq; ++h) {
      std::vector<double> lse;
      const refdense::Mat P = refdense::head_probs(s, b, h, q, k, &lse);
      for (int64_t i = 0; i < s.lq[b]; ++i)
        for (int64_t j = 0; j < s.lk[b]; ++j) {
          const double sign = refdense::kept(s, b, h, i, j) ? 1.0 : -1.0;
          r[((b * s.hq + h) * sq_max + i) * sk_max + j] = sign * P(i, j);
        }
    }
  return r;
}

fp_status probs_call(const fp_attn_params& p, const HostTensor& probs) {
  return fp_attn_probs(&p, probs.view());
}

struct ProbsCfg {
  int64_t batch = 2, sq = 5, sk = 9, hq = 4, hkv = 2, d = 8, dv = 6;
  bool causal = false, top_left = false;
  int64_t wl = -1, wr = -1;
  double softcap = 0.0;
  int alibi = 0;
  bool sinks = false;
  float dropout = 0.0f;
  fp_dtype probs_dtype = FP_F64;
  bool strided_probs = false;
  const char* name = "";
};

void check_batched(const ProbsCfg& c) {
  SCOPED_TRACE(std::string("case ") + c.name);
  BatchedCall call;
  refdense::Spec& s = call.spec;
  s.batch = c.batch;
  s.hq = c.hq;
  s.hkv = c.hkv;
  s.d = c.d;
  s.dv = c.dv;
  s.scale = rand_uniform(0.2, 0.6);
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
  s.offset = 99;
  call.make(c.sq, c.sk, c.softcap > 0 ? 2.0 : 1.0);
  fp_attn_params p = call.params();
  ASSERT_TRUE(FWD_OK(p));

  HostTensor probs = c.strided_probs
                         ? HostTensor::padded(c.probs_dtype, {c.batch, c.hq, c.sq, c.sk}, {0, 1, 2, 3})
                         : HostTensor(c.probs_dtype, {c.batch, c.hq, c.sq, c.sk});
  probs.fill_poison();
  fp_attn_params pp = p;
  pp.out = fp_tensor{};  // not read
  ASSERT_TRUE(call_ok(probs_call(pp, probs), "fp_attn_probs"));
  EXPECT_TRUE(probs.all_written());
  EXPECT_TRUE(probs.guards_intact());
  const auto want = dense_probs(s, batched_getter(call.q), batched_getter(call.k), c.sq, c.sk);
  const double tol = c.probs_dtype == FP_F64 ? 1e-12 : (c.probs_dtype == FP_F32 ? 1e-6 : 1e-2);
  EXPECT_TRUE(close(probs.to_double(), want, tol, "probs"));

  // The forward's output is sum_j dropout(P_ij) v_j with P recovered from probs.
  if (c.probs_dtype == FP_F64) {
    const auto pr = probs.to_double();
    const double inv_keep = 1.0 / refdense::keep_rate(c.dropout);
    std::vector<double> out(call.out.numel(), 0.0);
    const int64_t group = c.hq / c.hkv;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t i = 0; i < c.sq; ++i)
          for (int64_t j = 0; j < c.sk; ++j) {
            const double x = pr[((b * c.hq + h) * c.sq + i) * c.sk + j];
            if (x <= 0.0) continue;
            for (int64_t t = 0; t < c.dv; ++t)
              out[((b * c.sq + i) * c.hq + h) * c.dv + t] += x * inv_keep * call.v.get({b, j, h / group, t});
          }
    EXPECT_TRUE(close(out, call.out.to_double(), 1e-12, "out from probs"));
  }
}

TEST(ReferenceProbs, MatchesDense) {
  check_batched({.name = "plain"});
  check_batched({.sq = 7, .sk = 7, .causal = true, .name = "causal"});
  check_batched({.sq = 9, .sk = 4, .causal = true, .top_left = true, .name = "causal tl Sq>Sk (empty rows)"});
  check_batched({.causal = true, .wl = 2, .wr = 2, .name = "causal window"});
  check_batched({.wl = 1, .wr = 3, .softcap = 2.0, .name = "window softcap"});
  check_batched({.alibi = 2, .sinks = true, .name = "alibi sinks"});
  check_batched({.hq = 6, .hkv = 1, .dropout = 0.3f, .name = "mqa dropout"});
  check_batched({.causal = true, .softcap = 5.0, .alibi = 1, .sinks = true, .dropout = 0.5f, .name = "everything"});
}

TEST(ReferenceProbs, DtypesAndStrides) {
  check_batched({.dropout = 0.2f, .probs_dtype = FP_F32, .name = "fp32 probs"});
  check_batched({.causal = true, .probs_dtype = FP_F64, .strided_probs = true, .name = "strided probs"});
}

// Rows sum to one (less the sink's share) in absolute value; dropped elements are negative.
TEST(ReferenceProbs, RowSumsAndSigns) {
  BatchedCall call;
  refdense::Spec& s = call.spec;
  s.batch = 1;
  s.hq = s.hkv = 2;
  s.d = s.dv = 4;
  s.scale = 0.5;
  s.sinks = {0.3, -0.7};
  s.dropout_p = 0.4f;
  s.seed = 7;
  s.offset = 3;
  call.make(6, 40);
  fp_attn_params p = call.params();
  ASSERT_TRUE(FWD_OK(p));
  HostTensor probs(FP_F64, {1, 2, 6, 40});
  probs.fill_poison();
  ASSERT_TRUE(call_ok(probs_call(p, probs), "fp_attn_probs"));
  int64_t negative = 0;
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 6; ++i) {
      double sum = 0.0;
      for (int64_t j = 0; j < 40; ++j) {
        const double x = probs.get({0, h, i, j});
        sum += std::fabs(x);
        negative += x < 0.0;
      }
      const double lse = call.lse.get({0, h, i});
      EXPECT_NEAR(sum + std::exp(s.sinks[h] - lse), 1.0, 1e-12);
    }
  EXPECT_GT(negative, 0);
  EXPECT_LT(negative, 2 * 6 * 40);
}

TEST(ReferenceProbs, VarlenPadsWithZeros) {
  const std::vector<int64_t> lq = {3, 0, 5}, lk = {4, 6, 2};
  const int64_t B = 3, H = 2, D = 4, max_q = 6, max_k = 7;
  std::vector<int32_t> cq(B + 1, 0), ck(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    cq[b + 1] = cq[b] + int32_t(lq[b]);
    ck[b + 1] = ck[b] + int32_t(lk[b]);
  }
  HostTensor q(FP_F64, {cq.back(), H, D}), k(FP_F64, {ck.back(), H, D}), v(FP_F64, {ck.back(), H, D});
  HostTensor out(FP_F64, {cq.back(), H, D}), lse(FP_F64, {H, cq.back()});
  for (HostTensor* t : {&q, &k, &v}) t->fill_normal();
  HostTensor cu_q = HostTensor::i32({B + 1}, cq), cu_k = HostTensor::i32({B + 1}, ck);
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.lse = lse.view();
  p.cu_seqlens_q = cu_q.view();
  p.cu_seqlens_k = cu_k.view();
  p.max_seqlen_q = max_q;
  p.max_seqlen_k = max_k;
  p.causal = 1;
  p.softmax_scale = 0.4f;
  p.dropout_p = 0.25f;
  p.dropout_seed = 1234;
  ASSERT_TRUE(FWD_OK(p));
  HostTensor probs(FP_F32, {B, H, max_q, max_k});
  probs.fill_poison();
  ASSERT_TRUE(call_ok(probs_call(p, probs), "fp_attn_probs"));
  EXPECT_TRUE(probs.all_written());
  refdense::Spec s;
  s.batch = B;
  s.hq = s.hkv = H;
  s.d = s.dv = D;
  s.lq = lq;
  s.lk = lk;
  s.scale = 0.4f;
  s.causal = true;
  s.dropout_p = 0.25f;
  s.seed = 1234;
  std::vector<int64_t> sq(cq.begin(), cq.end()), sk(ck.begin(), ck.end());
  const auto want = dense_probs(s, packed_getter(q, sq), packed_getter(k, sk), max_q, max_k);
  EXPECT_TRUE(close(probs.to_double(), want, 1e-6, "probs"));
}

// KV cache: left pad, cache_batch_idx and paged pages give the probabilities over the logical
// keys (key j = cache row pad + j); Sk_max is the cache capacity.
TEST(ReferenceProbs, KvCacheWithLeftpad) {
  const int64_t B = 2, cap = 12, H = 2, D = 4, Sq = 3, page = 4, max_blocks = cap / page;
  HostTensor kc(FP_F64, {B + 1, cap, H, D}), vc(FP_F64, {B + 1, cap, H, D}), q(FP_F64, {B, Sq, H, D});
  HostTensor out(FP_F64, {B, Sq, H, D}), lse(FP_F64, {B, H, Sq});
  for (HostTensor* t : {&kc, &vc, &q}) t->fill_normal();
  const std::vector<int32_t> used = {9, 12}, pad = {3, 0}, idx = {2, 0};
  HostTensor seqused = HostTensor::i32({B}, used), leftpad = HostTensor::i32({B}, pad),
             cbi = HostTensor::i32({B}, idx);
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = kc.view();
  p.v = vc.view();
  p.out = out.view();
  p.lse = lse.view();
  p.seqused_k = seqused.view();
  p.cache_leftpad = leftpad.view();
  p.cache_batch_idx = cbi.view();
  p.causal = 1;
  p.window_left = 4;
  ASSERT_TRUE(FWD_OK(p));
  HostTensor probs(FP_F64, {B, H, Sq, cap});
  probs.fill_poison();
  ASSERT_TRUE(call_ok(probs_call(p, probs), "fp_attn_probs"));
  refdense::Spec s;
  s.batch = B;
  s.hq = s.hkv = H;
  s.d = s.dv = D;
  s.lq = {Sq, Sq};
  s.lk = {used[0] - pad[0], used[1] - pad[1]};
  s.scale = default_scale_of(D);
  s.causal = true;
  s.window_left = 4;
  auto kg = [&](int64_t b, int64_t j, int64_t h, int64_t d) { return kc.get({idx[b], pad[b] + j, h, d}); };
  const auto want = dense_probs(s, batched_getter(q), kg, Sq, cap);
  EXPECT_TRUE(close(probs.to_double(), want, 1e-12, "probs"));

  // The same cache as pages gives the same bits.
  HostTensor kp(FP_F64, {B * max_blocks, page, H, D}), vp(FP_F64, {B * max_blocks, page, H, D});
  std::vector<int32_t> bt(B * max_blocks);
  std::iota(bt.begin(), bt.end(), 0);
  std::shuffle(bt.begin(), bt.end(), test_rng());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < cap; ++r)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          kp.set({bt[b * max_blocks + r / page], r % page, h, d}, kc.get({idx[b], r, h, d}));
          vp.set({bt[b * max_blocks + r / page], r % page, h, d}, vc.get({idx[b], r, h, d}));
        }
  HostTensor table = HostTensor::i32({B, max_blocks}, bt);
  fp_attn_params pg = p;
  pg.k = kp.view();
  pg.v = vp.view();
  pg.cache_batch_idx = fp_tensor{};
  pg.block_table = table.view();
  HostTensor probs_paged(FP_F64, {B, H, Sq, cap});
  probs_paged.fill_poison();
  ASSERT_TRUE(call_ok(probs_call(pg, probs_paged), "fp_attn_probs paged"));
  EXPECT_TRUE(probs_paged.bitwise_equal(probs));
}

// ---- Bad input: a named error, nothing written --------------------------------------------------

struct BadProbs {
  BatchedCall call;
  HostTensor probs;
  fp_attn_params p;
  BadProbs() {
    refdense::Spec& s = call.spec;
    s.batch = 2;
    s.hq = 4;
    s.hkv = 2;
    s.d = s.dv = 8;
    call.make(3, 5);
    p = call.params();
    EXPECT_TRUE(FWD_OK(p));
    probs = HostTensor(FP_F64, {2, 4, 3, 5});
    probs.fill_poison();
  }
  ::testing::AssertionResult rejected(const fp_tensor& t, const std::string& needle) {
    const fp_status st = fp_attn_probs(&p, t);
    const std::string msg = fp_last_error();
    if (st != FP_ERR_INVALID_ARGUMENT)
      return ::testing::AssertionFailure() << fp_status_name(st) << ": " << msg;
    if (msg.find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << needle << "\"";
    if (probs.poisoned_count() != probs.numel())
      return ::testing::AssertionFailure() << "probs were written";
    return ::testing::AssertionSuccess();
  }
};

TEST(ReferenceProbs, BadInputs) {
  {
    BadProbs c;
    EXPECT_TRUE(c.rejected(fp_tensor{}, "probs: is required"));
  }
  {
    BadProbs c;
    c.p.lse = fp_tensor{};
    EXPECT_TRUE(c.rejected(c.probs.view(), "lse: is required"));
  }
  {
    BadProbs c;
    HostTensor wrong(FP_F64, {2, 4, 3, 6});
    wrong.fill_poison();
    EXPECT_TRUE(c.rejected(wrong.view(), "probs: must have shape [B, Hq, Sq_max, Sk_max] = [2, 4, 3, 5]"));
    EXPECT_EQ(wrong.poisoned_count(), wrong.numel());
  }
  {
    BadProbs c;
    HostTensor half(FP_F16, {2, 4, 3, 5});
    EXPECT_TRUE(c.rejected(half.view(), "probs: must be float32 or q's dtype float64"));
  }
  {
    BadProbs c;
    fp_tensor t = c.probs.view();
    t.device_type = FP_DEVICE_CUDA;
    EXPECT_TRUE(c.rejected(t, "probs: must be on the same device as q"));
  }
  {
    BadProbs c;
    HostTensor kn(FP_F64, {2, 1, 2, 8}), vn(FP_F64, {2, 1, 2, 8});
    HostTensor used = HostTensor::i32({2}, {3, 4});
    c.p.seqused_k = used.view();
    c.p.k_new = kn.view();
    c.p.v_new = vn.view();
    const HostTensor k0 = c.call.k;
    EXPECT_TRUE(c.rejected(c.probs.view(), "k_new: must be absent in fp_attn_probs"));
    EXPECT_TRUE(c.call.k.bitwise_equal(k0));
  }
  EXPECT_EQ(fp_attn_probs(nullptr, fp_tensor{}), FP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fp_last_error()).find("params"), std::string::npos);
}

}  // namespace
}  // namespace reftest
