// Layout features on the reference backend: varlen, paged KV, cache_batch_idx, append-then-attend
// and rotary — each against the dense implementation and/or the equivalent plain call.
#include <algorithm>
#include <cmath>
#include <complex>
#include <numeric>
#include <string>

#include "harness.hpp"

namespace reftest {
namespace {

using flashport::test::close;
using flashport::test::cumsum;

// ---- Varlen --------------------------------------------------------------------------------

struct VarlenCase {
  std::vector<int64_t> lq, lk;
  bool causal = false;
  int64_t wl = -1;
  bool alibi_per_batch = false, sinks = false;
  float dropout = 0.0f;
  int64_t wr = -1;  // with causal: intersected (flash_attn)
};

void check_varlen(const VarlenCase& vc) {
  refdense::Spec s;
  s.batch = static_cast<int64_t>(vc.lq.size());
  s.hq = 4;
  s.hkv = 2;
  s.d = 8;
  s.dv = 5;
  s.lq = vc.lq;
  s.lk = vc.lk;
  s.scale = static_cast<float>(0.35);
  s.causal = vc.causal;
  s.window_left = vc.wl;
  s.window_right = vc.wr;
  s.dropout_p = vc.dropout;
  s.seed = 77;
  s.offset = 5;
  const auto cq = cumsum(vc.lq), ck = cumsum(vc.lk);
  const int64_t pad = 2;  // trailing packed rows that belong to no sequence
  const int64_t tq = cq.back() + pad, tk = ck.back() + pad;
  HostTensor q(FP_F64, {tq, s.hq, s.d}), k(FP_F64, {tk, s.hkv, s.d}), v(FP_F64, {tk, s.hkv, s.dv});
  HostTensor out(FP_F64, {tq, s.hq, s.dv}), lse(FP_F64, {s.hq, tq});
  q.fill_normal();
  k.fill_normal();
  v.fill_normal();
  out.fill_poison();
  lse.fill_poison();
  HostTensor cu_q = HostTensor::i32({s.batch + 1}, cq), cu_k = HostTensor::i32({s.batch + 1}, ck);
  HostTensor alibi, sinks;
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.lse = lse.view();
  p.cu_seqlens_q = cu_q.view();
  p.cu_seqlens_k = cu_k.view();
  p.max_seqlen_q = *std::max_element(vc.lq.begin(), vc.lq.end());
  p.max_seqlen_k = *std::max_element(vc.lk.begin(), vc.lk.end());
  p.softmax_scale = static_cast<float>(s.scale);
  p.causal = vc.causal;
  p.window_left = static_cast<int32_t>(vc.wl);
  p.window_right = static_cast<int32_t>(vc.wr);
  p.dropout_p = vc.dropout;
  p.dropout_seed = s.seed;
  p.dropout_offset = s.offset;
  if (vc.alibi_per_batch) {
    alibi = HostTensor(FP_F32, {s.batch, s.hq});
    alibi.fill_uniform(0.05, 0.5);
    s.alibi = alibi.to_double();
    s.alibi_per_batch = true;
    p.alibi_slopes = alibi.view();
  }
  if (vc.sinks) {
    sinks = HostTensor(FP_F32, {s.hq});
    sinks.fill_uniform(-1, 1);
    s.sinks = sinks.to_double();
    p.sinks = sinks.view();
  }
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(lse.guards_intact());

  std::vector<int64_t> sq(cq.begin(), cq.end()), sk(ck.begin(), ck.end());
  const refdense::Result r = refdense::forward(s, packed_getter(q, sq), packed_getter(k, sk),
                                               packed_getter(v, sk));
  std::vector<double> got_out, want_out, got_lse, want_lse;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < vc.lq[b]; ++i)
      for (int64_t h = 0; h < s.hq; ++h) {
        for (int64_t d = 0; d < s.dv; ++d) {
          got_out.push_back(out.get({cq[b] + i, h, d}));
          want_out.push_back(r.out[b](i * s.hq + h, d));
        }
        got_lse.push_back(lse.get({h, cq[b] + i}));
        want_lse.push_back(r.lse[b][h * vc.lq[b] + i]);
      }
  EXPECT_TRUE(close(got_out, want_out, 1e-12, "out"));
  EXPECT_TRUE(close(got_lse, want_lse, 1e-12, "lse"));
  // Padding rows are not part of any sequence: the oracle leaves them alone.
  for (int64_t t = cq.back(); t < tq; ++t)
    for (int64_t h = 0; h < s.hq; ++h) EXPECT_TRUE(std::isnan(out.get({t, h, 0})));
  EXPECT_EQ(out.poisoned_count(), pad * s.hq * s.dv);
}

TEST(ReferenceVarlen, MatchesDense) {
  check_varlen({{5, 1, 7}, {6, 3, 9}});
  check_varlen({{5, 1, 7}, {6, 3, 9}, true});
  check_varlen({{8, 3}, {4, 3}, true, 2, true, true});
  check_varlen({{4, 6, 3}, {9, 2, 5}, false, -1, false, false, 0.25f});
  check_varlen({{4, 6, 3}, {9, 2, 5}, true, 1, true, true, 0.4f});
}

TEST(ReferenceVarlen, CausalIntersectsWindow) {
  for (auto [wl, wr] : {std::pair<int64_t, int64_t>{2, 2}, {2, 0}, {-1, 2}, {2, -1}}) {
    SCOPED_TRACE("window (" + std::to_string(wl) + ", " + std::to_string(wr) + ")");
    check_varlen({{5, 1, 7}, {6, 3, 9}, true, wl, false, false, 0.0f, wr});
    check_varlen({{8, 3, 4}, {4, 3, 11}, true, wl, true, true, 0.3f, wr});
  }
}

TEST(ReferenceVarlen, EmptySequences) {
  // A sequence with no queries and one with no keys (its rows: out 0, lse -inf; with sinks: lse = sink).
  check_varlen({{3, 0, 4}, {5, 2, 0}});
  check_varlen({{3, 0, 4}, {5, 2, 0}, true, -1, false, true});
}

// Varlen equals one batched call per sequence.
TEST(ReferenceVarlen, EqualsPerSequenceBatchedCalls) {
  const std::vector<int64_t> lq = {5, 1, 9}, lk = {7, 4, 9};
  const int64_t H = 2, D = 6;
  const auto cq = cumsum(lq), ck = cumsum(lk);
  HostTensor q(FP_F64, {cq.back(), H, D}), k(FP_F64, {ck.back(), H, D}), v(FP_F64, {ck.back(), H, D});
  HostTensor out(FP_F64, {cq.back(), H, D}), lse(FP_F64, {H, cq.back()});
  HostTensor cu_q = HostTensor::i32({4}, cq), cu_k = HostTensor::i32({4}, ck);
  HostTensor slopes(FP_F32, {H});
  slopes.fill_uniform(0.1, 0.3);
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
  p.cu_seqlens_q = cu_q.view();
  p.cu_seqlens_k = cu_k.view();
  p.max_seqlen_q = 9;
  p.max_seqlen_k = 9;
  p.causal = 1;
  p.softcap = 3.0f;
  p.alibi_slopes = slopes.view();
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(out.all_written());
  for (int64_t b = 0; b < 3; ++b) {
    HostTensor qb(FP_F64, {1, lq[b], H, D}), kb(FP_F64, {1, lk[b], H, D}), vb(FP_F64, {1, lk[b], H, D});
    HostTensor ob(FP_F64, {1, lq[b], H, D}), lb(FP_F64, {1, H, lq[b]});
    for (int64_t i = 0; i < lq[b]; ++i)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) qb.set({0, i, h, d}, q.get({cq[b] + i, h, d}));
    for (int64_t j = 0; j < lk[b]; ++j)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          kb.set({0, j, h, d}, k.get({ck[b] + j, h, d}));
          vb.set({0, j, h, d}, v.get({ck[b] + j, h, d}));
        }
    fp_attn_params pb = p;
    pb.cu_seqlens_q = pb.cu_seqlens_k = fp_tensor{};
    pb.max_seqlen_q = pb.max_seqlen_k = 0;
    pb.q = qb.view();
    pb.k = kb.view();
    pb.v = vb.view();
    pb.out = ob.view();
    pb.lse = lb.view();
    ASSERT_TRUE(FWD_OK(pb));
    for (int64_t i = 0; i < lq[b]; ++i)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out.get({cq[b] + i, h, d}), ob.get({0, i, h, d}));
        EXPECT_EQ(lse.get({h, cq[b] + i}), lb.get({0, h, i}));
      }
  }
}

