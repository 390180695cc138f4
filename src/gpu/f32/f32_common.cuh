// Device pieces shared by the fp32 forward and backward kernels (fwd_f32.cu, bwd_f32.cu): 4- and
// 16-byte asynchronous copies of fp32 elements, the shared-tile row loader, the 3xTF32 mma
// products (the split itself: tf32_frag.hpp); the dropout keep bits are those of every NVIDIA kernel
// (common/dropout_lanes.cuh: the m16n8 C layout is theirs).
#pragma once
#include <cstdint>

#include "core/philox.hpp"
#include "core/problem.hpp"
#include "gpu/common/dropout_lanes.cuh"
#include "gpu/common/tile_io.cuh"
#include "gpu/f32/tf32_frag.hpp"

namespace flashport::gpu::f32 {

// One fp32 element global -> shared; src_bytes 0 stores zero (rows/columns past the end).
__device__ __forceinline__ void cp_async_f32(float* smem, const float* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
}

// 16 bytes (4 fp32) global -> shared; src_bytes < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async_f32x4(float* smem, const float* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
}

// Threads on one row of a 16-byte-copy load_rows (why 8: load_rows).
inline constexpr int kLoadThreadsPerRow = 8;

// The thread mapping of load_rows: kPerRow threads on a row, kW columns a copy, kRowStep rows apart.
template <int D, int NT, bool kVec>
struct RowLoaderMap {
  static constexpr int kW = kVec ? 4 : 1;  // columns per thread and copy
  static constexpr int kMaxPerRow = kVec ? kLoadThreadsPerRow : NT;
  static constexpr int kPerRow = D / kW < kMaxPerRow ? D / kW : kMaxPerRow;
  static constexpr int kRowStep = NT / kPerRow;
  static_assert(NT % kPerRow == 0 && D % (kPerRow * kW) == 0, "thread mapping");
};

// Rows [0, R) of a shared tile with row stride kStride floats: row r's `cols` real columns from
// `row_ptr(r)` (null: a zero row), the rest of the D columns zero. Threads of one row walk
// consecutive columns (coalesced); each thread computes its row's address once. `any` is a valid
// global address for the zero-filling copies (they read nothing). kVec (kStride a multiple of 4,
// 16-byte aligned tile): 4 columns per copy where the source row is 16-byte aligned, zero rows
// stored directly, and kLoadThreadsPerRow threads on a row: fewer threads a row means each thread
// computes fewer row addresses (row_ptr: the layouts, pages, bounds, which cost more instructions
// than a row's copies) and issues more copies a row. Both kernels take 8 (128 bytes a copy
// instruction and row: whole sectors and 32 banks; ncu, session 30: the per-row address code was
// the forward's top stall lines at 32 threads a row; H200 session 31: forward +10-16%, backward
// +2-10% with 32-row query steps, session 32 with 64-row steps +2% / +6-7% / +11-13% at
// D64 / D128 / D256).
template <int R, int D, int kStride, int NT, bool kVec = false, typename RowPtr>
__device__ __forceinline__ void load_rows(float* tile, int cols, int tid, const float* any, RowPtr row_ptr) {
  using M = RowLoaderMap<D, NT, kVec>;
  constexpr int kW = M::kW;
  static_assert(!kVec || kStride % 4 == 0, "16-byte rows");
  const int c0 = (tid % M::kPerRow) * kW;
  for (int r = tid / M::kPerRow; r < R; r += M::kRowStep) {
    const float* src = row_ptr(r);
    const bool vec = kVec && (reinterpret_cast<uintptr_t>(src) & 15) == 0;
#pragma unroll
    for (int c = c0; c < D; c += M::kPerRow * kW) {
      if (kVec && src == nullptr) {
        *reinterpret_cast<float4*>(tile + r * kStride + c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      } else if (kVec && vec && c < cols) {
        cp_async_f32x4(tile + r * kStride + c, src + c, cols - c < 4 ? 4 * (cols - c) : 16);
      } else {
#pragma unroll
        for (int e = 0; e < kW; ++e) {
          const bool in = src != nullptr && c + e < cols;
          cp_async_f32(tile + r * kStride + c + e, in ? src + c + e : any, in ? 4 : 0);
        }
      }
    }
  }
}

// Splits (tf32_frag.hpp: split_tf32) the elements this thread copied with
// load_rows<R, D, kStride, NT, true>(big, ...): big's bits become the big parts and
// small's the small parts. Call it after the thread's cp_async_wait of those copies (they are
// visible to the thread that made them); other threads read the planes after a barrier. One split
// an element and block instead of one for every warp that reads it (the forward's K and V).
template <int R, int D, int kStride, int NT>
__device__ __forceinline__ void split_own_rows(float* big, float* small, int tid) {
  using M = RowLoaderMap<D, NT, true>;
  const int c0 = (tid % M::kPerRow) * 4;
  for (int r = tid / M::kPerRow; r < R; r += M::kRowStep) {
#pragma unroll
    for (int c = c0; c < D; c += M::kPerRow * 4) {
      float4* b4 = reinterpret_cast<float4*>(big + r * kStride + c);
      const float4 x = *b4;
      const Tf32Split s0 = split_tf32(x.x), s1 = split_tf32(x.y), s2 = split_tf32(x.z), s3 = split_tf32(x.w);
      *b4 = make_float4(float_of(s0.big), float_of(s1.big), float_of(s2.big), float_of(s3.big));
      *reinterpret_cast<float4*>(small + r * kStride + c) =
          make_float4(float_of(s0.small), float_of(s1.small), float_of(s2.small), float_of(s3.small));
    }
  }
}

// ---- 3xTF32 tensor-core products (mma.sync m16n8k8 .tf32, sm_80+; the split: tf32_frag.hpp) ----
// Fragments of m16n8k8 (g = lane / 4, t = lane % 4): A (16 x 8, row) a0 (g, t), a1 (g + 8, t),
// a2 (g, t + 4), a3 (g + 8, t + 4); B (8 x 8, col) b0 (k t, n g), b1 (k t + 4, n g); C (16 x 8)
// c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).

// d += a * b, one m16n8k8 tf32 product with fp32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d += a * b in 3xTF32 inside the tensor core: a, b the split A (a0..a3) and B (b0, b1) fragments.
__device__ __forceinline__ void mma_3xtf32_acc(float (&d)[4], const Tf32Split (&a)[4], const Tf32Split (&b)[2]) {
  mma_tf32(d, a[0].small, a[1].small, a[2].small, a[3].small, b[0].big, b[1].big);
  mma_tf32(d, a[0].big, a[1].big, a[2].big, a[3].big, b[0].small, b[1].small);
  mma_tf32(d, a[0].big, a[1].big, a[2].big, a[3].big, b[0].big, b[1].big);
}

// d += a * b in 3xTF32, the step's sum added to d by a rounded fp32 add. The tensor core rounds
// its fp32 additions toward zero: accumulated there over a long reduction the error would grow
// with the length, biased. So the products of a short chunk of the reduction (one 8-wide step
// here; callers may use mma_3xtf32_acc over a few steps into a zeroed fragment) are summed in the
// tensor core, and the chunks are added as an FMA loop adds its products.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const Tf32Split (&a)[4], const Tf32Split (&b)[2]) {
  float step[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_3xtf32_acc(step, a, b);
#pragma unroll
  for (int e = 0; e < 4; ++e) d[e] += step[e];
}

}  // namespace flashport::gpu::f32
