// The fp32 kernels of the CUDA backend (README.md here): tile tables, the forward candidate and
// launch, the backward plan and run. Exact to fp32 rounding: 3xTF32 tensor-core products, fp32
// softmax and accumulators throughout.
#pragma once
#include <cstdint>
#include <string>

#include "core/backend.hpp"
#include "core/problem.hpp"
#include "core/status.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/kernel_info.hpp"
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

// One head-dim bucket of an fp32 kernel: block_m query rows x block_n keys per step; head dims
// below the bucket run in it with zero-filled columns. Shared tiles are fp32 rows padded by 4
// floats: conflict-free fragment reads of the m16n8k8 products.
struct F32Tile {
  int head_dim, block_m, block_n, threads;
  const char* name;
  // Forward: K and V held split (fwd_f32.cu): each tile's tf32 big and small parts in two planes,
  // split once a block by the threads that copied them instead of once a warp at every read.
  bool kv_split = false;
  constexpr int row_stride() const { return head_dim + 4; }  // Q, K, V, dO rows
  constexpr int q_stride() const { return block_n + 4; }     // rows of P and dS (bwd): per query
  // Forward: Q, K, V tiles (P stays in registers); split K and V take two planes each.
  constexpr int fwd_smem_bytes() const { return (block_m + (kv_split ? 4 : 2) * block_n) * row_stride() * 4; }
  // Backward: K, V, Q, dO tiles, P, dS, LSE and D of the step's rows.
  constexpr int bwd_smem_bytes() const {
    return ((2 * block_n + 2 * block_m) * row_stride() + 2 * block_m * q_stride() + 2 * block_m) * 4;
  }
};

enum F32TileId : int { kF32D64 = 0, kF32D128, kF32D256, kNumF32Tiles };

constexpr F32TileId f32_tile_for(int64_t head_dim) {
  return head_dim <= 64 ? kF32D64 : (head_dim <= 128 ? kF32D128 : kF32D256);
}
// Whether a plan's tile serves a call of this head dim (max(d, dv)): the same head-dim bucket (a
// plan run on a call whose head dims left its bucket does not match).
constexpr bool f32_tile_serves(const F32Tile& tile, int64_t head_dim) {
  return f32_tile_for(tile.head_dim) == f32_tile_for(head_dim);
}

