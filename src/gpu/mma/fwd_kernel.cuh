// The forward main loop (FlashAttention-2 style), written once for NVIDIA (CUDA) and AMD (HIP).
// Template arguments are only the tile (head-dim bucket, block shape) and the storage type; every
// score feature is a runtime hook taken by a block-uniform branch, so the plain path does no
// per-element feature work:
//   - masking (key tail, causal/window edges) runs only on tiles that cut a row's visible range;
//   - softcap / ALiBi run only when the call has them;
//   - dropout (shared Philox rule) only when p > 0;
//   - split-KV is the same loop over a key range, writing fp32 partials + LSE to the workspace.
// Q sits in shared memory; K and V stream through their own shared buffers with cp.async: V's
// copy overlaps S = Q K^T, the next K's copy overlaps the softmax and O += P V.
//
// What differs per vendor is below this file: the tile-MMA layer (tile_mma.hpp: mma.sync,
// ldmatrix, 16x8 accumulators; tile_mma_amd.hpp: MFMA/WMMA, wave64/wave32, transposed products,
// one query per lane), the load layer (tile_io.cuh: cp.async, or plain copies on AMD), the
// warp vote and kernel spellings (vendor.hpp) and the tile rows (tile_config.hpp). The loop
// only reads the layer's AccLayout (which accumulator elements a lane holds: kRowSlots rows of
// each 16-row m-tile, kSlotElems columns of each row per kCols-column tile), its shared tile
// (SmemTile), fragment loads, products and fences, and the row reductions query_max/query_sum.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "core/philox.hpp"
#include "gpu/mma/fwd_launch.hpp"
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/tile_config.hpp"
#include "gpu/common/tile_io.cuh"
#if defined(FP_TARGET_NVIDIA)
#include "gpu/common/dropout_lanes.cuh"
#endif

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

// Loads key/value tiles of one (sequence, kv head) into a swizzled shared tile. Each thread owns
// one 16-byte column chunk and every (threads / chunks)-th row, so the common case (batched or
// packed layout, 16-byte aligned, whole chunk inside the head dim) is a straight line of cp.async
// with a pointer bump per row; rows past the end are zero-filled by the copy itself. Paged
// caches, unaligned tensors and a head-dim tail take the general per-row path.
template <int D, int BN, int NT>
struct KvTileLoader {
  static constexpr int kChunks = D / 8;
  static constexpr int kRowsPerPass = NT / kChunks;
  static constexpr int kPasses = BN / kRowsPerPass;
  static_assert(NT % kChunks == 0 && BN % kRowsPerPass == 0, "tile / thread mapping");

  const uint16_t* base;                // tensor + sequence/head offset (key 0 of the sequence)
  // Batched/packed: elements between rows. Paged: the cache row of key 0 (cache_leftpad); the
  // row stride inside a page is then read from the kernel parameters (ad.s1). One field for both
  // keeps the loader at its register count before left padding (the D128 prefill kernel sits at
  // the register limit; a separate pad field cost it 200 bytes of spills).
  int64_t stride_or_pad = 0;
  const int32_t* table_row = nullptr;  // paged: this sequence's page table row

  __device__ __forceinline__ KvTileLoader(const uint16_t* tensor, const SeqInfo& s, const KvAddr& ad,
                                          int64_t b, int64_t kvh) {
    const int64_t head_off = kvh * ad.s2;
    if (ad.layout == KvLayout::Paged) {
      table_row = s.block_table + b * s.block_table_stride;
      base = tensor + head_off;
      stride_or_pad = s.k_pad(b);
    } else if (ad.layout == KvLayout::Packed) {
      base = tensor + s.k_start(b) * ad.s0 + head_off;
      stride_or_pad = ad.s0;
    } else {
      // Key j is cache row k_pad + j (SeqInfo::key_row): the pad folds into the base.
      const int64_t row = s.cache_batch_idx ? int64_t(s.cache_batch_idx[b]) : b;
      base = tensor + row * ad.s0 + s.k_pad(b) * ad.s1 + head_off;
      stride_or_pad = ad.s1;
    }
  }

