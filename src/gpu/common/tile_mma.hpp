// Tile-MMA layer: register fragment types for a warp's 16x16 A tile, 16x8 B tiles and 16x8 fp32
// accumulators, their loads from swizzled shared memory, the multiply-accumulate, the
// accumulator -> A-operand conversion (for P @ V) and the element coordinates of an accumulator.
//
// One implementation per architecture family. This file has the NVIDIA one (sm_80+: mma.sync
// m16n8k16 with fp16/bf16 inputs and fp32 accumulate, ldmatrix, cp.async); tile_mma_amd.hpp has
// the AMD one (MFMA on CDNA, WMMA on RDNA). Both provide the same "main-loop view" (AccLayout,
// SmemTile, QFrag/KFrag/PFrag/VFrag, load_q/load_k/load_v, mma_qk/mma_pv, mma_fence, p_frag,
// query_max/query_sum/query_leader, cp_async_*, LoopScalar), which is all the shared forward main
// loop (fwd_kernel.cuh) knows about the matrix unit. The backward and the Hopper kernels use this
// file's NVIDIA names directly.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

// Storage element types: 16-bit, with packed conversions from float pairs.
struct Half {
  using T = __half;
  static constexpr bool kIsBf16 = false;
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float to_float(T v) { return __half2float(v); }
  __device__ __forceinline__ static T from_float(float v) { return __float2half_rn(v); }
};
struct BFloat16 {
  using T = __nv_bfloat16;
  static constexpr bool kIsBf16 = true;
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float to_float(T v) { return __bfloat162float(v); }
  __device__ __forceinline__ static T from_float(float v) { return __float2bfloat16_rn(v); }
};

// Fragments of one warp. A: 16 (rows) x 16 (k); B: 16 (k) x 8 (cols), two of them in a BPair;
// C: 16 x 8 fp32.
struct FragA { uint32_t r[4]; };
struct FragBPair { uint32_t r[4]; };  // r[0..1]: B tile 0, r[2..3]: B tile 1
struct FragC { float r[4]; };

// Accumulator element e (0..3) of this lane sits at (row, col) of the 16x8 tile.
__device__ __forceinline__ int c_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
__device__ __forceinline__ int c_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }
constexpr int kAccElems = 4;  // fp32 accumulators a lane holds per 16x8 tile

// The lanes that hold one accumulator row (one query row of S and O) are the 4 of a quad. The
// main loop reduces row statistics and picks the lane that writes per-row results through these,
// so another layout plugs in by name (tile_mma_amd.hpp: 16-lane columns, XOR 16 and 32).
__device__ __forceinline__ float query_max(float x) {
  x = fmaxf(x, shfl_xor(x, 1));
  return fmaxf(x, shfl_xor(x, 2));
}
__device__ __forceinline__ float query_sum(float x) {
  x += shfl_xor(x, 1);
  return x + shfl_xor(x, 2);
}
__device__ __forceinline__ bool query_leader(int lane) { return (lane & 3) == 0; }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- shared-memory tiles --------------------------------------------------------------------
// A tile of `kCols` 16-bit elements per row, 16-byte chunks XOR-swizzled by (row % 8) so that the
// 8 row addresses of one ldmatrix phase hit 8 different bank groups. No padding: a row is
// kRowElems = kCols elements (tile_config.hpp's NVIDIA rows have smem_row_pad 0).
template <int kCols>
struct SmemTile {
  static_assert(kCols % 64 == 0, "rows must be whole 128-byte lines for the swizzle");
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  static constexpr int kRowElems = kCols;
  __device__ __forceinline__ static int offset(int row, int chunk) {  // in elements
    return row * kCols + ((chunk ^ (row & 7)) << 3);
  }
};

// --- loads ----------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// A fragment: rows [row0, row0+16), k columns [k0, k0+16) of a row-major tile (Q).
template <int kCols>
__device__ __forceinline__ void load_a(FragA& a, const uint16_t* tile, int row0, int k0, int lane) {
  const int row = row0 + (lane & 15);
  const int chunk = (k0 >> 3) + (lane >> 4);
  ldmatrix_x4(a.r, smem_u32(tile + SmemTile<kCols>::offset(row, chunk)));
}

// Two B fragments for S = A @ K^T: K stored row-major [key][k]; keys [n0, n0+16), k [k0, k0+16).
template <int kCols>
__device__ __forceinline__ void load_b_rows(FragBPair& b, const uint16_t* tile, int n0, int k0,
                                            int lane) {
  const int row = n0 + (lane & 7) + ((lane >> 4) << 3);
  const int chunk = (k0 >> 3) + ((lane >> 3) & 1);
  ldmatrix_x4(b.r, smem_u32(tile + SmemTile<kCols>::offset(row, chunk)));
}

// Two B fragments for O = P @ V: V stored row-major [key][col]; keys [k0, k0+16) (the reduction),
// output columns [n0, n0+16).
template <int kCols>
__device__ __forceinline__ void load_b_trans(FragBPair& b, const uint16_t* tile, int k0, int n0,
                                             int lane) {
  const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
  const int chunk = (n0 >> 3) + (lane >> 4);
  ldmatrix_x4_trans(b.r, smem_u32(tile + SmemTile<kCols>::offset(row, chunk)));
}

