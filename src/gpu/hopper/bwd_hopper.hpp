// Hopper (sm_90a) backward fast path: host-side interface and capability check. The kernel
// (bwd_hopper.cu) is compiled only when 90 is among CMAKE_CUDA_ARCHITECTURES
// (FLASHPORT_WITH_HOPPER_BWD). A peer of the mma.sync backward in cuda_backend.cu's plan_bwd: asked
// first; when hopper_bwd_check passes, hopper_bwd_plan plans it (the preprocess and dq conversion
// kernels of mma/bwd_aux_kernels.cuh and their workspace layout (mma/bwd_launch.hpp) are shared); otherwise the mma.sync backward
// plans the call.
//
// Scope (everything else declined here, never ignored): fp16/bf16, head dims D, Dv <= 256 in
// multiples of 8 (any pair: instances for 64, 128, 256, hopper_bwd_head_bucket; smaller dims,
// 192 among them, padded inside the kernel: its copies zero-fill the columns past D and Dv, its
// stores skip them), batched or varlen q/k/v/dout with 16-byte aligned rows and strides,
// seqused_k, causal (both alignments), sliding windows, softcap (with its derivative), ALiBi,
// sinks (d_sinks by the shared conversion step), GQA/MQA (dK/dV summed over the group in
// registers), dropout (the keep mask replayed: common/dropout_lanes.cuh), dQ by bulk reduces in any
// order or, in deterministic mode, in a fixed order per query block (semaphores in the workspace:
// dq_sema in bwd_hopper.cu). The 256 instance is its own kernel (HopperBwdTileD256), with the same
// warp-specialised roles.
// Declined: FLASHPORT_HOPPER_BWD=0 (the user's kill switch), head dims above 256 or not multiples
// of 8 (rows of such dims have 16-byte strides only in padded layouts), unaligned tensors, devices
// other than sm_90.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/backend.hpp"
#include "core/config.hpp"
#include "gpu/common/fwd_plan.hpp"
#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu/mma/bwd_launch.hpp"
#include "core/problem.hpp"
#include "core/status.hpp"
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

// Tile of the Hopper backward: one block owns 128 keys of one kv head; per step a block of BM
// query rows (128 at D64, 64 at D128: the S^T/dP^T accumulators of the step plus dK/dV stay
// under the MMA warpgroups' 240 registers). Warp-specialised block of 3 warpgroups:
//   warpgroup 0, the producer, at 24 registers (setmaxnreg; 32 would leave the MMA warpgroups'
//     increase to 240 waiting: bench/results/HISTORY.md, the forward's session 5): its 128
//     threads copy the block's K and V once (cp.async, one mbarrier); warps 0-2 (kLoaders
//     threads) load each step's Q, dO rows (TMA boxes; a sequence's tail block by cp.async) and
//     LSE2, D values (cp.async) into a ring of kStages stages (full / empty mbarriers); warp 3
//     writes dQ: the step's dQ staged in shared memory goes into the workspace with one bulk
//     reduce (cp.reduce.async.bulk .add.f32) of the whole tile (one per row for padded head dims).
//   warpgroups 1 and 2, at 240 registers: 64 keys each, dK, dV in registers over the walk; they
//     take turns on the tensor cores (ping-pong), exchange dS^T (dQ = dS K needs both halves)
//     and hand dQ to the writer on named barriers.
// dQ staging: fp32, double-buffered, unpadded rows (the workspace's layout; the stores rotate their
// column chunks against bank conflicts). A third ring stage does not fit in shared memory at either
// head dim (D64 233,528 bytes, D128 248,376).
struct HopperBwdTile {
  static constexpr int kBlockN = 128;
  static constexpr int kThreads = 384;
  static constexpr int kLoaders = 96;  // producer warps 0-2; warp 3 writes dQ
  static constexpr int kStages = 2;
  static constexpr int kProducerRegs = 24, kMmaRegs = 240;  // 128 x 24 + 256 x 240: the launch's 384 x 168
  static constexpr int block_m(int d) { return d == 64 ? 128 : 64; }
  static constexpr int dq_stage_bytes(int d) { return 2 * block_m(d) * d * 4; }
  // K, V; the Q and dO ring; dS^T; the LSE2 and D ring; dQ staging; mbarriers (full and empty per
  // stage, K/V landed); + 1024 atom alignment slack.
  static constexpr int smem_bytes(int d) {
    return (2 * kBlockN * d + 2 * kStages * block_m(d) * d + kBlockN * block_m(d)) * 2 +
           2 * kStages * block_m(d) * 4 + dq_stage_bytes(d) + 8 * (2 * kStages + 1) + 1024;
  }
};

