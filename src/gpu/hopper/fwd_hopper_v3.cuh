// The Hopper forward kernel: warp-specialised, FA3's structure in our own code.
// Included by fwd_hopper.cu only (sm_90a object).
//
// Block = a producer warpgroup and 2 or 3 consumer warpgroups of 64 query rows (HopperTileV3:
// BM = 128 at D128/D192/D256, 192 at D64 (128 with dropout)), key tiles of HopperTileV3::block_n(D) keys or (D128's
// long unmasked calls, hopper_wide_tile) 160:
//   warpgroup 0, the producer: drops to 40 registers (setmaxnreg; 24 with three consumers or
//     160-key tiles, HopperTileV3::producer_regs; in the paged row-copy instances, kKvRows, its
//     128 threads copy K/V rows with cp.async instead); one thread issues every copy (paged
//     caches with boxes below the key tile: lane q the boxes of the tile's rows [q box, (q + 1)
//     box), inside one page; pools of back-to-back pages: one box across every panel,
//     KvTileLayout's grouped layout)
//     as TMA (cp.async.bulk.tensor, 64-column boxes, 128B swizzle: the panel layout wgmma reads):
//     Q once, then K(t), V(t) for the tiles in consumer order, each into its ring slot once the
//     slot's `empty` mbarrier says both consumers are done with it; the copy engine signals the
//     slot's `full` mbarrier (transaction bytes). Rows past the tensor are zero-filled by TMA;
//     rows past a sequence inside the tensor (varlen) are masked by the softmax (P = 0).
//   warpgroups 1.., the consumers: rise to 232 registers (240 with 160-key tiles, 160 with three);
//     64 query rows each.
//     Per tile t: [my turn] S(t+1) = Q K(t+1)^T and O += P(t) V(t) issued back to back
//     [other's turn]; softmax of S(t+1) runs while the tensor cores do P(t) V(t) (intra-warpgroup
//     overlap) and, with two consumers, while the other warpgroup's GEMMs run (ping-pong through
//     two named barriers). Three consumers (D64) share the tensor cores without turns.
//   K and V have separate rings: K(t) frees as soon as S(t) is done, V(t) after P V(t), so the
//   producer refills each a whole step ahead of its use with 2 slots.
//   Where a block's rows span more than a key tile (D64, D192, D256: kOwnTiles), each consumer
//     computes only the key tiles its own 64 rows see and passes the others (their slots freed
//     once landed, its ping-pong turn handed on at once).
//   Epilogue: each consumer writes its 64 rows of O into its own shared staging tile and stores
//   them as whole 16-byte row chunks (HopperRows::epilogue; coalesced, unlike the accumulator
//   layout's half-sector stores), so the Q buffer frees as before, after the last S.
// Split-KV (a.splits > 1): a work tile is (query block, split, head,
//   sequence); each covers a contiguous range of the sequence's key tiles (HopperRows::
//   clip_to_split) and stores its normalised fp32 partial and LSE in the workspace, every row,
//   empty ranges too (LSE = -inf); the combine kernel merges them. Tiles stay independent.
// Grid: one block per work tile (query block x [split x] head x sequence), or one block per
//   resident slot walking the tiles (hopper_grid in fwd_hopper.hpp): statically (w = blockIdx.x,
//   + gridDim.x, ...) for calls of short, equal tiles, dynamically otherwise (the next tile from a
//   counter in the workspace that block 0 starts, a NonceCounter, taken by the producer and
//   handed to every walking warp through shared memory). The ring and Q-round bookkeeping stays
//   right for any walk, and the producer runs into the next tile while the consumers finish this
//   one.
#pragma once
#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "gpu/common/nonce_counter.cuh"
#include "gpu/common/work_order.hpp"
#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu/hopper/fwd_hopper_rows.cuh"
#include "gpu/hopper/fwd_hopper_tma.cuh"
#include "gpu/hopper/fwd_hopper_wgmma.hpp"
#include "gpu/hopper/hopper_smem.hpp"

