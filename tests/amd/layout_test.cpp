// CPU tests of the AMD lane <-> element layouts (src/gpu/amd/amd_layouts.hpp) against the layouts AMD
// documents. The "documented" functions below transcribe the published rules independently of
// the header (AMD Matrix Instruction Calculator: gfx9 MFMA and gfx11 WMMA register/lane formulas;
// RDNA4 WMMA: K split across half-waves, C rows 8 per half-wave), and an emulated instruction
// built only from them checks the transposed attention products the kernels compute.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <utility>
#include <vector>

#include "gpu/amd/amd_layouts.hpp"

namespace amd = flashport::gpu::amd;

namespace {

// ---- documented rules --------------------------------------------------------------------------
// Each returns the (lane, element) pairs holding an element; inputs of gfx11 are held twice.
struct Doc {
  enum Kind { kGfx9Mfma, kGfx11Wmma, kGfx12Wmma } kind;
  int wave;

  // Calculator, gfx9 inputs (M = N = K = 16, one block): elements per lane = K / (64 / (M*B));
  // lane = i + M*B*floor(k / that), element = k % that. i is the row of A or the column of B.
  std::vector<amd::LaneElem> input(int i, int k) const {
    switch (kind) {
      case kGfx9Mfma: {
        const int M = 16, B = 1, K = 16;
        const int per_lane = K / (64 / (M * B));
        return {{i + M * B * (k / per_lane), k % per_lane}};
      }
      case kGfx11Wmma:  // register k, lanes i and i + 16 (wave32)
        return {{i, k}, {i + 16, k}};
      case kGfx12Wmma:  // lanes 0-15 hold k 0-7, lanes 16-31 hold k 8-15, 8 elements a lane
        return {{i + 16 * (k / 8), k % 8}};
    }
    return {};
  }
  // Outputs (fp32).
  amd::LaneElem output(int i, int j) const {
    switch (kind) {
      case kGfx9Mfma: {
        // Calculator, gfx9 32-bit outputs: multi-rows of height 4, N lanes wide.
        const int M = 16, N = 16;
        const int multirows_per_register = 64 / N, multirow_height = 4;
        const int blocks_per_register = (64 + (N * M) / multirow_height - 1) / ((N * M) / multirow_height);
        const int reg = (i / (multirow_height * multirows_per_register)) * multirow_height +
                        i % multirow_height;
        const int lane = ((i / multirow_height) % multirows_per_register) * blocks_per_register * N + j;
        return {lane, reg};
      }
      case kGfx11Wmma: {
        // Calculator, gfx11 32-bit outputs: register floor(i / (wave/16)), lane (N*(i % rows)) + j.
        const int N = 16, rows_per_slot = wave / 16, rows_per_vgpr = (wave * 16) / N;
        return {(N * (i % rows_per_vgpr) + j) % wave, i / rows_per_slot};
      }
      case kGfx12Wmma:  // rows 0-7 in lanes 0-15, rows 8-15 in lanes 16-31, register i % 8
        return {j + 16 * (i / 8), i % 8};
    }
    return {0, 0};
  }
};

template <typename L>
void expect_matches_doc(const Doc& doc) {
  // Every element of A, B, C: the header's inverse names a documented location, and the header's
  // forward functions read that location back as the same element.
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k) {
      const auto locs = doc.input(i, k);
      const amd::LaneElem a = L::a_at(i, k), b = L::b_at(k, i);
      bool a_found = false, b_found = false;
      for (const auto& d : locs) {
        EXPECT_EQ(L::a_row(d.lane, d.elem), i) << "A lane " << d.lane << " e " << d.elem;
        EXPECT_EQ(L::a_k(d.lane, d.elem), k) << "A lane " << d.lane << " e " << d.elem;
        EXPECT_EQ(L::b_col(d.lane, d.elem), i) << "B lane " << d.lane << " e " << d.elem;
        EXPECT_EQ(L::b_k(d.lane, d.elem), k) << "B lane " << d.lane << " e " << d.elem;
        a_found |= d.lane == a.lane && d.elem == a.elem;
        b_found |= d.lane == b.lane && d.elem == b.elem;
      }
      EXPECT_TRUE(a_found) << "A[" << i << "][" << k << "]";
      EXPECT_TRUE(b_found) << "B[" << k << "][" << i << "]";
    }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      const amd::LaneElem d = doc.output(i, j), c = L::c_at(i, j);
      EXPECT_EQ(L::c_row(d.lane, d.elem), i);
      EXPECT_EQ(L::c_col(d.lane, d.elem), j);
      EXPECT_EQ(c.lane, d.lane) << "C[" << i << "][" << j << "]";
      EXPECT_EQ(c.elem, d.elem) << "C[" << i << "][" << j << "]";
    }
}

