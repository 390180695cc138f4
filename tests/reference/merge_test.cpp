// fp_merge_fwd / fp_merge_bwd on the reference backend: vs the formula written out, vs unsplit
// attention, and the backward vs finite differences.
#include <cmath>
#include <string>

#include "harness.hpp"

namespace reftest {
namespace {

using flashport::test::close;

// The merge written out directly (no max shift; test values are moderate).
void merge_formula(const std::vector<double>& lse_i, const std::vector<std::vector<double>>& out_i,
                   std::vector<double>* out, double* lse) {
  const size_t dv = out_i.empty() ? 0 : out_i[0].size();
  long double z = 0;
  for (double l : lse_i) z += std::exp(static_cast<long double>(l));
  out->assign(dv, 0.0);
  if (z == 0) {
    *lse = -INFINITY;
    return;
  }
  *lse = static_cast<double>(std::log(z));
  for (size_t n = 0; n < lse_i.size(); ++n) {
    if (lse_i[n] == -INFINITY) continue;
    const double w = std::exp(lse_i[n] - *lse);
    for (size_t d = 0; d < dv; ++d) (*out)[d] += w * out_i[n][d];
  }
}

struct MergeCase {
  int64_t n, b, s, h, dv;
  bool packed = false;
  fp_dtype dtype = FP_F64;
  HostTensor parts, lse_parts, out, lse;

  MergeCase(int64_t n_, int64_t b_, int64_t s_, int64_t h_, int64_t dv_, bool packed_ = false,
            fp_dtype dtype_ = FP_F64)
      : n(n_), b(b_), s(s_), h(h_), dv(dv_), packed(packed_), dtype(dtype_) {}