namespace flashport::gpu {

// Kernel parameter of v3 (passed by value, __grid_constant__: the tensor maps must live in
// parameter/const space for TMA).
struct HopperV3Params {
  FwdArgs a;
  CUtensorMap tq, tk, tv;  // 4-d (col, row, head, batch) views of q, k, v; paged k/v: (col, row in page, head, page)
  // Work tile w -> (split x head x sequence unit, query block rank): units of ceil(Sq / BM) query
  // blocks, the last tail_units of them interleaved (gpu/common/work_order.hpp).
  TailOrder order;
  int32_t work_tiles = 0;  // query blocks x splits x Hq x B; block i takes tile i first, then walks (tile_walk)
  int32_t kv_box_rows = 0; // rows of one K/V box: the key tile, or the largest run dividing page and tile
  // Paged K/V read as 8-row groups of the whole pool (fwd_hopper.hpp kv_grouped_boxes): tk, tv are
  // 5-d (col, row in group, panel, head, group) and one box spans every panel of its rows; the ring
  // slots then hold the grouped layout (KvTileLayout).
  bool kv_grouped = false;
  // Dynamic persistent grid (hopper_grid in fwd_hopper.hpp): the call's tile walk in the workspace
  // (kernel_args.hpp NonceCounter, started by block 0 with a.call_nonce; no memset before the
  // launch); a block's next work tile is gridDim.x + a take. Null: the static walk w = blockIdx.x,
  // + gridDim.x, ...
  NonceCounter* tile_walk = nullptr;
  // Paged caches with a left pad (fwd_hopper.hpp kv_key_align): key tiles start at the pad rounded
  // down to this many rows (a box); 0: at the first key.
  int32_t kv_key_align = 0;
  // KV-cache calls: cache rows outside a sequence's keys hold whatever the caller left there (NaN
  // too), and P V would turn 0 x NaN into NaN, so producer warp 1 zeroes a V tile's rows outside the
  // keys -- past them in a work tile's first (tail) tile, before a left pad in tile 0
  // (kv_key_align) -- before the consumers read it (v_ready). Rows past the tensor are zero-filled
  // by TMA, and a batched or varlen call's other rows are the caller's finite keys.
  bool zero_v_tail = false;
};

namespace sm90 {

// kDropout: the call has dropout (HopperRows applies it to P and scales O). Its own instance: the
// consumer loop is register-bound, and a second copy of it in one function changed the plain
// loop's allocation (more spills).
// kKvRows: the instance of the irregular paged calls: pages below the key tile that TMA boxes
// cannot tile (fwd_hopper.hpp kv_by_rows), whose K/V rows the producer warpgroup copies with
// cp.async, and left-padded pages on TMA boxes (P.kv_key_align), whose key tiles start before the
// first key. Both keep their cost off the plain instance: the copies need more producer code, and
// the hidden keys of a left pad a runtime k_lo in the consumers' masks (SeqScoreRules::k_lo; in
// the plain instance the constant 0).
// kBlockN: the key tile, HopperTileV3::block_n(D), or kWideBlockN for D128's long unmasked calls
// (fwd_hopper.hpp hopper_wide_tile: plain only).
template <int D, typename Elem, bool kDropout, bool kKvRows, int kBlockN>
__global__ void __launch_bounds__(HopperTileV3::threads(D, kDropout), 1)
    fwd_hopper_v3_kernel(const __grid_constant__ HopperV3Params P) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = HopperTileV3;
  constexpr int BM = T::block_m(D, kDropout), BN = kBlockN, S = T::stages(D);
  constexpr int kConsumers = T::consumers(D, kDropout);
  constexpr bool kPingPong = kConsumers == 2;  // two consumers take turns at the tensor cores
  // Each consumer warpgroup computes only the key tiles its own rows see: where a block's rows
  // span more than one key tile's width (D64's 192 rows over 128 keys, 128 rows over D192's 96 or
  // D256's 64), a causal block's first rows do not see its last tile.
  constexpr bool kOwnTiles = BM > BN;
  constexpr int kPanels = D / 64;
  constexpr bool kBf16 = Elem::kIsBf16;
  constexpr uint32_t kTileBytes = uint32_t(BN) * D * 2;
  constexpr uint32_t kQBytes = uint32_t(BM) * D * 2;
  static_assert((S & (S - 1)) == 0, "ring depth: a power of two");
  static_assert(BN == T::block_n(D) || (D == 128 && BN == T::kWideBlockN && !kKvRows && !kDropout),
                "key tile: the head dim's, or D128's wide tile (no row copies, no dropout)");
  using Rows = HopperRows<BN, D == 64 || D == 256>;  // lazy rescale at D64, D256 (fwd_hopper_rows.cuh)
  const FwdArgs& a = P.a;
  // D128's wide tile runs no KV-cache call (fwd_hopper.hpp hopper_wide_tile): its copy leaves out
  // the cache code (paged boxes, left pads, V zeroing), which would cost its producer spills.
  constexpr bool kCacheCode = BN == T::block_n(D);
  const bool zero_v = kCacheCode && P.zero_v_tail;
  // Key tiles from a rounded-down left pad (kKvRows instance, TMA boxes); else row copies there.
  const int key_align = kKvRows ? P.kv_key_align : 0;
  const bool rows_by_threads = kKvRows && key_align == 0;
  // Paged boxes across panels (5-d maps): the K/V slots hold the grouped layout, which is the
  // panel-major one at one panel.
  const bool grouped = !rows_by_threads && BN == T::block_n(D) && P.kv_grouped;
  const KvTileLayout kv_layout =
      kPanels > 1 && grouped ? KvTileLayout{1024u, uint32_t(kPanels) * 1024u} : panel_major_layout<BN>();

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t sQ = (raw_u32 + 1023u) & ~1023u;  // swizzle atoms (and TMA 128B-swizzle boxes): 1024-byte aligned
  const uint32_t sK = sQ + kQBytes;                // slot s at sK + s * kTileBytes
  const uint32_t sV = sK + S * kTileBytes;
  const uint32_t sO = sV + S * kTileBytes;         // the consumers' output staging tiles, one each
  const uint32_t bars = sO + T::out_stage_bytes(D, kDropout);
  const uint32_t full_q = bars;
  auto full_k = [&](int s) { return bars + 8u * uint32_t(1 + s); };
  auto full_v = [&](int s) { return bars + 8u * uint32_t(1 + S + s); };
  auto empty_k = [&](int s) { return bars + 8u * uint32_t(1 + 2 * S + s); };
  auto empty_v = [&](int s) { return bars + 8u * uint32_t(1 + 3 * S + s); };
  const uint32_t empty_q = bars + 8u * uint32_t(1 + 4 * S);
  // The dynamic walk's hand-over: two slots of tile ids, full (taken) / empty (read by every walker).
  auto tile_full = [&](int s) { return bars + 8u * uint32_t(2 + 4 * S + s); };
  auto tile_empty = [&](int s) { return bars + 8u * uint32_t(4 + 4 * S + s); };
  const uint32_t tile_ids = bars + 8u * uint32_t(6 + 4 * S);
  auto v_ready = [&](int s) { return bars + 8u * uint32_t(7 + 4 * S + s); };  // zero_v: V slot s seen by warp 1

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7;           // 0: producer; 1..kConsumers: consumers
  const int wwarp = (tid >> 5) & 3;
  const int row_loc = (wg > 0 ? (wg - 1) * 64 : 0) + wwarp * 16 + (lane >> 2);
  // Work tile w: query block fastest, then head, then sequence, so the
  // blocks in flight share a few heads' K/V in L2; inside a head the heaviest (causal: last)
  // query blocks first. (Query-block-major order -- each block in flight on its own head --
  // measured 0.61-0.96x of this order on the H100, worst at S = 1k: gpu_hopper_v3.md, run 2.)
  // Split-KV: the split index sits between the query block and the head. Calls of unequal tiles
  // run their last units query block by query block (P.order, work_order.hpp), so they end on
  // light tiles.
  auto decode = [&](int w, int& mb, int& head, int& b, int& split) {
    int hsb, mb_rev;
    P.order.at(w, hsb, mb_rev);
    mb = P.order.per_unit - 1 - mb_rev;  // HopperRows places query block mb in its sequence
    const int hb = hsb / a.splits;
    split = hsb - hb * a.splits;
    head = hb % a.hq;
    b = hb / a.hq;
  };