// Varlen backward equals per-sequence batched backward.
TEST(ReferenceVarlen, BackwardEqualsPerSequenceCalls) {
  const std::vector<int64_t> lq = {4, 6}, lk = {5, 3};
  const int64_t Hq = 2, Hkv = 1, D = 4;
  const auto cq = cumsum(lq), ck = cumsum(lk);
  const int64_t tq = cq.back(), tk = ck.back();
  HostTensor q(FP_F64, {tq, Hq, D}), k(FP_F64, {tk, Hkv, D}), v(FP_F64, {tk, Hkv, D}),
      out(FP_F64, {tq, Hq, D}), lse(FP_F64, {Hq, tq}), dout(FP_F64, {tq, Hq, D});
  HostTensor dq(FP_F64, {tq, Hq, D}), dk(FP_F64, {tk, Hkv, D}), dv(FP_F64, {tk, Hkv, D});
  HostTensor cu_q = HostTensor::i32({3}, cq), cu_k = HostTensor::i32({3}, ck);
  for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_normal();
  for (HostTensor* t : {&dq, &dk, &dv}) t->fill_poison();
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.out = out.view();
  p.lse = lse.view();
  p.cu_seqlens_q = cu_q.view();
  p.cu_seqlens_k = cu_k.view();
  p.max_seqlen_q = 6;
  p.max_seqlen_k = 5;
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
  EXPECT_TRUE(dq.all_written());
  EXPECT_TRUE(dk.all_written());
  EXPECT_TRUE(dv.all_written());
  for (int64_t b = 0; b < 2; ++b) {
    auto slice = [](const HostTensor& src, int64_t start, int64_t len) {
      HostTensor t(FP_F64, {1, len, src.dim(1), src.dim(2)});
      for (int64_t r = 0; r < len; ++r)
        for (int64_t h = 0; h < src.dim(1); ++h)
          for (int64_t d = 0; d < src.dim(2); ++d) t.set({0, r, h, d}, src.get({start + r, h, d}));
      return t;
    };
    HostTensor qb = slice(q, cq[b], lq[b]), kb = slice(k, ck[b], lk[b]), vb = slice(v, ck[b], lk[b]);
    HostTensor ob = slice(out, cq[b], lq[b]), gb = slice(dout, cq[b], lq[b]);
    HostTensor lb(FP_F64, {1, Hq, lq[b]});
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < lq[b]; ++i) lb.set({0, h, i}, lse.get({h, cq[b] + i}));
    HostTensor dqb(FP_F64, qb.shape()), dkb(FP_F64, kb.shape()), dvb(FP_F64, vb.shape());
    fp_attn_bwd_params bb = bp;
    bb.fwd.cu_seqlens_q = bb.fwd.cu_seqlens_k = fp_tensor{};
    bb.fwd.max_seqlen_q = bb.fwd.max_seqlen_k = 0;
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
    EXPECT_TRUE(close(slice(dq, cq[b], lq[b]), dqb, 1e-14, "dq"));
    EXPECT_TRUE(close(slice(dk, ck[b], lk[b]), dkb, 1e-14, "dk"));
    EXPECT_TRUE(close(slice(dv, ck[b], lk[b]), dvb, 1e-14, "dv"));
  }
}