  // Rows [nb*BN, nb*BN + BN) into `tile`; `limit` columns are real, the rest zeros.
  __device__ __forceinline__ void load(uint16_t* tile, int nb, int lk, int limit, const FwdArgs& a,
                                       const KvAddr& ad, int tid) const {
    const int r0 = tid / kChunks, c = tid % kChunks;
    const int j0 = nb * BN + r0;
    if (a.vec_ok && table_row == nullptr && c * 8 + 8 <= limit) {
      const uint16_t* p = base + int64_t(j0) * stride_or_pad + c * 8;
      const int64_t step = int64_t(kRowsPerPass) * stride_or_pad;
#pragma unroll
      for (int k = 0; k < kPasses; ++k) {
        const bool in = j0 + k * kRowsPerPass < lk;
        cp_async_16(tile + SmemTile<D>::offset(r0 + k * kRowsPerPass, c), in ? p : base, in ? 16 : 0);
        p += step;
      }
    } else {
#pragma unroll 1
      for (int k = 0; k < kPasses; ++k) {
        const int j = j0 + k * kRowsPerPass;
        const uint16_t* src = nullptr;
        if (j < lk) {
          if (table_row != nullptr) {
            const int ps = static_cast<int>(a.seq.page_size);
            const int row = static_cast<int>(stride_or_pad) + j;
            const int64_t page = clamp_page_id<int64_t>(table_row[row / ps], a.num_pages);
            src = base + page * ad.s0 + int64_t(row % ps) * ad.s1;
          } else {
            src = base + int64_t(j) * stride_or_pad;
          }
        }
        load_chunk(tile + SmemTile<D>::offset(r0 + k * kRowsPerPass, c), src, c, limit, a.vec_ok);
      }
    }
  }
};

// S += Q K^T for this warp's rows over the first `ksteps` 16-column steps of the head dim.
// kGuard = false: all D/16 steps, one straight-line block the scheduler can pipeline (the common
// case); true: head dims below the bucket, the tail steps skipped (where the layer does:
// kSkipTailSteps; otherwise the tail runs on the zero-filled columns).
// The output columns of elements e2 and e2 + 1 of accumulator tile t in this lane.
struct OutCols {
  int col, col1;
};
__device__ __forceinline__ OutCols out_cols(int t, int e2, int lane) {
  const int col = t * AccLayout::kCols + AccLayout::col(lane, e2);
  return {col, AccLayout::kAdjacentPairs ? col + 1 : t * AccLayout::kCols + AccLayout::col(lane, e2 + 1)};
}

// Every accumulator of an [M][N] array of tiles to 0.
template <int M, int N>
__device__ __forceinline__ void zero_acc(FragC (&acc)[M][N]) {
#pragma unroll
  for (int mt = 0; mt < M; ++mt)
#pragma unroll
    for (int t = 0; t < N; ++t)
#pragma unroll
      for (int e = 0; e < kAccElems; ++e) acc[mt][t].r[e] = 0.0f;
}

template <int D, int BN, int MT, typename Elem, bool kGuard>
__device__ __forceinline__ void gemm_qk(FragC (&acc)[MT][BN / AccLayout::kCols], const uint16_t* sQ,
                                        const uint16_t* sK, int warp_row0, int lane, int ksteps) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    if (kGuard && ks >= ksteps) break;
    QFrag qa[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_q<D>(qa[mt], sQ, warp_row0 + mt * 16, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < BN / 16; ++np) {
      KFrag kb;
      load_k<D>(kb, sK, np * 16, ks * 16, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_qk<Elem>(acc[mt], np, qa[mt], kb);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mma_fence(acc[mt]);
  }
}

// O += P V over the first `dpairs` 16-column pairs of the output (kGuard as above).
template <int D, int BN, int MT, typename Elem, bool kGuard>
__device__ __forceinline__ void gemm_pv(FragC (&acc_o)[MT][D / AccLayout::kCols],
                                        const FragC (&acc_s)[MT][BN / AccLayout::kCols],
                                        const uint16_t* sV, int lane, int dpairs) {
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) {
    PFrag pa[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) pa[mt] = p_frag<Elem>(acc_s[mt], ks, lane);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      if (kGuard && dp >= dpairs) break;
      VFrag vb;
      load_v<D>(vb, sV, ks * 16, dp * 16, lane);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_pv<Elem>(acc_o[mt], dp, pa[mt], vb);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_fence(acc_o[mt], dp);
    }
  }
}