// D256 (bwd_hopper.cu, bwd_hopper_d256_kernel): dK and dV of 64 keys x 256 columns are 256 fp32
// accumulator registers per thread of one warpgroup, so a block owns BN = 64 keys and each MMA
// warpgroup keeps one of them over all 256 columns (128 registers): warpgroup 1, the score side,
// computes S^T = K Q^T, P^T and dV += P^T dO; warpgroup 2, the gradient side, dP^T = V dO^T, dS^T
// and dK += dS^T Q. Every product is M = 64 x N = 64 (S^T / dP^T over all 64 queries of the step;
// split as 32-query halves they were N = 32 products, which need 1.5x the shared-memory bandwidth
// the SM has at tensor peak), and dV / dK take A from registers. P^T goes from one side to the
// other in fp32 through shared memory (16 KB: the handoff, P^T x softcap derivative with the keep
// mask in its sign bits), dS^T in bf16/fp16 (8 KB) for dQ = dS K, whose columns [128w, 128w + 128)
// each warpgroup computes (SS). Warp-specialised as HopperBwdTile (same roles, thread count,
// register split, ring depth): the producer warpgroup copies K, V once, its warps 0-2 each step's
// Q, dO, LSE2, D into the 2-stage ring, its warp 3 adds each step's dQ into the workspace (one bulk
// reduce of the 64 KB tile, one per row for padded head dims). dQ staging: a stage's Q and dO sit
// next to each other (64 KB); once both MMA warpgroups' products are done with them they hold the
// step's fp32 dQ (64 x 256, row-major, unpadded: each quad rotates its 8-column chunks so a warp's
// stores hit every bank twice), and the writer hands the stage back to the loaders once the copy
// engine has read it (no room for separate staging: 64 KB more would be 288 KB).
struct HopperBwdTileD256 {
  static constexpr int kD = 256;
  static constexpr int kBlockN = 64;
  static constexpr int kBlockM = 64;
  static constexpr int kThreads = HopperBwdTile::kThreads;
  static constexpr int kLoaders = HopperBwdTile::kLoaders;
  static constexpr int kStages = HopperBwdTile::kStages;
  static constexpr int kProducerRegs = HopperBwdTile::kProducerRegs, kMmaRegs = HopperBwdTile::kMmaRegs;
  // K, V; the Q and dO ring; dS^T; the fp32 P^T handoff; the LSE2 and D ring; mbarriers (full and
  // empty per stage, K/V landed); + 1024 atom alignment slack: 223,272 bytes.
  static constexpr int smem_bytes() {
    return (2 * kBlockN * kD + 2 * kStages * kBlockM * kD + kBlockN * kBlockM) * 2 + kBlockN * kBlockM * 4 +
           2 * kStages * kBlockM * 4 + 8 * (2 * kStages + 1) + 1024;
  }
};
// sm_90's opt-in maximum per block is 227 KB (the capability check also asks the device).
static_assert(HopperBwdTile::smem_bytes(64) <= 227 * 1024 && HopperBwdTile::smem_bytes(128) <= 227 * 1024 &&
                  HopperBwdTileD256::smem_bytes() <= 227 * 1024,
              "a Hopper backward tile outgrows the block's shared memory");
// The backward's instance of a call: the smallest of 64, 128, 256 holding both head dims. The
// forward's 192 bucket (hopper_head_bucket) has no backward instance: dims in (128, 256] run padded
// in the 256 one.
inline int hopper_bwd_head_bucket(const Problem& p) {
  const int64_t m = std::max(p.d, p.dv);
  return m <= 64 ? 64 : m <= 128 ? 128 : 256;
}
inline constexpr int hopper_bwd_block_n(int d) { return d == 256 ? HopperBwdTileD256::kBlockN : HopperBwdTile::kBlockN; }
// Whether the instance has deterministic mode's rotated walk (bwd_hopper.cu DqRotation). Not
// D128: there its extra step state cost the default mode 4-6% at S >= 4k (H200, session 36: the
// step loop sits at the register limit), and its deterministic mode runs at 0.85-0.87x the
// default one without it. With it, deterministic D64 went from 0.81-0.85x to 0.97-1.00x and D256
// from 0.73x to 0.89-0.91x (non-causal S1k/S4k); the default D64 kept its speed (0.99-1.01x), the
// default D256 too except S4k non-causal (0.96-0.97x in two A/Bs; bench/results/gpu_backward.md).
inline constexpr bool hopper_bwd_rotates(int d) { return d != 128; }
inline constexpr int hopper_bwd_smem_bytes(int d) {
  return d == 256 ? HopperBwdTileD256::smem_bytes() : HopperBwdTile::smem_bytes(d);
}

#if defined(FLASHPORT_WITH_HOPPER_BWD)
template <int D, bool kBf16>
BwdKernelInfo hopper_bwd_kernel_info(int device);
template <int D, bool kBf16>
gpuError_t launch_hopper_bwd(const BwdArgs& a, dim3 grid, gpuStream_t stream);

