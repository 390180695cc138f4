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
#pragma once
#include <cstdint>

#include "core/backend.hpp"
#include "core/problem.hpp"
#include "core/status.hpp"
#include "gpu/common/kernel_info.hpp"
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

struct BwdTile {
  int head_dim;    // bucket: 64, 128, 256 (smaller head dims run masked in the next bucket)
  int block_m;     // query rows per step
  int block_n;     // keys per block (16 per key group of warps)
  int warps;
  int min_blocks;  // __launch_bounds__ blocks per SM
  int key_tiles;   // 16-key tiles per warp in S/dP/dK/dV (2: 32-key warp tiles, fewer smem reads)
  int dq_tiles;    // 16-row tiles per warp in dQ
  const char* name;

  constexpr int threads() const { return warps * 32; }
  constexpr int key_groups() const { return block_n / (16 * key_tiles); }
  constexpr int col_groups() const { return warps / key_groups(); }
  // K, V; Q and dO double-buffered; P^T and dS^T; LSE and D double-buffered.
  constexpr int smem_bytes() const {
    return (2 * block_n * head_dim + 4 * block_m * head_dim + 2 * block_n * block_m) * 2 +
           4 * block_m * 4;
  }
};

enum BwdTileId : int { kBwd64 = 0, kBwd128, kBwd256, kNumBwdTiles };

// The measured best on an H100 (16-key warp tiles at 64-row query blocks everywhere, and FA2's
// 8-warp tiling, lost: bench/results/HISTORY.md): 16 warps of 16 keys; D64 takes 128-row query
// blocks (its accumulators fit 128 registers).
inline constexpr BwdTile kBwdTiles[kNumBwdTiles] = {
    {64, 128, 128, 16, 1, 1, 1, "bwd_d64_m128n128w16"},
    {128, 64, 128, 16, 1, 1, 1, "bwd_d128_m64n128w16"},
    {256, 64, 64, 16, 1, 1, 1, "bwd_d256_m64n64w16"},
};

constexpr BwdTileId bwd_tile_for(int64_t head_dim) {
  return head_dim <= 64 ? kBwd64 : (head_dim <= 128 ? kBwd128 : kBwd256);
}

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
  bool deterministic = false;
  float scale = 1.0f, scale_log2 = 0.0f, softcap_in = 0.0f, softcap_out = 0.0f;
  // Workspace: lse2 [Hq][total_rows], dsum [Hq][total_rows], dq_acc [Hq][total_rows][dacc],
  // sema [B][Hq][m_blocks].
  float* ws_lse2 = nullptr;
  float* ws_dsum = nullptr;
  float* ws_dq = nullptr;
  int32_t* ws_sema = nullptr;
  int64_t sema_count = 0;
};

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

// The backward's workspace, shared by the mma.sync and the Hopper paths: lse2 [Hq][rows],
// dsum [Hq][rows], dq_acc [Hq][rows][dacc] (fp32), then `sema_count` int32 semaphores
// (deterministic mode), each area 256-byte aligned.
struct BwdWorkspace {
  int64_t total_rows = 0;  // rows of each per-head area: B * Sq (batched) or Tq (packed)
  int32_t dacc = 0;        // row stride of dq_acc: D rounded up to 8
  size_t lse_off = 0, dsum_off = 0, dq_off = 0, sema_off = 0, total = 0;
  int64_t sema_count = 0;
};
BwdWorkspace bwd_workspace(const Problem& p, int64_t sema_count);

// The BwdArgs fields every backward path fills alike: tensors and their addressing, score rules,
// scales, sizes, and the lse2/dsum/dq_acc areas of `workspace`. The caller sets the rest
// (m_blocks, vec_ok, deterministic, semaphores).
BwdArgs bwd_common_args(const BwdProblem& bp, const BwdWorkspace& w, void* workspace);

// Called from CudaBackend::plan_bwd / run_bwd (cuda_backend.cu) after its device checks.
Status plan_bwd_cuda(const BwdProblem& p, int smem_optin, Plan* plan);
Status run_bwd_cuda(const BwdProblem& p, const Plan& plan, void* workspace, gpuStream_t stream);

// Kernel template instances of the backward (main loop: 3 tiles x 2 dtypes; preprocess, convert).
inline constexpr int kBwdInstances = kNumBwdTiles * 2 + 2;

}  // namespace flashport::gpu
