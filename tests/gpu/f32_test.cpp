// CUDA float32 (src/gpu/f32: 3xTF32 tensor-core forward and backward) against the fp64 reference: every
// feature the 16-bit kernels take (batched/varlen, GQA/MQA, causal both alignments, windows,
// softcap, ALiBi, sinks, LSE, dropout, split-KV, KV cache contiguous/paged/cache_batch_idx/
// cache_leftpad/seqused_k, append + rotary, head dims 1..256, Dq != Dv), forward and backward,
// through the shared harnesses (fresh random inputs, poisoned outputs, sentinels, NaN checks) with
// the fp32 tolerances of test_util; and the error measured against an fp32 computation on the CPU
// (the fp32-rounding claim). Skipped without a CUDA device.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bwd_harness.hpp"
#include "core/score_rules.hpp"
#include "gpu/f32/f32_launch.hpp"
#include "gpu/f32/tf32_frag.hpp"
#include "scenarios.hpp"

namespace gputest {
namespace {

Case f32_case() {
  Case c;
  c.dtype = FP_F32;
  return c;
}

void check_f32(const Case& c) {
  SCOPED_TRACE("fp32");
  fp_selection sel{};
  check_case(c, &sel);
  EXPECT_NE(std::string(sel.kernel).find("f32_tf32x3"), std::string::npos) << sel.kernel;
}

void check_f32_bwd(const Case& c, bool det = false, int repeats = 1) {
  SCOPED_TRACE("fp32");
  fp_selection sel{};
  check_bwd(c, det, repeats, &sel);
  EXPECT_NE(std::string(sel.kernel).find("f32_tf32x3_bwd"), std::string::npos) << sel.kernel;
}

// ---- fragment coordinates (host only) ----------------------------------------------------------
// The m16n8k8 .tf32 fragment tables of the PTX ISA, written out here independently of Tf32Frag
// (g = lane / 4, t = lane % 4): A a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4);
// B b0 (k t, n g), b1 (k t + 4, n g); C c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
using Lanes4 = std::array<std::array<double, 4>, 32>;
using Lanes2 = std::array<std::array<double, 2>, 32>;

// One warp-wide mma (d = a b + d) from the lanes' fragments, as the hardware reads them.
void emulate_mma(const Lanes4& a, const Lanes2& b, Lanes4& d) {
  double A[16][8], B[8][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {t, t, t + 4, t + 4};
    const int cr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int r = 0; r < 4; ++r) A[ar[r]][ac[r]] = a[lane][r], C[cr[r]][cc[r]] = d[lane][r];
    B[t][g] = b[lane][0], B[t + 4][g] = b[lane][1];
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const int cr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int r = 0; r < 4; ++r) {
      double x = C[cr[r]][cc[r]];
      for (int k = 0; k < 8; ++k) x += A[cr[r]][k] * B[k][cc[r]];
      d[lane][r] = x;
    }
  }
}

// The forward's two products through Tf32Frag, emulated for one warp (16 rows, 2 key steps, 16
// columns; small integers, so every sum is exact): S = Q K^T read back at the C coordinates the
// score code uses, and O += P V with P from the C fragments. `pv_from_c` is the P reordering under
// test. Returns the number of wrong elements.
template <typename PvFromC>
int fwd_fragment_errors(PvFromC pv_from_c) {
  using F = flashport::gpu::f32::Tf32Frag;
  constexpr int kD = 16, kKeys = 16;
  double Q[16][kD], K[kKeys][kD], V[kKeys][kD];
  for (auto* m : {&Q[0][0], &K[0][0], &V[0][0]})
    for (int e = 0; e < 16 * kD; ++e) m[e] = static_cast<double>(rand_int(-4, 4));
  int errors = 0;
  std::array<Lanes4, kKeys / 8> s{};
  for (int n = 0; n < kKeys / 8; ++n) {
    for (int col = 0; col < kD; col += 8) {
      Lanes4 a{};
      Lanes2 b{};
      for (int lane = 0; lane < 32; ++lane) {
        for (int r = 0; r < 4; ++r) a[lane][r] = Q[F::a_row(lane, r)][col + F::a_col(lane, r)];
        for (int r = 0; r < 2; ++r) b[lane][r] = K[8 * n + F::b_n(lane)][col + F::b_k(lane, r)];
      }
      emulate_mma(a, b, s[n]);
    }
    for (int lane = 0; lane < 32; ++lane)
      for (int hr = 0; hr < 2; ++hr)
        for (int e = 0; e < 2; ++e) {
          // The kernel's coordinates of element 2 hr + e: row c_row(lane, 0) + 8 hr, key c_col(lane, e).
          const int row = F::c_row(lane, 0) + 8 * hr, key = 8 * n + F::c_col(lane, e);
          errors += row != F::c_row(lane, 2 * hr + e) || F::c_col(lane, e) != F::c_col(lane, 2 * hr + e);
          double want = 0.0;
          for (int c = 0; c < kD; ++c) want += Q[row][c] * K[key][c];
          errors += s[n][lane][2 * hr + e] != want;
        }
  }
  // P: the scores themselves (any values do); O = P V.
  std::array<Lanes4, kD / 8> o{};
  for (int n = 0; n < kKeys / 8; ++n)
    for (int c = 0; c < kD / 8; ++c) {
      Lanes4 a{};
      Lanes2 b{};
      for (int lane = 0; lane < 32; ++lane) {
        for (int r = 0; r < 4; ++r) a[lane][r] = s[n][lane][pv_from_c(r)];
        for (int r = 0; r < 2; ++r) b[lane][r] = V[8 * n + F::pv_key(F::b_k(lane, r))][8 * c + F::b_n(lane)];
      }
      emulate_mma(a, b, o[c]);
    }
  for (int c = 0; c < kD / 8; ++c)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const int row = F::c_row(lane, e), col = 8 * c + F::c_col(lane, e);
        double want = 0.0;
        for (int j = 0; j < kKeys; ++j) {
          double p = 0.0;
          for (int x = 0; x < kD; ++x) p += Q[row][x] * K[j][x];
          want += p * V[j][col];
        }
        errors += o[c][lane][e] != want;
      }
  return errors;
}