inline BwdKernelInfo hopper_bwd_info_for(int d, bool bf16, int dev) {
  if (d == 64) return bf16 ? hopper_bwd_kernel_info<64, true>(dev) : hopper_bwd_kernel_info<64, false>(dev);
  if (d == 256) return bf16 ? hopper_bwd_kernel_info<256, true>(dev) : hopper_bwd_kernel_info<256, false>(dev);
  return bf16 ? hopper_bwd_kernel_info<128, true>(dev) : hopper_bwd_kernel_info<128, false>(dev);
}
#endif

// Empty string: the Hopper backward runs this call. Otherwise the reason it doesn't.
inline std::string hopper_bwd_check(const BwdProblem& bp, int arch, int smem_optin) {
#if !defined(FLASHPORT_WITH_HOPPER_BWD)
  (void)bp, (void)arch, (void)smem_optin;
  return "hopper backward: not built (90 not in CMAKE_CUDA_ARCHITECTURES)";
#else
  const Problem& p = bp.fwd;
  if (!runtime_config().hopper_bwd) return "hopper backward: disabled by FLASHPORT_HOPPER_BWD=0";
  if (arch != 900) return "hopper backward: device is not sm_90";
  if (p.dtype != FP_F16 && p.dtype != FP_BF16) return "hopper backward: dtype";
  if (p.d > 256 || p.dv > 256) return "hopper backward: head dim above 256";
  // The kernel copies and stores whole 16-byte chunks of 8 columns.
  if ((p.d & 7) != 0 || (p.dv & 7) != 0) return "hopper backward: head dims must be multiples of 8";
  if (p.seq.kv_layout == KvLayout::Paged || p.seq.cache_batch_idx != nullptr || p.seq.snew > 0 ||
      p.rotary_dim > 0)
    return "hopper backward: paged / cache_batch_idx / append";
  if (!p.has_lse || p.lse_dtype != FP_F32) return "hopper backward: lse must be float32";
  auto a16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  auto m8 = [](int64_t x) { return (x & 7) == 0; };
  const bool aligned = a16(p.q_ptr) && a16(p.k_ptr) && a16(p.v_ptr) && a16(bp.dout_ptr) &&
                       m8(p.q.row_stride) && m8(p.q.head_stride) && m8(p.q.batch_stride) &&
                       m8(bp.dout.row_stride) && m8(bp.dout.head_stride) && m8(bp.dout.batch_stride) &&
                       m8(p.k.s0) && m8(p.k.s1) && m8(p.k.s2) && m8(p.v.s0) && m8(p.v.s1) && m8(p.v.s2);
  if (!aligned) return "hopper backward: q/k/v/dout rows or strides not 16-byte aligned";
  if (p.seq.batch > 65535 || p.hkv > 65535) return "hopper backward: grid too large (batch, kv heads <= 65535)";
  if (p.seq.sq > 0x3fffffff || p.seq.sk > 0x3fffffff) return "hopper backward: sequence lengths must fit int32";
  const int bucket = hopper_bwd_head_bucket(p);
  if (hopper_bwd_smem_bytes(bucket) > smem_optin) return "hopper backward: shared memory";
  const BwdKernelInfo ki = hopper_bwd_info_for(bucket, p.dtype == FP_BF16, p.device_index);
  if (ki.status != gpuSuccess) return std::string("hopper backward: no kernel image: ") + gpuGetErrorString(ki.status);
  if (ki.blocks_per_sm < 1) return "hopper backward: kernel does not fit an SM";
  return std::string();
#endif
}

// The Hopper plan of a call hopper_bwd_check accepted: the mma.sync backward's workspace layout
// (mma/bwd_launch.hpp; semaphores per (b, h, query block) in deterministic mode), the Hopper kernel's name (with ":d<D>_dv<Dv>" when
// the call runs padded in a larger instance, as the forward's), its id and, in deterministic
// mode, whether the walk rotates (backend_args[0]; ":deterministic-rotated" in the name).
// wave_slots: the SMs of the call's stream (a green context's partition, else the device's) x the
// kernel's blocks per SM (the rotated deterministic walk needs a head's key blocks resident
// together); read in deterministic mode only.
bool hopper_bwd_plan(const BwdProblem& bp, int64_t wave_slots, Plan* plan);
// Preprocess, the Hopper main loop, dq conversion (mma/bwd_aux_kernels.cuh), on `stream`.
Status run_bwd_hopper(const BwdProblem& bp, const Plan& plan, void* workspace, gpuStream_t stream);

// Kernel template instances: D64/D128/D256 x fp16/bf16 x without / with dropout (the replay is
// its own instance: the kernels sit at the register limit, and a second copy of the step loop in
// one function spilled in both copies).
inline constexpr int kHopperBwdInstances = 12;

}  // namespace flashport::gpu