// The score hooks of one query row slot over a key tile, shared by the forward main loop and the
// decode kernel: scores become S.score(s) plus the ALiBi bias (slope 0 without ALiBi) at distance
// base - column (base = the row's diagonal minus the tile's first key), in log2 units.
template <int kNTiles, typename Rules>
__device__ __forceinline__ void transform_row(FragC (&acc_s)[kNTiles], int slot, int lane, const Rules& S, int base,
                                              float slope) {
  constexpr int kSlotElems = AccLayout::kSlotElems;
#pragma unroll
  for (int t = 0; t < kNTiles; ++t)
#pragma unroll
    for (int e2 = 0; e2 < kSlotElems; ++e2) {
      float& s = acc_s[t].r[slot * kSlotElems + e2];
      s = S.score(s);
      s += S.alibi_bias_at(slope, base - (t * AccLayout::kCols + AccLayout::col(lane, e2)));
    }
}

// Keys of a row slot outside its visible range [lo, hi) (relative to the tile's first key) -> -inf.
template <int kNTiles>
__device__ __forceinline__ void mask_row(FragC (&acc_s)[kNTiles], int slot, int lane, int lo, int hi) {
  constexpr int kSlotElems = AccLayout::kSlotElems;
#pragma unroll
  for (int t = 0; t < kNTiles; ++t)
#pragma unroll
    for (int e2 = 0; e2 < kSlotElems; ++e2) {
      const int j = t * AccLayout::kCols + AccLayout::col(lane, e2);
      if (j < lo || j >= hi) acc_s[t].r[slot * kSlotElems + e2] = -INFINITY;
    }
}

// One query row's online-softmax step (base 2), shared by the forward main loop and the decode
// kernel (mma/decode_kernel.cuh): the lane's elements of the row (slot `slot` of every key tile's
// score accumulator) become exp2(s * mul - m) for the row's new running max m (over the lanes
// sharing the row), the running sum is rescaled by corr = exp2(old max - m) and added to. Returns
// whether the max moved (only then does O need corr; the common case after the first tiles).
template <int kNTiles>
__device__ __forceinline__ bool online_softmax_row(FragC (&acc_s)[kNTiles], int slot, float mul, float& row_max,
                                                   float& row_sum, float& corr) {
  constexpr int kSlotElems = AccLayout::kSlotElems;
  static_assert(kSlotElems % 2 == 0, "the max is taken over element pairs");
  float mx = -INFINITY;
#pragma unroll
  for (int t = 0; t < kNTiles; ++t)
#pragma unroll
    for (int e2 = 0; e2 < kSlotElems; e2 += 2)
      mx = fmaxf(mx, fmaxf(acc_s[t].r[slot * kSlotElems + e2], acc_s[t].r[slot * kSlotElems + e2 + 1]));
  mx = query_max(mx);
  const float m_new = fmaxf(row_max, mx * mul);
  const bool moved = m_new != row_max;
  const float m_use = m_new == -INFINITY ? 0.0f : m_new;
  corr = fast_exp2(row_max - m_use);
  row_max = m_new;
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kNTiles; ++t)
#pragma unroll
    for (int e2 = 0; e2 < kSlotElems; ++e2) {
      float& s = acc_s[t].r[slot * kSlotElems + e2];
      s = fast_exp2(fmaf(s, mul, -m_use));
      sum += s;
    }
  row_sum = row_sum * corr + sum;
  return moved;
}