// The backward's products with a reordered reduction, as bwd_f32.cu indexes them for one warp:
// stage 2 dV = P^T dO (A read down the key columns of P, stored per query), stage 3 dQ = dS K
// (A along dS rows, B down K rows). `b_key` is the B row order under test. Stage 1 is the
// forward's Q K^T layout. Returns the number of wrong elements.
template <typename BKey>
int bwd_fragment_errors(BKey b_key) {
  using F = flashport::gpu::f32::Tf32Frag;
  constexpr int kQ = 16, kKeys = 16, kD = 16;
  double P[kQ][kKeys], dO[kQ][kD], K[kKeys][kD];
  for (auto* m : {&P[0][0], &dO[0][0], &K[0][0]})
    for (int e = 0; e < 256; ++e) m[e] = static_cast<double>(rand_int(-4, 4));
  int errors = 0;
  std::array<Lanes4, kD / 8> dv{}, dq{};
  for (int q8 = 0; q8 < kQ; q8 += 8)
    for (int c = 0; c < kD / 8; ++c) {
      Lanes4 a{};
      Lanes2 b{};
      for (int lane = 0; lane < 32; ++lane) {
        for (int r = 0; r < 4; ++r) a[lane][r] = P[q8 + F::pv_key(F::a_col(lane, r))][F::a_row(lane, r)];
        for (int r = 0; r < 2; ++r) b[lane][r] = dO[q8 + b_key(F::b_k(lane, r))][8 * c + F::b_n(lane)];
      }
      emulate_mma(a, b, dv[c]);
    }
  for (int k8 = 0; k8 < kKeys; k8 += 8)
    for (int c = 0; c < kD / 8; ++c) {
      Lanes4 a{};
      Lanes2 b{};
      for (int lane = 0; lane < 32; ++lane) {
        for (int r = 0; r < 4; ++r) a[lane][r] = P[F::a_row(lane, r)][k8 + F::pv_key(F::a_col(lane, r))];
        for (int r = 0; r < 2; ++r) b[lane][r] = K[k8 + b_key(F::b_k(lane, r))][8 * c + F::b_n(lane)];
      }
      emulate_mma(a, b, dq[c]);
    }
  for (int c = 0; c < kD / 8; ++c)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const int row = F::c_row(lane, e), col = 8 * c + F::c_col(lane, e);
        double want_dv = 0.0, want_dq = 0.0;
        for (int x = 0; x < 16; ++x) want_dv += P[x][row] * dO[x][col], want_dq += P[row][x] * K[x][col];
        errors += (dv[c][lane][e] != want_dv) + (dq[c][lane][e] != want_dq);
      }
  return errors;
}

// Runs on the host (no GPU needed): the kernels' fragment coordinates give the products.
TEST(CudaF32Fragments, ForwardProductsMatchThePtxLayout) {
  using F = flashport::gpu::f32::Tf32Frag;
  EXPECT_EQ(fwd_fragment_errors([](int r) { return F::pv_from_c(r); }), 0);
  // The check can fail: P taken in C order (no reordering) gives wrong sums.
  EXPECT_GT(fwd_fragment_errors([](int r) { return r; }), 0);
}

TEST(CudaF32Fragments, BackwardProductsMatchThePtxLayout) {
  using F = flashport::gpu::f32::Tf32Frag;
  EXPECT_EQ(bwd_fragment_errors([](int k) { return F::pv_key(k); }), 0);
  // The check can fail: B rows in plain order while A is reordered.
  EXPECT_GT(bwd_fragment_errors([](int k) { return k; }), 0);
}

// ---- the 3xTF32 split and the deterministic dQ order, on the host ----------------------------
// x rounded to tf32 (10 explicit mantissa bits), nearest, ties away from zero: cvt.rna.tf32.f32,
// written independently of the kernels' bit arithmetic (fp64 scaling; overflow gives inf).
uint32_t tf32_rna_reference(float x) {
  using flashport::gpu::f32::bits_of;
  if (x == 0.0f) return bits_of(x);
  int e = 0;
  std::frexp(std::fabs(double(x)), &e);  // |x| in [2^(e-1), 2^e)
  const double ulp = std::ldexp(1.0, e - 11);
  const double r = std::floor(std::fabs(double(x)) / ulp + 0.5) * ulp;
  return bits_of(static_cast<float>(std::copysign(r, double(x))));
}

