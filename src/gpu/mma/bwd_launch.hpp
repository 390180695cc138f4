// GPU backward (FlashAttention-2 style): tile table, kernel arguments, launch entry points and the
// plan/run functions the CUDA backend calls. Three launches per call, all on the caller's stream:
//   1. bwd_preprocess: D_i = dout_i . out_i, LSE in log2 units (+inf for rows that saw nothing, so
//      P = 0 there), zeroes the fp32 dq accumulator and the deterministic-mode semaphores;
//   2. bwd_kernel (one block per (key block, kv head, batch)): recomputes P from the saved LSE,
//      keeps dK, dV of its keys in registers over every query block of every query head of its
//      GQA group (so dk/dv are summed over the group in a fixed order, without workspace), and
//      adds dQ into the fp32 accumulator (atomics; deterministic mode orders the key blocks of a
//      query block with a per-(b, h, q-block) semaphore, so every dq element is summed in the
//      same order every run);
//   3. bwd_convert: dq = scale * accumulator in the caller's dtype and layout; the sink gradient
//      d_sinks[h] = -sum_i exp(sink_h - lse_i) * D_i, reduced per head in a fixed order.
// The same three kernels compile for HIP on the AMD tile layer (bwd_kernel.cuh, bwd_aux_kernels.cuh;
// instances in amd/bwd_amd.hip, planned by amd/amd_plan.hpp) with the AMD rows of the tile table.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/backend.hpp"
#include "core/problem.hpp"
#include "core/status.hpp"
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/kernel_info.hpp"
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

struct BwdTile {
  int head_dim;    // bucket: 64, 128, 256 (smaller head dims run masked in the next bucket)
  int block_m;     // query rows per step
  int block_n;     // keys per block (16 per key group of warps)
  int warps;       // warps (AMD: waves)
  int min_blocks;  // NVIDIA: __launch_bounds__ blocks per SM (not used on AMD)
  int key_tiles;   // 16-key tiles per warp in S/dP/dK/dV (2: 32-key warp tiles, fewer smem reads)
  int dq_tiles;    // 16-row tiles per warp in dQ
  const char* name;
  int q_buffers = 2;     // Q/dO/LSE/D buffers: 2 overlap the next step's copy (cp.async); AMD 1
  int smem_row_pad = 0;  // 16-bit elements after each shared row (AMD: 8, as tile_mma_amd.hpp's SmemTile)
  int dq_passes = 1;     // stage 3 in column passes of the warp's dQ columns (fewer live accumulators)
  int score_groups = 0;  // query-column groups of stage 1 (S^T, dP^T) if fewer than col_groups() (0: as many)

  // Threads of a block on a device whose warps (waves) are `wave_size` lanes.
  constexpr int threads(int wave_size) const { return warps * wave_size; }
#if defined(FP_TARGET_NVIDIA)
  constexpr int threads() const { return threads(32); }
#endif
  constexpr int key_groups() const { return block_n / (16 * key_tiles); }
  constexpr int col_groups() const { return warps / key_groups(); }
  constexpr int score_col_groups() const { return score_groups > 0 ? score_groups : col_groups(); }
  // K, V; Q and dO (q_buffers each); P^T and dS^T; LSE and D (q_buffers each).
  constexpr int smem_bytes() const {
    return (2 * block_n * (head_dim + smem_row_pad) + 2 * q_buffers * block_m * (head_dim + smem_row_pad) +
            2 * block_n * (block_m + smem_row_pad)) * 2 +
           2 * q_buffers * block_m * 4;
  }
};

enum BwdTileId : int { kBwd64 = 0, kBwd128, kBwd256, kNumBwdTiles };

