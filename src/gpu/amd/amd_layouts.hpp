// Which lane of a wavefront holds which matrix element, for the AMD matrix instructions the
// tile-MMA layer uses (16x16x16, fp16/bf16 inputs, fp32 accumulate). Pure constexpr: the device
// code (tile_mma_amd.hpp) and the CPU tests (tests/amd) read the same functions.
//
// Element e (0-based, in register order) of lane l. A is M x K (16 x 16), B is K x N, C/D is M x N.
//
//   ColumnLanes<64>: v_mfma_f32_16x16x16_f16 / v_mfma_f32_16x16x16_bf16 (gfx90a, gfx942), wave64.
//       A: row l%16, k 4*(l/16)+e      B: k 4*(l/16)+e, col l%16      C: row 4*(l/16)+e, col l%16
//     (AMD Matrix Instruction Calculator, gfx9 rule: input lane = i + M*floor(k/4), element k%4;
//      output lane = j + N*floor(i/4), register i%4. The 16x16x16 layout is the same on CDNA3.)
//   ColumnLanes<32>: v_wmma_f32_16x16x16_{f16,bf16} on gfx12 (RDNA4), wave32, 8 elements a lane.
//       A: row l%16, k 8*(l/16)+e      B: k 8*(l/16)+e, col l%16      C: row 8*(l/16)+e, col l%16
//     (RDNA4 changed the RDNA3 layout: K is split over the two half-waves instead of replicated;
//      as described by AMD's "Using the Matrix Cores of AMD RDNA 4" and used by composable_kernel's
//      gfx12 WMMA traits: 2 K lane groups of 8, C rows 8 per lane group.)
//   WmmaGfx11: v_wmma_f32_16x16x16_{f16,bf16} (gfx1100), wave32.
//       A: row l%16, k e (e < 16)  -- both half-waves hold the same 16 x 16 (replicated)
//       B: k e, col l%16 (replicated)  C: row 2*e + l/16, col l%16 (e < 8)
//     (AMD Matrix Instruction Calculator, gfx11 rule: inputs in lanes i and i+16, register k;
//      output register floor(i/2), lane 16*(i%2) + j.)
//
// ColumnLanes<W> is also the layout of the plain (no matrix unit) path, for any wave size.
//
// Attention computes the transposed products S^T = K Q^T and O^T = V^T P^T on AMD, so that the
// accumulator of S^T is, register for register, the B operand of the second product (ColumnLanes)
// or one half-wave exchange away from it (gfx11). Each lane then owns one query (column l%16) and
// a query's keys are spread over the lanes {l, l^16, l^32, ...}: row statistics reduce with XOR
// masks 16 (and 32 on wave64).
#pragma once

namespace flashport::gpu::amd {

// Where one element of an operand lives: lane and element index inside that lane.
struct LaneElem {
  int lane;
  int elem;
};

template <int kWave>
struct ColumnLanes {
  static_assert(kWave == 32 || kWave == 64, "wave32 or wave64");
  static constexpr int kWaveSize = kWave;
  static constexpr int kPerLane = 256 / kWave;  // elements of a 16x16 operand per lane
  static constexpr int kAElems = kPerLane;
  static constexpr int kBElems = kPerLane;
  static constexpr int kCElems = kPerLane;
  static constexpr bool kReplicatedAB = false;

  static constexpr int a_row(int l, int) { return l % 16; }
  static constexpr int a_k(int l, int e) { return kPerLane * (l / 16) + e; }
  static constexpr int b_k(int l, int e) { return kPerLane * (l / 16) + e; }
  static constexpr int b_col(int l, int) { return l % 16; }
  static constexpr int c_row(int l, int e) { return kPerLane * (l / 16) + e; }
  static constexpr int c_col(int l, int) { return l % 16; }

  // Inverses: the (lane, element) that holds A[i][k], B[k][j], C[i][j].
  static constexpr LaneElem a_at(int i, int k) { return {i + 16 * (k / kPerLane), k % kPerLane}; }
  static constexpr LaneElem b_at(int k, int j) { return {j + 16 * (k / kPerLane), k % kPerLane}; }
  static constexpr LaneElem c_at(int i, int j) { return {j + 16 * (i / kPerLane), i % kPerLane}; }

  // Element e of B (as a 16 x 16 operand whose k is C's row) comes from this element of C:
  // the accumulator of one product feeds the next with no data movement.
  static constexpr LaneElem b_from_c(int l, int e) { return {l, e}; }
};

struct WmmaGfx11 {
  static constexpr int kWaveSize = 32;
  static constexpr int kAElems = 16;
  static constexpr int kBElems = 16;
  static constexpr int kCElems = 8;
  static constexpr bool kReplicatedAB = true;

  static constexpr int a_row(int l, int) { return l % 16; }
  static constexpr int a_k(int, int e) { return e; }
  static constexpr int b_k(int, int e) { return e; }
  static constexpr int b_col(int l, int) { return l % 16; }
  static constexpr int c_row(int l, int e) { return 2 * e + l / 16; }
  static constexpr int c_col(int l, int) { return l % 16; }

  // A and B elements are held by two lanes (l and l + 16); these return the first.
  static constexpr LaneElem a_at(int i, int k) { return {i, k}; }
  static constexpr LaneElem b_at(int k, int j) { return {j, k}; }
  static constexpr LaneElem c_at(int i, int j) { return {j + 16 * (i % 2), i / 2}; }