template <int kTile, typename Elem>
__global__ void FP_LAUNCH_BOUNDS(kTileConfigs[kTile].threads(kWarpSize), kTileConfigs[kTile].min_blocks)
    fwd_kernel(const FP_GRID_CONSTANT FwdArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  FP_REQUIRE_ARCH(kMinNvidiaArch);
#else
  constexpr TileConfig C = kTileConfigs[kTile];
  constexpr int D = C.head_dim, BM = C.block_m, BN = C.block_n, NT = C.threads(kWarpSize);
  constexpr int MT = C.m_tiles();
  constexpr int kChunks = D / 8;
  constexpr int kNTiles = BN / AccLayout::kCols;  // accumulator tiles of keys per step
  constexpr int kDTiles = D / AccLayout::kCols;   // accumulator tiles of output columns
  constexpr int kSlots = AccLayout::kRowSlots;    // rows of an m-tile a lane holds
  constexpr int kSlotElems = AccLayout::kSlotElems;  // elements of each such row per tile
  constexpr int kStages = C.stages;
  using Tile = SmemTile<D>;
  static_assert(Tile::kRowElems == D + C.smem_row_pad, "tile rows and the layer's shared tile agree");

  FP_EXTERN_SMEM(uint16_t, smem);
  uint16_t* sQ = smem;
  uint16_t* sK = sQ + BM * Tile::kRowElems;
  uint16_t* sV = sK + BN * Tile::kRowElems;

  const int tid = threadIdx.x, lane = int(threadIdx.x % kWarpSize), warp = int(threadIdx.x / kWarpSize);
  // Heaviest query blocks first (causal: the last rows see the most keys), lighter ones fill the tail.
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int head_idx = blockIdx.y;  // query head (pack == 1) or kv head (packed GQA)
  const int b = blockIdx.z / a.splits;
  const int split = blockIdx.z - b * a.splits;
  const ScoreRules& R = a.rules;

  // Sequence positions fit int32 (validated lengths); addresses stay int64.
  const FwdSeqLengths lengths(a, b);
  const int lq = lengths.lq, lk = lengths.lk;
  const int m_rows = lq * a.pack;
  if (m0 >= m_rows) return;
  const int64_t q_start = a.seq.q_start(b);
  const int kvh = a.pack > 1 ? head_idx : head_idx / a.group;
  const LoopScalar softcap_in(a.softcap_in);  // tested per score element (tile layer: where it lives)
  const KernelScoreRules S(R, lq, lk, a.scale_log2, softcap_in.value, a.softcap_out);
  // Sequence row i and query head h of packed row m.
  auto row_i = [&](int m) -> int { return a.pack > 1 ? m / a.pack : m; };
  auto row_h = [&](int m) -> int { return a.pack > 1 ? kvh * a.group + m % a.pack : head_idx; };

  // Key blocks this block visits: the union of its rows' visible ranges, cut to this split.
  const int i_min = row_i(m0);
  const int i_max = row_i((m0 + BM < m_rows ? m0 + BM : m_rows) - 1);
  const int key_lo = S.vis_lo(i_min);
  const int key_hi = S.vis_hi(i_max);
  int n_lo = key_lo / BN;
  int n_hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : n_lo;
  clip_key_blocks_to_split(n_lo, n_hi, lk, BN, split, a.splits);

  FragC acc_o[MT][kDTiles];
  zero_acc(acc_o);
  float row_max[MT][kSlots], row_sum[MT][kSlots];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < kSlots; ++hf) row_max[mt][hf] = -INFINITY, row_sum[mt][hf] = 0.0f;

  const int warp_row0 = warp * 16 * MT;  // first row of this warp inside the block
  // Packed row of (m-tile, row slot) for this lane.
  auto lane_row = [&](int mt, int hf) -> int { return m0 + warp_row0 + mt * 16 + AccLayout::row(lane, hf); };
  const bool warp_active = m0 + warp_row0 < m_rows;  // warps past the last row skip the math

  if (n_lo < n_hi) {
    const KvTileLoader<D, BN, NT> kload(a.k, a.seq, a.k_addr, b, kvh);
    const KvTileLoader<D, BN, NT> vload(a.v, a.seq, a.v_addr, b, kvh);
    // Q tile (rows past the end are zeros).
    for (int idx = tid; idx < BM * kChunks; idx += NT) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int m = m0 + r;
      const uint16_t* src = nullptr;
      if (m < m_rows) src = a.q + a.q_addr.at(b, q_start, row_i(m), row_h(m));
      load_chunk(sQ + Tile::offset(r, c), src, c, a.d, a.vec_ok);
    }
    const int q_ksteps = (a.d + 15) / 16;
    const int v_dpairs = (a.dv + 15) / 16;

    // The tile body, in two halves so the schedules below can put the V wait between them.
    auto scores = [&](FragC (&acc_s)[MT][kNTiles], const uint16_t* sK, int nb) {
      zero_acc(acc_s);
      if (warp_active) {
        // S = Q K^T
        if (!kSkipTailSteps || q_ksteps == D / 16) gemm_qk<D, BN, MT, Elem, false>(acc_s, sQ, sK, warp_row0, lane, q_ksteps);
        else gemm_qk<D, BN, MT, Elem, true>(acc_s, sQ, sK, warp_row0, lane, q_ksteps);

        // Scores to log2 units, then the feature hooks (block-uniform branches).
        const int n0 = nb * BN;
        const bool need_mask = S.tile_needs_mask(nb, BN, i_min, i_max);
        // Plain scores stay raw and the scale folds into the exp2 (one FFMA); transformed scores
        // are already in log2 units (mul = 1).
        const bool transformed = S.softcapped() || S.alibi() || !(*S.scale > 0.0f);
        const float mul = transformed ? 1.0f : *S.scale;
        if (transformed) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < kSlots; ++hf) {
              const int m = lane_row(mt, hf);
              // ALiBi distance |i + shift - j| with j = n0 + col: base - col, base = i + shift - n0.
              const int base = S.diagonal(row_i(m)) - n0;
              const float slope = R.alibi ? -R.alibi_slope(b, row_h(m < m_rows ? m : m0)) * kLog2e : 0.0f;
              transform_row(acc_s[mt], hf, lane, S, base, slope);
            }
        }
        if (need_mask) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < kSlots; ++hf) {
              const int i = row_i(lane_row(mt, hf));
              mask_row(acc_s[mt], hf, lane, S.vis_lo(i) - n0, S.vis_hi(i) - n0);  // relative to the tile
            }
        }

        // Online softmax (base 2): new row max over the lanes sharing the row, rescale O and the
        // running sum (skipped when no row max of the warp moved, the common case after the
        // first tiles).
        float corr[MT][kSlots];
        bool any_moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hf = 0; hf < kSlots; ++hf)
            any_moved |= online_softmax_row(acc_s[mt], hf, mul, row_max[mt][hf], row_sum[mt][hf], corr[mt][hf]);
        if (warp_any(any_moved)) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int t = 0; t < kDTiles; ++t)