// ---- KV cache: paged, cache_batch_idx ----------------------------------------------------------

struct Cache {
  int64_t B = 2, cap = 0, H = 2, D = 8, Dv = 6;
  HostTensor k, v;  // contiguous [B, cap, H, D|Dv]
  void make(int64_t b, int64_t c) {
    B = b;
    cap = c;
    k = HostTensor(FP_F64, {B, cap, H, D});
    v = HostTensor(FP_F64, {B, cap, H, Dv});
    k.fill_normal();
    v.fill_normal();
  }
};

// The same cache as pages: block_table[b][m] = perm[b * max_blocks + m], unused pages random.
struct Paged {
  int64_t page = 1, max_blocks = 0, num_blocks = 0;
  HostTensor k, v, table;
  void make(const Cache& c, int64_t page_size, const std::vector<int64_t>& used) {
    page = page_size;
    max_blocks = (c.cap + page - 1) / page;
    num_blocks = c.B * max_blocks + 3;
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), test_rng());
    std::vector<int32_t> bt(c.B * max_blocks);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t m = 0; m < max_blocks; ++m) {
        const bool reached = used.empty() || m * page < used[b];
        // Entries past the blocks a sequence reaches are never read: make them invalid.
        bt[b * max_blocks + m] = reached ? perm[b * max_blocks + m] : 987654;
      }
    table = HostTensor::i32({c.B, max_blocks}, bt);
    k = HostTensor(FP_F64, {num_blocks, page, c.H, c.D});
    v = HostTensor(FP_F64, {num_blocks, page, c.H, c.Dv});
    k.fill_normal();
    v.fill_normal();
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t j = 0; j < c.cap; ++j) {
        const int64_t pg = perm[b * max_blocks + j / page], row = j % page;
        for (int64_t h = 0; h < c.H; ++h) {
          for (int64_t d = 0; d < c.D; ++d) k.set({pg, row, h, d}, c.k.get({b, j, h, d}));
          for (int64_t d = 0; d < c.Dv; ++d) v.set({pg, row, h, d}, c.v.get({b, j, h, d}));
        }
      }
  }
};

