// Hopper (sm_90a) forward prefill: host-side interface and capability check, a peer of the
// mma.sync forward in cuda_backend.cu's planner. The kernel (fwd_hopper.cu, warp-specialised:
// fwd_hopper_v3.cuh) is compiled only when 90 is among CMAKE_CUDA_ARCHITECTURES
// (FLASHPORT_WITH_HOPPER_FWD).
//
// Scope (everything else is declined here, never ignored): fp16/bf16, head dims D, Dv <= 256 (any
// pair: instances for 64, 128, 192, 256, smaller dims padded inside the kernel; 16-byte strides),
// batched or varlen (packed) q/k/v with 16-byte aligned rows and strides, causal (both
// alignments), sliding windows, GQA/MQA, LSE, softcap, ALiBi, sinks; split-KV (partials in the
// workspace, then the combine kernel; hopper_fwd_candidate picks the count); KV caches:
// contiguous (seqused_k, cache_batch_idx, cache_leftpad) and paged with any page size (TMA boxes
// of the largest run of rows dividing both the page and the key tile, kv_page_box_rows, where it
// is 16 rows or more, 8 at D128 in pools of back-to-back pages, each box issued by one lane, one
// box across every panel in such pools (kv_grouped_boxes); a left pad: key tiles start at the pad
// rounded down to a box (kv_key_align); other pages: coalesced cp.async row copies by the
// producer warpgroup, kv_by_rows, head dims of multiples of 8; with dropout, 8-row runs keep
// their boxes too without a left pad, and the rest is declined), append and rotary (the
// pre-pass writes the cache rows and the rotated q, which the kernel reads from the workspace),
// varlen queries over a cache (chunked prefill), dropout (core/philox.hpp's keep mask, the
// words shared between lanes: common/dropout_lanes.cuh; split-KV too). Key tiles: HopperTileV3::block_n,
// and 160 keys for D128's long unmasked calls without dropout (hopper_wide_tile; plan name `_m128n160_`).
// Declined: decode-shaped calls (the mma.sync decode tile packs GQA heads), head dims
// above 256, unaligned tensors, devices other than sm_90, FLASHPORT_HOPPER_FWD=0 (the user's kill
// switch, core/config.hpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>

#include "core/config.hpp"
#include "core/heuristics.hpp"
#include "core/problem.hpp"
#include "gpu/common/fwd_plan.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/mma/fwd_launch.hpp"

