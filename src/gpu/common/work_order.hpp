// The order in which the Hopper forward's work tiles reach the SMs, for calls whose tiles differ
// in cost. Tiles come in units (a head of a sequence, or a split of one), each unit's query blocks
// heaviest first (a causal call's last query blocks). Free SMs take tiles in index order (the
// dynamic walk, like the hardware's block dispatch), so unit-major order ends the call on the last
// units' heavy tiles, taken late and run while the other SMs have nothing left: list scheduling of
// a causal S = 1k call idles about 6% of the SMs' time that way. TailOrder interleaves the last
// `tail_units` units item-major instead (every tail unit's heaviest tile, then every second one,
// ...), so the call ends on light tiles; the units before keep their order, so the tiles in flight
// still share a few units' K/V in L2. Measured: +2-8% on causal calls at S = 1k-4k, S = 16k within
// noise (bench/results/gpu_forward.md, session 27). The backward's launch order in the same form
// measured slower (branch bwd-tail-order).
#pragma once
#include <algorithm>
#include <cstdint>

#include "core/hd.hpp"

namespace flashport::gpu {

struct TailOrder {
  int32_t per_unit = 1;    // items per unit
  int32_t units = 0;
  int32_t tail_units = 0;  // the last units interleaved; 0: plain unit-major order
  // Item index w -> its unit and its rank inside the unit (0: heaviest).
  FP_HD void at(int w, int& unit, int& item) const {
    const int head_items = (units - tail_units) * per_unit;
    if (w < head_items) {
      unit = w / per_unit;
      item = w - unit * per_unit;
    } else {
      const int u = w - head_items;
      item = u / tail_units;
      unit = units - tail_units + (u - item * tail_units);
    }
  }
};

// Tail units for `slots` resident blocks when items differ in cost (uneven): enough that the tail
// holds about one item of its heaviest kind per slot, taking a unit's items to cost 1 .. per_unit
// (a causal triangle: a unit costs (per_unit + 1) / 2 heavy items). Equal items: 0.
inline int32_t tail_units_for(int64_t units, int64_t per_unit, int64_t slots, bool uneven) {
  if (!uneven || units <= 1 || per_unit <= 1) return 0;
  return static_cast<int32_t>(std::min<int64_t>(units, (2 * slots + per_unit) / (per_unit + 1)));
}

}  // namespace flashport::gpu
