// Hopper (sm_90a) forward prefill fast path: host-side interface and capability check.
// The kernel (fwd_hopper.cu) is compiled only when 90 is among CMAKE_CUDA_ARCHITECTURES
// (FLASHPORT_WITH_HOPPER_FWD); cuda_backend.cu's plan_fwd asks hopper_fwd_check first and falls
// back to the mma.sync kernel with the returned reason otherwise.
//
// Scope (everything else is declined here, never ignored): fp16/bf16, D == Dv in {64, 128, 256},
// batched or varlen (packed) q/k/v with 16-byte aligned rows and strides, causal (both
// alignments), sliding windows, GQA/MQA, LSE, softcap, ALiBi, sinks; one launch, no split-KV.
// Declined: dropout, KV cache (seqused_k, cache_batch_idx, paged, append/rotary), split-KV,
// decode-shaped calls (the mma.sync decode tile packs GQA heads), other head dims, unaligned
// tensors, devices other than sm_90.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/problem.hpp"
#include "fwd_launch.hpp"
#include "kernel_args.hpp"

namespace flashport::gpu {

// Tile of the Hopper kernel: 2 consumer warpgroups x 64 query rows, 128 keys per step, a
// 2-slot (K, V) ring filled by cp.async into the 128-byte-swizzled layout wgmma reads.
struct HopperTile {
  static constexpr int kBlockM = 128;
  static constexpr int kThreads = 256;
  static constexpr int kStages = 2;
  // Keys per step: 128; 64 for D256 (its O accumulators take 128 registers per thread); 112 for
  // D128 under the overlapped schedule (S of the next tile, P of this one and O live at once:
  // 128 keys spill there).
  static constexpr int block_n(int d, bool overlap) { return d == 256 ? 64 : (d == 128 && overlap ? 112 : 128); }
  static constexpr int smem_bytes(int d, bool overlap) {
    return (kBlockM + 2 * kStages * block_n(d, overlap)) * d * 2 + 1024;  // + 1024: atom alignment slack
  }
};

// Set to false (with the reason below) if the Hopper path must be switched off.
inline constexpr bool kHopperFwdEnabled = true;

// The schedule used: v1 unless FLASHPORT_HOPPER_SCHED=2 asks for v2. v2 measured 0-14% slower
// than v1 on an H200 (bench/results/gpu_hopper_v2.md); it stays selectable for the next
// schedule experiments (producer warp, ping-pong), both verified by the same tests.
inline bool hopper_overlap_schedule() {
  const char* env = std::getenv("FLASHPORT_HOPPER_SCHED");
  return env != nullptr && env[0] == '2';
}

#if defined(FLASHPORT_WITH_HOPPER_FWD)
// kOverlap: the main-loop schedule. false = v1 (S, softmax, P V in sequence per tile); true =
// v2 (S of the next tile issued before P V of this one: softmax overlaps the tensor cores).
template <int D, bool kBf16, bool kOverlap>
KernelInfo hopper_fwd_kernel_info(int device);
template <int D, bool kBf16, bool kOverlap>
gpuError_t launch_hopper_fwd(const FwdArgs& a, dim3 grid, gpuStream_t stream);

template <bool kOverlap>
inline KernelInfo hopper_info_for(int d, bool bf16, int dev) {
  switch (d) {
    case 64: return bf16 ? hopper_fwd_kernel_info<64, true, kOverlap>(dev) : hopper_fwd_kernel_info<64, false, kOverlap>(dev);
    case 128: return bf16 ? hopper_fwd_kernel_info<128, true, kOverlap>(dev) : hopper_fwd_kernel_info<128, false, kOverlap>(dev);
    default: return bf16 ? hopper_fwd_kernel_info<256, true, kOverlap>(dev) : hopper_fwd_kernel_info<256, false, kOverlap>(dev);
  }
}
template <bool kOverlap>
inline gpuError_t hopper_launch_for(int d, bool bf16, const FwdArgs& a, dim3 grid, gpuStream_t s) {
  switch (d) {
    case 64: return bf16 ? launch_hopper_fwd<64, true, kOverlap>(a, grid, s) : launch_hopper_fwd<64, false, kOverlap>(a, grid, s);
    case 128: return bf16 ? launch_hopper_fwd<128, true, kOverlap>(a, grid, s) : launch_hopper_fwd<128, false, kOverlap>(a, grid, s);
    default: return bf16 ? launch_hopper_fwd<256, true, kOverlap>(a, grid, s) : launch_hopper_fwd<256, false, kOverlap>(a, grid, s);
  }
}
#endif

inline bool hopper_mult8(int64_t x) { return (x & 7) == 0; }
inline bool hopper_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Empty string: the Hopper kernel runs this call. Otherwise the reason it doesn't.
// `mma_sync_decode` / `splits` / `pack`: what the mma.sync planner decided for the same call.
inline std::string hopper_fwd_check(const Problem& p, int arch, int smem_optin, bool mma_sync_decode,
                                    int pack, int splits) {
#if !defined(FLASHPORT_WITH_HOPPER_FWD)
  (void)p, (void)arch, (void)smem_optin, (void)mma_sync_decode, (void)pack, (void)splits;
  return "hopper path: not built (90 not in CMAKE_CUDA_ARCHITECTURES)";
#else
  if (!kHopperFwdEnabled) return "hopper path: disabled, failing tests";
  if (const char* env = std::getenv("FLASHPORT_HOPPER_FWD"); env != nullptr && env[0] == '0')
    return "hopper path: disabled by FLASHPORT_HOPPER_FWD=0";
  if (arch != 900) return "hopper path: device is not sm_90";
  if (p.dtype != FP_F16 && p.dtype != FP_BF16) return "hopper path: dtype";
  if (p.d != p.dv || (p.d != 64 && p.d != 128 && p.d != 256))
    return "hopper path: head dim must be 64, 128 or 256 (D == Dv)";
  if (p.rules.has_dropout()) return "hopper path: dropout";
  if (p.seq.kv_layout == KvLayout::Paged) return "hopper path: paged KV cache";
  if (p.seq.seqused_k != nullptr || p.seq.cache_batch_idx != nullptr || p.seq.snew > 0 || p.rotary_dim > 0)
    return "hopper path: KV cache / append / rotary";
  if (splits != 1) return "hopper path: split-KV";
  if (mma_sync_decode || pack != 1) return "hopper path: decode-shaped call";
  if (p.has_lse && p.lse_dtype != FP_F32) return "hopper path: lse dtype";
  const bool aligned = hopper_aligned16(p.q_ptr) && hopper_aligned16(p.k_ptr) && hopper_aligned16(p.v_ptr) &&
                       hopper_mult8(p.q.row_stride) && hopper_mult8(p.q.head_stride) &&
                       hopper_mult8(p.q.batch_stride) && hopper_mult8(p.k.s0) && hopper_mult8(p.k.s1) &&
                       hopper_mult8(p.k.s2) && hopper_mult8(p.v.s0) && hopper_mult8(p.v.s1) &&
                       hopper_mult8(p.v.s2);
  if (!aligned) return "hopper path: q/k/v rows or strides not 16-byte aligned";
  if (HopperTile::smem_bytes(int(p.d), hopper_overlap_schedule()) > smem_optin) return "hopper path: shared memory";
  const bool bf16 = p.dtype == FP_BF16;
  const KernelInfo ki = hopper_overlap_schedule() ? hopper_info_for<true>(int(p.d), bf16, p.device_index)
                                                  : hopper_info_for<false>(int(p.d), bf16, p.device_index);
  if (ki.status != gpuSuccess) return std::string("hopper path: no kernel image: ") + gpuGetErrorString(ki.status);
  if (ki.blocks_per_sm < 1) return "hopper path: kernel does not fit an SM";
  return std::string();
#endif
}

}  // namespace flashport::gpu