namespace flashport::gpu {

// Tile of the Hopper forward (warp-specialised): one producer warpgroup (one TMA-issuing thread,
// 40 or 24 registers, producer_regs) and consumer warpgroups of 64 query rows each. K and V have their own stages(d)-deep
// rings and mbarriers (full: TMA landed; empty: every consumer done reading).
// D64: three consumers (BM = 192, 160 registers each): a 64-wide head dim gives each key tile
// little tensor-core work per softmax, so a third warpgroup keeps the tensor cores fed where
// two ping-ponging ones leave them idle (FlashAttention-3 picks 192 rows at D64 too). Not with
// dropout: its softmax is issue-bound (the Philox calls), and two ping-pong consumers at 232
// registers let one warpgroup's softmax run in the shadow of the other's GEMMs as at D128, where
// three at 160 spill 184 bytes (the `dropout` argument below; the D64 dropout instance: +4-12%
// over three consumers on the H200, gpu_forward.md run 5).
// D128, D192, D256: two consumers (BM = 128, 232 registers; 240 with 160-key tiles) taking turns at the tensor cores (ping-pong).
struct HopperTileV3 {
  static constexpr int consumers(int d, bool dropout = false) { return d == 64 && !dropout ? 3 : 2; }
  static constexpr int block_m(int d, bool dropout = false) { return 64 * consumers(d, dropout); }
  static constexpr int threads(int d, bool dropout = false) { return 128 * (consumers(d, dropout) + 1); }
  // K/V ring depth: 4 at D64 (16 KB tiles; +3-5% at S >= 4k over 2 on the H100), 2 otherwise (the
  // 32 KB D128 / D256 and 24 KB D192 tiles leave no room for more next to Q).
  static constexpr int stages(int d) { return d == 64 ? 4 : 2; }
  // The producer gives back what the consumers take: launch registers 65536 / threads
  // (168 or 128). Two consumers with key tiles up to 128: producer 40, consumers 232
  // (2 x 64 <= 128); at 24 the producer's per-tile loops spilled 68 bytes (TMA issuer) and the
  // row copies' addresses more, and the consumers do not spill at 232. The 160-key tile needs the
  // consumers' 240 (28 bytes of spills at 232): producer 24. Three consumers (D64) keep 160 (152
  // bytes of spills in their softmax below that), so their producer stays at 24 (3 x 32 <= 104).
  static constexpr int producer_regs(int d, int block_n, bool dropout = false) {
    return consumers(d, dropout) == 2 && block_n <= 128 ? 40 : 24;
  }
  static constexpr int consumer_regs(int d, int block_n, bool dropout = false) {
    return consumers(d, dropout) == 3 ? 160 : block_n <= 128 ? 232 : 240;
  }
  // Key tile: 128 up to D128; 96 at D192 (230,536 bytes: the most that fits next to Q and the O
  // staging), 64 at D256. With 96, pages of 64, 128, 256 rows do not tile a key tile with TMA boxes:
  // row copies (dropout: declined, the mma.sync kernel runs them).
  static constexpr int block_n(int d) { return d == 192 ? 96 : d == 256 ? 64 : 128; }
  // D128's long unmasked calls (hopper_wide_tile): 160-key tiles, 25% more tensor work per softmax
  // and barrier round (FlashAttention-3 takes 176 at D128 without a causal mask). The S tile is 80
  // fp32 registers, P 40, O 64: under the consumers' 240. Keys from kWideMinKeys: a partial last
  // tile wastes at most 159 keys' work: under 8.3% from 1920 keys (12 tiles of 160, 15 of 128);
  // the A/B on the H100 decides the bound.
  static constexpr int kWideBlockN = 160;
  static constexpr int kWideMinKeys = 1920;
  // full/empty Q, full/empty x K/V x stages, the dynamic walk's two tile-id slots (full/empty
  // each, and the ids: 8 bytes), and `v_ready` x stages (KV-cache calls: a V tile's rows outside
  // the keys are zeroed before P V reads them).
  static constexpr int barrier_bytes(int d) { return 8 * (7 + 5 * stages(d)); }
  // O leaves through shared memory (HopperRows::epilogue): each consumer warpgroup stages its 64
  // rows, kOutStageRowBytes per row and pass (16-bit O: one pass up to D128, three of 64 columns at
  // D192, two at D256; fp32 split-KV partials: one pass per 64 columns). 16 KB per consumer fits next
  // to every ring: D64 206,040 bytes, D128 197,768 (160-key tile 230,536), D192 230,536, D256 230,536
  // of the 232,448 an H100 block may opt in to.
  static constexpr int kOutStageRowBytes = 256;
  static constexpr int out_stage_bytes(int d, bool dropout = false) {
    return consumers(d, dropout) * 64 * kOutStageRowBytes;
  }
  // Key tile bn (D128's wide tile: 230,536 bytes).
  static constexpr int smem_bytes(int d, int bn, bool dropout = false) {
    return (block_m(d, dropout) + 2 * stages(d) * bn) * d * 2 + out_stage_bytes(d, dropout) + 1024 +
           barrier_bytes(d);
  }
  static constexpr int smem_bytes(int d) { return smem_bytes(d, block_n(d)); }
};

// The kernel instance (head-dim bucket) of a call: the smallest of 64, 128, 192, 256 holding both
// head dims (192/128, DeepSeek-V3's prefill, runs the 192 instance). Smaller dims run padded inside
// the kernel: TMA zero-fills the columns past D (and Dv), so the padded products are exact, and the
// epilogue stores the Dv columns only. The backward has no 192 instance (hopper_bwd_head_bucket).
inline int hopper_head_bucket(const Problem& p) {
  const int64_t m = std::max(p.d, p.dv);
  return m <= 64 ? 64 : m <= 128 ? 128 : m <= 192 ? 192 : 256;
}

#if defined(FLASHPORT_WITH_HOPPER_FWD)
template <int D, bool kBf16>
KernelInfo hopper_fwd_kernel_info(int device);
// The launch of a call the candidate accepted: a.splits work tiles per (query block, head,
// sequence); with a.splits > 1 the partials land in a.ws_o / a.ws_lse and the caller launches
// the combine after it. Encodes the kernel's three TMA maps (q, k, v) from the call.
template <int D, bool kBf16>
// walk: the dynamic walk's state in the workspace (any contents; a.call_nonce tags it), or null.
gpuError_t launch_hopper_fwd(const Problem& p, const FwdArgs& a, int grid, NonceCounter* walk, gpuStream_t stream);
// Empty when cuTensorMapEncodeTiled accepts the q/k/v views of the call (the rules it documents,
// checked without encoding); otherwise why not.
std::string hopper_tma_reason(const Problem& p, int splits);

inline KernelInfo hopper_info_for(int d, bool bf16, int dev) {
  switch (d) {
    case 64: return bf16 ? hopper_fwd_kernel_info<64, true>(dev) : hopper_fwd_kernel_info<64, false>(dev);
    case 128: return bf16 ? hopper_fwd_kernel_info<128, true>(dev) : hopper_fwd_kernel_info<128, false>(dev);
    case 192: return bf16 ? hopper_fwd_kernel_info<192, true>(dev) : hopper_fwd_kernel_info<192, false>(dev);
    default: return bf16 ? hopper_fwd_kernel_info<256, true>(dev) : hopper_fwd_kernel_info<256, false>(dev);
  }
}
// grid: the plan's persistent block count (hopper_grid), 0 for one block per work tile; c: the
// dynamic walk's state or null.
inline gpuError_t hopper_launch(const Problem& p, const FwdArgs& a, int grid, NonceCounter* c, gpuStream_t s) {
  const bool bf16 = p.dtype == FP_BF16;
  switch (hopper_head_bucket(p)) {
    case 64: return bf16 ? launch_hopper_fwd<64, true>(p, a, grid, c, s) : launch_hopper_fwd<64, false>(p, a, grid, c, s);
    case 128: return bf16 ? launch_hopper_fwd<128, true>(p, a, grid, c, s) : launch_hopper_fwd<128, false>(p, a, grid, c, s);
    case 192: return bf16 ? launch_hopper_fwd<192, true>(p, a, grid, c, s) : launch_hopper_fwd<192, false>(p, a, grid, c, s);
    default: return bf16 ? launch_hopper_fwd<256, true>(p, a, grid, c, s) : launch_hopper_fwd<256, false>(p, a, grid, c, s);
  }
}
#endif

// The head dims of a call run padded inside its instance (the forward's bucket, or the one given),
// as the Hopper plans' names show them (":d96_dv96"); empty when the call's dims are the instance's.
struct HopperDimsTag {
  char text[32] = "";
  explicit HopperDimsTag(const Problem& p) : HopperDimsTag(p, hopper_head_bucket(p)) {}
  HopperDimsTag(const Problem& p, int bucket) {
    if (p.d != bucket || p.dv != bucket) std::snprintf(text, sizeof(text), ":d%d_dv%d", int(p.d), int(p.dv));
  }
};

// D128 calls of equal-cost work tiles with at least kWideMinKeys keys run 160-key tiles (their own
// instance); varlen is left out because the plan sees only the longest sequence (short ones would
// waste partial tiles), and dropout because its issue-bound softmax (the Philox calls) loses more
// on the wide tile's register pressure than the tile saves: on the H200 the 160-key dropout kernel
// ran at 0.48 of the featureless call, the 128-key one at 0.63 (gpu_dropout.md).
inline bool hopper_wide_tile(const Problem& p) {
  return hopper_head_bucket(p) == 128 && equal_cost_tiles(p) && !p.rules.has_dropout() &&
         p.seq.sk >= HopperTileV3::kWideMinKeys;
}
// The call's key tile: the wide one, else its head dim's.
inline int hopper_block_n(const Problem& p) {
  return hopper_wide_tile(p) ? HopperTileV3::kWideBlockN : HopperTileV3::block_n(hopper_head_bucket(p));
}

// A paged pool the K/V maps can read as one run of 8-row groups: its pages lie back to back (a
// [pages, page_size, heads, D] tensor: page stride = page_size x row stride, for k and v) and the
// head dims fill whole 64-column panels, more than one (fwd_hopper.cu make_v3_maps). Then one box
// brings a page's (or a tile's) rows with every panel, landing as the grouped KvTileLayout,
// instead of one box per panel.
inline bool kv_pool_in_groups(const Problem& p) {
  const int64_t page = p.seq.page_size;
  return p.seq.kv_layout == KvLayout::Paged && hopper_head_bucket(p) > 64 && p.d % 64 == 0 && p.dv % 64 == 0 &&
         p.k.s1 > 0 && p.v.s1 > 0 && p.k.s0 == page * p.k.s1 && p.v.s0 == page * p.v.s1;
}

// How the producer reads a paged cache: TMA boxes of kv_page_box_rows rows -- the largest run
// that divides both the page and the key tile (one box per tile for pages of whole tiles, one per
// page for pages dividing the tile, one per 8k rows for the rest, e.g. 16 at 48-row pages), each
// issued by its own lane of the producer warp -- where that run is a multiple of 8 rows (with a
// left pad too: kv_key_align); row copies by the producer's threads (the kKvRows instances,
// coalesced cp.async) for the rest (pages of no 8-row run) and where boxes would be smaller than the row
// copies are slow: 16 rows, or 8 at D128 with boxes across panels (kv_pool_in_groups). A box's
// cost is mostly fixed, not its bytes: on the H200 (prefill chunk, bench_ab_fwd.py cache,
// session 19; gpu_coverage.md), against the contiguous cache, D128: boxes per panel 0.93-0.97 at
// pages of 64-256 rows, 0.91 at 32, 0.78 at 16, 0.60 at 8 (session 15); boxes across panels
// 0.89-0.91 at 16, 0.79-0.80 at 8; row copies 0.67-0.73 at every size. D256: 16-row pages 0.75 ->
// 0.97-0.99 with boxes across panels, but 8-row pages 0.965x of the row copies (8 boxes of 4 KB
// for a 64-key tile). With a left pad (session 25, both A/B orders, pads 37/200 before 4096 keys:
// the shifted tiles cost one more tile here) boxes beat the row copies at D128 (16-row boxes
// 0.86 of the contiguous cache against 0.69) and D256 (+3-9% at 16-256-row pages), and at D64
// from 32-row boxes (+2.5% at 64 and 256), but not with 16-row boxes at D64 (0.80-0.82 against the
// row copies' 0.87): there the row copies stay. Dropout has no row-copy instance: its calls keep
// the boxes wherever they tile the cache without a left pad (its keep bits come in 16-key groups
// from a tile's first key, which a left pad's shifted tiles would break), and the candidate
// declines the rest (hopper_fwd_candidate).
inline constexpr int64_t kMinBoxPageRows = 16, kMinGroupedBoxPageRowsD128 = 8, kMinLeftPadBoxPageRowsD64 = 32;
inline int64_t kv_page_box_rows(const Problem& p) { return std::gcd(p.seq.page_size, int64_t(hopper_block_n(p))); }
inline bool kv_tma_boxes_fit(const Problem& p) { return kv_page_box_rows(p) % 8 == 0; }
inline bool kv_by_rows(const Problem& p) {
  if (p.seq.kv_layout != KvLayout::Paged) return false;
  if (p.rules.has_dropout()) return !kv_tma_boxes_fit(p) || p.seq.cache_leftpad != nullptr;
  const int bucket = hopper_head_bucket(p);
  const int64_t min_rows = kv_pool_in_groups(p) && bucket == 128                  ? kMinGroupedBoxPageRowsD128
                           : bucket == 64 && p.seq.cache_leftpad != nullptr ? kMinLeftPadBoxPageRowsD64
                                                                            : kMinBoxPageRows;
  return !kv_tma_boxes_fit(p) || kv_page_box_rows(p) < min_rows;
}
// The call's K/V maps are the grouped 5-d views (boxes across panels).
inline bool kv_grouped_boxes(const Problem& p) { return kv_pool_in_groups(p) && !kv_by_rows(p); }
// A paged cache with a left pad read by TMA boxes: a box must lie inside one page, so sequence b's
// key tiles start at cache row pad - pad % kv_key_align (a whole box) and the first pad %
// kv_key_align keys of tile 0 are hidden (SeqScoreRules::start_keys_early; their V rows zeroed
// like the rows past the keys). 0: tiles start at the first key (any other call). These calls run
// the row-copy instance (fwd_hopper_v3.cuh kKvRows: the irregular paged calls), on its TMA path,
// so that the plain instance's consumers keep the constant k_lo = 0.
inline int32_t kv_key_align(const Problem& p) {
  const bool shifted = p.seq.kv_layout == KvLayout::Paged && p.seq.cache_leftpad != nullptr && !kv_by_rows(p);
  return shifted ? int32_t(kv_page_box_rows(p)) : 0;
}

// Work tiles of a call: query blocks of block_m rows x splits x heads x sequences (the kernel's
// grid unit; a persistent block walks several).
inline int hopper_block_m(const Problem& p) {
  return HopperTileV3::block_m(hopper_head_bucket(p), p.rules.has_dropout());
}
inline int64_t hopper_work_tiles(const Problem& p, int splits) {
  const int64_t bm = hopper_block_m(p);
  return (p.seq.sq + bm - 1) / bm * p.hq * p.seq.batch * std::max(splits, 1);
}

// The plan's kernel name; split-KV adds ":splitkv+combine" (as the mma.sync plans do), a paged
// cache copied by the producer's threads ":kv_rows" (kv_by_rows).
inline void hopper_kernel_name(char* buf, size_t size, const Problem& p, int splits) {
  const int bucket = hopper_head_bucket(p);
  const HopperDimsTag dims(p);
  std::snprintf(buf, size, "cuda:sm90_wgmma_prefill_d%d_m%dn%d_tma_ws:%s%s%s%s", bucket, hopper_block_m(p),
                hopper_block_n(p), p.dtype == FP_BF16 ? "bf16" : "fp16", dims.text,
                kv_by_rows(p) ? ":kv_rows" : "", splits > 1 ? ":splitkv+combine" : "");
}

inline bool hopper_mult8(int64_t x) { return (x & 7) == 0; }
inline bool hopper_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// A decode-shaped call: its packed query rows fit one block of the mma.sync decode tile, which
// runs it (the same rule the mma.sync candidate uses to pick that tile).
inline bool decode_shaped(const Problem& p) {
  return p.seq.sq * gqa_pack(p) <= kTileConfigs[tile_id_for(std::max(p.d, p.dv), true)].block_m;
}

// Persistent grids: with more work tiles than resident slots, one block per slot walks the tiles,
// so the producer loads the next tile's Q and K/V while the consumers finish the current one
// instead of each block paying its own start and end.
//   Static walk (blockIdx.x, + gridDim.x, ...) when every tile costs the same (no causal or window
//   mask, every sequence as long as the batched tensors, no split) and is short (at most 64 key
//   tiles). Measured on the H100 (bf16, interleaved A/B): +4-11% at S = 1k, +2-4% at 4k, -0.5 to
//   -2.7% at 16k (hence the length limit; longer ones keep one block per tile). The limit counts
//   the call's own tiles (160 keys: up to 10,240 keys), not yet measured at 8k-10k keys.
//   Dynamic walk for calls whose tiles differ (causal, windows, varlen, caches, splits): each block
//   takes its next tile from a counter in the workspace (a NonceCounter started by block 0: no memset),
//   in the order of the tile index (heaviest query blocks of a head first), as the hardware hands
//   blocks to free slots; a static walk of such tiles measured up to 46% slower (HISTORY.md).
struct HopperGrid {
  int blocks = 0;        // 0: one block per work tile
  bool dynamic = false;  // the walk takes tiles from the workspace's counter
};
inline HopperGrid hopper_grid(const Problem& p, int splits, int64_t slots) {
  constexpr int64_t kMaxKeyTiles = 64;
  if (hopper_work_tiles(p, splits) <= slots) return {};
  if (splits != 1 || !equal_cost_tiles(p)) return {int(slots), true};
  const int64_t bn = hopper_block_n(p);
  if ((p.seq.sk + bn - 1) / bn > kMaxKeyTiles) return {};
  return {int(slots), false};
}

// The Hopper candidate: empty string and *splits when the kernel runs the call, else the reason
// it doesn't. Split count: the caller's num_splits (1 off; a forced count clamped to the call's
// 64-key blocks, so a count means the same on both kernels: splits past the kernel's own key
// tiles are empty and store LSE = -inf); with 0 the heuristic of core/heuristics.hpp over this
// kernel's work tiles (query blocks of block_m rows x heads x batch), key tiles (hopper_block_n) and occupancy
// (SMs x blocks per SM).
inline std::string hopper_fwd_candidate(const Problem& p, int arch, int sm_count, int smem_optin, int* splits,
                                        HopperGrid* grid) {
#if !defined(FLASHPORT_WITH_HOPPER_FWD)
  (void)p, (void)arch, (void)sm_count, (void)smem_optin, (void)splits, (void)grid;
  return "hopper path: not built (90 not in CMAKE_CUDA_ARCHITECTURES)";
#else
  if (!runtime_config().hopper_fwd) return "hopper path: disabled by FLASHPORT_HOPPER_FWD=0";
  if (arch != 900) return "hopper path: device is not sm_90";
  if (p.dtype != FP_F16 && p.dtype != FP_BF16) return "hopper path: dtype";
  if (p.d > 256 || p.dv > 256) return "hopper path: head dim above 256";
  const int d = hopper_head_bucket(p);
  if (decode_shaped(p) || gqa_pack(p) != 1) return "hopper path: decode-shaped call";
  if (p.has_lse && p.lse_dtype != FP_F32) return "hopper path: lse dtype";
  // With rotary the kernel reads the rotated q of the workspace (aligned by its layout).
  const bool q_aligned = p.rotary_dim > 0 || (hopper_aligned16(p.q_ptr) && hopper_mult8(p.q.row_stride) &&
                                              hopper_mult8(p.q.head_stride) && hopper_mult8(p.q.batch_stride));
  const bool aligned = q_aligned && hopper_aligned16(p.k_ptr) && hopper_aligned16(p.v_ptr) &&
                       hopper_mult8(p.k.s0) && hopper_mult8(p.k.s1) &&
                       hopper_mult8(p.k.s2) && hopper_mult8(p.v.s0) && hopper_mult8(p.v.s1) &&
                       hopper_mult8(p.v.s2);
  if (!aligned) return "hopper path: q/k/v rows or strides not 16-byte aligned";
  if (kv_by_rows(p) && p.rules.has_dropout())
    return "hopper path: dropout with a paged cache TMA boxes cannot tile (a left pad, or pages sharing no run of "
           "8k rows with the key tile): no row-copy dropout instance";
  if (kv_by_rows(p) && (p.d % 8 != 0 || p.dv % 8 != 0))
    return "hopper path: a paged cache copied by rows needs head dims D, Dv of whole 16-byte chunks (multiples of 8)";
  if (HopperTileV3::smem_bytes(d, hopper_block_n(p), p.rules.has_dropout()) > smem_optin)
    return "hopper path: shared memory";
  const KernelInfo ki = hopper_info_for(d, p.dtype == FP_BF16, p.device_index);
  if (ki.status != gpuSuccess) return std::string("hopper path: no kernel image: ") + gpuGetErrorString(ki.status);
  if (ki.blocks_per_sm < 1) return "hopper path: kernel does not fit an SM";
  const int64_t keys = max_kv_rows(p);
  int n = 1;
  if (p.num_splits != 0) {
    const int64_t key_blocks64 = std::max<int64_t>(1, (keys + 63) / 64);
    n = resolve_num_splits(p.num_splits, 1, key_blocks64, 1, kMaxSplits);
  } else {
    const int64_t bn = hopper_block_n(p);
    const int64_t tiles = hopper_work_tiles(p, 1);
    const int64_t key_blocks = std::max<int64_t>(1, (keys + bn - 1) / bn);
    const int64_t slots = int64_t(std::max(sm_count, 1)) * std::max(ki.blocks_per_sm, 1);
    n = resolve_num_splits(0, tiles, key_blocks, slots, kMaxSplits);
  }
  if (n < 1 || n > kMaxSplits) return "hopper path: split count out of range";
  if (std::string why = hopper_tma_reason(p, n); !why.empty()) return why;
  *splits = n;
  *grid = hopper_grid(p, n, int64_t(std::max(sm_count, 1)) * std::max(ki.blocks_per_sm, 1));
  return std::string();
#endif
}

}  // namespace flashport::gpu