// fp32 values from random bits, plus ties, carries into the exponent and the largest values; all
// of magnitude >= 2^-100, so that the rest x - big is a normal number (the kernels flush denormal
// rests to zero: --use_fast_math).
std::vector<float> split_samples() {
  using flashport::gpu::f32::float_of;
  std::vector<float> xs;
  std::mt19937 rng(static_cast<uint32_t>(test_rng()()));
  while (xs.size() < 200000) {
    const float x = float_of(static_cast<uint32_t>(rng()));
    if (std::isfinite(x) && std::fabs(x) >= 0x1p-100f) xs.push_back(x);
  }
  for (uint32_t exp_bits : {0x0d800000u, 0x3f800000u, 0x42000000u, 0x7f000000u})
    for (uint32_t low : {0x0u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu, 0x7fe000u, 0x7ff000u, 0x7fffffu, 0x3ff000u})
      for (uint32_t sign : {0x0u, 0x80000000u}) xs.push_back(float_of(sign | exp_bits | low));
  xs.push_back(std::numeric_limits<float>::max());
  xs.push_back(-std::numeric_limits<float>::max());
  xs.push_back(0.0f);
  xs.push_back(-0.0f);
  return xs;
}

TEST(CudaF32Split, OperandsAreTheCvtRnaRoundings) {
  using namespace flashport::gpu::f32;
  int64_t wrong_big = 0, wrong_small = 0;
  double worst = 0.0;  // |x - big - small| / |x|
  for (const float x : split_samples()) {
    const Tf32Split s = split_tf32(x);
    const uint32_t big = s.big & kTf32Bits, small = s.small & kTf32Bits;  // what the mma reads
    wrong_big += big != tf32_rna_reference(x);
    const float rest = x - float_of(big);
    wrong_small += small != tf32_rna_reference(rest);
    if (std::isfinite(float_of(big)) && x != 0.0f)
      worst = std::max(worst, std::fabs(double(x) - double(float_of(big)) - double(float_of(small))) / std::fabs(double(x)));
  }
  EXPECT_EQ(wrong_big, 0);
  EXPECT_EQ(wrong_small, 0);
  EXPECT_LE(worst, std::ldexp(1.0, -22));  // big + small carries 22 bits of x
  // The check can fail: truncation (no half ulp) is not the rounding.
  EXPECT_NE(bits_of(1.0f + std::ldexp(1.0f, -11)) & kTf32Bits, tf32_rna_reference(1.0f + std::ldexp(1.0f, -11)));
}

TEST(CudaF32Split, NonFiniteInputsKeepANanSmallPart) {
  using namespace flashport::gpu::f32;
  const float inf = std::numeric_limits<float>::infinity();
  for (const uint32_t x_bits : {bits_of(inf), bits_of(-inf), 0x7fc00000u, 0xffc00000u, 0x7fffffffu, 0xffffffffu,
                                0x7f800001u}) {
    const float x = float_of(x_bits);
    const Tf32Split s = split_tf32(x);
    // Every product 3xTF32 forms with x holds small * big_b: NaN whatever b is.
    EXPECT_TRUE(std::isnan(float_of(s.small & kTf32Bits))) << std::hex << x_bits;
    if (std::isinf(x)) EXPECT_EQ(s.big & kTf32Bits, x_bits);
  }
}

// The deterministic backward counts each query block's dQ parts down to last_key_block: the last
// key block with a key that some row of the query block sees (brute force over rows and keys).
TEST(CudaF32Rules, LastKeyBlockIsTheLastVisitor) {
  using flashport::KernelScoreRules;
  using flashport::ScoreRules;
  int checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    ScoreRules r;
    r.window_left = rand_int(-1, 40);
    r.window_right = rand_int(-1, 40);
    r.top_left = rand_int(0, 1);
    const int lq = static_cast<int>(rand_int(1, 150)), lk = static_cast<int>(rand_int(1, 150));
    const float one = 1.0f, zero = 0.0f;
    const KernelScoreRules s(r, lq, lk, one, zero, zero);
    const int bm = 16 << rand_int(0, 2), bn = 16 << rand_int(0, 2);
    for (int m = 0; m * bm < lq; ++m) {
      int last = -1;
      for (int i = m * bm; i < std::min(lq, m * bm + bm); ++i)
        if (s.vis_hi(i) > s.vis_lo(i)) last = std::max(last, (s.vis_hi(i) - 1) / bn);
      if (last < 0) continue;  // no key block visits it, none waits for it
      EXPECT_EQ(s.last_key_block(m, bm, bn), last) << "lq " << lq << " lk " << lk << " wl " << r.window_left
                                                   << " wr " << r.window_right << " m " << m;
      ++checked;
    }
  }
  EXPECT_GT(checked, 400);
}

// ---- forward ---------------------------------------------------------------------------------

TEST(CudaF32Fwd, HeadDimsAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256, 1, 8, 32, 40, 96, 160, 200, 255}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}, {200, 77}}) {
      Case c = f32_case();
      c.batch = rand_int(1, 2);
      c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
      check_f32(c);
    }
  }
}

TEST(CudaF32Fwd, DqDifferentFromDvAndGqa) {
  SKIP_WITHOUT_GPU();
  for (auto [d, dv] : kDqDvPairs) {
    Case c = f32_case();
    set_dq_dv_case(c, d, dv);
    check_f32(c);
  }
  Case odd = f32_case();  // odd head dims: D = 3, Dv = 77
  set_dq_dv_case(odd, 3, 77);
  check_f32(odd);
  for_each_gqa_case(f32_case, check_f32);
}

TEST(CudaF32Fwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  for (bool top_left : {false, true}) {
    for (auto [sq, sk] : kCausalWindowShapes) {
      Case c = f32_case();
      set_causal_window_shape(c, sq, sk);
      c.causal = true, c.top_left = top_left;
      check_f32(c);
      c.wl = static_cast<int32_t>(rand_int(0, 70));  // causal ∧ window
      check_f32(c);
      c.causal = false;
      c.wr = static_cast<int32_t>(rand_int(-1, 40));
      check_f32(c);
    }
  }
}