  std::vector<int64_t> part_shape() const {
    return packed ? std::vector<int64_t>{n, s, h, dv} : std::vector<int64_t>{n, b, s, h, dv};
  }
  std::vector<int64_t> lse_part_shape() const {
    return packed ? std::vector<int64_t>{n, h, s} : std::vector<int64_t>{n, b, h, s};
  }
  void make() {
    const fp_dtype lse_dt = dtype == FP_F64 ? FP_F64 : FP_F32;
    parts = HostTensor(dtype, part_shape());
    lse_parts = HostTensor(lse_dt, lse_part_shape());
    out = packed ? HostTensor(dtype, {s, h, dv}) : HostTensor(dtype, {b, s, h, dv});
    lse = packed ? HostTensor(lse_dt, {h, s}) : HostTensor(lse_dt, {b, h, s});
    parts.fill_normal();
    lse_parts.fill_uniform(-3.0, 3.0);
    out.fill_poison();
    lse.fill_poison();
  }
  // Element accessors over the (b, s, h) row; packed has b = 0.
  double part(int64_t i, int64_t bb, int64_t ss, int64_t hh, int64_t d) const {
    return packed ? parts.get({i, ss, hh, d}) : parts.get({i, bb, ss, hh, d});
  }
  double lse_part(int64_t i, int64_t bb, int64_t ss, int64_t hh) const {
    return packed ? lse_parts.get({i, hh, ss}) : lse_parts.get({i, bb, hh, ss});
  }
  void set_lse_part(int64_t i, int64_t bb, int64_t ss, int64_t hh, double v) {
    if (packed) lse_parts.set({i, hh, ss}, v);
    else lse_parts.set({i, bb, hh, ss}, v);
  }
  void set_part_nan(int64_t i, int64_t bb, int64_t ss, int64_t hh) {
    for (int64_t d = 0; d < dv; ++d) {
      if (packed) parts.set({i, ss, hh, d}, NAN);
      else parts.set({i, bb, ss, hh, d}, NAN);
    }
  }
  fp_merge_params params() const {
    fp_merge_params p;
    fp_merge_params_init(&p);
    p.backend = FP_BACKEND_REFERENCE;
    p.out_partials = parts.view();
    p.lse_partials = lse_parts.view();
    p.out = out.view();
    p.lse = lse.view();
    return p;
  }
  // Expected (out, lse) in the logical order of out / lse.
  void expected(std::vector<double>* eo, std::vector<double>* el) const {
    const int64_t bsz = packed ? 1 : b;
    eo->assign(bsz * s * h * dv, 0.0);
    el->assign(bsz * h * s, 0.0);
    for (int64_t bb = 0; bb < bsz; ++bb)
      for (int64_t ss = 0; ss < s; ++ss)
        for (int64_t hh = 0; hh < h; ++hh) {
          std::vector<double> li(n);
          std::vector<std::vector<double>> oi(n, std::vector<double>(dv));
          for (int64_t i = 0; i < n; ++i) {
            li[i] = lse_part(i, bb, ss, hh);
            for (int64_t d = 0; d < dv; ++d) oi[i][d] = part(i, bb, ss, hh, d);
          }
          std::vector<double> o;
          double l;
          merge_formula(li, oi, &o, &l);
          for (int64_t d = 0; d < dv; ++d) (*eo)[((bb * s + ss) * h + hh) * dv + d] = o[d];
          (*el)[(bb * h + hh) * s + ss] = l;
        }
  }
};

void check_merge_formula(MergeCase& m) {
  m.make();
  // Knock out partials: single -inf partials (with NaN outputs that must be ignored) and whole
  // rows of -inf.
  const int64_t bsz = m.packed ? 1 : m.b;
  for (int64_t bb = 0; bb < bsz; ++bb)
    for (int64_t ss = 0; ss < m.s; ++ss)
      for (int64_t hh = 0; hh < m.h; ++hh) {
        const int64_t mode = rand_int(0, 4);
        for (int64_t i = 0; i < m.n; ++i) {
          if (mode == 0 || (mode == 1 && i == rand_int(0, m.n - 1))) {
            m.set_lse_part(i, bb, ss, hh, -INFINITY);
            m.set_part_nan(i, bb, ss, hh);
          }
        }
      }
  fp_merge_params p = m.params();
  ASSERT_TRUE(call_ok(fp_merge_fwd(&p), "fp_merge_fwd"));
  EXPECT_TRUE(m.out.guards_intact());
  EXPECT_TRUE(m.lse.guards_intact());
  EXPECT_TRUE(m.out.all_written());
  std::vector<double> eo, el;
  m.expected(&eo, &el);
  const double tol = m.dtype == FP_F64 ? 1e-13 : flashport::test::tolerance(m.dtype);
  EXPECT_TRUE(close(m.out.to_double(), eo, tol, "out"));
  EXPECT_TRUE(close(m.lse.to_double(), el, m.dtype == FP_F64 ? 1e-13 : 1e-6, "lse"));
}

TEST(ReferenceMerge, MatchesFormulaBatched) {
  for (int64_t n : {1, 2, 5}) {
    MergeCase m{n, 2, 7, 3, 5};
    SCOPED_TRACE("n " + std::to_string(n));
    check_merge_formula(m);
  }
}

TEST(ReferenceMerge, MatchesFormulaPacked) {
  MergeCase m{3, 1, 11, 2, 4, true};
  check_merge_formula(m);
}

TEST(ReferenceMerge, LowPrecisionPartials) {
  for (fp_dtype dt : {FP_F32, FP_F16, FP_BF16}) {
    MergeCase m{4, 2, 5, 2, 8, false, dt};
    SCOPED_TRACE(flashport::dtype_name(dt));
    check_merge_formula(m);
  }
}

TEST(ReferenceMerge, AllMinusInfGivesZeroAndMinusInf) {
  MergeCase m{3, 1, 2, 1, 3};
  m.make();
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t ss = 0; ss < 2; ++ss) {
      m.set_lse_part(i, 0, ss, 0, -INFINITY);
      m.set_part_nan(i, 0, ss, 0);
    }
  fp_merge_params p = m.params();
  ASSERT_TRUE(call_ok(fp_merge_fwd(&p), "fp_merge_fwd"));
  for (double x : m.out.to_double()) EXPECT_EQ(x, 0.0);
  for (double x : m.lse.to_double()) EXPECT_EQ(x, -INFINITY);
}

// Attention over chunks of the keys, merged, equals attention over all keys.
TEST(ReferenceMerge, MergedChunksEqualUnsplitAttention) {
  for (bool with_sinks : {false, true}) {
    SCOPED_TRACE(with_sinks ? "sinks" : "no sinks");
    const int64_t B = 2, Sq = 5, Sk = 13, Hq = 4, Hkv = 2, D = 8, Dv = 6;
    BatchedCall full;
    full.spec.batch = B;
    full.spec.hq = Hq;
    full.spec.hkv = Hkv;
    full.spec.d = D;
    full.spec.dv = Dv;
    full.spec.scale = 0.3;
    full.spec.softcap = 4.0;
    if (with_sinks) full.spec.sinks = random_vec(Hq, -1, 1);
    full.make(Sq, Sk);
    fp_attn_params p = full.params();
    ASSERT_TRUE(FWD_OK(p));

    const int64_t bounds[] = {0, 4, 5, 13};  // chunks of 4, 1 and 8 keys
    const int64_t nchunks = 3, nparts = nchunks + (with_sinks ? 1 : 0);
    HostTensor parts(FP_F64, {nparts, B, Sq, Hq, Dv}), lse_parts(FP_F64, {nparts, B, Hq, Sq});
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t len = bounds[c + 1] - bounds[c];
      HostTensor kc(FP_F64, {B, len, Hkv, D}), vc(FP_F64, {B, len, Hkv, Dv});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < len; ++j)
          for (int64_t h = 0; h < Hkv; ++h) {
            for (int64_t d = 0; d < D; ++d) kc.set({b, j, h, d}, full.k.get({b, bounds[c] + j, h, d}));
            for (int64_t d = 0; d < Dv; ++d) vc.set({b, j, h, d}, full.v.get({b, bounds[c] + j, h, d}));
          }
      HostTensor oc(FP_F64, {B, Sq, Hq, Dv}), lc(FP_F64, {B, Hq, Sq});
      fp_attn_params pc = p;
      pc.k = kc.view();
      pc.v = vc.view();
      pc.out = oc.view();
      pc.lse = lc.view();
      pc.sinks = fp_tensor{};
      ASSERT_TRUE(FWD_OK(pc));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Sq; ++i)
          for (int64_t h = 0; h < Hq; ++h) {
            for (int64_t d = 0; d < Dv; ++d) parts.set({c, b, i, h, d}, oc.get({b, i, h, d}));
            lse_parts.set({c, b, h, i}, lc.get({b, h, i}));
          }
    }
    if (with_sinks) {  // the sink as one more partial: out 0, lse = sink
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Sq; ++i)
          for (int64_t h = 0; h < Hq; ++h) {
            for (int64_t d = 0; d < Dv; ++d) parts.set({nchunks, b, i, h, d}, 0.0);
            lse_parts.set({nchunks, b, h, i}, full.sinks.get({h}));
          }
    }
    HostTensor out(FP_F64, {B, Sq, Hq, Dv}), lse(FP_F64, {B, Hq, Sq});
    out.fill_poison();
    lse.fill_poison();
    fp_merge_params mp;
    fp_merge_params_init(&mp);
    mp.backend = FP_BACKEND_REFERENCE;
    mp.out_partials = parts.view();
    mp.lse_partials = lse_parts.view();
    mp.out = out.view();
    mp.lse = lse.view();
    ASSERT_TRUE(call_ok(fp_merge_fwd(&mp), "fp_merge_fwd"));
    EXPECT_TRUE(close(out, full.out, 1e-12, "out"));
    EXPECT_TRUE(close(lse, full.lse, 1e-12, "lse"));
  }
}