#if defined(FP_TARGET_NVIDIA)
// The measured best on an H100 (16-key warp tiles at 64-row query blocks everywhere, and FA2's
// 8-warp tiling, lost: bench/results/HISTORY.md): 16 warps of 16 keys; D64 takes 128-row query
// blocks (its accumulators fit 128 registers).
inline constexpr BwdTile kBwdTiles[kNumBwdTiles] = {
    {64, 128, 128, 16, 1, 1, 1, "bwd_d64_m128n128w16"},
    {128, 64, 128, 16, 1, 1, 1, "bwd_d128_m64n128w16"},
    {256, 64, 64, 16, 1, 1, 1, "bwd_d256_m64n64w16"},
};
#else
// AMD (HIP): 64 KiB of LDS a workgroup and plain global -> LDS copies (nothing to overlap), so one
// Q/dO buffer, padded rows (tile_mma_amd.hpp). Waves of 16 keys x 16 queries in stage 1; the
// column split keeps the per-lane accumulators of wave32 (8 per 16x16 tile, twice wave64's) within
// the VGPRs: D64/D128 8 waves (2 column groups of dK/dV); D256 16 keys x 32 queries, 4 waves with
// 64 dK/dV columns each (2 of them compute S^T, dP^T) and dQ in 2 column passes. Not tuned on
// hardware (none reachable): sized by LDS and the ISA check's VGPR counts.
inline constexpr BwdTile kBwdTiles[kNumBwdTiles] = {
    {64, 32, 64, 8, 1, 1, 1, "amd_bwd_d64_m32n64w8", 1, 8, 1},
    {128, 32, 64, 8, 1, 1, 1, "amd_bwd_d128_m32n64w8", 1, 8, 1},
    {256, 32, 16, 4, 1, 1, 1, "amd_bwd_d256_m32n16w4", 1, 8, 2, 2},
};
inline constexpr int kAmdBwdLdsPerWorkgroup = 64 * 1024;
static_assert(kBwdTiles[kBwd64].smem_bytes() <= kAmdBwdLdsPerWorkgroup &&
                  kBwdTiles[kBwd128].smem_bytes() <= kAmdBwdLdsPerWorkgroup &&
                  kBwdTiles[kBwd256].smem_bytes() <= kAmdBwdLdsPerWorkgroup,
              "AMD backward rows fit a workgroup's LDS");
#endif

constexpr BwdTileId bwd_tile_for(int64_t head_dim) {
  return head_dim <= 64 ? kBwd64 : (head_dim <= 128 ? kBwd128 : kBwd256);
}

FP_TARGET_NS_END

struct BwdArgs {
  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  const uint16_t* out = nullptr;
  const uint16_t* dout = nullptr;
  const float* lse = nullptr;
  uint16_t* dq_ptr = nullptr;
  uint16_t* dk_ptr = nullptr;
  uint16_t* dv_ptr = nullptr;
  float* d_sinks = nullptr;
  SeqInfo seq;
  RowAddr q_addr, out_addr, dout_addr, dq_addr;
  KvAddr k_addr, v_addr, dk_addr, dv_addr;
  LseAddr lse_addr;
  ScoreRules rules;
  int64_t k_rows_cap = 0;   // batched: rows per sequence in k/dk (clamp; rows past Lk get dk = 0)
  int64_t total_rows = 0;   // B * Sq (batched) or Tq (packed): rows of the workspace per head
  int32_t hq = 0, hkv = 0, d = 0, dv = 0, group = 1;
  int32_t dacc = 0;         // row stride of the dq accumulator (D rounded up to 8)
  int32_t m_blocks = 0;     // query blocks per sequence (semaphores per (b, h))
  bool bf16 = false;
  bool vec_ok = false;      // 16-byte aligned rows/strides of q, k, v, dout: cp.async path
  bool kv_out_vec_ok = false;  // 4-byte aligned pairs in dk, dv
  bool kv_out_vec16_ok = false;  // 16-byte aligned rows in dk, dv (the Hopper backward's staged dK, dV stores)
  bool deterministic = false;
  bool dq_rotated = false;  // deterministic Hopper backward: the rotated walk (bwd_hopper.cu DqRotation)
  float scale = 1.0f, scale_log2 = 0.0f, softcap_in = 0.0f, softcap_out = 0.0f;
  // Workspace: lse2 [Hq][total_rows], dsum [Hq][total_rows], dq_acc [Hq][total_rows][dacc],
  // sema [B][Hq][m_blocks].
  float* ws_lse2 = nullptr;
  float* ws_dsum = nullptr;
  float* ws_dq = nullptr;
  int32_t* ws_sema = nullptr;
  int64_t sema_count = 0;
};

