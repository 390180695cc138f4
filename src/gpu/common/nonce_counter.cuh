// A counter in the caller's workspace that one block starts per call (kernel_args.hpp
// NonceCounter): the Hopper forward's dynamic tile walk and the decode kernel's split merge.
// CUDA only (PTX release/acquire at GPU scope).
#pragma once
#include <cstdint>

#include "gpu/common/kernel_args.hpp"

namespace flashport::gpu {

__device__ __forceinline__ void st_release_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// The starting block (one per counter and call, at its start): the count to 0, then the nonce.
__device__ __forceinline__ void nonce_counter_start(NonceCounter* c, uint64_t nonce) {
  c->count = 0;
  st_release_gpu(&c->ready, static_cast<unsigned long long>(nonce));  // after the zeroing
}

// One take of the call's `total`: the count before it (0 .. total - 1). A block's first take waits
// for the start. Acquire and release (the decode merger reads the partials the other takers
// stored before their takes). The last take clears `ready`: every block has made its first take,
// and so its wait, before it.
__device__ __forceinline__ int nonce_counter_take(NonceCounter* c, uint64_t nonce, bool first, int total) {
  if (first)
    while (ld_acquire_gpu(&c->ready) != static_cast<unsigned long long>(nonce)) {
    }
  int n;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(n) : "l"(&c->count) : "memory");
  if (n == total - 1) st_release_gpu(&c->ready, 0ull);
  return n;
}

}  // namespace flashport::gpu
