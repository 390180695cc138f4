// A CPU emulation of one workgroup of the AMD kernels, for tests only: every lane is a
// cooperative context (ucontext) of one OS thread. __syncthreads is a workgroup barrier (every
// live lane of the workgroup meets there); cross-lane shuffles, votes and the matrix instruction
// are wave barriers (every live lane of that wave meets there, other waves run on), so a wave that
// skips the math (the main loop's inactive warps) can't pass a __syncthreads that another wave
// has not reached. A lane reaching a barrier of the other kind than its wave or workgroup is an
// error (divergent barriers), not a silent reordering. The instruction itself is computed from the
// lane layouts of src/gpu/amd/amd_layouts.hpp (which tests/amd/layout_test.cpp checks against AMD's
// documentation), so the kernel source runs unchanged except for the one builtin call. This
// header provides what src/gpu/common/vendor.hpp provides on a real build (it is empty here). Include
// it first, with FP_AMD_EMULATION_LAYOUT and FP_AMD_EMULATION_WAVE defined.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>

#include "gpu/amd/amd_layouts.hpp"

#ifndef FP_AMD_EMULATION
#define FP_AMD_EMULATION 1
#endif

namespace simt {

struct Idx3 {
  unsigned x = 0, y = 0, z = 0;
};
// The lane being run, the workgroup being emulated and the launch's grid.
Idx3 thread_idx();
Idx3 block_idx();
Idx3 grid_dim();
Idx3 block_dim();
// All live lanes of the workgroup reach this point before any passes it.
void barrier();
// All live lanes of the calling lane's wave (`wave_size` lanes) reach this point before any passes it.
void wave_barrier();
// Runs `body` as `threads` lanes (waves of `wave_size`) of workgroup `block` of `grid` to
// completion, with `smem_bytes` of dynamic shared memory (filled with 0xff bytes: a NaN in fp16
// and bf16, so a read of a shared element nobody wrote shows up in the results).
void run_block(unsigned threads, unsigned wave_size, Idx3 block, Idx3 grid, size_t smem_bytes,
               const std::function<void()>& body);
// Scratch shared by the lanes of the running workgroup, one region per kind of exchange (waves
// progress independently, so a shuffle of one wave may run while another wave is in a product).
enum Region : size_t { kShuffleWords = 0, kVoteWords = 1024, kProductWords = 2048 };
uint32_t* exchange_words(size_t words);
// The dynamic shared memory of the running workgroup.
void* dynamic_smem();
// A wait on another workgroup (the backward's deterministic-mode semaphore) that is not yet
// satisfied: one workgroup runs at a time, to completion, so it never will be. Reported and aborted
// (a hang on hardware, or a wrong launch order in the emulation).
[[noreturn]] void unsatisfiable_wait();
// Test-only mutation of the emulated matrix instruction: when set, every product reads its B
// operand at k ^ 1 (two k rows swapped: a register layout that disagrees with the loads). Tests set
// it to prove that a wrong layout is caught by their comparisons.
extern bool g_mutate_layout;

}  // namespace simt

// ---- the HIP spellings the kernel sources use ------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define FP_LAUNCH_BOUNDS(threads, min_blocks)
#define FP_GRID_CONSTANT
#define __shared__ static  // one workgroup runs at a time
#define FP_EXTERN_SMEM(type, name) type* const name = static_cast<type*>(::simt::dynamic_smem())
#define threadIdx (::simt::thread_idx())
#define blockIdx (::simt::block_idx())
#define gridDim (::simt::grid_dim())
#define blockDim (::simt::block_dim())
#define __syncthreads() ::simt::barrier()
#define __expf expf
#define __logf logf
#define __log2f log2f

struct uint2 {
  uint32_t x, y;
};
struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
// One lane runs at a time: plain operations are atomic and every write is visible.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
inline void __threadfence() {}
inline void __nanosleep(unsigned) { simt::unsatisfiable_wait(); }
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
using gpuError_t = int;
using gpuStream_t = void*;
constexpr gpuError_t gpuSuccess = 0;
constexpr int kWarpSize = FP_AMD_EMULATION_WAVE;
#ifndef FLASHPORT_GPU_ARCHS
#define FLASHPORT_GPU_ARCHS "cpu-emulation"
#endif

