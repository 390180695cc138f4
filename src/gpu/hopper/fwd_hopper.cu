// Hopper (sm_90a) forward prefill: the FlashAttention loop with both products on wgmma (HGMMA),
// warp-specialised (fwd_hopper_v3.cuh: a TMA producer warp, mbarrier rings, setmaxnreg, two
// consumer warpgroups in ping-pong), split-KV through the workspace and the combine kernel.
// Compiled only for sm_90a (its own object library in CMakeLists.txt); scope and candidate check
// in fwd_hopper.hpp. This file: the host side (TMA maps, kernel info, launch, instances).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu/hopper/fwd_hopper_rows.cuh"
#include "gpu/hopper/fwd_hopper_tma.cuh"
#include "gpu/hopper/fwd_hopper_v3.cuh"
#include "gpu/hopper/fwd_hopper_wgmma.hpp"
#include "gpu/hopper/hopper_smem.hpp"
#include "gpu/hopper/tma_maps.hpp"
#include "gpu/common/kernel_info.cuh"
#include "gpu/common/tile_io.cuh"
#include "gpu/common/tile_mma.hpp"

namespace flashport::gpu {

// ---- v3 tensor maps (host; the encoder and the rows view: tma_maps.hpp) -------------------------

namespace {

// A paged pool of `pages` pages of `page_rows` rows, pages back to back (kv_grouped_boxes), as a
// (col, row in group, panel, head, group) view: 8-row groups of the whole pool, each row split into
// its 64-column panels (`cols` / 64 of them; a box's panels past them are zero-filled). One box of
// `box_rows` rows lands as [group][panel][8 rows][128 bytes], the grouped KvTileLayout.
std::string encode_grouped_map(CUtensorMap* map, const void* base, int64_t cols, int64_t pages, int64_t page_rows,
                               int64_t heads, int64_t row_stride, int64_t head_stride, int kernel_panels,
                               int box_rows) {
  const cuuint64_t dims[5] = {64, 8, cuuint64_t(cols / 64), cuuint64_t(heads), cuuint64_t(pages * (page_rows / 8))};
  const cuuint64_t strides[4] = {cuuint64_t(row_stride * 2), 128,
                                 cuuint64_t((heads <= 1 ? row_stride : head_stride) * 2),
                                 cuuint64_t(row_stride * 16)};
  const cuuint32_t box[5] = {64, 8, cuuint32_t(kernel_panels), 1, cuuint32_t(box_rows / 8)};
  return encode_swizzled_map(map, base, 5, dims, strides, box, "grouped layout");
}

// Rows of one K/V box: the key tile, or (paged caches) the largest run dividing the page and the
// tile (kv_page_box_rows).
int kv_box_rows(const Problem& p) {
  return p.seq.kv_layout == KvLayout::Paged ? int(kv_page_box_rows(p)) : hopper_block_n(p);
}

// The (rows, heads, batch) extents and (row, head, batch) element strides of the q, k and v views
// the maps encode: q as the kernel reads it (the caller's or its rotated workspace copy: a.q,
// a.q_addr), packed tensors as one batch of all their rows, batched ones (and contiguous caches)
// with the batch (cache entry) as the 4th coordinate, paged caches as (row in page, head, page).
struct V3View {
  int64_t rows, heads, batch, row_stride, head_stride, batch_stride;
};
V3View q_view(const Problem& p, const RowAddr& q) {
  const fp_attn_params& raw = *p.raw;
  return q.packed ? V3View{raw.q.shape[0], p.hq, 1, q.row_stride, q.head_stride, 0}
                  : V3View{p.seq.sq, p.hq, p.seq.batch, q.row_stride, q.head_stride, q.batch_stride};
}
V3View kv_view(const Problem& p, const KvAddr& kv) {
  const fp_attn_params& raw = *p.raw;
  switch (p.seq.kv_layout) {
    case KvLayout::Packed: return {raw.k.shape[0], p.hkv, 1, kv.s0, kv.s2, 0};
    case KvLayout::Paged: return {p.seq.page_size, p.hkv, raw.k.shape[0], kv.s1, kv.s2, kv.s0};
    default: return {p.seq.sk, p.hkv, raw.k.shape[0], kv.s1, kv.s2, kv.s0};
  }
}

std::string make_v3_maps(const Problem& p, const FwdArgs& a, HopperV3Params* prm) {
  const int box = kv_box_rows(p);
  const V3View q = q_view(p, a.q_addr), k = kv_view(p, p.k), v = kv_view(p, p.v);
  std::string why = encode_rows_map(&prm->tq, a.q, p.d, q.rows, q.heads, q.batch, q.row_stride, q.head_stride,
                                    q.batch_stride, hopper_block_m(p));
  if (!why.empty() || kv_by_rows(p)) return why;  // rows by threads: no K/V maps
  if (kv_grouped_boxes(p)) {
    const int panels = hopper_head_bucket(p) / 64;
    why = encode_grouped_map(&prm->tk, p.k_ptr, p.d, p.raw->k.shape[0], p.seq.page_size, p.hkv, p.k.s1, p.k.s2,
                             panels, box);
    if (!why.empty()) return why;
    return encode_grouped_map(&prm->tv, p.v_ptr, p.dv, p.raw->v.shape[0], p.seq.page_size, p.hkv, p.v.s1, p.v.s2,
                              panels, box);
  }
  why = encode_rows_map(&prm->tk, p.k_ptr, p.d, k.rows, k.heads, k.batch, k.row_stride, k.head_stride,
                        k.batch_stride, box);
  if (!why.empty()) return why;
  return encode_rows_map(&prm->tv, p.v_ptr, p.dv, v.rows, v.heads, v.batch, v.row_stride, v.head_stride,
                         v.batch_stride, box);
}

}  // namespace

// The rules cuTensorMapEncodeTiled documents for the views make_v3_maps encodes: every dimension
// in [1, 2^32], every used stride a multiple of 16 bytes below 2^40 (the base is 16-byte aligned:
// the candidate checked). Checked here without encoding, so a call encodes its three maps once,
// at the launch.
std::string hopper_tma_reason(const Problem& p, int splits) {
  if (hopper_work_tiles(p, splits) > int64_t(INT32_MAX)) return "hopper path: more than 2^31 work tiles";
  if (tensor_map_encoder() == nullptr) return "hopper path: the driver has no cuTensorMapEncodeTiled";
  // q as the kernel reads it: with rotary, the rotated copy in the workspace (its layout only).
  RowAddr q_addr = p.q;
  if (p.rotary_dim > 0) q_addr = q_rot_addr(p, fwd_workspace(p, splits).q_rot_row_stride);
  const V3View views[3] = {q_view(p, q_addr), kv_view(p, p.k), kv_view(p, p.v)};
  constexpr int64_t kMaxDim = int64_t(1) << 32, kMaxStrideBytes = int64_t(1) << 40;
  auto dims_ok = [&](const V3View& w) {
    return w.rows >= 1 && w.rows <= kMaxDim && w.heads >= 1 && w.heads <= kMaxDim && w.batch >= 1 &&
           w.batch <= kMaxDim;
  };
  auto stride_ok = [&](int64_t stride, int64_t extent) {
    return extent <= 1 || (stride > 0 && (stride * 2) % 16 == 0 && stride * 2 < kMaxStrideBytes);
  };
  // The grouped maps' group coordinate is a signed 32-bit TMA coordinate.
  if (kv_grouped_boxes(p) && p.raw->k.shape[0] * (p.seq.page_size / 8) > int64_t(INT32_MAX))
    return "hopper path: a paged pool of 2^31 or more 8-row groups (the grouped tensor map's coordinate range)";
  for (const V3View& w : views) {
    if (&w != &views[0] && kv_by_rows(p)) break;  // K/V copied row by row: no maps
    if (!dims_ok(w)) return "hopper path: a q/k/v dimension is outside the tensor map range [1, 2^32]";
    if (!stride_ok(w.row_stride, w.rows) || !stride_ok(w.head_stride, w.heads) || !stride_ok(w.batch_stride, w.batch))
      return "hopper path: q/k/v strides outside the tensor map rules (16-byte multiples below 2^40)";
  }
  return std::string();
}

// Every instance of the head dim (plain, dropout, paged row copies), so the candidate's check holds
// for any launch and every kernel gets its shared-memory attribute: the first failure, else the
// lowest occupancy.
template <int D, bool kBf16>
KernelInfo hopper_fwd_kernel_info(int device) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  const int threads = HopperTileV3::threads(D), smem = HopperTileV3::smem_bytes(D);
  constexpr int BN = HopperTileV3::block_n(D);
  const int drop_threads = HopperTileV3::threads(D, true), drop_smem = HopperTileV3::smem_bytes(D, BN, true);
  // D128 adds its wide-tile instance (hopper_wide_tile); elsewhere the plain one stands in.
  constexpr int kWideBN = D == 128 ? HopperTileV3::kWideBlockN : BN;
  const int wide_smem = HopperTileV3::smem_bytes(D, kWideBN);
  const KernelInfo infos[4] = {
      cached_kernel_info<sm90::fwd_hopper_v3_kernel<D, Elem, false, false, BN>>(device, threads, smem),
      cached_kernel_info<sm90::fwd_hopper_v3_kernel<D, Elem, true, false, BN>>(device, drop_threads, drop_smem),
      cached_kernel_info<sm90::fwd_hopper_v3_kernel<D, Elem, false, true, BN>>(device, threads, smem),
      cached_kernel_info<sm90::fwd_hopper_v3_kernel<D, Elem, false, false, kWideBN>>(device, threads, wide_smem)};
  KernelInfo worst = infos[0];
  for (const KernelInfo& k : infos) {
    if (k.status != gpuSuccess) return k;
    if (k.blocks_per_sm < worst.blocks_per_sm) worst = k;
  }
  return worst;
}

