// Hopper (sm_90a) forward prefill fast path: host-side interface and capability check.
// The kernel (fwd_hopper.cu) is compiled only when 90 is among CMAKE_CUDA_ARCHITECTURES
// (FLASHPORT_WITH_HOPPER_FWD); cuda_backend.cu's plan_fwd asks hopper_fwd_check first and falls
// back to the mma.sync kernel with the returned reason otherwise.
//
// Scope (everything else is declined here, never ignored): fp16/bf16, D == Dv in {64, 128, 256},
// batched or varlen (packed) q/k/v with 16-byte aligned rows and strides, causal (both
// alignments), sliding windows, GQA/MQA, LSE, softcap, ALiBi, sinks; split-KV on schedule v3
// (partials in the workspace, then the combine kernel; hopper_num_splits picks the count).
// Declined: dropout, KV cache (seqused_k, cache_batch_idx, paged, append/rotary), split-KV on
// schedule v1 or with FLASHPORT_HOPPER_SPLIT=0, decode-shaped calls (the mma.sync decode tile
// packs GQA heads), other head dims, unaligned tensors, devices other than sm_90.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/heuristics.hpp"
#include "core/problem.hpp"
#include "gpu/mma/fwd_launch.hpp"
#include "gpu/common/kernel_args.hpp"