// The sequence of a backward block (every backward kernel: mma.sync, fp32, Hopper): its query
// rows lq (clamped to Sq), its keys lk (clamped to the cache rows of k), its first packed query
// row and the workspace row of its query 0.
struct BwdSeq {
  int lq, lk;
  int64_t q_start, ws_row0;
  FP_HD BwdSeq(const BwdArgs& a, int b) {
    lq = static_cast<int>(a.seq.q_len(b));
    if (lq > a.seq.sq) lq = static_cast<int>(a.seq.sq);
    if (lq < 0) lq = 0;
    int64_t lk64 = a.seq.k_len(b);
    if (a.k_rows_cap > 0 && lk64 > a.k_rows_cap) lk64 = a.k_rows_cap;
    lk = lk64 < 0 ? 0 : static_cast<int>(lk64);
    q_start = a.seq.q_start(b);
    ws_row0 = a.seq.cu_q ? q_start : int64_t(b) * a.seq.sq;
  }
};

// The backward's workspace, shared by the mma.sync (CUDA and HIP) and the Hopper paths: lse2
// [Hq][rows], dsum [Hq][rows], dq_acc [Hq][rows][dacc] (fp32), then `sema_count` int32 semaphores
// (deterministic mode), each area 256-byte aligned.
struct BwdWorkspace {
  int64_t total_rows = 0;  // rows of each per-head area: B * Sq (batched) or Tq (packed)
  int32_t dacc = 0;        // row stride of dq_acc: D rounded up to 8
  size_t lse_off = 0, dsum_off = 0, dq_off = 0, sema_off = 0, total = 0;
  int64_t sema_count = 0;
};

inline BwdWorkspace bwd_workspace(const Problem& p, int64_t sema_count) {
  auto align_up = [](size_t x) { return (x + 255) / 256 * 256; };
  BwdWorkspace w;
  w.total_rows = p.total_q_rows;
  w.dacc = static_cast<int32_t>((p.d + 7) / 8 * 8);
  const size_t rows = size_t(p.hq) * size_t(w.total_rows);
  size_t off = 0;
  w.lse_off = off;
  off += align_up(rows * 4);
  w.dsum_off = off;
  off += align_up(rows * 4);
  w.dq_off = off;
  off += align_up(rows * size_t(w.dacc) * 4);
  w.sema_off = off;
  w.sema_count = sema_count;
  off += align_up(size_t(sema_count) * 4);
  w.total = off;
  return w;
}