#pragma unroll
              for (int e = 0; e < kAccElems; ++e) acc_o[mt][t].r[e] *= corr[mt][e / kSlotElems];
        }

        // Dropout on P after the sum (the LSE is that of the undropped softmax). One Philox call
        // covers an aligned group of 16 keys of a row.
        if (R.dropout_p > 0.0f) {
#if defined(FP_TARGET_NVIDIA)
          // NVIDIA: the m16n8 accumulator is the layout of common/dropout_lanes.cuh; each call is
          // made by one lane of the quad holding the row and its bits shuffled to the others (its
          // 4 lanes and 2 tiles of a call used to make it 8 times). Lane q makes the calls of
          // row q % 2, whose head may differ from the other row's (packed GQA rows).
          static_assert(kNTiles % 2 == 0 && kNTiles <= 16, "whole 16-key calls, one keep word per row");
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const int m = lane_row(mt, lane & 1);
            uint32_t keep[kSlots];
            fwd_keep_bits<kNTiles>(keep, R, b, a.hq, row_h(m < m_rows ? m : m0), row_i(m), n0);
            fwd_zero_dropped<kNTiles>(keep, [&](int t, int e) -> float& { return acc_s[mt][t].r[e]; });
          }
#else
          // AMD layouts: the Philox words are made in a rolled loop into one keep-bit word per row
          // (small code, few registers), then applied with constant indices; kQuadRun consecutive
          // elements of a row share a call.
          constexpr int kRun = AccLayout::kQuadRun;
          static_assert(kNTiles * kSlotElems <= 32, "one keep-bit word per row");
          const uint64_t rng_seed = R.rng_seed(), rng_offset = R.rng_offset();
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hf = 0; hf < kSlots; ++hf) {
              const int m = lane_row(mt, hf);
              const int i = row_i(m);
              const int h = row_h(m < m_rows ? m : m0);
              uint32_t keep = 0;
#pragma unroll 1
              for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
                for (int q = 0; q < kSlotElems; q += kRun) {
                  const int jq = n0 + t * AccLayout::kCols + AccLayout::col(lane, q);
                  const Philox4 w = dropout_words(rng_seed, rng_offset, b, a.hq, h, i, jq);
#pragma unroll
                  for (int e2 = q; e2 < q + kRun; ++e2) {
                    // The key is jq plus a constant below kQuadRun (jq is kQuadRun-aligned): the
                    // same call's group of 16 keys.
                    const int j = jq + (AccLayout::col(lane, e2) - AccLayout::col(lane, q));
                    keep |= uint32_t(dropout_byte(w, j) >= R.dropout_threshold) << (kSlotElems * t + e2);
                  }
                }
              }
