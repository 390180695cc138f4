// Left-padded KV caches (cache_leftpad) on the reference backend. The keys of sequence b are the
// cache rows [pad[b], seqused_k[b] + Snew): checked against the dense implementation over keys
// gathered by that rule (appended rows and rotary positions are absolute cache rows), and against
// the same call on a cache whose rows were shifted left by the pad (no cache_leftpad).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "core/score_rules.hpp"
#include "harness.hpp"

namespace reftest {
namespace {

using flashport::test::close;

struct LeftpadCase {
  bool paged = false;
  int64_t page = 4;
  bool batch_idx = false;  // contiguous cache: sequences read cache rows in reverse order
  int64_t snew = 0;
  int64_t rotary_dim = 0;
  bool interleaved = false;
  bool causal = false, top_left = false;
  int64_t wl = -1, wr = -1;
  bool alibi = false, sinks = false;
  float dropout = 0.0f;
  int32_t splits = 1;
  int64_t sq = 3, hq = 4, hkv = 2;
  const char* name = "";
};

constexpr int64_t kB = 3, kCap = 14, kD = 8, kDv = 5;

// Rotation of the first rd entries at one table row (pairs interleaved or half-split).
void rotate(std::vector<double>& x, int64_t rd, bool interleaved, const HostTensor& cos_t,
            const HostTensor& sin_t, int64_t pos) {
  for (int64_t t = 0; t < rd / 2; ++t) {
    const int64_t a = interleaved ? 2 * t : t, b = interleaved ? 2 * t + 1 : t + rd / 2;
    const double c = cos_t.get({pos, t}), s = sin_t.get({pos, t});
    const double x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
  }
}

void check_leftpad(const LeftpadCase& lc) {
  SCOPED_TRACE(std::string("case ") + lc.name);
  const int64_t H = lc.hkv;
  // Rows in use and pads: sequence 0 a pad inside its rows, 1 a pad equal to seqused_k (only
  // appended keys, if any), 2 no pad; lengths random.
  std::vector<int32_t> used(kB), pad(kB);
  for (int64_t b = 0; b < kB; ++b) used[b] = static_cast<int32_t>(rand_int(2, kCap - lc.snew));
  pad[0] = static_cast<int32_t>(rand_int(1, used[0] - 1));
  pad[1] = used[1];
  pad[2] = 0;
  const int64_t cache_rows = lc.batch_idx ? kB + 1 : kB;
  std::vector<int32_t> cache_of(kB);
  for (int64_t b = 0; b < kB; ++b) cache_of[b] = static_cast<int32_t>(lc.batch_idx ? cache_rows - 1 - b : b);

  // The logical cache [cache_rows, kCap, H, D|Dv] and, for paged calls, the same rows as pages.
  HostTensor kc(FP_F64, {cache_rows, kCap, H, kD}), vc(FP_F64, {cache_rows, kCap, H, kDv});
  kc.fill_normal();
  vc.fill_normal();
  const int64_t max_blocks = (kCap + lc.page - 1) / lc.page;
  HostTensor kp, vp, table;
  std::vector<int32_t> bt(kB * max_blocks);
  if (lc.paged) {
    const int64_t num_blocks = kB * max_blocks + 2;
    std::vector<int32_t> perm(num_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), test_rng());
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t m = 0; m < max_blocks; ++m) {
        const bool in_pad = (m + 1) * lc.page <= pad[b];
        // Blocks wholly inside the pad are never read: make them invalid.
        bt[b * max_blocks + m] = in_pad ? -12345 : perm[b * max_blocks + m];
      }
    table = HostTensor::i32({kB, max_blocks}, bt);
    kp = HostTensor(FP_F64, {num_blocks, lc.page, H, kD});
    vp = HostTensor(FP_F64, {num_blocks, lc.page, H, kDv});
    kp.fill_normal();
    vp.fill_normal();
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t r = 0; r < kCap; ++r) {
        const int32_t pg = bt[b * max_blocks + r / lc.page];
        if (pg < 0) continue;
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t d = 0; d < kD; ++d) kp.set({pg, r % lc.page, h, d}, kc.get({cache_of[b], r, h, d}));
          for (int64_t d = 0; d < kDv; ++d) vp.set({pg, r % lc.page, h, d}, vc.get({cache_of[b], r, h, d}));
        }
      }
  }
  HostTensor& k_store = lc.paged ? kp : kc;
  HostTensor& v_store = lc.paged ? vp : vc;
  const HostTensor k_before = k_store, v_before = v_store;
  const HostTensor kc0 = kc, vc0 = vc;  // logical rows before the append

  HostTensor k_new, v_new;
  if (lc.snew) {
    k_new = HostTensor(FP_F64, {kB, lc.snew, H, kD});
    v_new = HostTensor(FP_F64, {kB, lc.snew, H, kDv});
    k_new.fill_normal();
    v_new.fill_normal();
  }
  HostTensor cos_t, sin_t;
  if (lc.rotary_dim) {
    const int64_t rows = kCap + lc.sq;
    cos_t = HostTensor(FP_F64, {rows, lc.rotary_dim / 2});
    sin_t = HostTensor(FP_F64, {rows, lc.rotary_dim / 2});
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < lc.rotary_dim / 2; ++t) {
        const double th = rand_uniform(-3.1, 3.1);
        cos_t.set({r, t}, std::cos(th));
        sin_t.set({r, t}, std::sin(th));
      }
  }
  HostTensor q(FP_F64, {kB, lc.sq, lc.hq, kD}), out(FP_F64, {kB, lc.sq, lc.hq, kDv}),
      lse(FP_F64, {kB, lc.hq, lc.sq});
  q.fill_normal();
  out.fill_poison();
  lse.fill_poison();
  HostTensor seqused = HostTensor::i32({kB}, used), leftpad = HostTensor::i32({kB}, pad);
  HostTensor idx = HostTensor::i32({kB}, cache_of);
  HostTensor alibi, sinks;

  refdense::Spec s;
  s.batch = kB;
  s.hq = lc.hq;
  s.hkv = H;
  s.d = kD;
  s.dv = kDv;
  s.lq.assign(kB, lc.sq);
  for (int64_t b = 0; b < kB; ++b) s.lk.push_back(used[b] + lc.snew - pad[b]);
  s.scale = static_cast<float>(rand_uniform(0.2, 0.5));
  s.causal = lc.causal;
  s.top_left = lc.top_left;
  s.window_left = lc.wl;
  s.window_right = lc.wr;
  s.dropout_p = lc.dropout;
  s.seed = test_rng()();
  s.offset = 321;

  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = k_store.view();
  p.v = v_store.view();
  p.out = out.view();
  p.lse = lse.view();
  p.seqused_k = seqused.view();
  p.cache_leftpad = leftpad.view();
  if (lc.paged) p.block_table = table.view();
  if (lc.batch_idx) p.cache_batch_idx = idx.view();
  if (lc.snew) {
    p.k_new = k_new.view();
    p.v_new = v_new.view();
  }
  if (lc.rotary_dim) {
    p.rotary_cos = cos_t.view();
    p.rotary_sin = sin_t.view();
    p.rotary_interleaved = lc.interleaved;
  }
  p.softmax_scale = static_cast<float>(s.scale);
  p.causal = lc.causal;
  p.causal_align = lc.top_left ? FP_CAUSAL_TOP_LEFT : FP_CAUSAL_BOTTOM_RIGHT;
  p.window_left = static_cast<int32_t>(lc.wl);
  p.window_right = static_cast<int32_t>(lc.wr);
  if (lc.alibi) {
    alibi = HostTensor(FP_F32, {kB, lc.hq});
    alibi.fill_uniform(0.05, 0.5);
    s.alibi = alibi.to_double();
    s.alibi_per_batch = true;
    p.alibi_slopes = alibi.view();
  }
  if (lc.sinks) {
    sinks = HostTensor(FP_F32, {lc.hq});
    sinks.fill_uniform(-1.0, 1.0);
    s.sinks = sinks.to_double();
    p.sinks = sinks.view();
  }
  p.dropout_p = lc.dropout;
  p.dropout_seed = s.seed;
  p.dropout_offset = s.offset;
  p.num_splits = lc.splits;
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(out.all_written());
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(lse.all_written());
  EXPECT_TRUE(lse.guards_intact());

  // Appended row j of sequence b: k_new rotated at absolute cache row used[b] + j.
  auto new_key = [&](int64_t b, int64_t j, int64_t h) {
    std::vector<double> x(kD);
    for (int64_t d = 0; d < kD; ++d) x[d] = k_new.get({b, j, h, d});
    if (lc.rotary_dim) rotate(x, lc.rotary_dim, lc.interleaved, cos_t, sin_t, used[b] + j);
    return x;
  };
  // The cache after the call: appended rows at seqused_k + j, every other element unchanged.
  auto cache_off = [&](const HostTensor& t, int64_t b, int64_t r, int64_t h, int64_t d) {
    return lc.paged ? t.offset({bt[b * max_blocks + r / lc.page], r % lc.page, h, d})
                    : t.offset({cache_of[b], r, h, d});
  };
  {
    std::vector<char> appended_k(k_store.storage_bytes() / sizeof(double), 0);
    std::vector<char> appended_v(v_store.storage_bytes() / sizeof(double), 0);
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t j = 0; j < lc.snew; ++j)
        for (int64_t h = 0; h < H; ++h) {
          const auto x = new_key(b, j, h);
          const int64_t r = used[b] + j;
          for (int64_t d = 0; d < kD; ++d) {
            const int64_t off = cache_off(k_store, b, r, h, d);
            appended_k[off] = 1;
            EXPECT_NEAR(static_cast<const double*>(k_store.storage())[off], x[d], 1e-15);
          }
          for (int64_t d = 0; d < kDv; ++d) {
            const int64_t off = cache_off(v_store, b, r, h, d);
            appended_v[off] = 1;
            EXPECT_EQ(static_cast<const double*>(v_store.storage())[off], v_new.get({b, j, h, d}));
          }
        }
    const auto* k_now = static_cast<const double*>(k_store.storage());
    const auto* k_was = static_cast<const double*>(k_before.storage());
    const auto* v_now = static_cast<const double*>(v_store.storage());
    const auto* v_was = static_cast<const double*>(v_before.storage());
    int64_t other_changes = 0;
    for (size_t i = 0; i < appended_k.size(); ++i) other_changes += !appended_k[i] && k_now[i] != k_was[i];
    for (size_t i = 0; i < appended_v.size(); ++i) other_changes += !appended_v[i] && v_now[i] != v_was[i];
    EXPECT_EQ(other_changes, 0);
    EXPECT_TRUE(k_store.guards_intact());
    EXPECT_TRUE(v_store.guards_intact());
  }

  // Dense over the keys the header names: key j of sequence b is cache row pad[b] + j.
  const bool per_row = lc.causal || lc.wl >= 0 || lc.wr >= 0;
  auto qg = [&](int64_t b, int64_t i, int64_t h, int64_t d) {
    std::vector<double> x(kD);
    for (int64_t t = 0; t < kD; ++t) x[t] = q.get({b, i, h, t});
    if (lc.rotary_dim) rotate(x, lc.rotary_dim, lc.interleaved, cos_t, sin_t, used[b] + (per_row ? i : 0));
    return x[d];
  };
  auto kg = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    const int64_t r = pad[b] + j;
    return r < used[b] ? kc0.get({cache_of[b], r, h, d}) : new_key(b, r - used[b], h)[d];
  };
  auto vg = [&](int64_t b, int64_t j, int64_t h, int64_t d) {
    const int64_t r = pad[b] + j;
    return r < used[b] ? vc0.get({cache_of[b], r, h, d}) : v_new.get({b, r - used[b], h, d});
  };
  const refdense::Result r = refdense::forward(s, qg, kg, vg);
  EXPECT_TRUE(close(out.to_double(), r.out_flat(), 1e-12, "out"));
  EXPECT_TRUE(close(lse.to_double(), r.lse_flat(), 1e-12, "lse"));

  // Without rotary (whose positions are absolute rows), the call equals one on a cache shifted
  // left by the pad, bit for bit: same keys, same order, same alignment.
  if (lc.rotary_dim == 0) {
    HostTensor ks(FP_F64, {kB, kCap, H, kD}), vs(FP_F64, {kB, kCap, H, kDv});
    ks.fill_normal();
    vs.fill_normal();
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t row = pad[b]; row < used[b]; ++row)
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t d = 0; d < kD; ++d) ks.set({b, row - pad[b], h, d}, kc0.get({cache_of[b], row, h, d}));
          for (int64_t d = 0; d < kDv; ++d) vs.set({b, row - pad[b], h, d}, vc0.get({cache_of[b], row, h, d}));
        }
    std::vector<int32_t> used_shifted(kB);
    for (int64_t b = 0; b < kB; ++b) used_shifted[b] = used[b] - pad[b];
    HostTensor seqused_shifted = HostTensor::i32({kB}, used_shifted);
    HostTensor out2(FP_F64, out.shape()), lse2(FP_F64, lse.shape());
    out2.fill_poison();
    lse2.fill_poison();
    fp_attn_params ps = p;
    ps.k = ks.view();
    ps.v = vs.view();
    ps.block_table = fp_tensor{};
    ps.cache_batch_idx = fp_tensor{};
    ps.cache_leftpad = fp_tensor{};
    ps.seqused_k = seqused_shifted.view();
    ps.out = out2.view();
    ps.lse = lse2.view();
    ASSERT_TRUE(FWD_OK(ps));
    EXPECT_TRUE(out2.bitwise_equal(out));
    EXPECT_TRUE(lse2.bitwise_equal(lse));
  }
}