// --- multiply-accumulate --------------------------------------------------------------------
template <typename Elem>
__device__ __forceinline__ void mma(FragC& c, const FragA& a, uint32_t b0, uint32_t b1) {
  if constexpr (Elem::kIsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b0), "r"(b1));
  }
}

// The accumulators of columns [16j, 16j+8) and [16j+8, 16j+16) as the A operand of k-step j.
template <typename Elem>
__device__ __forceinline__ FragA acc_to_a(const FragC& lo, const FragC& hi) {
  FragA a;
  a.r[0] = Elem::pack(lo.r[0], lo.r[1]);
  a.r[1] = Elem::pack(lo.r[2], lo.r[3]);
  a.r[2] = Elem::pack(hi.r[0], hi.r[1]);
  a.r[3] = Elem::pack(hi.r[2], hi.r[3]);
  return a;
}

// --- asynchronous global -> shared copies ---------------------------------------------------
// 16 bytes; src_bytes 0 fills the destination with zeros (rows past the end).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// --- the main-loop view (shared with tile_mma_amd.hpp) ---------------------------------------
// Accumulator ownership as the forward main loop sees it: rows are query rows, columns keys (S)
// or output columns (O). One 16-row m-tile of a warp is a row of accumulator tiles of kCols
// columns; a lane holds kRowSlots of its rows and, per tile, kSlotElems elements of each, at
// register index slot * kSlotElems + i.
struct AccLayout {
  static constexpr int kCols = 8;
  static constexpr int kRowSlots = 2;
  static constexpr int kSlotElems = 2;
  // Elements 2p and 2p+1 of a slot are adjacent columns (one 32-bit pair store).
  static constexpr bool kAdjacentPairs = true;
  // Runs of this many consecutive elements of a slot lie in one aligned group of 4 columns (one
  // Philox call of the dropout rule).
  static constexpr int kQuadRun = 2;
  __device__ __forceinline__ static int row(int lane, int slot) { return (lane >> 2) + (slot << 3); }
  __device__ __forceinline__ static int col(int lane, int i) { return ((lane & 3) << 1) + i; }
};
static_assert(AccLayout::kRowSlots * AccLayout::kSlotElems == kAccElems, "accumulator view");

// Operands of S = Q K^T (16 query rows x 16 k; 16 keys x 16 k) and O += P V (16 rows x 16 keys;
// 16 keys x 16 output columns).
using QFrag = FragA;
using KFrag = FragBPair;
using PFrag = FragA;
using VFrag = FragBPair;

template <int kCols>
__device__ __forceinline__ void load_q(QFrag& q, const uint16_t* tile, int row0, int k0, int lane) {
  load_a<kCols>(q, tile, row0, k0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_k(KFrag& k, const uint16_t* tile, int key0, int k0, int lane) {
  load_b_rows<kCols>(k, tile, key0, k0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_v(VFrag& v, const uint16_t* tile, int key0, int col0, int lane) {
  load_b_trans<kCols>(v, tile, key0, col0, lane);
}

// The products on a row of accumulator tiles (one m-tile of S or O), 16 columns at a time:
// block c16 is tiles [2 c16, 2 c16 + 2) here. s: scores, block key16 of 16 keys.
template <typename Elem, int N>
__device__ __forceinline__ void mma_qk(FragC (&s)[N], int key16, const QFrag& q, const KFrag& k) {
  mma<Elem>(s[2 * key16], q, k.r[0], k.r[1]);
  mma<Elem>(s[2 * key16 + 1], q, k.r[2], k.r[3]);
}
// P (the exponentiated scores of keys [16 key16, 16 key16 + 16)) as the A operand of O += P V.
template <typename Elem, int N>
__device__ __forceinline__ PFrag p_frag(const FragC (&s)[N], int key16, int /*lane*/) {
  return acc_to_a<Elem>(s[2 * key16], s[2 * key16 + 1]);
}
// o: output, block col16 of 16 output columns.
template <typename Elem, int N>
__device__ __forceinline__ void mma_pv(FragC (&o)[N], int col16, const PFrag& p, const VFrag& v) {
  mma<Elem>(o[2 * col16], p, v.r[0], v.r[1]);
  mma<Elem>(o[2 * col16 + 1], p, v.r[2], v.r[3]);
}

// Head dims below the bucket skip the GEMM steps past them (a guarded copy of the GEMM).
constexpr bool kSkipTailSteps = true;

// End of a group of products on a row of accumulators (all tiles, or block col16): the AMD layer
// pins the results there so later fragment loads are not issued ahead of them; ptxas keeps the
// order by itself, so nothing here.
template <int N>
__device__ __forceinline__ void mma_fence(FragC (&)[N]) {}
template <int N>
__device__ __forceinline__ void mma_fence(FragC (&)[N], int /*col16*/) {}

// A kernel-argument float the main loop tests per element (the softcap switch of the score),
// read in place: a constant-bank operand of the __grid_constant__ arguments. (The AMD layer copies
// it into a register of its own on MFMA targets: why there.)
struct LoopScalar {
  const float& value;
  __device__ __forceinline__ explicit LoopScalar(const float& arg) : value(arg) {}
};

}  // namespace flashport::gpu
