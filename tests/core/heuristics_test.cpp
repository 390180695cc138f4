// Split-KV heuristics: pure functions of (work tiles, key blocks, processors, max splits).
#include <gtest/gtest.h>

#include <cmath>

#include "core/heuristics.hpp"

namespace flashport {
namespace {

double wave_efficiency(int64_t tiles, int s, int64_t procs) {
  const double waves = double(tiles * s) / double(procs);
  return waves / std::ceil(waves - 1e-12);
}

TEST(Heuristics, FullMachineDoesNotSplit) {
  EXPECT_EQ(choose_num_splits(132, 1024, 132, 128), 1);
  EXPECT_EQ(choose_num_splits(4096, 64, 132, 128), 1);
  EXPECT_EQ(choose_num_splits(106, 1024, 132, 128), 1);  // >= 80% of one wave
}

TEST(Heuristics, LittleWorkOnManyProcessorsSplits) {
  const int s = choose_num_splits(16, 1024, 132, 128);
  EXPECT_GT(s, 1);
  EXPECT_LE(s, 128);
  EXPECT_GE(wave_efficiency(16, s, 132), 0.5);  // 16 tiles alone fill 12% of the machine
}

TEST(Heuristics, DecodeShapesSplit) {
  // Batch 1 decode, 8 KV heads (GQA-packed queries), 32k keys in blocks of 128, 132 SMs.
  EXPECT_GT(choose_num_splits(8, 256, 132, 128), 1);
  // Batch 4, 32 heads, 4k keys on 108 SMs.
  EXPECT_GT(choose_num_splits(4 * 8, 32, 108, 128), 1);
  // A CPU: 2 tiles on 16 cores.
  EXPECT_GT(choose_num_splits(2, 64, 16, 64), 1);
}

TEST(Heuristics, NeverAlwaysOne) {
  int split_cases = 0, total = 0;
  for (int64_t tiles : {1, 2, 3, 5, 8, 13, 21, 34, 55, 89})
    for (int64_t blocks : {2, 8, 64, 512}) {
      ++total;
      if (choose_num_splits(tiles, blocks, 132, 128) > 1) ++split_cases;
    }
  EXPECT_GT(split_cases, total / 2);
}

TEST(Heuristics, ResultWithinBoundsAndNearBestEfficiency) {
  for (int64_t tiles = 1; tiles < 140; tiles += 7)
    for (int64_t blocks : {1, 2, 3, 7, 100, 1000})
      for (int max_splits : {1, 2, 16, 128}) {
        const int s = choose_num_splits(tiles, blocks, 132, max_splits);
        ASSERT_GE(s, 1);
        ASSERT_LE(s, std::max(1, max_splits));
        ASSERT_LE(s, std::max<int64_t>(1, blocks));
        if (s > 1) {
          double best = 0;
          // Among the counts that change the blocks per split (the others add work, no balance).
          auto per_split = [&](int c) { return (blocks + c - 1) / c; };
          for (int c = 1; c <= std::min<int64_t>(max_splits, blocks); ++c)
            if (c == 1 || per_split(c) != per_split(c - 1))
              best = std::max(best, wave_efficiency(tiles, c, 132));
          EXPECT_GE(wave_efficiency(tiles, s, 132), 0.85 * best - 1e-9);
        }
      }
}

TEST(Heuristics, DegenerateInputsDoNotSplit) {
  EXPECT_EQ(choose_num_splits(0, 100, 132, 128), 1);
  EXPECT_EQ(choose_num_splits(10, 1, 132, 128), 1);
  EXPECT_EQ(choose_num_splits(10, 100, 0, 128), 1);
  EXPECT_EQ(choose_num_splits(10, 100, 132, 1), 1);
}

TEST(Heuristics, ResolveForcedCountsClampToKeyBlocks) {
  EXPECT_EQ(resolve_num_splits(1, 16, 1024, 132, 128), 1);  // off
  EXPECT_EQ(resolve_num_splits(7, 512, 1024, 132, 128), 7);  // forced, even on a full machine
  EXPECT_EQ(resolve_num_splits(64, 16, 4, 132, 128), 4);     // clamped to the key blocks
  EXPECT_EQ(resolve_num_splits(8, 16, 0, 132, 128), 1);      // no keys
  EXPECT_EQ(resolve_num_splits(0, 16, 1024, 132, 128), choose_num_splits(16, 1024, 132, 128));
  EXPECT_EQ(resolve_num_splits(0, 1000, 1024, 132, 128), 1);
}

TEST(DecodeSplits, FillOneWave) {
  // H100/H200: 132 SMs x 2 decode blocks = 264 slots. B=1, 8 kv heads: 8 tiles.
  EXPECT_EQ(choose_decode_splits(8, 1024, 264, 128), 32);  // 64k keys: 33 -> 32 (same keys per split)
  EXPECT_EQ(choose_decode_splits(8, 128, 264, 128), 32);   // 8k keys
  EXPECT_EQ(choose_decode_splits(64, 128, 264, 128), 4);   // B=8
  EXPECT_EQ(choose_decode_splits(128, 512, 264, 128), 2);  // B=16, 32k keys
  EXPECT_EQ(choose_decode_splits(512, 64, 264, 128), 1);   // B=64: more tiles than slots
  EXPECT_EQ(choose_decode_splits(220, 64, 264, 128), 1);   // >= 80% of a wave already
}

TEST(DecodeSplits, BoundsAndNoWastedSplits) {
  for (int64_t tiles = 1; tiles < 300; tiles += 13)
    for (int64_t blocks : {1, 2, 3, 7, 100, 1000})
      for (int64_t slots : {16, 132, 264, 528})
        for (int max_splits : {1, 2, 16, 128}) {
          const int s = choose_decode_splits(tiles, blocks, slots, max_splits);
          ASSERT_GE(s, 1);
          ASSERT_LE(s, std::max(1, max_splits));
          ASSERT_LE(s, std::max<int64_t>(1, blocks));
          if (s > 1) {
            EXPECT_LE(tiles * s, slots) << "one wave";
            // One split fewer would change the keys per split (else it was a wasted split).
            EXPECT_NE((blocks + s - 2) / (s - 1), (blocks + s - 1) / s);
          }
        }
  EXPECT_EQ(choose_decode_splits(0, 100, 264, 128), 1);
  EXPECT_EQ(choose_decode_splits(8, 1, 264, 128), 1);
  EXPECT_EQ(choose_decode_splits(8, 100, 0, 128), 1);
}

TEST(DecodeSplits, ResolveUsesTheDecodeRule) {
  EXPECT_EQ(resolve_num_splits(0, 8, 1024, 264, 128, true), 32);
  EXPECT_EQ(resolve_num_splits(0, 8, 1024, 264, 128, false), choose_num_splits(8, 1024, 264, 128));
  EXPECT_EQ(resolve_num_splits(5, 8, 1024, 264, 128, true), 5);  // forced counts stay forced
}

// The decode rule with a minimum of tiles per split (the decode kernel's ring): one wave of equal
// blocks, no block below its ring's tiles in flight, no split that leaves the tiles per split unchanged.
TEST(DecodeKernelSplits, BoundsRingAndNoWastedSplits) {
  for (int64_t tiles = 1; tiles < 300; tiles += 13)
    for (int64_t blocks : {1, 2, 3, 7, 100, 1000, 1024})
      for (int64_t slots : {16, 132, 264, 528})
        for (int64_t ring : {1, 2, 4})
          for (int max_splits : {1, 2, 16, 128}) {
            const int s = choose_decode_splits(tiles, blocks, slots, max_splits, ring);
            ASSERT_GE(s, 1);
            ASSERT_LE(s, std::max(1, max_splits));
            ASSERT_LE(s, std::max<int64_t>(1, blocks));
            if (s > 1) {
              EXPECT_LE(tiles * s, slots) << "one wave";
              EXPECT_GE(blocks / s, ring) << "every split fills the ring";
              EXPECT_NE((blocks + s - 2) / (s - 1), (blocks + s - 1) / s) << "wasted split";
            }
          }
  EXPECT_EQ(choose_decode_splits(0, 100, 264, 128, 2), 1);
  EXPECT_EQ(choose_decode_splits(8, 1, 264, 128, 2), 1);
  EXPECT_EQ(choose_decode_splits(8, 100, 0, 128, 2), 1);
}

// The benchmark shapes on an H100 (132 SMs x 2 blocks), 64-key tiles, 2 tiles in flight:
// B=1 (8 kv heads): 32 splits (256 blocks of 4 tiles at 8k keys, 32 tiles at 64k); B=8: 4 splits
// (256 blocks); B=64: 512 blocks fill the machine, no split.
TEST(DecodeKernelSplits, BenchmarkShapes) {
  EXPECT_EQ(choose_decode_splits(8, 128, 264, 128, 2), 32);
  EXPECT_EQ(choose_decode_splits(8, 1024, 264, 128, 2), 32);
  EXPECT_EQ(choose_decode_splits(64, 128, 264, 128, 2), 4);
  EXPECT_EQ(choose_decode_splits(64, 1024, 264, 128, 2), 4);
  EXPECT_EQ(choose_decode_splits(512, 128, 264, 128, 2), 1);
  // Short caches: 1000 keys (16 tiles) -> 8 splits of 2 tiles, not 16 single-tile ones.
  EXPECT_EQ(choose_decode_splits(8, 16, 264, 128, 2), 8);
  EXPECT_EQ(choose_decode_splits(8, 1, 264, 128, 2), 1);
}

TEST(DecodeKernelSplits, ForcedCountsAreClamped) {
  EXPECT_EQ(resolve_num_splits(0, 8, 128, 264, 128, true, 2), 32);
  EXPECT_EQ(resolve_num_splits(1, 8, 128, 264, 128, true, 2), 1);
  EXPECT_EQ(resolve_num_splits(7, 8, 128, 264, 128, true, 2), 7);
  EXPECT_EQ(resolve_num_splits(64, 8, 16, 264, 128, true, 2), 16);   // <= key tiles
  EXPECT_EQ(resolve_num_splits(64, 8, 1, 264, 128, true, 2), 1);
}

}  // namespace
}  // namespace flashport