TEST(ReferenceLeftpad, ContiguousCache) {
  check_leftpad({.name = "plain"});
  check_leftpad({.batch_idx = true, .name = "cache_batch_idx"});
  check_leftpad({.causal = true, .name = "causal"});
  check_leftpad({.causal = true, .top_left = true, .name = "causal top-left"});
  check_leftpad({.causal = true, .wl = 2, .wr = 2, .alibi = true, .sinks = true, .name = "causal window alibi sinks"});
  check_leftpad({.wl = 3, .wr = 1, .sq = 5, .name = "window"});
  check_leftpad({.hq = 6, .hkv = 1, .name = "mqa"});
  check_leftpad({.dropout = 0.3f, .name = "dropout"});
  check_leftpad({.splits = 3, .sq = 1, .hq = 8, .hkv = 2, .name = "decode splits"});
}

TEST(ReferenceLeftpad, Append) {
  check_leftpad({.snew = 2, .causal = true, .name = "append causal"});
  check_leftpad({.batch_idx = true, .snew = 3, .sq = 3, .name = "append cache_batch_idx"});
  check_leftpad({.snew = 1, .causal = true, .alibi = true, .splits = 2, .sq = 1, .name = "append decode alibi splits"});
}

TEST(ReferenceLeftpad, Rotary) {
  for (bool inter : {false, true})
    for (bool causal : {false, true}) {
      SCOPED_TRACE("interleaved " + std::to_string(inter) + " causal " + std::to_string(causal));
      check_leftpad({.snew = 2, .rotary_dim = 4, .interleaved = inter, .causal = causal, .name = "rotary"});
      check_leftpad({.batch_idx = true, .snew = 3, .rotary_dim = 8, .interleaved = inter, .causal = causal,
                     .hq = 4, .hkv = 1, .name = "rotary cache_batch_idx gqa"});
    }
  check_leftpad({.snew = 2, .rotary_dim = 6, .wl = 2, .sq = 4, .name = "rotary window (per-row q positions)"});
}

