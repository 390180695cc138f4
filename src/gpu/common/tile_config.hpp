// The one tile table: read by the kernels (as template arguments) and by the host planner
// (workspace, split heuristic, occupancy), so the two can never disagree. Its rows are per
// target family (gpu_target.hpp): NVIDIA's below, AMD's at the end (64 KiB of LDS, no
// asynchronous copies); the main loop that reads them is the same.
#pragma once
#include <cstdint>

#include "gpu/common/gpu_target.hpp"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

struct TileConfig {
  int head_dim;    // bucket: 64, 128 or 256 (smaller head dims run masked in the next bucket)
  int block_m;     // query rows per block (packed GQA rows in decode)
  int block_n;     // keys per main-loop step
  int warps;       // warps (AMD: waves) per block; each owns block_m / warps rows (16 per m-tile)
  int min_blocks;  // NVIDIA: __launch_bounds__ blocks per SM (register budget = 64K / (threads*min))
  int stages;      // 1: FA2 schedule (one K, one V buffer); >= 2: ring of (K, V) slots
  const char* name;
  int smem_row_pad = 0;  // 16-bit elements of padding after each shared-memory row (AMD: 8)

  // Threads of a block on a device whose warps (waves) are `wave_size` lanes: 32 on NVIDIA; 64
  // (CDNA) or 32 (RDNA) on AMD, where the host reads it from the device.
  constexpr int threads(int wave_size) const { return warps * wave_size; }
#if defined(FP_TARGET_NVIDIA)
  constexpr int threads() const { return threads(32); }
#endif
  constexpr int m_tiles() const { return block_m / (16 * warps); }
  // Q tile + `stages` (K, V) tile pairs, 16-bit elements.
  constexpr int smem_bytes() const { return (block_m + 2 * block_n * stages) * (head_dim + smem_row_pad) * 2; }
};

// Indices into kTileConfigs; also the Plan::kernel_id (times 2, + 1 for bf16).
enum TileId : int {
  kPrefill64 = 0,
  kPrefill128,
  kPrefill256,
  kDecode64,
  kDecode128,
  kDecode256,
  kNumTileIds
};

#if defined(FP_TARGET_NVIDIA)
inline constexpr TileConfig kTileConfigs[kNumTileIds] = {
    // Prefill: 128 x 64 with 4 warps (D64, D128); the alternatives timed (128 x 128, 64 x 64,
    // 8 warps, a 2-stage ring) lost: bench/results/HISTORY.md.
    {64, 128, 64, 4, 2, 1, "prefill_d64_m128n64w4"},
    {128, 128, 64, 4, 2, 1, "prefill_d128_m128n64w4"},
    // 64 x 64 with 4 warps, two blocks per SM, measured 0.86-1.03x FA2 against 0.75-0.93x for
    // FA2's own 128 x 64 x 8-warp shape (gpu_bench_v4*.md).
    {256, 64, 64, 4, 2, 1, "prefill_d256_m64n64w4"},
    // Decode: a ring of (K, V) stages; deeper rings and narrower key steps lost (HISTORY.md).
    {64, 64, 64, 4, 3, 3, "decode_d64_m64n64w4s3"},
    {128, 64, 64, 4, 2, 3, "decode_d128_m64n64w4s3"},
    {256, 64, 64, 4, 2, 2, "decode_d256_m64n64w4s2"},
};
#else
// AMD (HIP): a workgroup may use 64 KiB of LDS, and global -> LDS copies are plain loads and
// stores (tile_mma_amd.hpp), so a ring of stages buys nothing: every row has one K and one V
// buffer. One 16-row m-tile per wave, the shapes the AMD tile ran before the loops were unified
// (d256: 2 waves, 32 keys a step); shared rows padded by 8 elements (tile_mma_amd.hpp, SmemTile).
// min_blocks is not used on AMD (FP_LAUNCH_BOUNDS). Decode-shaped calls run the prefill rows
// (tile_id_for), so the decode rows are never instantiated; they repeat the prefill ones only to
// keep the table indexable by every TileId.
inline constexpr TileConfig kTileConfigs[kNumTileIds] = {
    {64, 64, 64, 4, 1, 1, "amd_d64_m64n64w4", 8},
    {128, 64, 64, 4, 1, 1, "amd_d128_m64n64w4", 8},
    {256, 32, 32, 2, 1, 1, "amd_d256_m32n32w2", 8},
    {64, 64, 64, 4, 1, 1, "amd_d64_m64n64w4", 8},
    {128, 64, 64, 4, 1, 1, "amd_d128_m64n64w4", 8},
    {256, 32, 32, 2, 1, 1, "amd_d256_m32n32w2", 8},
};
inline constexpr int kAmdLdsPerWorkgroup = 64 * 1024;
static_assert(kTileConfigs[kPrefill64].smem_bytes() <= kAmdLdsPerWorkgroup &&
                  kTileConfigs[kPrefill128].smem_bytes() <= kAmdLdsPerWorkgroup &&
                  kTileConfigs[kPrefill256].smem_bytes() <= kAmdLdsPerWorkgroup,
              "AMD rows fit a workgroup's LDS");
