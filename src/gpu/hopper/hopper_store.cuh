// A warpgroup's 64-row wgmma accumulator tile to global memory through shared memory, in whole
// 16-byte row chunks: the Hopper forward's O (fwd_hopper_rows.cuh, HopperRows::epilogue) and the
// backward's dK, dV (bwd_hopper.cu). Stored from the accumulator layout instead, a warp's store
// covers 8 rows with 16 bytes each (half sectors). The shared-memory primitives it uses are here too.
#pragma once
#include <cstdint>

#include "gpu/hopper/fwd_hopper_tma.cuh"

namespace flashport::gpu::sm90 {

// A warpgroup's staging tile in shared memory (64 rows of the caller's kRowBytes) and the named
// barrier of its 128 threads.
struct OutStage {
  uint32_t addr;  // shared-window address
  int barrier;
};

// Four 8x8 16-bit matrices from the mma fragment layout into shared memory (lanes 8i..8i+7: the
// row addresses of matrix i, 16 bytes each).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
// 16 bytes to global memory in one store (the compiler splits a uint4 store through a pointer
// to 2-byte elements into four).
__device__ __forceinline__ void st_global_16(void* ptr, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// This warpgroup's 64 x (kPanels * 64) accumulator tile o (row hf of a thread scaled by inv[hf]),
// as Out (Elem::T or fp32), to rows dst + r * row_stride for row_lo <= r < rows, columns < cols,
// through the warpgroup's staging tile: the fragments go in (stmatrix for 16-bit, 8-byte stores for
// fp32), then each thread stores whole 16-byte chunks of rows, so a warp's stores cover complete
// row segments. Staged rows hold kPassCols columns: as many whole panels as kRowBytes holds when
// they divide the tile's panels, else one (D192 16-bit: three passes of 64 columns); wider tiles
// go in passes. 16-byte chunk c of staged row r sits at chunk c ^ (r % 8): the fragment writes
// (8 rows at one chunk) and the row reads (8 chunks of one row) hit every bank once per 128 bytes.
// Needs dst and row_stride 16-byte aligned and cols a multiple of a chunk.
template <typename Elem, int kRowBytes, typename Out, int kPanels>
__device__ __forceinline__ void store_tile_staged(const float (&o)[kPanels][32], const float (&inv)[2], Out* dst,
                                                  int64_t row_stride, int row_lo, int rows, int cols,
                                                  const OutStage& stage) {
  constexpr int kOutBytes = int(sizeof(Out));
  constexpr int kRowPanels = kRowBytes / (64 * kOutBytes);  // panels a staged row holds (256 bytes: 2 16-bit, 1 fp32)
  static_assert(kRowPanels >= 1, "a staged row holds at least one panel");
  constexpr int kPanelsPerPass = kPanels % kRowPanels == 0 ? kRowPanels : 1;
  constexpr int kPassCols = kPanelsPerPass * 64;
  constexpr int kRowChunks = kPassCols * kOutBytes / 16;  // 16-byte chunks per staged row
  constexpr int kPitch = kRowChunks * 16;
  constexpr int kRowsPerStep = 128 / kRowChunks;          // a multiple of 8: one swizzle per thread
  constexpr int kChunkCols = 16 / kOutBytes;
  static_assert(kPanels % kPanelsPerPass == 0 && kRowsPerStep % 8 == 0, "staging tile shape");
  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
  const int read_chunk = tid % kRowChunks, read_row = tid / kRowChunks;
  const uint32_t read_addr = stage.addr + read_row * kPitch + ((read_chunk ^ (read_row & 7)) << 4);
#pragma unroll
  for (int pass = 0; pass < kPanels / kPanelsPerPass; ++pass) {
    named_sync<128>(stage.barrier);  // the tile's last reads (previous pass or work tile) are done
    if constexpr (kOutBytes == 2) {
      // stmatrix x4: lanes 8i..8i+7 address the rows of matrix i = (rows 8 (i % 2).. of the
      // warp's 16, 8-column tile t + i / 2); register i holds that matrix's fragment. t is even,
      // so chunk t + i / 2 = t ^ (i / 2).
      const int mat = lane >> 3;
      const uint32_t row_addr = stage.addr + (warp * 16 + (mat & 1) * 8 + (lane & 7)) * kPitch;
      const int swz = (lane & 7) ^ (mat >> 1);
#pragma unroll
      for (int pp = 0; pp < kPanelsPerPass; ++pp) {
        const int p = pass * kPanelsPerPass + pp;
#pragma unroll
        for (int t = 0; t < 8; t += 2)
          stmatrix_x4(row_addr + (((pp * 8 + t) ^ swz) << 4),
                      Elem::pack(o[p][4 * t + 0] * inv[0], o[p][4 * t + 1] * inv[0]),
                      Elem::pack(o[p][4 * t + 2] * inv[1], o[p][4 * t + 3] * inv[1]),
                      Elem::pack(o[p][4 * t + 4] * inv[0], o[p][4 * t + 5] * inv[0]),
                      Elem::pack(o[p][4 * t + 6] * inv[1], o[p][4 * t + 7] * inv[1]));
      }
    } else {
      // fp32: one panel per pass; a thread's column pair of tile t is 8 bytes of chunk 2t + q / 2.
      const int q = lane & 3;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = warp * 16 + hf * 8 + (lane >> 2);
        const uint32_t row_addr = stage.addr + row * kPitch + (q & 1) * 8;
#pragma unroll
        for (int t = 0; t < 8; ++t)
          st_shared_f32x2(row_addr + (((2 * t + (q >> 1)) ^ (row & 7)) << 4), o[pass][4 * t + 2 * hf] * inv[hf],
                          o[pass][4 * t + 2 * hf + 1] * inv[hf]);
      }
    }
    named_sync<128>(stage.barrier);  // the staged tile is complete
    const int col = pass * kPassCols + read_chunk * kChunkCols;
    if (col < cols) {  // padded columns (Dv below the instance's head dim) are not stored
#pragma unroll
      for (int k = 0; k < 64 / kRowsPerStep; ++k) {
        const int r = read_row + k * kRowsPerStep;
        if (r >= row_lo && r < rows)
          st_global_16(dst + r * row_stride + col, ld_shared_16(read_addr + k * kRowsPerStep * kPitch));
      }
    }
  }
}

}  // namespace flashport::gpu::sm90