namespace flashport::gpu {

// Value of `v` in lane (own lane ^ mask) of the same wave.
template <typename T>
inline T shfl_xor(T v, int mask) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  const unsigned tid = simt::thread_idx().x, base = tid / kWarpSize * kWarpSize;
  uint32_t* slots = simt::exchange_words(1024);
  slots[tid] = __builtin_bit_cast(uint32_t, v);
  simt::wave_barrier();
  const uint32_t r = slots[base + ((tid % kWarpSize) ^ unsigned(mask))];
  simt::wave_barrier();
  return __builtin_bit_cast(T, r);
}
// Whether `pred` holds in any live lane of the wave.
inline bool warp_any(bool pred) {
  const unsigned tid = simt::thread_idx().x, base = tid / kWarpSize * kWarpSize;
  uint32_t* slots = simt::exchange_words(simt::kVoteWords + 1024) + simt::kVoteWords;
  slots[tid] = pred ? 1u : 0u;
  simt::wave_barrier();
  bool any = false;
  for (unsigned l = 0; l < unsigned(kWarpSize); ++l) any |= slots[base + l] != 0;
  simt::wave_barrier();
  return any;
}
inline float fast_exp2(float x) { return exp2f(x); }
}  // namespace flashport::gpu

// CUDA's spelling of the xor shuffle (the NVIDIA kernels' dropout bit exchange,
// src/gpu/common/dropout_lanes.cuh, runs here at wave 32; the mask of lanes is all of them there).
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return flashport::gpu::shfl_xor(v, mask);
}

// Value of `v` in lane `src` of the same wave (the plain path's operand fetch).
inline int __shfl(int v, int src) {
  const unsigned tid = simt::thread_idx().x, base = tid / kWarpSize * kWarpSize;
  uint32_t* slots = simt::exchange_words(1024);
  slots[tid] = uint32_t(v);
  simt::wave_barrier();
  const int r = int(slots[base + unsigned(src) % kWarpSize]);
  simt::wave_barrier();
  return r;
}

namespace flashport::gpu {
inline float fast_log2(float x) { return log2f(x); }

// D = A B + C for one wave, every lane holding its registers in the layout L: each lane publishes
// its A and B words, then computes its own accumulators from the published operands.
template <typename L, typename Elem>
inline void emulated_mma(float* c, const uint32_t* a, const uint32_t* b) {
  constexpr int kA = L::kAElems / 2, kB = L::kBElems / 2, W = L::kWaveSize;
  const unsigned tid = simt::thread_idx().x, lane = tid % W, wave = tid / W;
  uint32_t* words = simt::exchange_words(simt::kProductWords + 1024 * (kA + kB)) + simt::kProductWords;
  uint32_t* wa = words + size_t(wave) * W * (kA + kB);
  uint32_t* wb = wa + W * kA;
  for (int i = 0; i < kA; ++i) wa[lane * kA + i] = a[i];
  for (int i = 0; i < kB; ++i) wb[lane * kB + i] = b[i];
  simt::wave_barrier();
  auto elem = [](const uint32_t* w, int per_lane, amd::LaneElem at) {
    const uint32_t word = w[at.lane * per_lane + at.elem / 2];
    return Elem::bits_to_float((at.elem & 1) ? word >> 16 : word & 0xffffu);
  };
  for (int e = 0; e < L::kCElems; ++e) {
    const int i = L::c_row(int(lane), e), j = L::c_col(int(lane), e);
    float acc = c[e];
    for (int k = 0; k < 16; ++k)
      acc = fmaf(elem(wa, kA, L::a_at(i, k)), elem(wb, kB, L::b_at(simt::g_mutate_layout ? k ^ 1 : k, j)), acc);
    c[e] = acc;
  }
  simt::wave_barrier();
}

}  // namespace flashport::gpu