// Every register of the wave holds an element, and each element the documented number of times.
template <typename L>
void expect_covers_once(int copies) {
  std::vector<int> a(256, 0), b(256, 0), c(256, 0);
  for (int l = 0; l < L::kWaveSize; ++l) {
    for (int e = 0; e < L::kAElems; ++e) {
      ASSERT_GE(L::a_row(l, e), 0);
      ASSERT_LT(L::a_row(l, e), 16);
      ASSERT_GE(L::a_k(l, e), 0);
      ASSERT_LT(L::a_k(l, e), 16);
      ++a[L::a_row(l, e) * 16 + L::a_k(l, e)];
    }
    for (int e = 0; e < L::kBElems; ++e) ++b[L::b_k(l, e) * 16 + L::b_col(l, e)];
    for (int e = 0; e < L::kCElems; ++e) ++c[L::c_row(l, e) * 16 + L::c_col(l, e)];
  }
  for (int x = 0; x < 256; ++x) {
    EXPECT_EQ(a[x], copies) << "A element " << x;
    EXPECT_EQ(b[x], copies) << "B element " << x;
    EXPECT_EQ(c[x], 1) << "C element " << x;
  }
}

// Registers of one wave: reg[lane][elem].
using Regs = std::vector<std::vector<float>>;
using Mat = std::vector<std::vector<double>>;

Mat random_mat(std::mt19937& g) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  Mat m(16, std::vector<double>(16));
  for (auto& r : m)
    for (auto& x : r) x = u(g);
  return m;
}

// The instruction, emulated from the documented rules only: D = A B + C, reading A and B from
// every lane that holds them (replicated copies must agree) and writing D where C was.
Regs emulate(const Doc& doc, const Regs& a, const Regs& b, const Regs& c) {
  Regs d = c;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      double acc = 0.0;
      for (int k = 0; k < 16; ++k) {
        const auto la = doc.input(i, k), lb = doc.input(j, k);
        for (const auto& x : la) EXPECT_EQ(a[x.lane][x.elem], a[la[0].lane][la[0].elem]);
        for (const auto& x : lb) EXPECT_EQ(b[x.lane][x.elem], b[lb[0].lane][lb[0].elem]);
        acc += double(a[la[0].lane][la[0].elem]) * double(b[lb[0].lane][lb[0].elem]);
      }
      const amd::LaneElem o = doc.output(i, j);
      d[o.lane][o.elem] = float(double(c[o.lane][o.elem]) + acc);
    }
  return d;
}

// S^T = K Q^T, then O^T = V^T P^T with P^T taken from S^T's accumulators through b_from_c (the
// only data movement the kernels do between the two products), against O = S V in fp64.
template <typename L>
void expect_attention_products(const Doc& doc) {
  std::mt19937 g(1234);
  const Mat q = random_mat(g), k = random_mat(g), v = random_mat(g);
  const int W = L::kWaveSize;
  Regs ka(W, std::vector<float>(L::kAElems)), qb(W, std::vector<float>(L::kBElems));
  Regs zero(W, std::vector<float>(L::kCElems, 0.0f));
  for (int l = 0; l < W; ++l) {
    for (int e = 0; e < L::kAElems; ++e) ka[l][e] = float(k[L::a_row(l, e)][L::a_k(l, e)]);  // K[key][d]
    for (int e = 0; e < L::kBElems; ++e) qb[l][e] = float(q[L::b_col(l, e)][L::b_k(l, e)]);  // Q^T[d][query]
  }
  const Regs st = emulate(doc, ka, qb, zero);  // S^T[key][query]
  Regs va(W, std::vector<float>(L::kAElems)), pb(W, std::vector<float>(L::kBElems));
  for (int l = 0; l < W; ++l) {
    for (int e = 0; e < L::kAElems; ++e) va[l][e] = float(v[L::a_k(l, e)][L::a_row(l, e)]);  // V^T[d][key]
    for (int e = 0; e < L::kBElems; ++e) {
      const amd::LaneElem src = L::b_from_c(l, e);
      ASSERT_GE(src.lane, 0);
      ASSERT_LT(src.lane, W);
      ASSERT_LT(src.elem, L::kCElems);
      pb[l][e] = st[src.lane][src.elem];
    }
  }
  const Regs ot = emulate(doc, va, pb, zero);  // O^T[d][query]
  for (int qi = 0; qi < 16; ++qi)
    for (int di = 0; di < 16; ++di) {
      double s_ref[16];
      for (int j = 0; j < 16; ++j) {
        s_ref[j] = 0.0;
        for (int t = 0; t < 16; ++t) s_ref[j] += double(float(q[qi][t])) * double(float(k[j][t]));
      }
      double o_ref = 0.0;
      for (int j = 0; j < 16; ++j) o_ref += double(float(s_ref[j])) * double(float(v[j][di]));
      const amd::LaneElem o = L::c_at(di, qi);
      EXPECT_NEAR(ot[o.lane][o.elem], o_ref, 1e-4 * (1.0 + std::abs(o_ref))) << "O[" << qi << "][" << di << "]";
    }
}