// The BwdArgs fields every backward path fills alike: tensors and their addressing, score rules,
// scales, sizes, and the lse2/dsum/dq_acc areas of `workspace`. The caller sets the rest
// (m_blocks, vec_ok, deterministic, semaphores).
inline BwdArgs bwd_common_args(const BwdProblem& bp, const BwdWorkspace& w, void* workspace) {
  const Problem& p = bp.fwd;
  char* ws = static_cast<char*>(workspace);
  BwdArgs a;
  a.q = static_cast<const uint16_t*>(p.q_ptr);
  a.k = static_cast<const uint16_t*>(p.k_ptr);
  a.v = static_cast<const uint16_t*>(p.v_ptr);
  a.out = static_cast<const uint16_t*>(p.out_ptr);
  a.dout = static_cast<const uint16_t*>(bp.dout_ptr);
  a.lse = static_cast<const float*>(p.lse_ptr);
  a.dq_ptr = static_cast<uint16_t*>(bp.dq_ptr);
  a.dk_ptr = static_cast<uint16_t*>(bp.dk_ptr);
  a.dv_ptr = static_cast<uint16_t*>(bp.dv_ptr);
  a.d_sinks = p.rules.sinks != nullptr ? bp.d_sinks : nullptr;
  a.seq = p.seq;
  a.q_addr = p.q, a.out_addr = p.out, a.dout_addr = bp.dout, a.dq_addr = bp.dq;
  a.k_addr = p.k, a.v_addr = p.v, a.dk_addr = bp.dk, a.dv_addr = bp.dv;
  a.lse_addr = p.lse;
  a.rules = p.rules;
  a.k_rows_cap = p.seq.kv_layout == KvLayout::Batched ? p.seq.sk : 0;
  a.total_rows = w.total_rows;
  a.hq = int32_t(p.hq), a.hkv = int32_t(p.hkv), a.d = int32_t(p.d), a.dv = int32_t(p.dv);
  a.group = int32_t(p.group);
  a.dacc = w.dacc;
  a.bf16 = p.dtype == FP_BF16;
  auto even = [](int64_t x) { return (x & 1) == 0; };
  a.kv_out_vec_ok = (reinterpret_cast<uintptr_t>(a.dk_ptr) & 3) == 0 && (reinterpret_cast<uintptr_t>(a.dv_ptr) & 3) == 0 &&
                    even(bp.dk.s0) && even(bp.dk.s1) && even(bp.dk.s2) && even(bp.dv.s0) &&
                    even(bp.dv.s1) && even(bp.dv.s2);
  a.kv_out_vec16_ok = rows_aligned16(a.dk_ptr, 2, bp.dk) && rows_aligned16(a.dv_ptr, 2, bp.dv);
  a.scale = p.rules.scale;
  a.scale_log2 = p.rules.scale * kLog2e;
  if (p.rules.softcap > 0.0f) {
    a.softcap_in = p.rules.scale / p.rules.softcap;
    a.softcap_out = p.rules.softcap * kLog2e;
  }
  a.ws_lse2 = reinterpret_cast<float*>(ws + w.lse_off);
  a.ws_dsum = reinterpret_cast<float*>(ws + w.dsum_off);
  a.ws_dq = reinterpret_cast<float*>(ws + w.dq_off);
  return a;
}

// Whether q, k, v and dout allow 16-byte row copies (aligned pointers, strides of 8 elements).
inline bool bwd_vec_ok(const BwdProblem& bp) {
  const Problem& p = bp.fwd;
  auto aligned16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  auto mult8 = [](int64_t x) { return (x & 7) == 0; };
  return aligned16(p.q_ptr) && aligned16(p.k_ptr) && aligned16(p.v_ptr) && aligned16(bp.dout_ptr) &&
         mult8(p.q.row_stride) && mult8(p.q.head_stride) && mult8(p.q.batch_stride) &&
         mult8(bp.dout.row_stride) && mult8(bp.dout.head_stride) && mult8(bp.dout.batch_stride) &&
         mult8(p.k.s0) && mult8(p.k.s1) && mult8(p.k.s2) && mult8(p.v.s0) && mult8(p.v.s1) && mult8(p.v.s2);
}

// The call shapes every GPU backward takes (the mma.sync one on CUDA and HIP, the fp32 one): ""
// or why not, without the backend's prefix. A missing lse is an invalid call, the caller's to
// report; dtype, tile and shared memory are each kernel family's own checks.
inline std::string bwd_shape_refusal(const Problem& p) {
  if (p.lse_dtype != FP_F32) return "lse must be float32";
  if (p.d > 256 || p.dv > 256) return "head dim > 256";
  if (p.seq.snew > 0 || p.rotary_dim > 0) return "no backward for append-then-attend (k_new, rotary)";
  if (p.seq.kv_layout == KvLayout::Paged || p.seq.cache_batch_idx != nullptr)
    return "backward over a paged cache or cache_batch_idx is not supported";
  return "";
}
// The limits of a backward grid (key blocks x kv heads x batch) and of its int32 positions.
inline std::string bwd_grid_refusal(const Problem& p, int64_t key_blocks) {
  if (key_blocks > 0x7fffffff || p.hkv > 65535 || p.seq.batch > 65535)
    return "backward grid too large (batch <= 65535, kv heads <= 65535)";
  if (p.seq.sq > 0x3fffffff || p.seq.sk > 0x3fffffff) return "sequence lengths must fit int32";
  return "";
}