TEST(CudaF32Fwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for_each_score_feature_case(f32_case, check_f32);
}

TEST(CudaF32Fwd, RowsWithoutKeysGetZeroAndMinusInf) {
  SKIP_WITHOUT_GPU();
  Case c = f32_case();
  c.hq = 2, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 200, c.sk = 50;
  c.causal = true;  // bottom-right: the first 150 rows see nothing
  check_f32(c);
}

TEST(CudaF32Fwd, Dropout) {
  SKIP_WITHOUT_GPU();
  for (float p : kDropoutRates) {
    for (int64_t d : {64, 128, 256}) {
      Case c = f32_case();
      set_dropout_fwd_case(c, d, p);
      check_f32(c);
      c.sq = 1;
      c.rng_on_device = true;
      check_f32(c);
    }
  }
}

TEST(CudaF32Fwd, NoLseAndStridedTensors) {
  SKIP_WITHOUT_GPU();
  Case c = f32_case();
  c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 90, c.sk = 200;
  c.lse = false;
  check_f32(c);
  c.lse = true;
  c.strided = true;
  check_f32(c);
  c.d = 40, c.dv = 40;
  check_f32(c);
}

TEST(CudaF32Fwd, VarlenAndSplitKv) {
  SKIP_WITHOUT_GPU();
  for_each_random_varlen_case(f32_case, check_f32);
  for (int32_t s : {0, 2, 7, 64}) {
    Case c = f32_case();
    c.batch = 1, c.hq = 4, c.hkv = 4, c.d = 64, c.dv = 64, c.sq = 70, c.sk = 3000, c.splits = s;
    c.causal = s == 7;
    c.sinks = s == 7;
    c.dropout = s == 2 ? 0.2f : 0.0f;
    fp_selection sel{};
    check_case(c, &sel);
    if (s >= 2) EXPECT_GT(sel.num_splits, 1) << sel.kernel;
  }
  // Decode shape: one query row, auto splits.
  Case c = f32_case();
  c.batch = 1, c.hq = 32, c.hkv = 8, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 8192, c.splits = 0;
  fp_selection sel{};
  check_case(c, &sel);
  EXPECT_GT(sel.num_splits, 1) << sel.kernel;
}

// Decode-shaped GQA calls (Sq * group <= 128) pack the group's query heads into one 64-row
// block's rows: per-row heads for ALiBi slopes, sinks, dropout streams, the output, LSE and split
// partials; per-row query positions for causal masks and windows. Beyond 128 rows: unpacked.
TEST(CudaF32Fwd, PackedGqaRows) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int64_t sq, hq, hkv, d;
  };
  for (const Shape& x : {Shape{1, 32, 8, 128}, Shape{3, 16, 2, 64}, Shape{16, 8, 1, 96}, Shape{13, 6, 1, 256}}) {
    for (int variant = 0; variant < 4; ++variant) {
      Case c = f32_case();
      c.batch = 2, c.hq = x.hq, c.hkv = x.hkv, c.d = c.dv = x.d, c.sq = x.sq, c.sk = 333;
      c.causal = variant >= 1;
      if (variant == 1) c.wl = 40, c.alibi = true, c.sinks = true;
      if (variant == 2) c.dropout = 0.2f, c.softcap = 20.0f, c.splits = 3;
      if (variant == 3) c.cache = true, c.paged = true, c.page_size = 16, c.nan_unused_cache = true, c.splits = 2;
      SCOPED_TRACE(c.describe());
      fp_selection sel{};
      check_case(c, &sel);
      EXPECT_NE(std::string(sel.kernel).find(":packgqa"), std::string::npos) << sel.kernel;
    }
  }
  Case wide = f32_case();  // 17 x 8 = 136 rows: one head a block
  wide.hq = 8, wide.hkv = 1, wide.d = wide.dv = 64, wide.sq = 17, wide.sk = 200, wide.causal = true;
  fp_selection sel{};
  check_case(wide, &sel);
  EXPECT_EQ(std::string(sel.kernel).find(":packgqa"), std::string::npos) << sel.kernel;
}

TEST(CudaF32Fwd, KvCacheContiguousPagedLeftPad) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 4; ++rep) {
    Case c = f32_case();
    c.cache = true;
    c.batch = 3, c.hq = 8, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = rep < 2 ? 1 : 33, c.sk = 700;
    c.batch_idx = rep % 2;
    c.causal = rep >= 2;
    c.nan_unused_cache = true;
    check_f32(c);
  }
  for (int64_t ps : {1, 7, 16, 64, 256}) {
    Case c = f32_case();
    c.cache = true, c.paged = true, c.page_size = ps;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = ps == 7 ? 20 : 1, c.sk = 600;
    c.causal = true;
    c.nan_unused_cache = true;
    check_f32(c);
  }
  // Prefill-sized calls on paged caches: the 128-row blocks (split K/V planes on Hopper), head
  // dims of each bucket, one odd (rows not 16-byte aligned: 4-byte copies).
  for (auto [ps, d] : {std::pair<int64_t, int64_t>{16, 128}, {7, 37}, {64, 256}, {1, 64}}) {
    Case c = f32_case();
    c.cache = true, c.paged = true, c.page_size = ps;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 200, c.sk = 700;
    c.causal = ps != 64;
    c.nan_unused_cache = true;
    check_f32(c);
  }
  for (bool paged : {false, true}) {
    Case c = f32_case();
    c.cache = true, c.paged = paged, c.page_size = 16;
    c.batch = 3, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 5, c.sk = 300;
    c.seqused = {120, 300, 17};
    c.leftpad = {10, 0, 17};  // the last sequence: no keys left
    c.causal = true;
    c.nan_unused_cache = true;
    check_f32(c);
  }
}