// Merge backward vs central differences of L = sum(dout * out) + sum(dlse * lse).
TEST(ReferenceMerge, BackwardMatchesFiniteDifferences) {
  for (bool with_dlse : {true, false}) {
    SCOPED_TRACE(with_dlse ? "with dlse" : "without dlse");
    MergeCase m{3, 2, 3, 2, 4};
    m.make();
    // One -inf partial and one all -inf row: their gradients must be exactly 0.
    m.set_lse_part(1, 0, 1, 1, -INFINITY);
    for (int64_t i = 0; i < 3; ++i) m.set_lse_part(i, 1, 2, 0, -INFINITY);
    fp_merge_params fp = m.params();
    ASSERT_TRUE(call_ok(fp_merge_fwd(&fp), "fp_merge_fwd"));

    HostTensor dout(FP_F64, {2, 3, 2, 4}), dlse(FP_F64, {2, 2, 3});
    dout.fill_normal();
    dlse.fill_normal();
    HostTensor d_parts(FP_F64, m.part_shape()), d_lse_parts(FP_F64, m.lse_part_shape());
    d_parts.fill_poison();
    d_lse_parts.fill_poison();
    fp_merge_bwd_params bp;
    fp_merge_bwd_params_init(&bp);
    bp.fwd = fp;
    bp.dout = dout.view();
    if (with_dlse) bp.dlse = dlse.view();
    bp.d_out_partials = d_parts.view();
    bp.d_lse_partials = d_lse_parts.view();
    ASSERT_TRUE(call_ok(fp_merge_bwd(&bp), "fp_merge_bwd"));
    EXPECT_TRUE(d_parts.guards_intact());
    EXPECT_TRUE(d_lse_parts.guards_intact());
    EXPECT_TRUE(d_parts.all_written());
    EXPECT_TRUE(d_lse_parts.all_written());

    const auto g = dout.to_double(), gl = dlse.to_double();
    auto loss = [&]() {
      std::vector<double> eo, el;
      m.expected(&eo, &el);
      double l = 0;
      for (size_t i = 0; i < eo.size(); ++i) l += g[i] * eo[i];
      if (with_dlse)
        for (size_t i = 0; i < el.size(); ++i)
          if (std::isfinite(el[i])) l += gl[i] * el[i];
      return l;
    };
    const double step = 1e-6;
    auto fd = [&](HostTensor& x) {
      std::vector<double> r(x.numel());
      for (int64_t i = 0; i < x.numel(); ++i) {
        const double keep = x.at_linear(i);
        if (!std::isfinite(keep)) {
          r[i] = 0.0;
          continue;
        }
        x.set_linear(i, keep + step);
        const double lp = loss();
        x.set_linear(i, keep - step);
        const double lm = loss();
        x.set_linear(i, keep);
        r[i] = (lp - lm) / (2 * step);
      }
      return r;
    };
    EXPECT_TRUE(close(d_parts.to_double(), fd(m.parts), 1e-8, "d_out_partials"));
    EXPECT_TRUE(close(d_lse_parts.to_double(), fd(m.lse_parts), 1e-8, "d_lse_partials"));
    EXPECT_EQ(d_lse_parts.get({1, 0, 1, 1}), 0.0);
    for (int64_t i = 0; i < 3; ++i) {
      EXPECT_EQ(d_lse_parts.get({i, 1, 0, 2}), 0.0);
      for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(d_parts.get({i, 1, 2, 0, d}), 0.0);
    }
  }
}

}  // namespace
}  // namespace reftest