// The lanes joined by the column-group XOR masks hold one column (query) and, together, all 16
// of its rows exactly once: what the softmax row max / row sum reduce over.
template <typename L>
void expect_column_groups() {
  constexpr int W = L::kWaveSize;
  for (int l = 0; l < W; ++l) {
    std::set<int> lanes = {l};
    for (int m = 0; m < amd::column_group_masks<W>(); ++m) {
      std::set<int> next = lanes;
      for (int x : lanes) next.insert(x ^ amd::column_group_mask(m));
      lanes = next;
    }
    EXPECT_EQ(int(lanes.size()), W / 16);
    std::multiset<int> rows;
    for (int x : lanes) {
      EXPECT_EQ(L::c_col(x, 0), L::c_col(l, 0));
      for (int e = 0; e < L::kCElems; ++e) {
        EXPECT_EQ(L::c_col(x, e), L::c_col(l, 0));
        rows.insert(L::c_row(x, e));
      }
    }
    EXPECT_EQ(rows.size(), 16u);
    EXPECT_EQ(std::set<int>(rows.begin(), rows.end()).size(), 16u);
  }
}

const Doc kMfma{Doc::kGfx9Mfma, 64};
const Doc kGfx11{Doc::kGfx11Wmma, 32};
const Doc kGfx12{Doc::kGfx12Wmma, 32};

}  // namespace

TEST(AmdLayout, Mfma16x16x16MatchesCalculator) { expect_matches_doc<amd::Mfma16x16x16>(kMfma); }
TEST(AmdLayout, WmmaGfx11MatchesCalculator) { expect_matches_doc<amd::WmmaGfx11>(kGfx11); }
TEST(AmdLayout, WmmaGfx12MatchesRdna4Layout) { expect_matches_doc<amd::WmmaGfx12>(kGfx12); }

TEST(AmdLayout, EveryRegisterHoldsOneElement) {
  expect_covers_once<amd::Mfma16x16x16>(1);
  expect_covers_once<amd::WmmaGfx12>(1);
  expect_covers_once<amd::WmmaGfx11>(2);  // A and B replicated over the half-waves
}

TEST(AmdLayout, SpotValuesFromTheCalculatorTables) {
  // v_mfma_f32_16x16x16f16: A[5][6] is v1{21}.[15:0] (lane 21, element 2); D[6][3] is v2{19}.
  EXPECT_EQ(amd::Mfma16x16x16::a_at(5, 6).lane, 21);
  EXPECT_EQ(amd::Mfma16x16x16::a_at(5, 6).elem, 2);
  EXPECT_EQ(amd::Mfma16x16x16::c_at(6, 3).lane, 19);
  EXPECT_EQ(amd::Mfma16x16x16::c_at(6, 3).elem, 2);
  // v_wmma_f32_16x16x16_f16 (gfx11, wave32): D[3][5] is v1{21}; A[2][9] in lanes 2 and 18.
  EXPECT_EQ(amd::WmmaGfx11::c_at(3, 5).lane, 21);
  EXPECT_EQ(amd::WmmaGfx11::c_at(3, 5).elem, 1);
  EXPECT_EQ(amd::WmmaGfx11::a_row(18, 9), 2);
  EXPECT_EQ(amd::WmmaGfx11::a_k(18, 9), 9);
  // gfx12: D[9][4] in lane 20, element 1; A[3][12] in lane 19, element 4.
  EXPECT_EQ(amd::WmmaGfx12::c_at(9, 4).lane, 20);
  EXPECT_EQ(amd::WmmaGfx12::c_at(9, 4).elem, 1);
  EXPECT_EQ(amd::WmmaGfx12::a_at(3, 12).lane, 19);
  EXPECT_EQ(amd::WmmaGfx12::a_at(3, 12).elem, 4);
}