struct QOut {
  HostTensor q, out, lse;
  void make(int64_t B, int64_t sq, int64_t H, int64_t D, int64_t Dv) {
    q = HostTensor(FP_F64, {B, sq, H, D});
    out = HostTensor(FP_F64, {B, sq, H, Dv});
    lse = HostTensor(FP_F64, {B, H, sq});
    q.fill_normal();
    out.fill_poison();
    lse.fill_poison();
  }
};

TEST(ReferencePaged, EqualsContiguousCache) {
  for (int64_t page : {1, 3, 16}) {
    for (bool with_used : {true, false}) {
      SCOPED_TRACE("page " + std::to_string(page) + (with_used ? " seqused_k" : " full"));
      Cache c;
      const int64_t max_blocks = (19 + page - 1) / page;
      c.make(2, max_blocks * page);  // capacity a multiple of the page size
      std::vector<int64_t> used;
      if (with_used) used = {rand_int(1, c.cap), rand_int(1, c.cap)};
      Paged pg;
      pg.make(c, page, used);
      HostTensor seqused = HostTensor::i32({2}, {int32_t(used.empty() ? 0 : used[0]), int32_t(used.empty() ? 0 : used[1])});
      QOut a, b;
      a.make(2, 4, c.H, c.D, c.Dv);
      b = a;
      fp_attn_params p = ref_params();
      p.q = a.q.view();
      p.k = c.k.view();
      p.v = c.v.view();
      p.out = a.out.view();
      p.lse = a.lse.view();
      p.causal = 1;
      if (with_used) p.seqused_k = seqused.view();
      ASSERT_TRUE(FWD_OK(p));
      fp_attn_params pp = p;
      pp.k = pg.k.view();
      pp.v = pg.v.view();
      pp.block_table = pg.table.view();
      pp.out = b.out.view();
      pp.lse = b.lse.view();
      ASSERT_TRUE(FWD_OK(pp));
      EXPECT_TRUE(b.out.bitwise_equal(a.out));
      EXPECT_TRUE(b.lse.bitwise_equal(a.lse));
      EXPECT_TRUE(b.out.all_written());
      EXPECT_TRUE(b.out.guards_intact());
      // And the contiguous call itself against dense.
      refdense::Spec s;
      s.batch = 2;
      s.hq = s.hkv = c.H;
      s.d = c.D;
      s.dv = c.Dv;
      s.lq = {4, 4};
      s.lk = with_used ? used : std::vector<int64_t>{c.cap, c.cap};
      s.scale = default_scale_of(c.D);
      s.causal = true;
      const auto r = refdense::forward(s, batched_getter(a.q), batched_getter(c.k), batched_getter(c.v));
      EXPECT_TRUE(close(a.out.to_double(), r.out_flat(), 1e-12, "out"));
      EXPECT_TRUE(close(a.lse.to_double(), r.lse_flat(), 1e-12, "lse"));
    }
  }
}