  // B element e of lane l is C row e of column l%16: in this lane when e%2 == l/16, else in the
  // partner lane l^16; in both cases accumulator register e/2.
  static constexpr LaneElem b_from_c(int l, int e) {
    return {(e % 2 == l / 16) ? l : (l ^ 16), e / 2};
  }
};

using Mfma16x16x16 = ColumnLanes<64>;
using WmmaGfx12 = ColumnLanes<32>;

// XOR masks that join the lanes sharing one accumulator column (one query of S^T / O^T):
// 16, then 32 on wave64. Count of masks = log2(wave / 16).
template <int kWave>
constexpr int column_group_masks() { return kWave == 64 ? 2 : 1; }
constexpr int column_group_mask(int i) { return 16 << i; }

// The forward main loop's view of an S^T / O^T accumulator (the AccLayout of tile_mma_amd.hpp;
// the NVIDIA one is in tile_mma.hpp): rows are queries, columns keys or output columns. A lane
// holds one query row per 16-row m-tile (its accumulator column) and, per 16-column tile, the
// kCElems columns that are the accumulator's rows in this lane, at register index i.
//
// Whether elements 2p and 2p+1 are adjacent columns in every lane (one 32-bit pair store).
template <typename L>
constexpr bool attention_adjacent_pairs() {
  for (int l = 0; l < L::kWaveSize; ++l)
    for (int i = 0; i + 1 < L::kCElems; i += 2)
      if (L::c_row(l, i + 1) != L::c_row(l, i) + 1) return false;
  return true;
}
// The longest run r (4, 2 or 1) such that elements [q*r, q*r + r) lie in one aligned group of 4
// columns in every lane, so in one group of 16: elements that share one Philox call of the
// dropout rule.
template <typename L>
constexpr int attention_quad_run() {
  for (int r = 4; r > 1; r /= 2) {
    bool ok = L::kCElems % r == 0;
    for (int l = 0; ok && l < L::kWaveSize; ++l)
      for (int i = 0; ok && i < L::kCElems; ++i) ok = (L::c_row(l, i) >> 2) == (L::c_row(l, i - i % r) >> 2);
    if (ok) return r;
  }
  return 1;
}
template <typename L>
struct AttentionView {
  static constexpr int kCols = 16;
  static constexpr int kRowSlots = 1;
  static constexpr int kSlotElems = L::kCElems;
  static constexpr bool kAdjacentPairs = attention_adjacent_pairs<L>();
  static constexpr int kQuadRun = attention_quad_run<L>();
  static constexpr int row(int l, int) { return L::c_col(l, 0); }
  static constexpr int col(int l, int i) { return L::c_row(l, i); }
};

// --- architecture names -------------------------------------------------------------------------
// The matrix unit of a gfx target, from the device's gcnArchName ("gfx942:sramecc+:xnack-").
enum class MatrixUnit : int { kNone = 0, kMfma = 1, kWmmaGfx11 = 2, kWmmaGfx12 = 3 };

// The gfx number as written (hex digits: gfx90a -> 0x90a, gfx1201 -> 0x1201); 0 if not gfx*.
// Stops at ':' (target features), ',' or ';' (lists).
constexpr int gfx_number(const char* name) {
  if (name == nullptr || name[0] != 'g' || name[1] != 'f' || name[2] != 'x') return 0;
  int v = 0, digits = 0;
  for (const char* p = name + 3; *p != '\0' && *p != ':' && *p != ',' && *p != ';'; ++p, ++digits) {
    const char c = *p;
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (d < 0 || digits >= 5) return 0;
    v = v * 16 + d;
  }
  return digits >= 3 ? v : 0;
}

// Which tile-MMA implementation a gfx number runs: MFMA on gfx90a and gfx94x (CDNA2/3), WMMA on
// gfx11xx (RDNA3) and gfx12xx (RDNA4), the plain path elsewhere.
constexpr MatrixUnit matrix_unit(int gfx) {
  if (gfx == 0x90a || (gfx >= 0x940 && gfx <= 0x942)) return MatrixUnit::kMfma;
  if (gfx >= 0x1100 && gfx < 0x1200) return MatrixUnit::kWmmaGfx11;
  if (gfx >= 0x1200 && gfx < 0x1300) return MatrixUnit::kWmmaGfx12;
  return MatrixUnit::kNone;
}

// Wave size the kernels are compiled for on a gfx number (HIP's default: wave64 on gfx9, wave32
// on gfx10+).
constexpr int wave_size(int gfx) { return gfx >= 0x1000 ? 32 : 64; }

// Shared memory (LDS) a workgroup may use: 64 KiB on gfx90a/gfx94x and on RDNA3/RDNA4
// (kernel-visible LDS per workgroup), 64 KiB as the conservative default elsewhere.
constexpr int lds_bytes_per_workgroup(int gfx) {
  if (gfx == 0x950) return 160 * 1024;
  return 64 * 1024;
}

// Whether `gfx` is in a comma-separated list of built targets ("gfx90a,gfx942,gfx1100").
constexpr bool gfx_in_list(int gfx, const char* list) {
  if (list == nullptr) return false;
  const char* p = list;
  while (*p != '\0') {
    if (gfx_number(p) == gfx && gfx != 0) return true;
    while (*p != '\0' && *p != ',' && *p != ';') ++p;
    if (*p != '\0') ++p;
  }
  return false;
}

}  // namespace flashport::gpu::amd