TEST(AmdLayout, TransposedAttentionProductsMfma) { expect_attention_products<amd::Mfma16x16x16>(kMfma); }
TEST(AmdLayout, TransposedAttentionProductsGfx11) { expect_attention_products<amd::WmmaGfx11>(kGfx11); }
TEST(AmdLayout, TransposedAttentionProductsGfx12) { expect_attention_products<amd::WmmaGfx12>(kGfx12); }

TEST(AmdLayout, AccumulatorFeedsNextProductWithoutMovementOnColumnLanes) {
  for (int l = 0; l < 64; ++l)
    for (int e = 0; e < 4; ++e) {
      EXPECT_EQ(amd::Mfma16x16x16::b_from_c(l, e).lane, l);
      EXPECT_EQ(amd::Mfma16x16x16::b_from_c(l, e).elem, e);
    }
  // gfx11 needs the half-wave partner for every other key.
  int moved = 0;
  for (int l = 0; l < 32; ++l)
    for (int e = 0; e < 16; ++e) moved += amd::WmmaGfx11::b_from_c(l, e).lane != l;
  EXPECT_EQ(moved, 32 * 8);
}

// One shared-memory load serves both operand roles (K as A, Q^T as B): B's (column, k) of a
// register is A's (row, k) in every layout.
template <typename L>
void expect_b_is_a_transposed() {
  for (int l = 0; l < L::kWaveSize; ++l)
    for (int e = 0; e < L::kAElems; ++e) {
      EXPECT_EQ(L::b_col(l, e), L::a_row(l, e));
      EXPECT_EQ(L::b_k(l, e), L::a_k(l, e));
      if (e > 0) {
        EXPECT_EQ(L::a_k(l, e), L::a_k(l, e - 1) + 1) << "k not contiguous in a lane";
      }
    }
}

TEST(AmdLayout, OneLoadServesBothOperandRoles) {
  expect_b_is_a_transposed<amd::Mfma16x16x16>();
  expect_b_is_a_transposed<amd::WmmaGfx11>();
  expect_b_is_a_transposed<amd::WmmaGfx12>();
}

TEST(AmdLayout, ColumnGroupsJoinOneQuery) {
  expect_column_groups<amd::Mfma16x16x16>();
  expect_column_groups<amd::WmmaGfx12>();
  expect_column_groups<amd::WmmaGfx11>();
}

// The main loop's view of an accumulator (AttentionView): element i of lane l is query row
// row(l) and key/output column col(l, i) of the S^T / O^T tile, i.e. accumulator (col, row); pair
// stores and the dropout Philox runs rely on kAdjacentPairs / kQuadRun, checked from the layout.
template <typename L>
void expect_attention_view(bool adjacent_pairs, int quad_run) {
  using V = amd::AttentionView<L>;
  EXPECT_EQ(V::kAdjacentPairs, adjacent_pairs);
  EXPECT_EQ(V::kQuadRun, quad_run);
  EXPECT_EQ(V::kSlotElems, L::kCElems);
  for (int l = 0; l < L::kWaveSize; ++l) {
    std::set<int> cols;
    for (int i = 0; i < V::kSlotElems; ++i) {
      const amd::LaneElem at = L::c_at(V::col(l, i), V::row(l, 0));
      EXPECT_EQ(at.lane, l);
      EXPECT_EQ(at.elem, i);
      cols.insert(V::col(l, i));
      if (adjacent_pairs && i % 2 == 1) {
        EXPECT_EQ(V::col(l, i), V::col(l, i - 1) + 1);
      }
      const int q = i - i % quad_run;  // the run's first element: same group of 4 keys, and the
      EXPECT_EQ(V::col(l, i) >> 2, V::col(l, q) >> 2);  // offset's bits are clear in col(q) % 4
      EXPECT_EQ((V::col(l, q) & 3) & (V::col(l, i) - V::col(l, q)), 0);
    }
    EXPECT_EQ(int(cols.size()), V::kSlotElems);
  }
}