TEST(ReferenceCache, CacheBatchIdxEqualsGatheredCache) {
  for (std::vector<int32_t> idx : {std::vector<int32_t>{3, 1}, {2, 2}}) {
    Cache big;
    big.make(4, 10);
    Cache small;
    small.make(2, 10);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t j = 0; j < 10; ++j)
        for (int64_t h = 0; h < big.H; ++h) {
          for (int64_t d = 0; d < big.D; ++d) small.k.set({b, j, h, d}, big.k.get({idx[b], j, h, d}));
          for (int64_t d = 0; d < big.Dv; ++d) small.v.set({b, j, h, d}, big.v.get({idx[b], j, h, d}));
        }
    HostTensor cbi = HostTensor::i32({2}, idx), used = HostTensor::i32({2}, {7, 10});
    QOut a, b;
    a.make(2, 3, big.H, big.D, big.Dv);
    b = a;
    fp_attn_params p = ref_params();
    p.q = a.q.view();
    p.k = small.k.view();
    p.v = small.v.view();
    p.out = a.out.view();
    p.lse = a.lse.view();
    p.seqused_k = used.view();
    ASSERT_TRUE(FWD_OK(p));
    p.k = big.k.view();
    p.v = big.v.view();
    p.cache_batch_idx = cbi.view();
    p.out = b.out.view();
    p.lse = b.lse.view();
    ASSERT_TRUE(FWD_OK(p));
    EXPECT_TRUE(b.out.bitwise_equal(a.out));
    EXPECT_TRUE(b.lse.bitwise_equal(a.lse));
  }
}

// ---- Append-then-attend and rotary -------------------------------------------------------------

// x (first rd entries) rotated by angle theta_t per pair, via complex multiplication.
void rotate_explicit(std::vector<double>& x, int64_t rd, bool interleaved,
                     const std::vector<double>& cos_row, const std::vector<double>& sin_row) {
  for (int64_t t = 0; t < rd / 2; ++t) {
    const int64_t a = interleaved ? 2 * t : t, b = interleaved ? 2 * t + 1 : t + rd / 2;
    const std::complex<double> z = std::complex<double>(x[a], x[b]) *
                                   std::complex<double>(cos_row[t], sin_row[t]);
    x[a] = z.real();
    x[b] = z.imag();
  }
}

struct AppendCase {
  bool paged = false;
  int64_t page = 4;
  int64_t rotary_dim = 0;  // 0 = none
  bool interleaved = false;
  bool causal = false;
  int64_t wl = -1;
  int64_t wr = -1;  // with causal: intersected (flash_attn)
  fp_dtype rotary_dtype = FP_F32;
  int64_t sq = 3;
};