// Forward: warps of 16 query rows each (3xTF32 m16n8k8 products). Calls of 128+ query rows run
// 8 warps (one block an SM, the registers' limit): each K/V tile serves 128 rows and the wider key
// tile gives a warp more independent products a step (H200: +16-25% at D64/D128 in session 30,
// +21-32% at D256 in session 31, over two blocks of 4 warps with half as many keys a tile).
// Shorter calls (decode) keep 4-warp blocks, two an SM: with one row a (sequence, head) the
// 128-row block computed 8 warps' products for it and halved the blocks an SM (1.5x slower). So
// do devices whose shared memory a block cannot hold the 128-row tile (D256's 195 KB: every
// device before Hopper; D64/D128 on sm_86/89's 99 KB).
// D64 and D128 hold K and V split (kv_split: H200 session 32, +9-10% / +14-15%) where a block's
// shared memory holds both planes (Hopper); elsewhere (the A100) their 128-row tiles split at
// every read. D256's split planes fit only 16-key tiles: 0.80x of the 32-key tile, not kept.
enum F32FwdTileId : int {
  kF32FwdD64 = 0, kF32FwdD128, kF32FwdD256,              // the head-dim buckets (F32TileId order)
  kF32FwdD64Rows64, kF32FwdD128Rows64, kF32FwdD256Rows64,  // their 64-row blocks (same order)
  kF32FwdD64Unsplit, kF32FwdD128Unsplit,                   // D64/D128 128-row blocks, K/V split at reads
  kNumF32FwdTiles
};
inline constexpr F32Tile kF32FwdTiles[kNumF32FwdTiles] = {
    {64, 128, 128, 256, "f32_tf32x3_d64_m128n128_kvsplit", true},   // 174,080 shared bytes
    {128, 128, 64, 256, "f32_tf32x3_d128_m128n64_kvsplit", true},   // 202,752
    {256, 128, 32, 256, "f32_tf32x3_d256_m128n32"},                 // 199,680
    {64, 64, 64, 128, "f32_tf32x3_d64_m64n64"},                     // 52,224
    {128, 64, 32, 128, "f32_tf32x3_d128_m64n32"},                   // 67,584
    {256, 64, 16, 128, "f32_tf32x3_d256_m64n16"},                   // 99,840
    {64, 128, 128, 256, "f32_tf32x3_d64_m128n128"},                 // 104,448
    {128, 128, 64, 256, "f32_tf32x3_d128_m128n64"},                 // 135,168
};
// Packed GQA calls (pack > 1: a decode step's query heads in one block's rows) run the 64-row
// blocks, the instances that take packed rows.
constexpr int f32_fwd_tile_for(int64_t head_dim, int64_t sq, int smem_optin, int pack = 1) {
  const F32TileId bucket = f32_tile_for(head_dim);
  const int narrow = int(kF32FwdD64Rows64) + int(bucket);
  if (pack != 1 || sq < 128) return narrow;
  if (kF32FwdTiles[bucket].fwd_smem_bytes() <= smem_optin) return bucket;
  const int unsplit = int(kF32FwdD64Unsplit) + int(bucket);
  return bucket != kF32D256 && kF32FwdTiles[unsplit].fwd_smem_bytes() <= smem_optin ? unsplit : narrow;
}
// Backward: 8 warps (Hopper's D256 tile 16, below); stages 1 and 2 split the block's keys into
// 16-key tiles and the queries (stage 1) or columns (stage 2) among the warps of a key tile; stage
// 3 splits queries x columns.
// D128 and D256 take 64 query rows a step where a block's shared memory holds them (Hopper: H200
// session 31, +15-25% over 32-row steps, deterministic +18-28%), 32 rows elsewhere (A100: 163 KB).
// Hopper's D256 tile runs 16 warps (4 a scheduler at 128 registers, against the latency of 2 at
// 255): H200 session 35, both orders, +2.2-4.5% (deterministic +0.3-0.8%); the same at D128 was
// 5% slower (more instructions a product: each warp's split fragments serve half the products).
enum F32BwdTileId : int {
  kF32BwdD64 = 0, kF32BwdD128, kF32BwdD256,  // the head-dim buckets (F32TileId order)
  kF32BwdD128Rows32, kF32BwdD256Rows32,      // D128 and D256 in 32-row steps
  kNumF32BwdTiles
};
inline constexpr F32Tile kF32BwdTiles[kNumF32BwdTiles] = {
    {64, 64, 64, 256, "f32_tf32x3_bwd_d64_m64n64"},     // 104,960 shared bytes
    {128, 64, 64, 256, "f32_tf32x3_bwd_d128_m64n64"},   // 170,496
    {256, 64, 32, 512, "f32_tf32x3_bwd_d256_m64n32_w16"},  // 218,624
    {128, 32, 64, 256, "f32_tf32x3_bwd_d128_m32n64"},   // 119,040
    {256, 32, 32, 256, "f32_tf32x3_bwd_d256_m32n32"},   // 142,592
};
constexpr int f32_bwd_tile_for(int64_t head_dim, int smem_optin) {
  const F32TileId bucket = f32_tile_for(head_dim);
  if (bucket == kF32D64 || kF32BwdTiles[bucket].bwd_smem_bytes() <= smem_optin) return bucket;
  return bucket == kF32D128 ? kF32BwdD128Rows32 : kF32BwdD256Rows32;
}

// Kernel template instances: forward 8 tiles, backward 5 tiles + preprocess + convert.
inline constexpr int kF32Instances = int(kNumF32FwdTiles) + int(kNumF32BwdTiles) + 2;

// Forward: the candidate for an fp32 call (empty string: it runs the call with `tile` and
// `splits`; else why not), and the launch of the main loop over a decided plan.
struct F32FwdChoice {
  int tile = 0, pack = 1, splits = 1;  // pack: GQA heads packed into a block's rows (gqa_pack)
};
std::string f32_fwd_candidate(const Problem& p, int sm_count, int smem_optin, F32FwdChoice* out);
// The grid of a decided plan, and its layout (FwdArgs::query_blocks_outer).
dim3 f32_fwd_grid(const Problem& p, int tile, int pack, int splits, bool* query_blocks_outer);
gpuError_t launch_f32_fwd(int tile, const FwdArgs& a, dim3 grid, gpuStream_t stream);

// Backward (float32 calls): plan and run (preprocess, main loop, dq conversion + sink gradient).
Status plan_bwd_f32(const BwdProblem& p, int smem_optin, Plan* plan);
Status run_bwd_f32(const BwdProblem& p, const Plan& plan, void* workspace, gpuStream_t stream);

}  // namespace flashport::gpu