namespace flashport::gpu {

// Tile of the v1 kernel: 2 warpgroups x 64 query rows, 128 keys per step (64 for D256: its O
// accumulators take 128 registers per thread), a 2-slot (K, V) ring filled by cp.async into the
// 128-byte-swizzled layout wgmma reads.
struct HopperTile {
  static constexpr int kBlockM = 128;
  static constexpr int kThreads = 256;
  static constexpr int kStages = 2;
  static constexpr int block_n(int d) { return d == 256 ? 64 : 128; }
  static constexpr int smem_bytes(int d) {
    return (kBlockM + 2 * kStages * block_n(d)) * d * 2 + 1024;  // + 1024: atom alignment slack
  }
};

// Tile of the v3 kernel (warp-specialised): one producer warpgroup (one TMA-issuing thread,
// 24 registers) and two consumer warpgroups x 64 query rows (240 registers). K and V have their
// own kStages-deep rings and mbarriers (full: TMA landed; empty: both consumers done reading).
struct HopperTileV3 {
  static constexpr int kBlockM = 128;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = 2;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int block_n(int d) { return d == 256 ? 64 : 128; }
  static constexpr int kBarrierBytes = 8 * (2 + 4 * kStages);  // full/empty Q, full/empty x K/V x stages
  static constexpr int smem_bytes(int d) {
    return (kBlockM + 2 * kStages * block_n(d)) * d * 2 + 1024 + kBarrierBytes;
  }
};

// Set to false (with the reason below) if the Hopper path must be switched off.
inline constexpr bool kHopperFwdEnabled = true;

// The schedule: 3 (the default: TMA producer warp, mbarrier rings, setmaxnreg, ping-pong
// consumers; 1.19-1.54x v1 on the H100 prefill grid, gpu_hopper_v3.md) unless
// FLASHPORT_HOPPER_SCHED=1 asks for v1 (cp.async, all threads load). Schedule v2 (the
// intra-warpgroup overlap on v1's structure, 0-14% slower than v1: gpu_hopper_v2.md) is gone;
// v3 carries that overlap.
inline int hopper_schedule() {
  const char* env = std::getenv("FLASHPORT_HOPPER_SCHED");
  return env != nullptr && env[0] == '1' ? 1 : 3;
}
// v3's consumer ping-pong (named barriers: one warpgroup's GEMMs while the other does its
// softmax); FLASHPORT_HOPPER_PINGPONG=0 switches it off (for measurements).
inline bool hopper_pingpong() {
  const char* env = std::getenv("FLASHPORT_HOPPER_PINGPONG");
  return !(env != nullptr && env[0] == '0');
}
// v3's grid: one block per work tile (query block x head x batch), or, with
// FLASHPORT_HOPPER_PERSISTENT=1, one block per SM walking the tiles (the producer loads the next
// tile's Q/K/V while the consumers finish and store the last one).
inline bool hopper_persistent() {
  const char* env = std::getenv("FLASHPORT_HOPPER_PERSISTENT");
  return env != nullptr && env[0] == '1';
}
// v3's split-KV (the default): FLASHPORT_HOPPER_SPLIT=0 switches it off, and calls whose
// mma.sync plan splits then go to the mma.sync kernel, as before split-KV existed in v3.
inline bool hopper_split_enabled() {
  const char* env = std::getenv("FLASHPORT_HOPPER_SPLIT");
  return !(env != nullptr && env[0] == '0');
}
inline int hopper_block_n(int d, int sched) { return sched == 3 ? HopperTileV3::block_n(d) : HopperTile::block_n(d); }
inline int hopper_smem_bytes(int d, int sched) {
  return sched == 3 ? HopperTileV3::smem_bytes(d) : HopperTile::smem_bytes(d);
}

#if defined(FLASHPORT_WITH_HOPPER_FWD)
// kSched: 1 or 3 (above).
template <int D, bool kBf16, int kSched>
KernelInfo hopper_fwd_kernel_info(int device);
template <int D, bool kBf16, int kSched>
gpuError_t launch_hopper_fwd(const Problem& p, const FwdArgs& a, dim3 grid, gpuStream_t stream);
// v3 reads q/k/v through TMA tensor maps built on the host from the call's shapes and strides;
// empty when they encode, otherwise why not (the call then goes to the mma.sync kernel).
// `splits`: the split count (work tiles = query blocks x heads x batch x splits < 2^31).
std::string hopper_v3_maps_reason(const Problem& p, int splits);

template <int kSched>
inline KernelInfo hopper_info_for(int d, bool bf16, int dev) {
  switch (d) {
    case 64: return bf16 ? hopper_fwd_kernel_info<64, true, kSched>(dev) : hopper_fwd_kernel_info<64, false, kSched>(dev);
    case 128: return bf16 ? hopper_fwd_kernel_info<128, true, kSched>(dev) : hopper_fwd_kernel_info<128, false, kSched>(dev);
    default: return bf16 ? hopper_fwd_kernel_info<256, true, kSched>(dev) : hopper_fwd_kernel_info<256, false, kSched>(dev);
  }
}
template <int kSched>
inline gpuError_t hopper_launch_for(int d, bool bf16, const Problem& p, const FwdArgs& a, dim3 grid, gpuStream_t s) {
  switch (d) {
    case 64: return bf16 ? launch_hopper_fwd<64, true, kSched>(p, a, grid, s) : launch_hopper_fwd<64, false, kSched>(p, a, grid, s);
    case 128: return bf16 ? launch_hopper_fwd<128, true, kSched>(p, a, grid, s) : launch_hopper_fwd<128, false, kSched>(p, a, grid, s);
    default: return bf16 ? launch_hopper_fwd<256, true, kSched>(p, a, grid, s) : launch_hopper_fwd<256, false, kSched>(p, a, grid, s);
  }
}
// The launch for a call the check accepted (grid: query blocks x heads x batch, times a.splits
// work tiles for v3 with split-KV; nothing when empty). With a.splits > 1 the partials land in
// a.ws_o / a.ws_lse and the caller launches the combine after it.
inline gpuError_t hopper_launch(const Problem& p, const FwdArgs& a, gpuStream_t stream) {
  const int bm = HopperTile::kBlockM;
  static_assert(HopperTile::kBlockM == HopperTileV3::kBlockM, "one grid for both schedules");
  const dim3 grid(unsigned((p.seq.sq + bm - 1) / bm), unsigned(p.hq), unsigned(p.seq.batch));
  if (grid.x == 0 || p.seq.batch == 0) return gpuSuccess;
  const bool bf16 = p.dtype == FP_BF16;
  return hopper_schedule() == 3 ? hopper_launch_for<3>(int(p.d), bf16, p, a, grid, stream)
                                : hopper_launch_for<1>(int(p.d), bf16, p, a, grid, stream);
}
#endif

// The plan's kernel name: v1 "..._cpasync", v3 "..._tma_ws" (warp-specialised); split-KV adds
// ":splitkv+combine" (as the mma.sync plans do).
inline void hopper_kernel_name(char* buf, size_t size, const Problem& p, int splits) {
  const int sched = hopper_schedule();
  std::snprintf(buf, size, "cuda:sm90_wgmma_prefill_d%d_m128n%d_%s:%s%s", int(p.d), hopper_block_n(int(p.d), sched),
                sched != 3 ? "cpasync" : hopper_persistent() ? (hopper_pingpong() ? "tma_ws_persist" : "tma_ws_persist_nopp")
                                                      : (hopper_pingpong() ? "tma_ws" : "tma_ws_nopp"),
                p.dtype == FP_BF16 ? "bf16" : "fp16", splits > 1 ? ":splitkv+combine" : "");
}

// The split count the Hopper kernel would run a call with (the check below gets it). Schedule v3
// with split-KV on: num_splits 1 (off) and forced counts as the mma.sync plan resolved them
// (`mma_splits`: clamped to its 64-key blocks, so a count means the same on both kernels; v3's
// splits past its own key tiles are empty and store LSE = -inf); auto (0) from the same heuristic
// over v3's own work tiles (128-row query blocks x heads x batch), key tiles (block_n) and
// occupancy (SMs x v3 blocks per SM: 1), fewer slots than the mma.sync kernel's 2 per SM.
// Otherwise `mma_splits` (the check declines > 1).
inline int hopper_num_splits(const Problem& p, int sm_count, int mma_splits) {
#if defined(FLASHPORT_WITH_HOPPER_FWD)
  if (hopper_schedule() != 3 || !hopper_split_enabled() || p.num_splits != 0) return mma_splits;
  const int d = int(p.d);
  if (d != 64 && d != 128 && d != 256) return mma_splits;  // declined by the check anyway
  const KernelInfo ki = hopper_info_for<3>(d, p.dtype == FP_BF16, p.device_index);
  const int64_t bm = HopperTileV3::kBlockM, bn = HopperTileV3::block_n(d);
  const int64_t keys = p.seq.kv_layout == KvLayout::Paged ? p.seq.max_blocks * p.seq.page_size : p.seq.sk;
  const int64_t tiles = (p.seq.sq + bm - 1) / bm * p.hq * p.seq.batch;
  const int64_t key_blocks = std::max<int64_t>(1, (keys + bn - 1) / bn);
  const int64_t slots = int64_t(std::max(sm_count, 1)) * std::max(ki.blocks_per_sm, 1);
  return resolve_num_splits(0, tiles, key_blocks, slots, kMaxSplits);
#else
  (void)p, (void)sm_count;
  return mma_splits;
#endif
}

inline bool hopper_mult8(int64_t x) { return (x & 7) == 0; }
inline bool hopper_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Empty string: the Hopper kernel runs this call. Otherwise the reason it doesn't.
// `mma_sync_decode` / `pack`: what the mma.sync planner decided for the same call; `splits`: the
// split count this kernel would run with (hopper_num_splits).
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
  if (splits != 1 && (hopper_schedule() != 3 || !hopper_split_enabled()))
    return "hopper path: split-KV (schedule v3 only, FLASHPORT_HOPPER_SPLIT=0 declines it)";
  if (splits < 1 || splits > kMaxSplits) return "hopper path: split count out of range";
  if (mma_sync_decode || pack != 1) return "hopper path: decode-shaped call";
  if (p.has_lse && p.lse_dtype != FP_F32) return "hopper path: lse dtype";
  const bool aligned = hopper_aligned16(p.q_ptr) && hopper_aligned16(p.k_ptr) && hopper_aligned16(p.v_ptr) &&
                       hopper_mult8(p.q.row_stride) && hopper_mult8(p.q.head_stride) &&
                       hopper_mult8(p.q.batch_stride) && hopper_mult8(p.k.s0) && hopper_mult8(p.k.s1) &&
                       hopper_mult8(p.k.s2) && hopper_mult8(p.v.s0) && hopper_mult8(p.v.s1) &&
                       hopper_mult8(p.v.s2);
  if (!aligned) return "hopper path: q/k/v rows or strides not 16-byte aligned";
  const int sched = hopper_schedule();
  if (hopper_smem_bytes(int(p.d), sched) > smem_optin) return "hopper path: shared memory";
  if (sched == 3) {
    if (std::string why = hopper_v3_maps_reason(p, splits); !why.empty()) return why;
  }
  const bool bf16 = p.dtype == FP_BF16;
  const KernelInfo ki = sched == 3 ? hopper_info_for<3>(int(p.d), bf16, p.device_index)
                                   : hopper_info_for<1>(int(p.d), bf16, p.device_index);
  if (ki.status != gpuSuccess) return std::string("hopper path: no kernel image: ") + gpuGetErrorString(ki.status);
  if (ki.blocks_per_sm < 1) return "hopper path: kernel does not fit an SM";
  return std::string();
#endif
}

}  // namespace flashport::gpu