void check_append(const AppendCase& ac) {
  const int64_t B = 2, cap = 12, Snew = 3, H = 2, D = 8, Dv = 5;
  const std::vector<int64_t> used = {2, 7};
  Cache c;
  c.H = H;
  c.D = D;
  c.Dv = Dv;
  c.make(B, cap);
  const Cache orig = c;
  Paged pg;
  if (ac.paged) pg.make(c, ac.page, {used[0] + Snew, used[1] + Snew});
  const Paged pg_orig = pg;
  HostTensor k_new(FP_F64, {B, Snew, H, D}), v_new(FP_F64, {B, Snew, H, Dv});
  k_new.fill_normal();
  v_new.fill_normal();
  HostTensor seqused = HostTensor::i32({B}, {int32_t(used[0]), int32_t(used[1])});
  QOut qo;
  qo.make(B, ac.sq, H, D, Dv);
  // Rotary tables: random angles per (position, pair).
  HostTensor cos_t, sin_t;
  std::vector<std::vector<double>> cos_v(cap), sin_v(cap);
  if (ac.rotary_dim) {
    cos_t = HostTensor(ac.rotary_dtype, {cap, ac.rotary_dim / 2});
    sin_t = HostTensor(ac.rotary_dtype, {cap, ac.rotary_dim / 2});
    for (int64_t pos = 0; pos < cap; ++pos)
      for (int64_t t = 0; t < ac.rotary_dim / 2; ++t) {
        const double th = rand_uniform(-3.1, 3.1);
        cos_t.set({pos, t}, std::cos(th));
        sin_t.set({pos, t}, std::sin(th));
        cos_v[pos].push_back(cos_t.get({pos, t}));
        sin_v[pos].push_back(sin_t.get({pos, t}));
      }
  }
  fp_attn_params p = ref_params();
  p.q = qo.q.view();
  p.k = ac.paged ? pg.k.view() : c.k.view();
  p.v = ac.paged ? pg.v.view() : c.v.view();
  if (ac.paged) p.block_table = pg.table.view();
  p.out = qo.out.view();
  p.lse = qo.lse.view();
  p.seqused_k = seqused.view();
  p.k_new = k_new.view();
  p.v_new = v_new.view();
  p.causal = ac.causal;
  p.window_left = static_cast<int32_t>(ac.wl);
  p.window_right = static_cast<int32_t>(ac.wr);
  if (ac.rotary_dim) {
    p.rotary_cos = cos_t.view();
    p.rotary_sin = sin_t.view();
    p.rotary_interleaved = ac.interleaved;
  }
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(qo.out.all_written());
  EXPECT_TRUE(qo.out.guards_intact());

  // Expected keys of sequence b: the old cache rows, then k_new rotated at used[b] + j.
  auto new_key = [&](int64_t b, int64_t j, int64_t h) {
    std::vector<double> x(D);
    for (int64_t d = 0; d < D; ++d) x[d] = k_new.get({b, j, h, d});
    if (ac.rotary_dim) rotate_explicit(x, ac.rotary_dim, ac.interleaved, cos_v[used[b] + j], sin_v[used[b] + j]);
    return x;
  };
  // Check the cache: appended rows hold the (rotated) new keys, everything else is untouched.
  auto cache_k = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    if (!ac.paged) return c.k.get({b, j, h, d});
    const int32_t page = pg.table.to_i32()[b * pg.max_blocks + j / ac.page];
    return pg.k.get({page, j % ac.page, h, d});
  };
  auto cache_v = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    if (!ac.paged) return c.v.get({b, j, h, d});
    const int32_t page = pg.table.to_i32()[b * pg.max_blocks + j / ac.page];
    return pg.v.get({page, j % ac.page, h, d});
  };
  int64_t changed = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Snew; ++j)
      for (int64_t h = 0; h < H; ++h) {
        const auto x = new_key(b, j, h);
        for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(cache_k(b, used[b] + j, h, d), x[d], 1e-15);
        for (int64_t d = 0; d < Dv; ++d) EXPECT_EQ(cache_v(b, used[b] + j, h, d), v_new.get({b, j, h, d}));
      }
  // Everything else unchanged (compare whole storages against the copies, minus appended rows).
  const HostTensor& kk = ac.paged ? pg.k : c.k;
  const HostTensor& kk0 = ac.paged ? pg_orig.k : orig.k;
  const auto now = kk.to_double(), before = kk0.to_double();
  for (size_t i = 0; i < now.size(); ++i) changed += now[i] != before[i];
  EXPECT_LE(changed, B * Snew * H * D);
  EXPECT_TRUE(kk.guards_intact());

  // Output vs dense over the concatenation, with q rotated per the header's position rule.
  refdense::Spec s;
  s.batch = B;
  s.hq = s.hkv = H;
  s.d = D;
  s.dv = Dv;
  s.lq = {ac.sq, ac.sq};
  s.lk = {used[0] + Snew, used[1] + Snew};
  s.scale = default_scale_of(D);
  s.causal = ac.causal;
  s.window_left = ac.wl;
  s.window_right = ac.wr;
  const bool per_row = ac.causal || ac.wl >= 0 || ac.wr >= 0;
  auto qg = [&](int64_t b, int64_t i, int64_t h, int64_t d) {
    std::vector<double> x(D);
    for (int64_t t = 0; t < D; ++t) x[t] = qo.q.get({b, i, h, t});
    if (ac.rotary_dim) {
      const int64_t pos = used[b] + (per_row ? i : 0);
      rotate_explicit(x, ac.rotary_dim, ac.interleaved, cos_v[pos], sin_v[pos]);
    }
    return x[d];
  };
  auto kg = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    return j < used[b] ? orig.k.get({b, j, h, d}) : new_key(b, j - used[b], h)[d];
  };
  auto vg = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    return j < used[b] ? orig.v.get({b, j, h, d}) : v_new.get({b, j - used[b], h, d});
  };
  const auto r = refdense::forward(s, qg, kg, vg);
  EXPECT_TRUE(close(qo.out.to_double(), r.out_flat(), 1e-12, "out"));
  EXPECT_TRUE(close(qo.lse.to_double(), r.lse_flat(), 1e-12, "lse"));
}