  if (tid == 0) {
    if (P.tile_walk != nullptr && blockIdx.x == 0) nonce_counter_start(P.tile_walk, a.call_nonce);
    mbar_init(full_q, 1);
    mbar_init(empty_q, 4 * kConsumers);
    // The warps that read the walk's tile ids: every consumer warp and the producer warps that walk
    // besides warp 0 (which takes them): 1-3 copying rows, or warp 1 zeroing V tails.
    const uint32_t walkers = 4 * kConsumers + (rows_by_threads ? 3u : zero_v ? 1u : 0u);
    for (int s = 0; s < 2; ++s) {
      mbar_init(tile_full(s), 1);
      mbar_init(tile_empty(s), walkers);
    }
    const uint32_t kv_arrivals = rows_by_threads ? 128u : 1u;  // the producer's threads, or the TMA issuer
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar_init(full_k(s), kv_arrivals);
      mbar_init(full_v(s), kv_arrivals);
      mbar_init(empty_k(s), 4 * kConsumers);  // one arrival per consumer warp
      mbar_init(empty_v(s), 4 * kConsumers + (zero_v ? 1 : 0));  // + warp 1 (zero_v)
      mbar_init(v_ready(s), 1);
    }
    mbar_init_fence();
  }
  __syncthreads();

  // The block's walk over work tiles: blockIdx.x first; then, on a static grid, + gridDim.x each
  // step; on a dynamic one (P.tile_walk), the tile producer warp 0 takes from the call's counter
  // (lane 0; its first take waits for block 0 to start the walk, and the call's last take ends it:
  // NonceCounter) and hands to every other warp that walks through the two id slots in shared memory
  // (tile_full / tile_empty), so all of them visit the same tiles in the same order. Walk step k
  // (k = 0 for the tile after the first) uses slot k % 2 in round k / 2. The last id handed over
  // is past the tiles: every walker stops on it.
  auto take_next_tile = [&](int w, uint32_t k) -> int {  // warp 0, every lane
    if (P.tile_walk == nullptr) return w + int(gridDim.x);
    int next = 0;
    if (lane == 0) {
      // One take per work tile past the first ones: work_tiles takes in all (each block's last
      // is its id past the tiles).
      next = int(gridDim.x) + nonce_counter_take(P.tile_walk, a.call_nonce, k == 0, P.work_tiles);
      mbar_wait(tile_empty(int(k & 1)), ((k >> 1) & 1) ^ 1);
      st_shared_s32(tile_ids + 4u * (k & 1), next);
      mbar_arrive(tile_full(int(k & 1)));  // release: the id is visible to the waiters
    }
    return __shfl_sync(0xffffffffu, next, 0);
  };
  auto read_next_tile = [&](int w, uint32_t k) -> int {  // the other walkers, every lane of a warp
    if (P.tile_walk == nullptr) return w + int(gridDim.x);
    mbar_wait(tile_full(int(k & 1)), (k >> 1) & 1);
    const int next = ld_shared_s32(tile_ids + 4u * (k & 1));
    __syncwarp();
    if (lane == 0) mbar_arrive(tile_empty(int(k & 1)));
    return next;
  };
  auto next_tile = [&](int w, uint32_t k) { return tid < 32 ? take_next_tile(w, k) : read_next_tile(w, k); };