TEST(CudaF32Fwd, AppendThenAttendWithRotary) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 6; ++rep) {
    Case c = f32_case();
    c.cache = true;
    c.paged = rep >= 3;
    c.page_size = 16;
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sk = 400;
    c.snew = rep % 3 == 0 ? 1 : 5;
    c.sq = c.snew;
    c.causal = rep % 2 == 0;
    c.rot_dim = rep == 0 ? 0 : (rep % 2 ? 64 : 32);
    c.rot_interleaved = rep % 3 == 1;
    check_f32(c);
  }
}

TEST(CudaF32Fwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 24; ++rep) {
    Case c = f32_case();
    const int64_t groups[] = {1, 2, 4, 8};
    c.hkv = rand_int(1, 3);
    c.hq = c.hkv * groups[rand_int(0, 3)];
    c.batch = rand_int(1, 3);
    c.d = rand_int(1, 256);
    c.dv = rand_int(0, 1) ? c.d : rand_int(1, 256);
    c.sq = rand_int(0, 1) ? rand_int(1, 8) : rand_int(1, 600);
    c.sk = rand_int(1, 900);
    c.causal = rand_int(0, 2) == 0;
    c.top_left = rand_int(0, 1);
    if (rand_int(0, 3) == 0) c.wl = static_cast<int32_t>(rand_int(0, 100));
    if (rand_int(0, 4) == 0) c.softcap = 20.0f;
    c.alibi = rand_int(0, 4) == 0;
    c.sinks = rand_int(0, 4) == 0;
    if (rand_int(0, 4) == 0) c.dropout = 0.25f;
    c.lse = rand_int(0, 5) != 0;
    c.splits = rand_int(0, 3) == 0 ? 0 : 1;
    check_f32(c);
  }
}

TEST(CudaF32Fwd, GraphCaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  Case c = f32_case();
  c.batch = 1, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 1, c.sk = 4000, c.splits = 0;
  Call call(c);
  DeviceCall dev(call);
  const Outputs got = run_cuda(call, dev);
  ASSERT_TRUE(got.ok) << got.error;
  expect_graph_replay_equals(call, got, /*garbage_workspace=*/true);
}

// The error is that of an fp32 computation: the GPU's relative error against the fp64 reference is
// within 8x the CPU backend's fp32 error on the same inputs, or below 4e-7 (~3 ulp of fp32; a
// single-pass TF32 product would be ~1e-4, fp16 ~1e-3). Both errors are printed.
void expect_fp32_error(const char* what, double gpu_err, double cpu_err) {
  std::printf("fp32 %s: relative error vs fp64: cuda %.3g, cpu fp32 %.3g\n", what, gpu_err, cpu_err);
  EXPECT_LE(gpu_err, std::max(8.0 * cpu_err, 4e-7)) << what << ": cuda " << gpu_err << " vs cpu fp32 " << cpu_err;
}

void expect_fwd_error_is_fp32(const Case& c) {
  SCOPED_TRACE(c.describe());
  Call call(c);
  const Outputs ref = run_reference(call);
  ASSERT_TRUE(ref.ok) << ref.error;
  DeviceCall dev(call);
  const Outputs got = run_cuda(call, dev);
  ASSERT_TRUE(got.ok) << got.error;
  // The CPU backend's fp32 result on the same host inputs.
  HostTensor cpu_out = call.out, cpu_lse = call.lse;
  Call::Views w{};
  w.q = call.q.view(), w.k = call.k.view(), w.v = call.v.view(), w.out = cpu_out.view(), w.lse = cpu_lse.view();
  if (!call.sinks.empty()) w.sinks = call.sinks.view();
  fp_attn_params p = call.params(w, FP_BACKEND_CPU);
  ASSERT_EQ(fp_attn_fwd(&p), FP_OK) << fp_last_error();
  const auto want = gather_rows(call, ref.out, false);
  const std::string what = "out D=" + std::to_string(c.d) + " Sk=" + std::to_string(c.sk);
  expect_fp32_error(what.c_str(), flashport::test::compare(gather_rows(call, got.out, false), want).rel_err,
                    flashport::test::compare(gather_rows(call, cpu_out, false), want).rel_err);
}

// The backward's dq, dk, dv against the fp64 reference backward, with the CPU backend's fp32
// backward on the same inputs (out and lse from the fp64 forward, rounded to fp32) as the yardstick.
void expect_bwd_error_is_fp32(const Case& c) {
  SCOPED_TRACE(c.describe());
  BwdCall bc(c);
  ASSERT_TRUE(bc.ok) << bc.error;
  const BwdOutputs ref = run_reference_bwd(bc);
  ASSERT_TRUE(ref.ok) << ref.error;
  DeviceBwd dev(bc);
  const BwdOutputs got = dev.run(bc, false);
  ASSERT_TRUE(got.ok) << got.error;
  const Call& call = bc.call;
  HostTensor dq = call.q, dk = call.k, dv = call.v, out = bc.out, lse = bc.lse, dout = bc.dout;
  Call::Views w{};
  w.q = call.q.view(), w.k = call.k.view(), w.v = call.v.view(), w.out = out.view(), w.lse = lse.view();
  if (!call.sinks.empty()) w.sinks = call.sinks.view();
  fp_attn_bwd_params p = bc.params(w, dout.view(), dq.view(), dk.view(), dv.view(), fp_tensor{}, FP_BACKEND_CPU, false);
  ASSERT_EQ(fp_attn_bwd(&p), FP_OK) << fp_last_error();
  const std::string dims = " D=" + std::to_string(c.d) + " Sk=" + std::to_string(c.sk);
  for (auto [name, g, cpu, want] : {std::tuple<const char*, const HostTensor*, const HostTensor*, const HostTensor*>{
                                        "dq", &got.dq, &dq, &ref.dq},
                                    {"dk", &got.dk, &dk, &ref.dk},
                                    {"dv", &got.dv, &dv, &ref.dv}}) {
    const auto wd = want->to_double();
    expect_fp32_error((name + dims).c_str(), flashport::test::compare(g->to_double(), wd).rel_err,
                      flashport::test::compare(cpu->to_double(), wd).rel_err);
  }
}

