// sm_90a helpers shared by the Hopper forward (fwd_hopper.cu) and backward (bwd_hopper.cu):
// the 128-byte-swizzled panel layout of shared tiles, wgmma descriptors and the wgmma / proxy
// fences. Tiles are stored as 64-column panels of 128-byte rows, 16-byte chunks XOR-swizzled by
// row % 8 (the canonical 128B-swizzle layout the descriptors describe; atoms 1024-byte aligned).
#pragma once
#include <cstdint>

namespace flashport::gpu::sm90 {

// Element offset of (row, 16-byte chunk) in a tile of `rows` rows stored as 64-column panels.
__device__ __forceinline__ int panel_offset(int rows, int row, int chunk) {
  return (chunk >> 3) * rows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// wgmma shared-memory descriptor, 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= uint64_t((smem_addr & 0x3FFFF) >> 4);
  d |= uint64_t((lbo_bytes & 0x3FFFF) >> 4) << 16;
  d |= uint64_t((sbo_bytes & 0x3FFFF) >> 4) << 32;
  d |= uint64_t(1) << 62;
  return d;
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accumulator reads across the wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace flashport::gpu::sm90