#pragma unroll
              for (int t = 0; t < kNTiles; ++t)
#pragma unroll
                for (int e2 = 0; e2 < kSlotElems; ++e2)
                  if (!((keep >> (kSlotElems * t + e2)) & 1u)) acc_s[mt][t].r[hf * kSlotElems + e2] = 0.0f;
            }
#endif
        }
      }

    };
    auto accumulate = [&](const FragC (&acc_s)[MT][kNTiles], const uint16_t* sV) {
      if (warp_active) {
        // O += P V
        if (!kSkipTailSteps || v_dpairs == D / 16) gemm_pv<D, BN, MT, Elem, false>(acc_o, acc_s, sV, lane, v_dpairs);
        else gemm_pv<D, BN, MT, Elem, true>(acc_o, acc_s, sV, lane, v_dpairs);
      }
    };

    if constexpr (kStages == 1) {
      // FA2 schedule: one K and one V buffer; V's copy overlaps S = Q K^T, the next K's copy
      // overlaps the softmax and P V.
      kload.load(sK, n_hi - 1, lk, a.d, a, a.k_addr, tid);
      cp_async_commit();
      for (int nb = n_hi - 1; nb >= n_lo; --nb) {
        cp_async_wait<0>();
        __syncthreads();  // K (and Q) landed; the previous P @ V is done with sV
        vload.load(sV, nb, lk, a.dv, a, a.v_addr, tid);
        cp_async_commit();
        FragC acc_s[MT][kNTiles];
        scores(acc_s, sK, nb);
        cp_async_wait<0>();
        __syncthreads();  // V landed; every warp is done reading sK
        if (nb > n_lo) {
          kload.load(sK, nb - 1, lk, a.d, a, a.k_addr, tid);
          cp_async_commit();
        }
        accumulate(acc_s, sV);
      }
    } else {
      // Ring of kStages (K, V) slots: tiles nb-1 .. nb-kStages+1 are in flight while nb is
      // processed (memory-bound decode: more bytes in flight per block).
      auto slot_k = [&](int slot) { return sK + slot * 2 * BN * Tile::kRowElems; };
#pragma unroll
      for (int st = 0; st < kStages - 1; ++st) {
        if (n_hi - 1 - st >= n_lo) {
          kload.load(slot_k(st), n_hi - 1 - st, lk, a.d, a, a.k_addr, tid);
          vload.load(slot_k(st) + BN * Tile::kRowElems, n_hi - 1 - st, lk, a.dv, a, a.v_addr, tid);
        }
        cp_async_commit();
      }
      int slot = 0;
      for (int nb = n_hi - 1; nb >= n_lo; --nb) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // tile nb landed; every warp is done with the previous slot
        const int nf = nb - (kStages - 1);
        const int fslot = slot == 0 ? kStages - 1 : slot - 1;
        if (nf >= n_lo) {
          kload.load(slot_k(fslot), nf, lk, a.d, a, a.k_addr, tid);
          vload.load(slot_k(fslot) + BN * Tile::kRowElems, nf, lk, a.dv, a, a.v_addr, tid);
        }
        cp_async_commit();
        FragC acc_s[MT][kNTiles];
        scores(acc_s, slot_k(slot), nb);
        accumulate(acc_s, slot_k(slot) + BN * Tile::kRowElems);
        slot = slot + 1 == kStages ? 0 : slot + 1;
      }
    }
  }

  // Epilogue: finish the row sums, add the sink (first split only), normalise, store.
  const float keep_scale = R.dropout_scale;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hf = 0; hf < kSlots; ++hf) {
      const int m = lane_row(mt, hf);
      float l = row_sum[mt][hf];
      l = query_sum(l);
      float mx = row_max[mt][hf];
      if (m >= m_rows) continue;
      const int i = row_i(m);
      const int h = row_h(m);
      const float o_scale = R.sinks != nullptr && split == 0 ? fold_sink(R.sinks[h] * kLog2e, mx, l) : 1.0f;
      const float inv = l > 0.0f ? o_scale * keep_scale / l : 0.0f;
      const float lse = l > 0.0f ? (mx + __log2f(l)) * kLn2 : -INFINITY;
      if (a.splits > 1) {
        const int64_t row = (int64_t(b) * a.hq + h) * a.seq.sq + i;
        float* dst = a.ws_o + (int64_t(split) * a.ws_rows + row) * a.dv;
#pragma unroll
        for (int t = 0; t < kDTiles; ++t)
#pragma unroll
          for (int e2 = 0; e2 < kSlotElems; e2 += 2) {
            const auto [col, col1] = out_cols(t, e2, lane);
            if (col < a.dv) dst[col] = acc_o[mt][t].r[hf * kSlotElems + e2] * inv;
            if (col1 < a.dv) dst[col1] = acc_o[mt][t].r[hf * kSlotElems + e2 + 1] * inv;
          }
        if (query_leader(lane)) a.ws_lse[int64_t(split) * a.ws_rows + row] = lse;
      } else {
        typename Elem::T* dst =
            static_cast<typename Elem::T*>(a.out) + a.out_addr.at(b, q_start, i, h);
#pragma unroll
        for (int t = 0; t < kDTiles; ++t)
#pragma unroll
          for (int e2 = 0; e2 < kSlotElems; e2 += 2) {
            const auto [col, col1] = out_cols(t, e2, lane);
            const float v0 = acc_o[mt][t].r[hf * kSlotElems + e2] * inv;
            const float v1 = acc_o[mt][t].r[hf * kSlotElems + e2 + 1] * inv;
            if (AccLayout::kAdjacentPairs && a.out_vec_ok && col + 1 < a.dv) {
              *reinterpret_cast<uint32_t*>(dst + col) = Elem::pack(v0, v1);
            } else {
              if (col < a.dv) dst[col] = Elem::from_float(v0);
              if (col1 < a.dv) dst[col1] = Elem::from_float(v1);
            }
          }
        if (a.lse != nullptr && query_leader(lane)) a.lse[a.lse_addr.at(b, q_start, h, i)] = lse;
      }
    }