template <int D, bool kBf16>
gpuError_t launch_hopper_fwd(const Problem& p, const FwdArgs& a, int grid, NonceCounter* walk, gpuStream_t stream) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  const bool dropout = p.rules.has_dropout();  // the instance (hopper_block_m's rule)
  const int64_t block_m = hopper_block_m(p);
  const int64_t m_blocks = (p.seq.sq + block_m - 1) / block_m;
  if (m_blocks == 0 || p.seq.batch == 0) return gpuSuccess;
  HopperV3Params prm;
  prm.a = a;
  if (!make_v3_maps(p, a, &prm).empty()) return cudaErrorInvalidValue;  // the candidate checked the same rules
  prm.kv_box_rows = kv_box_rows(p);
  prm.kv_key_align = kv_key_align(p);
  prm.kv_grouped = kv_grouped_boxes(p);
  const bool rows = kv_by_rows(p);
  prm.zero_v_tail = is_kv_cache_call(p) && !rows;  // the row copies zero-fill
  // Work tiles: query block x split x head x sequence (the candidate bounds them); one block
  // each, or the plan's persistent grid walking them. Tiles of unequal cost (causal, windows,
  // varlen, caches, splits) end on the last units' light query blocks (TailOrder).
  const int64_t units = p.hq * p.seq.batch * std::max(a.splits, 1);
  prm.work_tiles = int32_t(m_blocks * units);
  const unsigned blocks = grid > 0 && grid < prm.work_tiles ? unsigned(grid) : unsigned(prm.work_tiles);
  prm.order = TailOrder{int32_t(m_blocks), int32_t(units), 0};
  if (int64_t(blocks) < prm.work_tiles)
    prm.order.tail_units = tail_units_for(units, m_blocks, blocks, a.splits > 1 || !equal_cost_tiles(p));
  prm.tile_walk = walk;  // no memset: block 0 starts the walk (NonceCounter)
  constexpr int BN = HopperTileV3::block_n(D);
  const int threads = HopperTileV3::threads(D, dropout), smem = HopperTileV3::smem_bytes(D, BN, dropout);
  if constexpr (D == 128) {
    if (hopper_wide_tile(p)) {  // no cache, no dropout: TMA boxes of whole tiles
      constexpr int kWideBN = HopperTileV3::kWideBlockN;
      const int wide_smem = HopperTileV3::smem_bytes(D, kWideBN);
      sm90::fwd_hopper_v3_kernel<D, Elem, false, false, kWideBN><<<blocks, threads, wide_smem, stream>>>(prm);
      return gpuGetLastError();
    }
  }
  if (rows || prm.kv_key_align > 0)  // irregular pages (the candidate declines them with dropout)
    sm90::fwd_hopper_v3_kernel<D, Elem, false, true, BN><<<blocks, threads, smem, stream>>>(prm);
  else if (dropout)
    sm90::fwd_hopper_v3_kernel<D, Elem, true, false, BN><<<blocks, threads, smem, stream>>>(prm);
  else
    sm90::fwd_hopper_v3_kernel<D, Elem, false, false, BN><<<blocks, threads, smem, stream>>>(prm);
  return gpuGetLastError();
}

#define FP_INSTANTIATE_HOPPER(D, bf16)                       \
  template KernelInfo hopper_fwd_kernel_info<D, bf16>(int); \
  template gpuError_t launch_hopper_fwd<D, bf16>(const Problem&, const FwdArgs&, int, NonceCounter*, gpuStream_t);
#define FP_INSTANTIATE_HOPPER_D(D) FP_INSTANTIATE_HOPPER(D, false) FP_INSTANTIATE_HOPPER(D, true)
FP_INSTANTIATE_HOPPER_D(64)
FP_INSTANTIATE_HOPPER_D(128)
FP_INSTANTIATE_HOPPER_D(192)
FP_INSTANTIATE_HOPPER_D(256)

}  // namespace flashport::gpu
