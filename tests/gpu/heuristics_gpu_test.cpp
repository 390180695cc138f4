// The GPU planner's pure pieces (no device needed): tile table invariants, the split-count
// decisions the CUDA backend makes for the benchmark shapes on an H100-sized machine, and the
// work order of calls whose items differ in cost (work_order.hpp).
#include <gtest/gtest.h>

#include "core/heuristics.hpp"
#include "gpu/common/tile_config.hpp"
#include "gpu/common/work_order.hpp"

#include <algorithm>
#include <queue>
#include <vector>

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

// TailOrder visits every (unit, item) exactly once, keeps unit-major order before the tail and
// runs the tail item-major (every tail unit's heaviest item before any second one).
TEST(WorkOrder, TailOrderIsAPermutation) {
  for (int per_unit : {1, 2, 8, 16})
    for (int units : {1, 3, 64, 257})
      for (int tail : {0, 1, 5, units}) {
        if (tail > units) continue;
        const TailOrder order{per_unit, units, tail};
        std::vector<int> seen(size_t(per_unit) * units, 0);
        int last_unit = -1, last_item = -1;
        for (int w = 0; w < per_unit * units; ++w) {
          int unit = -1, item = -1;
          order.at(w, unit, item);
          ASSERT_TRUE(unit >= 0 && unit < units && item >= 0 && item < per_unit) << w;
          ++seen[size_t(unit) * per_unit + item];
          if (unit >= units - tail) {
            EXPECT_GE(item, last_unit >= units - tail ? last_item : 0) << "tail: item-major";
          } else {
            EXPECT_EQ(w, unit * per_unit + item) << "before the tail: unit-major";
          }
          last_unit = unit, last_item = item;
        }
        EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
      }
  EXPECT_EQ(tail_units_for(256, 8, 132, false), 0) << "equal items keep their order";
  EXPECT_EQ(tail_units_for(256, 8, 132, true), 30);  // ceil(2 x 132 / 9)
  EXPECT_EQ(tail_units_for(4, 8, 132, true), 4);     // capped at the units
}

// What the tail is for: list scheduling (free slots take the next item, as the hardware's block
// dispatch and the forward's dynamic walk do) of a causal call's items, unit k's item i costing
// per_unit - i, ends within 2.5% of the ideal time with the tail, at least 1.5 points closer than
// without it.
TEST(WorkOrder, TailShortensCausalSchedules) {
  auto makespan = [](const TailOrder& order, int slots) {
    std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
    for (int s = 0; s < slots; ++s) free_at.push(0.0);
    double end = 0.0, total = 0.0;
    for (int w = 0; w < order.per_unit * order.units; ++w) {
      int unit, item;
      order.at(w, unit, item);
      const double cost = order.per_unit - item + 0.5;  // + a per-item overhead
      const double t = free_at.top() + cost;
      free_at.pop();
      free_at.push(t);
      end = std::max(end, t);
      total += cost;
    }
    return total / slots / end;  // 1: no slot idles before the end
  };
  const int slots = 132;
  for (auto [per_unit, units] : {std::pair{8, 256}, std::pair{16, 256}, std::pair{32, 64}}) {
    SCOPED_TRACE(std::to_string(per_unit) + " items x " + std::to_string(units) + " units");
    const TailOrder plain{per_unit, units, 0};
    const TailOrder tail{per_unit, units, tail_units_for(units, per_unit, slots, true)};
    const double without = makespan(plain, slots), with = makespan(tail, slots);
    EXPECT_GT(with, 0.975);
    EXPECT_GT(with - without, 0.015) << without << " -> " << with;
  }
}

}  // namespace