#endif

constexpr int head_dim_bucket(int64_t d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }

constexpr TileId tile_id_for(int64_t head_dim, bool decode) {
  const int bucket = head_dim_bucket(head_dim);
#if defined(FP_TARGET_AMD)
  (void)decode;  // one row per head-dim bucket on AMD (see the table)
  const int base = kPrefill64;
#else
  const int base = decode ? kDecode64 : kPrefill64;
#endif
  return static_cast<TileId>(base + (bucket == 64 ? 0 : bucket == 128 ? 1 : 2));
}

#if defined(FP_TARGET_NVIDIA)
// The dedicated decode kernel (mma/decode_kernel.cuh, CUDA only): one block per (sequence, kv
// head or query head, split) with all packed query rows (Sq x GQA group <= rows) in one 16-row
// m-tile; the block streams block_n-key (K, V) tiles through a ring of `stages` slots and each of
// its `warps` warps takes block_n / warps keys of every tile (FlashDecoding: the warps split the
// keys, not the rows), their softmax states merged in shared memory at the end. Split partials
// are merged by the last split block of a (sequence, head) to finish (a counter per pair in the
// workspace). One instance per storage dtype, head dims 65..128.
struct DecodeTileConfig {
  int head_dim;    // instance head dim (q and v head dims above 64 up to it run in it)
  int rows;        // packed query rows of a block (one m-tile)
  int block_n;     // keys per ring slot
  int warps;       // each takes block_n / warps keys of a slot
  int stages;      // ring slots of (K, V) tiles: stages - 1 tiles in flight while one is used
  int min_blocks;  // __launch_bounds__ blocks per SM
  const char* name;
  constexpr int threads() const { return warps * 32; }
  constexpr int keys_per_warp() const { return block_n / warps; }
  // Q tile + `stages` (K, V) tile pairs, 16-bit elements (the reduction scratch reuses the ring).
  constexpr int smem_bytes() const { return (rows + 2 * block_n * stages) * head_dim * 2; }
  // fp32 scratch of the in-block merge: every warp's O rows, padded (fits the ring).
  static constexpr int kScratchPad = 8;
  constexpr int scratch_bytes() const { return warps * rows * (head_dim + kScratchPad) * 4; }
};
// 128-key slots x 2, 8 warps, one block per SM (135 KiB): the next tile (64 KiB) loads while the
// 8 warps work on this one. Sweep on the H200 (session 12, kernel time per call vs cuDNN at B1 Sk8k
// / B1 Sk64k / B8 Sk8k / B64 Sk8k, GQA 32/8): this tile 0.93 / 0.98 / 0.98 / 1.00; 128 x 3 slots
// 0.90 / 0.99 / 0.98 / 1.00; the 64-key tile of 4 warps at 3 slots x 2 blocks (the previous one)
// 0.80 / 0.96 / 0.97 / 1.00, at 2 slots x 3 blocks 0.69 / 0.93 / 0.96 / 0.92; 32-key tiles of 2
// warps x 4 blocks 0.51 at B1 Sk8k. More warps on one tile shorten the per-tile chain
// (bench/results/HISTORY.md).
inline constexpr DecodeTileConfig kDecodeTile{128, 16, 128, 8, 2, 1, "decode_d128_r16n128w8s2"};
static_assert(kDecodeTile.keys_per_warp() == 16, "one 16-key k-step of P V per warp and slot");
static_assert(kDecodeTile.scratch_bytes() <= 2 * kDecodeTile.block_n * kDecodeTile.stages * kDecodeTile.head_dim * 2,
              "the in-block merge scratch fits the ring");
#endif

FP_TARGET_NS_END

// Upper bound of split counts (partials in the workspace grow with it).
inline constexpr int kMaxSplits = 128;

}  // namespace flashport::gpu