TEST(CudaF32Fwd, ErrorIsFp32Rounding) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 200, c.sk = 1500;
    c.causal = d == 128;
    c.softcap = d == 256 ? 30.0f : 0.0f;
    expect_fwd_error_is_fp32(c);
  }
}

// Accumulation over many key tiles (forward: 128 tiles of 32 keys per row; backward: dK, dV over
// 32 query blocks, dQ over 64 key blocks): forward and backward at Sk 4096, D 128.
TEST(CudaF32Bwd, ErrorIsFp32RoundingLongSequence) {
  SKIP_WITHOUT_GPU();
  Case c = f32_case();
  c.batch = 1, c.hq = 2, c.hkv = 1, c.d = 128, c.dv = 128, c.sq = 1024, c.sk = 4096;
  expect_fwd_error_is_fp32(c);
  expect_bwd_error_is_fp32(c);
  c.causal = true;
  expect_fwd_error_is_fp32(c);
  expect_bwd_error_is_fp32(c);
}

// The forward's block follows the query rows and the device's shared memory, the backward's
// query step the shared memory: 128-row forward blocks from 128 rows where they fit, 64-row
// backward steps at D128/D256 where they fit (H100/H200), the narrower tiles elsewhere.
TEST(CudaF32Plan, TileFollowsRowsAndSharedMemory) {
  SKIP_WITHOUT_GPU();
  int device = 0, smem = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), cudaSuccess);
  // wide: the split K/V tile (Hopper's shared memory); unsplit: the 128-row tile elsewhere.
  const struct {
    int64_t d, sq;
    const char *wide;
    int wide_bytes;
    const char* unsplit;
    int unsplit_bytes;
    const char* narrow;
  } fwd_cases[] = {{64, 1, "_d64_m128n128_kvsplit", 174080, "_d64_m128n128", 104448, "_d64_m64n64"},
                   {64, 127, "_d64_m128n128_kvsplit", 174080, "_d64_m128n128", 104448, "_d64_m64n64"},
                   {64, 128, "_d64_m128n128_kvsplit", 174080, "_d64_m128n128", 104448, "_d64_m64n64"},
                   {128, 16, "_d128_m128n64_kvsplit", 202752, "_d128_m128n64", 135168, "_d128_m64n32"},
                   {128, 1000, "_d128_m128n64_kvsplit", 202752, "_d128_m128n64", 135168, "_d128_m64n32"},
                   {96, 200, "_d128_m128n64_kvsplit", 202752, "_d128_m128n64", 135168, "_d128_m64n32"},
                   {256, 1, "_d256_m128n32", 199680, nullptr, 0, "_d256_m64n16"},
                   {256, 1000, "_d256_m128n32", 199680, nullptr, 0, "_d256_m64n16"},
                   {160, 300, "_d256_m128n32", 199680, nullptr, 0, "_d256_m64n16"}};
  for (const auto& x : fwd_cases) {
    Case c = f32_case();
    c.d = c.dv = x.d, c.sq = x.sq, c.sk = 300;
    Call call(c);
    DeviceCall dev(call);
    fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
    fp_selection sel{};
    ASSERT_EQ(fp_attn_fwd_select(&p, &sel), FP_OK) << fp_last_error();
    const char* want = x.sq < 128                                    ? x.narrow
                       : smem >= x.wide_bytes                        ? x.wide
                       : x.unsplit != nullptr && smem >= x.unsplit_bytes ? x.unsplit
                                                                     : x.narrow;
    EXPECT_NE(std::string(sel.kernel).find(std::string(want) + ":"), std::string::npos)
        << "forward d " << x.d << " sq " << x.sq << " shared memory " << smem << ": " << sel.kernel;
  }
  const struct {
    int64_t d;
    const char* wide;
    int wide_bytes;
    const char* narrow;
  } bwd_cases[] = {{64, "_bwd_d64_m64n64", 104960, "_bwd_d64_m64n64"},
                   {128, "_bwd_d128_m64n64", 170496, "_bwd_d128_m32n64"},
                   {80, "_bwd_d128_m64n64", 170496, "_bwd_d128_m32n64"},
                   {256, "_bwd_d256_m64n32_w16", 218624, "_bwd_d256_m32n32"}};
  for (const auto& x : bwd_cases) {
    Case c = f32_case();
    c.d = c.dv = x.d, c.sq = 200, c.sk = 300;
    BwdCall bc(c);
    ASSERT_TRUE(bc.ok) << bc.error;
    DeviceBwd dev(bc);
    fp_attn_bwd_params p = bc.params(dev.views, dev.dout_v, dev.dq_v, dev.dk_v, dev.dv_v, fp_tensor{},
                                     FP_BACKEND_CUDA, false);
    fp_selection sel{};
    ASSERT_EQ(fp_attn_bwd_select(&p, &sel), FP_OK) << fp_last_error();
    const char* want = smem >= x.wide_bytes ? x.wide : x.narrow;
    EXPECT_NE(std::string(sel.kernel).find(want), std::string::npos)
        << "backward d " << x.d << " shared memory " << smem << ": " << sel.kernel;
  }
}