TEST(ReferenceLeftpad, PagedCache) {
  for (int64_t page : {1, 3, 4, 16}) {
    SCOPED_TRACE("page " + std::to_string(page));
    check_leftpad({.paged = true, .page = page, .causal = true, .name = "paged causal"});
    check_leftpad({.paged = true, .page = page, .snew = 2, .rotary_dim = 4, .interleaved = true, .causal = true,
                   .name = "paged append rotary"});
    check_leftpad({.paged = true, .page = page, .snew = 1, .wl = 3, .wr = 0, .alibi = true, .splits = 4, .sq = 1,
                   .hq = 8, .hkv = 2, .name = "paged decode window alibi splits"});
  }
}

// Varlen queries (cu_seqlens_q) over a left-padded cache equal the same call on the shifted cache.
TEST(ReferenceLeftpad, VarlenQueries) {
  const int64_t B = 3, cap = 10, H = 2, D = 4;
  const std::vector<int32_t> cu = {0, 3, 4, 9}, used = {8, 5, 10}, pad = {2, 5, 4};
  HostTensor q(FP_F64, {9, H, D}), kc(FP_F64, {B, cap, H, D}), vc(FP_F64, {B, cap, H, D});
  for (HostTensor* t : {&q, &kc, &vc}) t->fill_normal();
  HostTensor ks(FP_F64, {B, cap, H, D}), vs(FP_F64, {B, cap, H, D});
  ks.fill_normal();
  vs.fill_normal();
  std::vector<int32_t> used_shifted(B);
  for (int64_t b = 0; b < B; ++b) {
    used_shifted[b] = used[b] - pad[b];
    for (int64_t r = pad[b]; r < used[b]; ++r)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          ks.set({b, r - pad[b], h, d}, kc.get({b, r, h, d}));
          vs.set({b, r - pad[b], h, d}, vc.get({b, r, h, d}));
        }
  }
  HostTensor cu_q = HostTensor::i32({B + 1}, cu), seqused = HostTensor::i32({B}, used),
             leftpad = HostTensor::i32({B}, pad), seqused2 = HostTensor::i32({B}, used_shifted);
  HostTensor out(FP_F64, {9, H, D}), lse(FP_F64, {H, 9}), out2(FP_F64, {9, H, D}), lse2(FP_F64, {H, 9});
  for (HostTensor* t : {&out, &lse, &out2, &lse2}) t->fill_poison();
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = kc.view();
  p.v = vc.view();
  p.out = out.view();
  p.lse = lse.view();
  p.cu_seqlens_q = cu_q.view();
  p.max_seqlen_q = 5;
  p.seqused_k = seqused.view();
  p.cache_leftpad = leftpad.view();
  p.causal = 1;
  p.window_left = 3;
  ASSERT_TRUE(FWD_OK(p));
  EXPECT_TRUE(out.all_written());
  fp_attn_params ps = p;
  ps.k = ks.view();
  ps.v = vs.view();
  ps.cache_leftpad = fp_tensor{};
  ps.seqused_k = seqused2.view();
  ps.out = out2.view();
  ps.lse = lse2.view();
  ASSERT_TRUE(FWD_OK(ps));
  EXPECT_TRUE(out.bitwise_equal(out2));
  EXPECT_TRUE(lse.bitwise_equal(lse2));
}