  // Both roles walk the same work tiles and the same key tiles, so the ring position `it` and the
  // Q round `qr` (work tiles with keys) advance identically on both sides. The producer's roles
  // (the copies, the tail zeroing) visit only the tiles with keys: body(rows, m0, head, b), rows
  // clipped to the tile's split.
  auto for_each_tile_with_keys = [&](auto&& body) {
    uint32_t k = 0;
    for (int w = blockIdx.x; w < P.work_tiles; w = next_tile(w, k++)) {
      int mb, head, b, split;
      decode(w, mb, head, b, split);
      Rows rows(a, b, head, mb, BM, 0, key_align);
      if (rows.empty()) continue;
      rows.clip_to_split(split, a.splits);
      if (rows.n_hi - rows.n_lo <= 0) continue;
      body(rows, rows.m0, head, b);
    }
  };
  // The Q block of a work tile (one thread issues; the caller has waited for the Q buffer).
  auto issue_q = [&](const Rows& rows, int m0, int head, int b) {
    const bool q_packed = a.q_addr.packed;
    const int q_row = q_packed ? int(rows.q_start) + m0 : m0, q_batch = q_packed ? 0 : b;
    mbar_arrive_expect_tx(full_q, kQBytes);
#pragma unroll
    for (int p = 0; p < kPanels; ++p) tma_load_4d(sQ + p * (BM * 128), &P.tq, full_q, p * 64, q_row, head, q_batch);
  };
  if (wg == 0) {
    // ---- producer ----
    regs_dec<T::producer_regs(D, BN, kDropout)>();
    if (rows_by_threads) {
      // Paged K/V with pages below the key tile (or a left pad): the warpgroup's 128 threads copy
      // with cp.async into the 128B-swizzled panels a TMA box would produce (row r, 16-byte chunk
      // c of panel p at p * (BN * 128) + r * 128 + ((c % 8) ^ (r % 8)) * 16). Warp w copies the
      // tile's rows [w * kWarpRows, + kWarpRows). Lane i finds row i's cache offset once per tile
      // (its page id: one load per lane, issued before the slot wait); then each pass shuffles
      // kPassRows rows' offsets to the lanes copying them, adjacent lanes on adjacent chunks of a
      // row, so a warp instruction reads whole 32-byte sectors (512 bytes; 384 at D192). Rows past the keys
      // and chunks past the head dim (padded dims; the candidate wants dims of whole chunks) are
      // zero-filled without a read: no tail zeroing needed.
      constexpr int kRowChunks = D / 8;               // 16-byte chunks per row: 8, 16, 24, 32
      constexpr int kPassRows = 32 / kRowChunks;      // rows per warp instruction: 4, 2, 1, 1
      constexpr int kWarpRows = BN / 4;               // 32, 32, 16, 16
      constexpr int kPasses = kWarpRows / kPassRows;  // 8, 16, 16, 16
      // D192: a row's 24 chunks take lanes 0..23 of a pass; lanes 24..31 copy nothing (their `sub`
      // would name the pass's next row, which is another pass's).
      constexpr int kCopyLanes = kPassRows * kRowChunks;
      // Pass j copies rows j * kPassRows + sub of the warp's part; warp parts start at multiples
      // of 8 rows and sub < kPassRows, so the row's swizzle term is sub ^ (j * kPassRows % 8):
      // kPatterns values. Passes run pattern by pattern, one destination register each.
      constexpr int kPatterns = 8 / kPassRows;
      const int chunk = lane % kRowChunks, sub = lane / kRowChunks;
      const int warp_row0 = wwarp * kWarpRows;
      const uint32_t lane_dst =
          uint32_t((chunk / 8) * (BN * 128) + (warp_row0 + sub) * 128 + (((chunk % 8) ^ sub) << 4));
      const bool k_chunk = chunk * 8 < a.d, v_chunk = chunk * 8 < a.dv;
      const bool lane_copies = kCopyLanes == 32 || lane < kCopyLanes;
      // A row past the keys: zero-filled. Row byte offsets are multiples of 16 (16-byte strides),
      // so the odd marker is told apart by its low bit, and masking that bit leaves an address
      // inside the tensor (its first row) for the copy that does not read it.
      constexpr int64_t kNoRow = 1;
      // One K or V tile's part of this warp into a slot; row_off: this lane's row's byte offset.
      auto copy_rows = [&](uint32_t slot, const uint16_t* base, int64_t row_off, bool chunk_ok) {
        const uint32_t slot_lane = slot + lane_dst;  // slot: 1024-byte aligned, so the XOR below only swizzles
        const char* col_base = reinterpret_cast<const char*>(base + (chunk_ok ? chunk * 8 : 0));
#pragma unroll
        for (int x = 0; x < kPatterns; ++x) {
          const uint32_t dst = (slot_lane ^ uint32_t((x * kPassRows) << 4)) + uint32_t(x * kPassRows * 128);
#pragma unroll
          for (int y = 0; y < kPasses / kPatterns; ++y) {
            const int64_t off = __shfl_sync(0xffffffffu, row_off, (x + y * kPatterns) * kPassRows + sub);
            const bool row_ok = (uint32_t(off) & uint32_t(kNoRow)) == 0;
            if (lane_copies)
              cp_async_16_or_zeros(dst + uint32_t(y * 1024), col_base + (off & ~kNoRow), chunk_ok && row_ok);
          }
        }
      };
      if (tid == 0) tma_prefetch_desc(&P.tq);
      uint32_t it = 0, qr = 0;
      for_each_tile_with_keys([&](const Rows& rows, int m0, int head, int b) {
        // Q first (once the previous work tile's last S is done), so m0/head need no register past
        // this point.
        if (tid == 0) {
          mbar_wait(empty_q, (qr & 1) ^ 1);
          issue_q(rows, m0, head, b);
        }
        ++qr;
        const uint32_t kvh = uint32_t(head / a.group);
        const int32_t* pages = a.seq.block_table + int64_t(b) * a.seq.block_table_stride;
        const int pad = int(a.seq.k_pad(b));
        for (int nb = rows.n_hi - 1; nb >= rows.n_lo; --nb, ++it) {
          const int s = int(it & (S - 1));
          const uint32_t free_parity = ((it / S) & 1) ^ 1;
          // This lane's row: key nb * BN + row of the sequence, cache row pad + that.
          const int row = warp_row0 + lane;
          int64_t k_off = kNoRow, v_off = kNoRow;
          if (lane < kWarpRows && nb * BN + row < rows.lk) {
            const uint32_t cache_row = uint32_t(pad + nb * BN + row), page_size = uint32_t(a.seq.page_size);
            const uint32_t page_idx = cache_row / page_size;
            const int id = pages[page_idx];
            // Page ids are never trusted to fault: clamped into the cache.
            const uint32_t page = uint32_t(clamp_page_id(id, int(a.num_pages)));
            const uint32_t in_page = cache_row - page_idx * page_size;
            k_off = 2 * int64_t(uint64_t(page) * uint64_t(a.k_addr.s0) + uint64_t(in_page) * uint64_t(a.k_addr.s1) +
                                uint64_t(kvh) * uint64_t(a.k_addr.s2));
            v_off = 2 * int64_t(uint64_t(page) * uint64_t(a.v_addr.s0) + uint64_t(in_page) * uint64_t(a.v_addr.s1) +
                                uint64_t(kvh) * uint64_t(a.v_addr.s2));
          }
          mbar_wait(empty_k(s), free_parity);
          copy_rows(sK + s * kTileBytes, a.k, k_off, k_chunk);
          cp_async_arrive(full_k(s));  // arrives when this thread's copies have landed; no wait here
          mbar_wait(empty_v(s), free_parity);
          copy_rows(sV + s * kTileBytes, a.v, v_off, v_chunk);
          cp_async_arrive(full_v(s));
        }
      });
    } else if (tid < 32) {
      // Warp 0: lane 0 issues every copy; paged, lane q reads and copies the tile's page q.
      if (lane == 0) {
        tma_prefetch_desc(&P.tq);
        tma_prefetch_desc(&P.tk);
        tma_prefetch_desc(&P.tv);
      }
      uint32_t it = 0, qr = 0;
      for_each_tile_with_keys([&](const Rows& rows, int m0, int head, int b) {
        const int n_hi = rows.n_hi, count = n_hi - rows.n_lo;
        const int kvh = head / a.group;
        // Q after the first K: the Q buffer frees when the previous work tile's last S is done.
        auto load_q = [&] {
          mbar_wait(empty_q, (qr & 1) ^ 1);
          if (lane == 0) issue_q(rows, m0, head, b);
          ++qr;
        };
        // Key j of the sequence: packed, row k_start + j; batched or a contiguous cache, row
        // k_pad + j of cache entry cache_batch_idx[b] (or b); paged, cache row r = kv_row0 + j
        // (the left pad less the keys rows.rules.k_lo that the tiles start early: kv_key_align)
        // is row r % page of page block_table[b][r / page], one box per page when pages are
        // smaller than the key tile. Two copies of the loop (paged or not) keep the producer's 24
        // registers enough.
        auto produce = [&](auto paged_tag) {
          constexpr bool kPaged = decltype(paged_tag)::value;
          int kv_row0 = 0, kv_batch = 0;
          const int32_t* pages = nullptr;
          if constexpr (kPaged) {
            pages = a.seq.block_table + int64_t(b) * a.seq.block_table_stride;
            kv_row0 = rows.key_row0;
          } else {
            const bool packed = a.k_addr.layout == KvLayout::Packed;
            kv_row0 = packed ? int(a.seq.k_start(b)) : int(a.seq.k_pad(b));
            kv_batch = packed ? 0 : a.seq.cache_batch_idx != nullptr ? int(a.seq.cache_batch_idx[b]) : b;
          }
          // One K or V tile (keys key0 .. key0 + BN) into a ring slot, completing on `bar`. Paged:
          // only the boxes holding keys of the sequence (the block table ends there); lane q
          // holds the page of box q and issues that box's copies itself. No warp-wide step
          // between one lane's copies and the next: with the page ids handed to lane 0 by
          // shuffles, one shuffle placed after a copy cost 16-18% of the call at 128/256-row pages
          // (bench/results/gpu_coverage.md, session 15). The transaction count may run ahead of the expectation
          // (lane 0's arrival): the phase cannot complete before that arrival.
          auto load_kv = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar, int key0, int boxes, int my_page) {
            if constexpr (!kPaged) {
              if (lane == 0) {
                mbar_arrive_expect_tx(bar, kTileBytes);
#pragma unroll
                for (int p = 0; p < kPanels; ++p)
                  tma_load_4d(dst + p * (BN * 128), map, bar, p * 64, kv_row0 + key0, kvh, kv_batch);
              }
            } else {
              const int box = P.kv_box_rows;
              if (lane == 0) mbar_arrive_expect_tx(bar, uint32_t(boxes * box) * 128u * kPanels);
              if (lane < boxes) {
                const int in_page = (kv_row0 + key0 + lane * box) % int(a.seq.page_size);
                if (grouped) {  // one box: the box's 8-row groups, each with every panel
                  const int group = my_page * int(a.seq.page_size >> 3) + (in_page >> 3);
                  tma_load_5d(dst + uint32_t(lane * box) * 128u * kPanels, map, bar, 0, 0, 0, kvh, group);
                } else {
#pragma unroll
                  for (int p = 0; p < kPanels; ++p)
                    tma_load_4d(dst + p * (BN * 128) + lane * box * 128, map, bar, p * 64, in_page, kvh, my_page);
                }
              }
            }
          };
          // Tile t: K(t) [then Q, for t = 0], V(t), each once its slot is free. Paged: the
          // tile's page ids are read (one per lane, in parallel) before the waits.
          auto load_tile = [&](int t, bool with_q) {
            const int s = int(it & (S - 1));
            const uint32_t free_parity = ((it / S) & 1) ^ 1;  // the round before this one (fresh: done)
            const int key0 = (n_hi - 1 - t) * BN;
            int boxes = 0, my_page = 0;
            if constexpr (kPaged) {
              const int box = P.kv_box_rows;
              boxes = min(BN / box, (rows.lk - key0 + box - 1) / box);
              if (lane < boxes)
                my_page = clamp_page_id(pages[(kv_row0 + key0 + lane * box) / int(a.seq.page_size)], int(a.num_pages));
            }
            mbar_wait(empty_k(s), free_parity);
            load_kv(sK + s * kTileBytes, &P.tk, full_k(s), key0, boxes, my_page);
            if (with_q) load_q();
            mbar_wait(empty_v(s), free_parity);
            load_kv(sV + s * kTileBytes, &P.tv, full_v(s), key0, boxes, my_page);
            ++it;
          };
          load_tile(0, true);
          for (int t = 1; t < count; ++t) load_tile(t, false);
        };
        if (kCacheCode && a.k_addr.layout == KvLayout::Paged) produce(std::true_type{});
        else produce(std::false_type{});
      });
    } else if (tid >= 32 && tid < 64 && zero_v) {
      // Warp 1 sees every V tile in ring order: once landed (full_v), its rows outside the keys
      // [k_lo, lk) are zeroed -- past them in a work tile's first (highest) tile, before a left
      // pad in tile 0 -- and it arrives on v_ready, which the consumers wait for on those tiles
      // only, and on empty_v, so the producer cannot refill a slot before this warp has seen it.
      // Each wait is then within one phase of its barrier (waiting only on the tiles it zeroes,
      // this warp could run two rounds ahead of a slot, where a parity wait returns at once).
      // Whole 128-byte rows: the swizzle permutes chunks within a row.
      uint32_t it = 0;
      for_each_tile_with_keys([&](const Rows& rows, int, int, int) {
        for (int nb = rows.n_hi - 1; nb >= rows.n_lo; --nb, ++it) {  // the consumers' order
          const int s = int(it & (S - 1));
          mbar_wait(full_v(s), (it / S) & 1);
          if (rows.tile_has_rows_outside_keys(nb)) {
            const int lo = rows.rules.k_lo - nb * BN, hi = rows.lk - nb * BN;  // the tile's key rows
            auto zero_rows = [&](int r0, int r1) {  // 16-byte chunks of rows [r0, r1) of each panel
              for (int p = 0; p < kPanels; ++p)
                for (int c = lane; c < (r1 - r0) * 8; c += 32)
                  st_shared_zero16(sV + s * kTileBytes + kv_layout.offset(r0 + (c >> 3), p) + uint32_t(c & 7) * 16u);
            };
            if (lo > 0) zero_rows(0, lo);
            if (hi < BN) zero_rows(hi, BN);
            fence_proxy_async();  // generic-proxy stores -> the consumers' wgmma reads (async proxy)
          }
          __syncwarp();
          if (lane == 0) {
            mbar_arrive(v_ready(s));
            mbar_arrive(empty_v(s));
          }
        }
      });
    }
  } else {
    // ---- consumers ----
    regs_inc<T::consumer_regs(D, BN, kDropout)>();
    // kOwnTiles: broadcast from lane 0, so the compiler knows the warpgroup index is warp-uniform,
    // and so is everything derived from it (each warpgroup's own key range moves the ring position
    // `it`, which must stay in uniform registers: held per thread, it cost the D64 loop 18 spilled
    // words). The other instances keep their code: D128 with the broadcast and the first arrive
    // below moved ran its causal calls 2-3% slower on the H200 (both A/B orders).
    const int cwg = kOwnTiles ? __shfl_sync(0xffffffffu, wg - 1, 0) : wg - 1;
    const int my_bar = 1 + cwg, other_bar = 2 - cwg;
    auto my_turn = [&] {
      if constexpr (kPingPong) named_sync<256>(my_bar);
    };
    auto your_turn = [&] {
      if constexpr (kPingPong) named_arrive<256>(other_bar);
    };
    // Every thread of the warp has passed its wgmma wait: the warp's reads of the buffer are done.
    auto release = [&](uint32_t bar) {
      __syncwarp();
      if (lane == 0) mbar_arrive(bar);
    };
    uint32_t it = 0, qr = 0, k = 0;
    for (int w = blockIdx.x; w < P.work_tiles; w = read_next_tile(w, k++)) {
      int mb, head, b, split;
      decode(w, mb, head, b, split);
      Rows rows(a, b, head, mb, BM, row_loc, key_align);
      if (rows.empty()) continue;
      rows.clip_to_split(split, a.splits);
      // This warpgroup's own key tiles: those some of its 64 rows see (kOwnTiles); it passes the
      // block's others, `lead` above them and `trail` below. With 64-key tiles under 128-row
      // blocks (D256; D192's 96) a causal block's last tile is hidden from its first 64 rows, as
      // with D64's 192 rows over 128-key tiles (9 of 81 tiles at S = 1k). The mask test narrows
      // to the warpgroup's rows too. D128 (blocks of whole key tiles) keeps the block's range.
      const int block_tiles = rows.n_hi - rows.n_lo;
      int lead = 0, trail = 0;
      if constexpr (kOwnTiles) rows.narrow_to_rows(cwg * 64, 64, lead, trail);
      const int n_hi = rows.n_hi, count = n_hi - rows.n_lo;
      // A ping-pong turn without GEMMs, handed on at once; `final_turn`: the work tile's last,
      // where consumer 1 arrives on nothing.
      auto turn_without_gemms = [&](bool final_turn) {
        my_turn();
        if (!(cwg == 1 && final_turn)) your_turn();
      };
      // A tile this warpgroup passes: its turn, then its slots freed once landed (the wait keeps
      // each arrival in its barrier's phase).
      auto pass_tile = [&](bool final_turn) {
        turn_without_gemms(final_turn);
        const int slot = int(it & (S - 1));
        const uint32_t round = (it / S) & 1;
        mbar_wait(full_k(slot), round);
        release(empty_k(slot));
        mbar_wait(full_v(slot), round);
        release(empty_v(slot));
        ++it;
      };
      // Ping-pong, per work tile: consumer c waits on named barrier 1 + c (its turn at the tensor
      // cores) and, once its GEMMs are issued, arrives on the other's. Consumer 0 goes first. Both
      // take block_tiles + 1 turns (count + 1 with GEMMs, one per passed tile, one more without
      // GEMMs when count = 0); consumer 1 skips its last arrive, so every barrier generation of
      // the tile completes inside it.
      if (kOwnTiles && kPingPong && cwg == 1 && block_tiles > 0) named_arrive<256>(1);
      for (int i = 0; i < lead; ++i) pass_tile(false);
      if (kOwnTiles && block_tiles > 0 && count <= 0) {  // no row sees a key of the block's range
        turn_without_gemms(trail == 0);
        mbar_wait(full_q, qr & 1);
        release(empty_q);
        ++qr;
      }
      // KV-cache calls: the tiles with V rows outside the keys are read once warp 1 has zeroed
      // those rows. Only the first tile (rows past the keys) and the last (before a left pad) can.
      // Every tile waits for full_v first: its completion for round r needs warp 1's arrivals of
      // round r - 1 (empty_v), so a v_ready wait after it is within one phase. Then the zeroed
      // tiles wait for v_ready: behind a branch, except in the dropout instances, where the
      // second wait takes a selected barrier (v_ready, or full_v again: already complete). The
      // branch made ptxas schedule the D64 dropout loop's Philox calls apart from the softmax's
      // exponentials instead of interleaved with them (9-18% slower), and the selected barrier's
      // extra wait made the plain D128 128-key instance 1-4% slower and the KV-cache calls 1-3%
      // (both A/B orders: bench/results/gpu_dropout.md and gpu_forward.md, sessions 29-30).
      const bool zero_first = zero_v && rows.tile_has_rows_outside_keys(n_hi - 1);
      const bool zero_last = zero_v && rows.tile_has_rows_outside_keys(rows.n_lo);
      auto wait_v = [&](int slot, uint32_t round, bool zeroed) {
        mbar_wait(full_v(slot), round & 1);
        if constexpr (kCacheCode && kDropout) mbar_wait(zeroed ? v_ready(slot) : full_v(slot), round & 1);
        else if (zeroed) mbar_wait(v_ready(slot), round & 1);
      };
      float o_acc[kPanels][32];
#pragma unroll
      for (int p = 0; p < kPanels; ++p)
#pragma unroll
        for (int e = 0; e < 32; ++e) o_acc[p][e] = 0.0f;

      if (count > 0) {
        if (!kOwnTiles && kPingPong && cwg == 1) named_arrive<256>(1);  // the first turn's, as above
        auto issue_s = [&](float (&s)[BN / 2], int slot) {
          issue_qk<D, BM, BN, kBf16>(s, sQ + cwg * (64 * 128), sK + slot * kTileBytes, kv_layout);
        };
        auto issue_pv = [&](const uint32_t (&pa)[BN / 16][4], int slot) {
          sm90::issue_pv<BN, kPanels, kBf16>(o_acc, pa, sV + slot * kTileBytes, kv_layout);
        };

        float s[BN / 2];
        float corr[2];
        uint32_t pa[BN / 16][4];
        {
          const int slot = int(it & (S - 1));
          mbar_wait(full_q, qr & 1);
          mbar_wait(full_k(slot), (it / S) & 1);
          my_turn();
          wg_fence();
          issue_s(s, slot);
          your_turn();
          wg_wait<0>();
          fence_regs(s);
          release(empty_k(slot));
        }
        rows.template softmax<kDropout>(s, n_hi - 1, corr);  // O is zero: no rescale
        Rows::template pack_p<Elem>(s, pa);
        if constexpr (kDropout) rows.drop_packed(pa);
        // Steps with a next tile: one fixed wgmma group structure (ptxas keeps the products
        // asynchronous only then); the last step is peeled.
        for (int t = 0; t + 1 < count; ++t, ++it) {
          const int slot = int(it & (S - 1)), next = int((it + 1) & (S - 1));
          mbar_wait(full_k(next), ((it + 1) / S) & 1);
          wait_v(slot, it / S, t == 0 && zero_first);
          my_turn();
          wg_fence();
          issue_s(s, next);
          issue_pv(pa, slot);
          your_turn();
          wg_wait<1>();  // S(t+1) done; P V(t) may still run
          fence_regs(s);
          release(empty_k(next));
          rows.template softmax<kDropout>(s, n_hi - 2 - t, corr);
          wg_wait<0>();  // P V(t) done
#pragma unroll
          for (int p = 0; p < kPanels; ++p) fence_regs(o_acc[p]);
          release(empty_v(slot));
          Rows::rescale_o(o_acc, corr);
          Rows::template pack_p<Elem>(s, pa);
          if constexpr (kDropout) rows.drop_packed(pa);
        }
        release(empty_q);  // every S of this work tile is done: the producer may load the next Q
        const int slot = int(it & (S - 1));
        wait_v(slot, it / S, zero_last);  // count 1: the first tile is the last
        my_turn();
        wg_fence();
        issue_pv(pa, slot);
        if (kPingPong && (cwg == 0 || trail > 0)) named_arrive<256>(other_bar);
        wg_wait<0>();
#pragma unroll
        for (int p = 0; p < kPanels; ++p) fence_regs(o_acc[p]);
        release(empty_v(slot));
        ++it;
        ++qr;
      }
      for (int i = 0; i < trail; ++i) pass_tile(i + 1 == trail);
      // Named barriers 3.. (1 and 2 are the ping-pong turns): one per consumer's staging tile.
      const sm90::OutStage stage{sO + uint32_t(cwg) * uint32_t(T::out_stage_bytes(D, kDropout) / kConsumers), 3 + cwg};
      rows.template epilogue<Elem, kPanels, kDropout>(o_acc, split, stage);
    }
  }
#else
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    printf("flashport: the Hopper forward kernel needs sm_90a\n");
  __trap();
#endif
}

}  // namespace sm90
}  // namespace flashport::gpu
