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

// Split-KV count for memory-bound decode blocks: as many splits as one wave of `slots` (SMs x
// resident blocks) holds, so every SM streams keys until the end (a second, partial wave would be a
// tail); then the smallest count with the same keys per split (more splits would add partials to
// merge, no balance). Returns 1 when the tiles fill 80% of a wave. `min_tiles_per_split`: a kernel
// that keeps that many key tiles in flight per block (the decode kernel's cp.async ring: 2) gains
// no bytes in flight from shorter splits, only partials to merge, so splits are capped at
// key_blocks / min_tiles_per_split. Measured on an H200 (bench/results/gpu_decode_variants_v1.md):
// a full wave beats the count choose_num_splits picks (B=1, 64k keys: 32 splits 77 us, its 28
// splits 83 us).
inline int choose_decode_splits(int64_t work_tiles, int64_t key_blocks, int64_t slots, int max_splits,
                                int64_t min_tiles_per_split = 1) {
  if (work_tiles <= 0 || key_blocks <= 1 || slots <= 0 || max_splits <= 1) return 1;
  if (work_tiles * 5 >= slots * 4) return 1;
  int64_t s = slots / work_tiles;
  if (min_tiles_per_split > 1 && s > key_blocks / min_tiles_per_split) s = key_blocks / min_tiles_per_split;
  if (s > max_splits) s = max_splits;
  if (s > key_blocks) s = key_blocks;
  auto blocks_per_split = [&](int64_t c) { return (key_blocks + c - 1) / c; };
  while (s > 1 && blocks_per_split(s - 1) == blocks_per_split(s)) --s;
  return static_cast<int>(s < 1 ? 1 : s);
}

// Resolves the caller's num_splits (0 = auto, 1 = off, >= 2 = forced) to a count in
// [1, key_blocks]; decode: choose_decode_splits's rule (with its min_tiles_per_split).
inline int resolve_num_splits(int32_t requested, int64_t work_tiles, int64_t key_blocks,
                              int64_t num_processors, int max_splits, bool decode = false,
                              int64_t min_tiles_per_split = 1) {
  int s = requested != 0 ? requested
          : decode       ? choose_decode_splits(work_tiles, key_blocks, num_processors, max_splits, min_tiles_per_split)
                         : choose_num_splits(work_tiles, key_blocks, num_processors, max_splits);
  if (s > key_blocks) s = static_cast<int>(key_blocks < 1 ? 1 : key_blocks);
  return s < 1 ? 1 : s;
}

}  // namespace flashport
