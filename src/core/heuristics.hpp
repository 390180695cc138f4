// Launch heuristics as small pure functions (unit-tested in tests/core/heuristics_test.cpp).
#pragma once
#include <cstdint>

namespace flashport {

// Split-KV count for a call with `work_tiles` independent (batch, head, q-block) tiles, each
// walking `key_blocks` key blocks, on `num_processors` SMs / cores / CUs.
// Picks the smallest split count whose wave efficiency is within 85% of the best one reachable
// with at most `max_splits` splits; returns 1 when the tiles already fill the machine. Split
// counts that leave the blocks-per-split unchanged are skipped (they add work but no balance).
inline int choose_num_splits(int64_t work_tiles, int64_t key_blocks, int64_t num_processors,
                             int max_splits) {
  if (work_tiles <= 0 || key_blocks <= 1 || num_processors <= 0 || max_splits <= 1) return 1;
  if (work_tiles * 5 >= num_processors * 4) return 1;  // >= 80% of one full wave already
  if (max_splits > key_blocks) max_splits = static_cast<int>(key_blocks);
  auto efficiency = [&](int s) {
    const double waves = double(work_tiles * s) / double(num_processors);
    return waves / static_cast<double>(static_cast<int64_t>(waves + 0.999999999));
  };
  auto blocks_per_split = [&](int s) { return (key_blocks + s - 1) / s; };
  auto eligible = [&](int s) { return s == 1 || blocks_per_split(s) != blocks_per_split(s - 1); };
  double best = 0.0;
  for (int s = 1; s <= max_splits; ++s)
    if (eligible(s) && efficiency(s) > best) best = efficiency(s);
  for (int s = 1; s <= max_splits; ++s)
    if (eligible(s) && efficiency(s) >= 0.85 * best) return s;
  return 1;
}

// Resolves the caller's num_splits (0 = auto, 1 = off, >= 2 = forced) to a count in
// [1, key_blocks].
inline int resolve_num_splits(int32_t requested, int64_t work_tiles, int64_t key_blocks,
                              int64_t num_processors, int max_splits) {
  int s = requested == 0 ? choose_num_splits(work_tiles, key_blocks, num_processors, max_splits)
                         : requested;
  if (s > key_blocks) s = static_cast<int>(key_blocks < 1 ? 1 : key_blocks);
  return s < 1 ? 1 : s;
}

}  // namespace flashport