// The forward grid's layout (host): query blocks innermost for equal-cost tiles (a unit's blocks
// share its K/V), outermost for uneven ones (causal, windows, varlen, caches, splits: every
// unit's heaviest block first), and innermost again where they would pass the z limit.
TEST(CudaF32Plan, GridPutsQueryBlocksOuterForUnevenTiles) {
  using namespace flashport::gpu;
  flashport::Problem p;
  p.dtype = FP_F32;
  p.d = p.dv = 128;
  p.hq = p.hkv = 8;
  p.seq.batch = 3, p.seq.sq = p.seq.sk = 1024;
  const int tile = f32_fwd_tile_for(128, p.seq.sq, 232448);
  const unsigned m_blocks = 1024 / kF32FwdTiles[tile].block_m;
  bool outer = true;
  dim3 g = f32_fwd_grid(p, tile, 1, 1, &outer);
  EXPECT_FALSE(outer);
  EXPECT_EQ(g.x, m_blocks);
  EXPECT_EQ(g.y, 8u);
  EXPECT_EQ(g.z, 3u);
  g = f32_fwd_grid(p, tile, 1, 2, &outer);  // splits
  EXPECT_TRUE(outer);
  EXPECT_EQ(g.x, 8u);
  EXPECT_EQ(g.y, 6u);
  EXPECT_EQ(g.z, m_blocks);
  p.rules.window_right = 0;  // causal, as the problem states it
  g = f32_fwd_grid(p, tile, 1, 1, &outer);
  EXPECT_TRUE(outer);
  EXPECT_EQ(g.x, 8u);
  EXPECT_EQ(g.y, 3u);
  EXPECT_EQ(g.z, m_blocks);
  p.seq.sq = 60;  // one query block: nothing to order
  g = f32_fwd_grid(p, f32_fwd_tile_for(128, p.seq.sq, 232448), 1, 1, &outer);
  EXPECT_FALSE(outer);
  EXPECT_EQ(g.x, 1u);
  EXPECT_EQ(g.y, 8u);
  EXPECT_EQ(g.z, 3u);
  p.seq.sq = int64_t(128) * 70000;  // past gridDim.z's 65535
  g = f32_fwd_grid(p, tile, 1, 1, &outer);
  EXPECT_FALSE(outer);
  EXPECT_EQ(g.x, 70000u);
  p.rules.window_right = -1;
  p.seq.sq = 1024;
  static const int32_t cu_q[4] = {0, 500, 900, 1024};  // varlen
  p.seq.cu_q = cu_q;
  f32_fwd_grid(p, tile, 1, 1, &outer);
  EXPECT_TRUE(outer);
}

// The tile rules on the host for the shared memory of sm_86/89 (99 KB), the A100 (163 KB) and
// Hopper (227 KB): every picked tile covers the head dim and fits the device wherever a tile of
// its head-dim bucket does, the wide ones taken exactly when they fit (and, forward, from 128 rows:
// the split K/V tile where it fits, else the 128-row tile that splits at reads, else 64 rows).
TEST(CudaF32Plan, TileRulesFitEachDevice) {
  using namespace flashport::gpu;
  for (const int smem : {101376, 166912, 232448}) {
    for (int64_t d = 1; d <= 256; ++d) {
      for (const int64_t sq : {1, 127, 128, 4096}) {
        const F32Tile& f = kF32FwdTiles[f32_fwd_tile_for(d, sq, smem)];
        const F32Tile& wide = kF32FwdTiles[f32_tile_for(d)];
        const bool has_unsplit = f32_tile_for(d) != kF32D256;
        const F32Tile& unsplit = kF32FwdTiles[has_unsplit ? kF32FwdD64Unsplit + f32_tile_for(d) : kF32FwdD256];
        EXPECT_GE(f.head_dim, d);
        EXPECT_TRUE(f32_tile_serves(f, d)) << "forward d " << d;
        EXPECT_LE(f.fwd_smem_bytes(), smem) << "forward d " << d << " smem " << smem;
        EXPECT_EQ(f.block_m, sq >= 128 && unsplit.fwd_smem_bytes() <= smem ? 128 : 64) << "forward d " << d << " sq " << sq;
        EXPECT_EQ(&f == &wide, sq >= 128 && wide.fwd_smem_bytes() <= smem) << "forward d " << d << " sq " << sq;
        EXPECT_EQ(f.kv_split, smem >= 232448 && sq >= 128 && has_unsplit) << "forward d " << d << " smem " << smem;
        // Packed GQA rows: only the 64-row blocks take them.
        EXPECT_EQ(kF32FwdTiles[f32_fwd_tile_for(d, sq, smem, 4)].block_m, 64) << "packed d " << d << " sq " << sq;
      }
      const F32Tile& b = kF32BwdTiles[f32_bwd_tile_for(d, smem)];
      EXPECT_GE(b.head_dim, d);
      EXPECT_TRUE(f32_tile_serves(b, d)) << "backward d " << d;
      EXPECT_FALSE(f32_tile_serves(b, b.head_dim == 64 ? 65 : 64)) << "backward d " << d;  // another bucket
      int smallest = 1 << 30;
      for (const F32Tile& t : kF32BwdTiles)
        if (t.head_dim == b.head_dim) smallest = std::min(smallest, t.bwd_smem_bytes());
      if (smallest <= smem) EXPECT_LE(b.bwd_smem_bytes(), smem) << "backward d " << d << " smem " << smem;
      const F32Tile& bwide = kF32BwdTiles[f32_tile_for(d)];
      if (bwide.bwd_smem_bytes() <= smem) EXPECT_EQ(&b, &bwide) << "backward d " << d << " smem " << smem;
    }
  }
}

