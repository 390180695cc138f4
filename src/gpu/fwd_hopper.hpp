// Hopper (sm_90a) forward prefill fast path: host-side interface and capability check.
// The kernel (fwd_hopper.cu) is compiled only when 90 is among CMAKE_CUDA_ARCHITECTURES
// (FLASHPORT_WITH_HOPPER_FWD); cuda_backend.cu's plan_fwd asks hopper_fwd_check first and falls
// back to the mma.sync kernel with the returned reason otherwise.
//
// Scope (everything else is declined here, never ignored): fp16/bf16, D == Dv in {64, 128},
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
  static constexpr int kBlockN = 128;
  static constexpr int kThreads = 256;
  static constexpr int kStages = 2;
  static constexpr int smem_bytes(int d) {
    return (kBlockM + 2 * kStages * kBlockN) * d * 2 + 1024;  // + 1024: atom alignment slack
  }
};

// Set to false (with the reason below) if the Hopper path must be switched off.
inline constexpr bool kHopperFwdEnabled = true;

#if defined(FLASHPORT_WITH_HOPPER_FWD)
template <int D, bool kBf16>
KernelInfo hopper_fwd_kernel_info(int device);
template <int D, bool kBf16>
gpuError_t launch_hopper_fwd(const FwdArgs& a, dim3 grid, gpuStream_t stream);
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
  if (p.d != p.dv || (p.d != 64 && p.d != 128)) return "hopper path: head dim must be 64 or 128 (D == Dv)";
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
  if (HopperTile::smem_bytes(int(p.d)) > smem_optin) return "hopper path: shared memory";
  const bool bf16 = p.dtype == FP_BF16;
  const KernelInfo ki = p.d == 64 ? (bf16 ? hopper_fwd_kernel_info<64, true>(p.device_index)
                                          : hopper_fwd_kernel_info<64, false>(p.device_index))
                                  : (bf16 ? hopper_fwd_kernel_info<128, true>(p.device_index)
                                          : hopper_fwd_kernel_info<128, false>(p.device_index));
  if (ki.status != gpuSuccess) return std::string("hopper path: no kernel image: ") + gpuGetErrorString(ki.status);
  if (ki.blocks_per_sm < 1) return "hopper path: kernel does not fit an SM";
  return std::string();
#endif
}

}  // namespace flashport::gpu