// A sequence whose pad equals seqused_k and no append sees no key: out = 0, lse = -inf (the
// sink's logit with sinks).
TEST(ReferenceLeftpad, PadEqualToSequsedLeavesNoKeys) {
  HostTensor kc(FP_F64, {1, 6, 1, 4}), vc(FP_F64, {1, 6, 1, 4}), q(FP_F64, {1, 2, 1, 4});
  HostTensor out(FP_F64, {1, 2, 1, 4}), lse(FP_F64, {1, 1, 2});
  for (HostTensor* t : {&kc, &vc, &q}) t->fill_normal();
  out.fill_poison();
  lse.fill_poison();
  HostTensor used = HostTensor::i32({1}, {4}), pad = HostTensor::i32({1}, {4});
  fp_attn_params p = ref_params();
  p.q = q.view();
  p.k = kc.view();
  p.v = vc.view();
  p.out = out.view();
  p.lse = lse.view();
  p.seqused_k = used.view();
  p.cache_leftpad = pad.view();
  ASSERT_TRUE(FWD_OK(p));
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(lse.get({0, 0, i}), -INFINITY);
    for (int64_t d = 0; d < 4; ++d) EXPECT_EQ(out.get({0, i, 0, d}), 0.0);
  }
}

// The score rules of a forward whose key tiles start `off` rows before the first key (the Hopper
// forward over a left-padded paged cache: SeqScoreRules::start_keys_early): every row sees the
// same keys, renumbered j + off, at the same distance from its diagonal; the first off keys are
// hidden from every row; a tile that skips the mask (tile_needs_mask false) holds only keys every
// row of the block sees. Brute force over rows and keys.
TEST(ReferenceLeftpad, KeysStartedEarlyKeepEachRowsKeys) {
  using Rules = flashport::SeqScoreRules<int64_t, double>;
  // At least 300 trials, more until 100 tiles have taken the mask-skip branch (about one trial in
  // six gives such a tile: 300 trials once gave exactly 50).
  int tiles_checked = 0;
  for (int trial = 0; trial < 300 || (tiles_checked < 100 && trial < 5000); ++trial) {
    flashport::ScoreRules r;
    r.window_left = rand_int(-1, 40);
    r.window_right = rand_int(-1, 40);
    r.top_left = rand_int(0, 1) == 1;
    const int64_t lq = rand_int(1, 90), lk = rand_int(0, 90), off = rand_int(0, 63);
    const double one = 1.0, zero = 0.0;
    const Rules plain(r, lq, lk, one, zero, zero);
    Rules early = plain;
    early.start_keys_early(off);
    const std::string what = "lq " + std::to_string(lq) + " lk " + std::to_string(lk) + " off " + std::to_string(off) +
                             " wl " + std::to_string(r.window_left) + " wr " + std::to_string(r.window_right) +
                             (r.top_left ? " top-left" : "");
    ASSERT_EQ(early.lk, lk + off) << what;
    auto sees = [](const Rules& s, int64_t i, int64_t j) { return j >= s.vis_lo(i) && j < s.vis_hi(i); };
    for (int64_t i = 0; i < lq; ++i) {
      for (int64_t j = 0; j < lk + off; ++j) {
        const bool want = j >= off && sees(plain, i, j - off);
        ASSERT_EQ(sees(early, i, j), want) << what << " row " << i << " key " << j;
        if (want) {
          ASSERT_EQ(early.diagonal(i) - j, plain.diagonal(i) - (j - off)) << what;
        }
      }
    }
    const int64_t bn = 16 << rand_int(0, 2), bm = 16 << rand_int(0, 2);
    for (int64_t i0 = 0; i0 < lq; i0 += bm) {
      const int64_t i1 = std::min(lq, i0 + bm) - 1;
      for (int64_t nb = 0; nb * bn < lk + off; ++nb) {
        if (early.tile_needs_mask(nb, bn, i0, i1)) continue;
        ++tiles_checked;
        for (int64_t i = i0; i <= i1; ++i)
          for (int64_t j = nb * bn; j < nb * bn + bn; ++j)
            ASSERT_TRUE(sees(early, i, j)) << what << " tile " << nb << " rows " << i0 << ".." << i1;
      }
    }
  }
  EXPECT_GE(tiles_checked, 100);
}

}  // namespace
}  // namespace reftest