FP_TARGET_NS_BEGIN
// The launch shape of one call of the mma.sync backward on the target's tile rows: tile, grid
// (key blocks x kv heads x batch), query blocks (semaphores per (b, h)) and the workspace.
struct BwdLayout {
  int tile = 0;
  int64_t key_blocks = 0, m_blocks = 0;
  BwdWorkspace ws;
};
inline BwdLayout bwd_layout(const BwdProblem& bp) {
  const Problem& p = bp.fwd;
  BwdLayout l;
  l.tile = bwd_tile_for(std::max(p.d, p.dv));
  const BwdTile& C = kBwdTiles[l.tile];
  const int64_t max_keys = p.seq.sk;  // batched: rows per sequence; varlen: max_seqlen_k
  l.key_blocks = (max_keys + C.block_n - 1) / C.block_n;
  l.m_blocks = (p.seq.sq + C.block_m - 1) / C.block_m;
  l.ws = bwd_workspace(p, bp.deterministic ? p.seq.batch * p.hq * l.m_blocks : 0);
  return l;
}
// The arguments of the three launches of a call laid out by `l`, over `workspace`.
inline BwdArgs bwd_launch_args(const BwdProblem& bp, const BwdLayout& l, void* workspace) {
  BwdArgs a = bwd_common_args(bp, l.ws, workspace);
  a.m_blocks = static_cast<int32_t>(l.m_blocks);
  a.vec_ok = bwd_vec_ok(bp);
  a.deterministic = bp.deterministic;
  a.ws_sema = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + l.ws.sema_off);
  a.sema_count = l.ws.sema_count;
  return a;
}
FP_TARGET_NS_END

#if defined(FP_TARGET_NVIDIA)
using BwdKernelInfo = KernelInfo;

template <int kTile, bool kBf16>
BwdKernelInfo bwd_kernel_info(int device);
template <int kTile, bool kBf16>
gpuError_t launch_bwd(const BwdArgs& a, dim3 grid, gpuStream_t stream);

gpuError_t launch_bwd_preprocess(const BwdArgs& a, gpuStream_t stream);
gpuError_t launch_bwd_convert(const BwdArgs& a, gpuStream_t stream);
// The sink gradient alone (reads only the workspace's lse2 and D: any dtype; the fp32 backward's
// conversion step calls it).
gpuError_t launch_bwd_sink_grad(const BwdArgs& a, gpuStream_t stream);

// Called from CudaBackend::plan_bwd / run_bwd (cuda_backend.cu) after its device checks.
Status plan_bwd_cuda(const BwdProblem& p, int smem_optin, Plan* plan);
Status run_bwd_cuda(const BwdProblem& p, const Plan& plan, void* workspace, gpuStream_t stream);

// Kernel template instances of the backward (main loop: 3 tiles x 2 dtypes; preprocess, convert).
inline constexpr int kBwdInstances = kNumBwdTiles * 2 + 2;
#else
FP_TARGET_NS_BEGIN
// HIP: the main loop's instances on the AMD rows (3 tiles x fp16/bf16) and the preprocess, dq
// conversion and sink-gradient kernels, launched with waves of `wave_size` lanes (the device's;
// the gate has checked it is the one the code objects were built for). Defined in amd/bwd_amd.hip.
inline constexpr int kAmdBwdInstances = kNumBwdTiles * 2 + 3;
gpuError_t launch_bwd_amd(int tile, bool bf16, const BwdArgs& a, dim3 grid, int wave_size, gpuStream_t stream);
gpuError_t launch_bwd_preprocess_amd(const BwdArgs& a, int wave_size, gpuStream_t stream);
gpuError_t launch_bwd_convert_amd(const BwdArgs& a, int wave_size, gpuStream_t stream);
FP_TARGET_NS_END
#endif

}  // namespace flashport::gpu