TEST(CudaF32Plan, Float64DeclinedWithReason) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = FP_F64;
  Call call(c);
  DeviceCall dev(call);
  fp_attn_params p = call.params(dev.views, FP_BACKEND_CUDA);
  fp_selection sel{};
  EXPECT_EQ(fp_attn_fwd_select(&p, &sel), FP_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(fp_last_error()).find("float64"), std::string::npos) << fp_last_error();
}

// ---- backward --------------------------------------------------------------------------------

TEST(CudaF32Bwd, HeadDimsAndOddLengths) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256, 1, 8, 40, 96, 200}) {
    for (auto [sq, sk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 113}, {113, 3}, {129, 257}}) {
      Case c = f32_case();
      c.batch = rand_int(1, 2);
      c.hq = 2, c.hkv = 1, c.d = d, c.dv = d, c.sq = sq, c.sk = sk;
      check_f32_bwd(c);
    }
  }
}

TEST(CudaF32Bwd, DqDifferentFromDvAndGqa) {
  SKIP_WITHOUT_GPU();
  for (auto [d, dv] : kDqDvPairs) {
    Case c = f32_case();
    set_dq_dv_case(c, d, dv);
    check_f32_bwd(c);
  }
  for_each_gqa_case(f32_case, [](const Case& c) { check_f32_bwd(c); });
}

TEST(CudaF32Bwd, CausalBothAlignmentsAndWindows) {
  SKIP_WITHOUT_GPU();
  for_each_causal_window_case(f32_case, [](const Case& c) { check_f32_bwd(c); });
}

TEST(CudaF32Bwd, ScoreFeatures) {
  SKIP_WITHOUT_GPU();
  for_each_score_feature_case(f32_case, [](const Case& c) { check_f32_bwd(c); });
}

TEST(CudaF32Bwd, DropoutReplay) {
  SKIP_WITHOUT_GPU();
  for (float p : kDropoutRates) {
    for (int64_t d : {64, 128, 256}) {
      Case c = f32_case();
      set_dropout_bwd_case(c, d, p);
      c.rng_on_device = d == 128;
      check_f32_bwd(c);
    }
  }
}

TEST(CudaF32Bwd, StridedVarlenAndKvCache) {
  SKIP_WITHOUT_GPU();
  {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = 64, c.dv = 64, c.sq = 77, c.sk = 150;
    c.strided = true;
    check_f32_bwd(c);
  }
  for (int rep = 0; rep < 3; ++rep) {
    Case c = f32_case();
    c.varlen = true;
    const int64_t nb = rand_int(1, 4);
    for (int64_t b = 0; b < nb; ++b) {
      c.lq.push_back(rand_int(0, 300));
      c.lk.push_back(rand_int(1, 300));
    }
    c.hq = 4, c.hkv = rand_int(0, 1) ? 4 : 1;
    c.d = rep == 2 ? 256 : 64 * (rep + 1), c.dv = c.d;
    c.causal = rand_int(0, 1), c.top_left = rand_int(0, 1);
    c.sinks = rand_int(0, 1);
    check_f32_bwd(c);
  }
  {
    Case c = f32_case();
    c.batch = 3, c.hq = 4, c.hkv = 2, c.d = 128, c.dv = 128, c.sq = 20, c.sk = 300;
    c.cache = true;
    c.causal = true;  // rows past seqused_k[b] get dk = dv = 0
    check_f32_bwd(c);
  }
}

TEST(CudaF32Bwd, DeterministicIsBitIdentical) {
  SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128, 256}) {
    Case c = f32_case();
    c.batch = 2, c.hq = 4, c.hkv = 2, c.d = d, c.dv = d, c.sq = 700, c.sk = 900;
    c.causal = d == 128;
    c.sinks = true;
    check_f32_bwd(c, /*det=*/true, /*repeats=*/3);
    c.causal = false, c.wl = 200, c.wr = 30;
    check_f32_bwd(c, true, 2);
  }
}

TEST(CudaF32Bwd, RandomizedMix) {
  SKIP_WITHOUT_GPU();
  for (int rep = 0; rep < 12; ++rep) {
    Case c = f32_case();
    c.batch = rand_int(1, 3);
    const int64_t ratios[] = {1, 2, 4};
    c.hkv = rand_int(1, 2);
    c.hq = c.hkv * ratios[rand_int(0, 2)];
    c.d = rand_int(1, 256);
    c.dv = rand_int(0, 1) ? c.d : rand_int(1, 256);
    c.sq = rand_int(1, 400);
    c.sk = rand_int(1, 500);
    c.causal = rand_int(0, 1);
    c.top_left = rand_int(0, 1);
    if (rand_int(0, 3) == 0) c.wl = static_cast<int32_t>(rand_int(0, 100));
    if (rand_int(0, 4) == 0) c.softcap = 20.0f;
    c.alibi = rand_int(0, 4) == 0;
    c.sinks = rand_int(0, 4) == 0;
    if (rand_int(0, 4) == 0) c.dropout = 0.25f;
    check_f32_bwd(c, /*det=*/rand_int(0, 3) == 0);
  }
}

}  // namespace
}  // namespace gputest
