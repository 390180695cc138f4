// The GPU planner's pure pieces (no device needed): tile table invariants and the split-count
// decisions the CUDA backend makes for the benchmark shapes on an H100-sized machine.
#include <gtest/gtest.h>

#include "core/heuristics.hpp"
#include "gpu/common/tile_config.hpp"

namespace {

using namespace flashport;
using namespace flashport::gpu;

TEST(GpuTileTable, ShapesAreConsistent) {
  for (const TileConfig& c : kTileConfigs) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.block_m % (16 * c.warps), 0);
    EXPECT_GE(c.m_tiles(), 1);
    EXPECT_EQ(c.block_n % 16, 0);
    EXPECT_LE(c.block_n / 8 * 2, 32) << "dropout keep bits fit one word per row";
    EXPECT_EQ(c.head_dim % 64, 0);
    EXPECT_LE(c.smem_bytes(), 227 * 1024) << "fits an H100 block";
    EXPECT_LE(c.threads() * c.min_blocks * 64, 65536) << "register budget >= 64 per thread";
  }
  EXPECT_EQ(tile_id_for(1, false), kPrefill64);
  EXPECT_EQ(tile_id_for(65, false), kPrefill128);
  EXPECT_EQ(tile_id_for(256, true), kDecode256);
}

// Slots = 132 SMs x resident blocks per SM (what one wave holds).
TEST(GpuSplitHeuristic, BenchmarkShapes) {
  // Long-KV (1, 16, 16, 128, 65535, 64): 16 tiles, 512 key blocks of 128, 2 blocks/SM.
  const int long_kv = resolve_num_splits(0, 16, 512, 132 * 2, kMaxSplits);
  EXPECT_GE(long_kv, 8);
  // (1, 2, 2, 40000, 40000, 64): 626 tiles fill the machine: no split.
  EXPECT_EQ(resolve_num_splits(0, 2 * 313, 313, 132 * 2, kMaxSplits), 1);
  // Decode B=1, Hkv=8 (packed GQA), Sk=8k: 8 tiles -> split.
  EXPECT_GT(resolve_num_splits(0, 8, 128, 132 * 3, kMaxSplits), 8);
  // Decode B=64, Sk=4k: 512 tiles: no split.
  EXPECT_EQ(resolve_num_splits(0, 512, 64, 132 * 3, kMaxSplits), 1);
  // Forced and off.
  EXPECT_EQ(resolve_num_splits(1, 8, 128, 132, kMaxSplits), 1);
  EXPECT_EQ(resolve_num_splits(300, 8, 128, 132, kMaxSplits), 128);
}

}  // namespace