TEST(AmdLayout, AttentionViewOfTheAccumulators) {
  expect_attention_view<amd::Mfma16x16x16>(true, 4);  // 4 consecutive keys a lane
  expect_attention_view<amd::WmmaGfx12>(true, 4);     // 8 consecutive keys: two runs of 4
  expect_attention_view<amd::WmmaGfx11>(false, 2);    // keys 2e + l/16: stride 2
}

TEST(AmdArch, GfxNumberFromGcnArchName) {
  EXPECT_EQ(amd::gfx_number("gfx90a"), 0x90a);
  EXPECT_EQ(amd::gfx_number("gfx90a:sramecc+:xnack-"), 0x90a);
  EXPECT_EQ(amd::gfx_number("gfx942:sramecc+:xnack-"), 0x942);
  EXPECT_EQ(amd::gfx_number("gfx1100"), 0x1100);
  EXPECT_EQ(amd::gfx_number("gfx1201"), 0x1201);
  EXPECT_EQ(amd::gfx_number("gfx906"), 0x906);
  EXPECT_EQ(amd::gfx_number(""), 0);
  EXPECT_EQ(amd::gfx_number("gfx"), 0);
  EXPECT_EQ(amd::gfx_number("gfx9"), 0);
  EXPECT_EQ(amd::gfx_number("sm_90"), 0);
  EXPECT_EQ(amd::gfx_number("gfx94z"), 0);
  EXPECT_EQ(amd::gfx_number(nullptr), 0);
}

TEST(AmdArch, MatrixUnitPerTarget) {
  EXPECT_EQ(amd::matrix_unit(0x90a), amd::MatrixUnit::kMfma);
  EXPECT_EQ(amd::matrix_unit(0x942), amd::MatrixUnit::kMfma);
  EXPECT_EQ(amd::matrix_unit(0x1100), amd::MatrixUnit::kWmmaGfx11);
  EXPECT_EQ(amd::matrix_unit(0x1101), amd::MatrixUnit::kWmmaGfx11);
  EXPECT_EQ(amd::matrix_unit(0x1201), amd::MatrixUnit::kWmmaGfx12);
  EXPECT_EQ(amd::matrix_unit(0x908), amd::MatrixUnit::kNone);  // MI100: no bf16 16x16x16, plain path
  EXPECT_EQ(amd::matrix_unit(0x906), amd::MatrixUnit::kNone);
  EXPECT_EQ(amd::matrix_unit(0x1030), amd::MatrixUnit::kNone);
  EXPECT_EQ(amd::wave_size(0x942), 64);
  EXPECT_EQ(amd::wave_size(0x1100), 32);
  EXPECT_EQ(amd::wave_size(0x1201), 32);
}

TEST(AmdArch, BuiltListGate) {
  const char* built = "gfx90a,gfx942,gfx1100,gfx1201";
  EXPECT_TRUE(amd::gfx_in_list(amd::gfx_number("gfx942:sramecc+:xnack-"), built));
  EXPECT_TRUE(amd::gfx_in_list(0x1201, built));
  EXPECT_TRUE(amd::gfx_in_list(0x90a, "gfx90a;gfx942"));
  EXPECT_FALSE(amd::gfx_in_list(0x1101, built));
  EXPECT_FALSE(amd::gfx_in_list(0x940, built));
  EXPECT_FALSE(amd::gfx_in_list(0, built));
  EXPECT_FALSE(amd::gfx_in_list(0x942, ""));
  EXPECT_FALSE(amd::gfx_in_list(0x942, nullptr));
}

// The header is usable in constant expressions (the kernels index registers with it).
static_assert(amd::Mfma16x16x16::c_row(17, 3) == 7);
static_assert(amd::WmmaGfx11::c_row(17, 3) == 7);
static_assert(amd::WmmaGfx12::c_row(17, 3) == 11);
static_assert(amd::gfx_number("gfx942") == 0x942);