TEST(ReferenceAppend, WritesCacheAndAttendsOverConcatenation) {
  check_append({});
  check_append({.causal = true});
  check_append({.causal = true, .sq = 1});
  check_append({.wl = 2, .sq = 4});
}

TEST(ReferenceAppend, CausalIntersectsWindow) {
  for (auto [wl, wr] : {std::pair<int64_t, int64_t>{2, 2}, {2, 0}, {-1, 2}, {2, -1}}) {
    SCOPED_TRACE("window (" + std::to_string(wl) + ", " + std::to_string(wr) + ")");
    check_append({.causal = true, .wl = wl, .wr = wr, .sq = 4});
    check_append({.paged = true, .page = 3, .rotary_dim = 4, .interleaved = true, .causal = true,
                  .wl = wl, .wr = wr, .sq = 3});
  }
}

TEST(ReferenceAppend, Paged) {
  for (int64_t page : {1, 3, 16}) {
    SCOPED_TRACE("page " + std::to_string(page));
    check_append({.paged = true, .page = page, .causal = true});
  }
}

TEST(ReferenceRotary, EqualsExplicitRotation) {
  for (bool inter : {false, true})
    for (int64_t rd : {2, 4, 8})
      for (bool causal : {false, true}) {
        SCOPED_TRACE("interleaved " + std::to_string(inter) + " rotary_dim " + std::to_string(rd) +
                     " causal " + std::to_string(causal));
        check_append({.rotary_dim = rd, .interleaved = inter, .causal = causal});
      }
  // Windowed (non-causal) rows rotate per row too; fp64 tables; paged cache.
  check_append({.rotary_dim = 6, .interleaved = false, .wl = 1, .sq = 4});
  check_append({.rotary_dim = 4, .interleaved = true, .rotary_dtype = FP_F64});
  check_append({.paged = true, .page = 3, .rotary_dim = 8, .interleaved = true, .causal = true});
}

}  // namespace
}  // namespace reftest

namespace reftest {
namespace {

// Causal q rows are rotated at seqused_k + i; with Sq > Snew that can pass the table's last row.
// The oracle refuses (naming rotary_cos) before writing anything, cache included.
TEST(ReferenceRotary, QueryPositionPastTableIsAnErrorAndWritesNothing) {
  const int64_t B = 1, cap = 6, H = 1, D = 4;
  HostTensor kc(FP_F64, {B, cap, H, D}), vc(FP_F64, {B, cap, H, D}), q(FP_F64, {B, 4, H, D});
  HostTensor kn(FP_F64, {B, 1, H, D}), vn(FP_F64, {B, 1, H, D}), out(FP_F64, {B, 4, H, D});
  HostTensor cos_t(FP_F32, {cap, 2}), sin_t(FP_F32, {cap, 2});
  for (HostTensor* t : {&kc, &vc, &q, &kn, &vn, &cos_t, &sin_t}) t->fill_normal();
  out.fill_poison();
  const HostTensor kc0 = kc;
  HostTensor used = HostTensor::i32({1}, {5});  // rows 5 + i for i < 4 reach position 8 >= 6
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = kc.view();
  p.v = vc.view();
  p.out = out.view();
  p.seqused_k = used.view();
  p.k_new = kn.view();
  p.v_new = vn.view();
  p.rotary_cos = cos_t.view();
  p.rotary_sin = sin_t.view();
  p.causal = 1;
  const fp_status st = fp_attn_fwd(&p);
  EXPECT_EQ(st, FP_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fp_last_error()).find("rotary_cos"), std::string::npos) << fp_last_error();
  EXPECT_TRUE(kc.bitwise_equal(kc0));
  EXPECT_EQ(out.poisoned_count(), out.numel());
  // Non-causal: every q row is rotated at seqused_k = 5, inside the table.
  p.causal = 0;
  EXPECT_TRUE(FWD_OK(p));
}

}  // namespace
}  // namespace reftest