#endif
}

FP_TARGET_NS_END
}  // namespace flashport::gpu

// ---- host side: per-device setup and launch of one instance (CUDA; HIP: fwd_amd.hip) --------
#if defined(FP_TARGET_NVIDIA)
#include "gpu/common/kernel_info.cuh"

namespace flashport::gpu {

template <int kTile, bool kBf16>
using FwdInstance = KernelInstance<fwd_kernel<kTile, std::conditional_t<kBf16, BFloat16, Half>>,
                                   kTileConfigs[kTile].threads(), kTileConfigs[kTile].smem_bytes()>;

template <int kTile, bool kBf16>
KernelInfo fwd_kernel_info(int device) {
  return FwdInstance<kTile, kBf16>::info(device);
}

template <int kTile, bool kBf16>
gpuError_t launch_fwd(const FwdArgs& a, dim3 grid, gpuStream_t stream) {
  return FwdInstance<kTile, kBf16>::launch(a, grid, stream);
}

#define FP_INSTANTIATE_FWD(tile)                                                 \
  template KernelInfo fwd_kernel_info<tile, false>(int);                         \
  template KernelInfo fwd_kernel_info<tile, true>(int);                          \
  template gpuError_t launch_fwd<tile, false>(const FwdArgs&, dim3, gpuStream_t); \
  template gpuError_t launch_fwd<tile, true>(const FwdArgs&, dim3, gpuStream_t);

}  // namespace flashport::gpu
#endif  // FP_TARGET_NVIDIA
