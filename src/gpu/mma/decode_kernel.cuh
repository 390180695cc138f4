// The decode kernel (CUDA, sm_80+): attention of a few query rows against a long KV cache,
// memory-bound, so built to keep K/V bytes in flight and to split keys, not rows:
//   - a block is (split, head, sequence): all packed query rows of the head (Sq x GQA group
//     <= 16, one 16-row m-tile) against the split's share of the keys;
//   - every thread copies: (K, V) tiles of kDecodeTile.block_n keys (128) stream through a ring
//     of kDecodeTile.stages shared slots (2) with 16-byte cp.async (KvTileLoader, as the mma.sync
//     forward: contiguous, paged with any page size, cache_batch_idx, cache_leftpad, varlen):
//     the next tile lands while this one is used, one block per SM (tile_config.hpp);
//   - each of the 8 warps takes 16 keys of every tile (S = Q K^T, the score hooks, an online
//     softmax of its own, O += P V: 32 mma.sync per warp and tile, Q in registers), so the math
//     of a tile is spread over the SM's four schedulers, two warps each, instead of one warp's
//     16 rows;
//   - the warps' states merge in shared memory at the end; with splits the block writes an fp32
//     partial and takes a count of its (sequence, head)'s counter in the workspace (a
//     NonceCounter, started by split 0 with the call's nonce); the block taking the last count
//     merges the partials into out / lse: no second kernel, and no memset node before the launch
//     (the caller's workspace needs no zeroing; below).
// Score features are the forward main loop's hooks (KernelScoreRules): causal/window masks only
// on tiles that cut a row's range, softcap, ALiBi, sinks (folded into split 0). Dropout is
// declined by the planner (decode_plan.hpp).
#pragma once
#include <cstdint>
#include <type_traits>

#include "gpu/common/kernel_info.cuh"
#include "gpu/common/nonce_counter.cuh"
#include "gpu/mma/fwd_kernel.cuh"

namespace flashport::gpu {

template <typename Elem>
__global__ void __launch_bounds__(kDecodeTile.threads(), kDecodeTile.min_blocks)
    decode_kernel(const FP_GRID_CONSTANT FwdArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  FP_REQUIRE_ARCH(kMinNvidiaArch);
#else
  constexpr DecodeTileConfig C = kDecodeTile;
  constexpr int D = C.head_dim, BN = C.block_n, NT = C.threads(), kRows = C.rows, kWarps = C.warps;
  constexpr int kStages = C.stages;
  constexpr int kWarpKeys = C.keys_per_warp();  // 16: one k-step of P V
  constexpr int kNTiles = kWarpKeys / AccLayout::kCols;  // accumulator tiles of a warp's keys
  constexpr int kDTiles = D / AccLayout::kCols;          // accumulator tiles of output columns
  constexpr int kKSteps = D / 16;
  constexpr int kSlots = AccLayout::kRowSlots;
  constexpr int kSlotElems = AccLayout::kSlotElems;
  constexpr int kChunks = D / 8;
  using Tile = SmemTile<D>;
  static_assert(kRows == 16 && kWarpKeys == 16 && BN % 16 == 0, "one m-tile of rows, one P V k-step per warp");

  FP_EXTERN_SMEM(uint16_t, smem);
  uint16_t* sQ = smem;
  uint16_t* ring = sQ + kRows * Tile::kRowElems;
  auto slot_k = [&](int slot) { return ring + slot * 2 * BN * Tile::kRowElems; };
  __shared__ float s_max[kWarps][kRows], s_sum[kWarps][kRows];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int split = blockIdx.x;
  const int head_idx = blockIdx.y;  // kv head (packed GQA) or query head
  const int b = blockIdx.z;
  const ScoreRules& R = a.rules;
  // The (sequence, head)'s split counter: split 0 starts it for this call (its splits take their
  // counts at their ends, long after).
  NonceCounter* const counter = a.splits > 1 ? a.split_counters + (int64_t(b) * gridDim.y + head_idx) : nullptr;
  if (counter != nullptr && split == 0 && tid == 0) nonce_counter_start(counter, a.call_nonce);

  const FwdSeqLengths lengths(a, b);
  const int lq = lengths.lq, lk = lengths.lk;
  const int m_rows = lq * a.pack;  // <= kRows (planner)
  if (m_rows <= 0) return;         // every block of this (sequence, head) returns here
  const int64_t q_start = a.seq.q_start(b);
  const int kvh = a.pack > 1 ? head_idx : head_idx / a.group;
  const LoopScalar softcap_in(a.softcap_in);
  const KernelScoreRules S(R, lq, lk, a.scale_log2, softcap_in.value, a.softcap_out);
  auto row_i = [&](int m) -> int { return a.pack > 1 ? m / a.pack : m; };
  auto row_h = [&](int m) -> int { return a.pack > 1 ? kvh * a.group + m % a.pack : head_idx; };

  // Key tiles of this split: the rows' visible keys, cut to the split's share.
  const int key_lo = S.vis_lo(0), key_hi = S.vis_hi(lq - 1);
  int n_lo = key_lo / BN;
  int n_hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : n_lo;
  clip_key_blocks_to_split(n_lo, n_hi, lk, BN, split, a.splits);

  FragC acc_o[kDTiles];
#pragma unroll
  for (int t = 0; t < kDTiles; ++t)
#pragma unroll
    for (int e = 0; e < kAccElems; ++e) acc_o[t].r[e] = 0.0f;
  float row_max[kSlots], row_sum[kSlots];
#pragma unroll
  for (int hf = 0; hf < kSlots; ++hf) row_max[hf] = -INFINITY, row_sum[hf] = 0.0f;

  if (n_lo < n_hi) {
    const KvTileLoader<D, BN, NT> kload(a.k, a.seq, a.k_addr, b, kvh);
    const KvTileLoader<D, BN, NT> vload(a.v, a.seq, a.v_addr, b, kvh);
    // Q (rows past m_rows and columns past d are zeros); lands with the first ring group.
    for (int idx = tid; idx < kRows * kChunks; idx += NT) {
      const int r = idx / kChunks, c = idx % kChunks;
      const uint16_t* src = r < m_rows ? a.q + a.q_addr.at(b, q_start, row_i(r), row_h(r)) : nullptr;
      load_chunk(sQ + Tile::offset(r, c), src, c, a.d, a.vec_ok);
    }
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (n_lo + st < n_hi) {
        kload.load(slot_k(st), n_lo + st, lk, a.d, a, a.k_addr, tid);
        vload.load(slot_k(st) + BN * Tile::kRowElems, n_lo + st, lk, a.dv, a, a.v_addr, tid);
      }
      cp_async_commit();
    }

    // Plain scores stay raw with the scale folded into the exp2; transformed ones are log2 units.
    const bool transformed = S.softcapped() || S.alibi() || !(*S.scale > 0.0f);
    const float mul = transformed ? 1.0f : *S.scale;
    const int warp_key0 = warp * kWarpKeys;  // this warp's keys inside a tile
    QFrag qa[kKSteps];
    int slot = 0;
    for (int nb = n_lo; nb < n_hi; ++nb) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile nb (and Q) landed; every warp is done with the slot refilled next
      if (nb == n_lo) {
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) load_q<D>(qa[ks], sQ, 0, ks * 16, lane);
      }
      const int nf = nb + kStages - 1;
      if (nf < n_hi) {
        const int fslot = slot == 0 ? kStages - 1 : slot - 1;
        kload.load(slot_k(fslot), nf, lk, a.d, a, a.k_addr, tid);
        vload.load(slot_k(fslot) + BN * Tile::kRowElems, nf, lk, a.dv, a, a.v_addr, tid);
      }
      cp_async_commit();
      const uint16_t* sK = slot_k(slot);
      const uint16_t* sV = sK + BN * Tile::kRowElems;

      // S = Q K^T for the warp's 16 keys (columns past d are zeros in both).
      FragC acc_s[kNTiles];
#pragma unroll
      for (int t = 0; t < kNTiles; ++t)
#pragma unroll
        for (int e = 0; e < kAccElems; ++e) acc_s[t].r[e] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        KFrag kb;
        load_k<D>(kb, sK, warp_key0, ks * 16, lane);
        mma_qk<Elem>(acc_s, 0, qa[ks], kb);
      }

      // Feature hooks (block-uniform branches), as the forward main loop.
      const int n0 = nb * BN + warp_key0;  // key of the warp's column 0
      if (transformed) {
#pragma unroll
        for (int hf = 0; hf < kSlots; ++hf) {
          const int m = AccLayout::row(lane, hf);
          const int base = S.diagonal(row_i(m)) - n0;
          const float slope = R.alibi ? -R.alibi_slope(b, row_h(m < m_rows ? m : 0)) * kLog2e : 0.0f;
          transform_row(acc_s, hf, lane, S, base, slope);
        }
      }
      if (S.tile_needs_mask(nb, BN, 0, lq - 1)) {
#pragma unroll
        for (int hf = 0; hf < kSlots; ++hf) {
          const int i = row_i(AccLayout::row(lane, hf));
          mask_row(acc_s, hf, lane, S.vis_lo(i) - n0, S.vis_hi(i) - n0);
        }
      }

      // Online softmax (base 2) of the warp's keys; O rescaled only when a row max moved.
      float corr[kSlots];
      bool any_moved = false;
#pragma unroll
      for (int hf = 0; hf < kSlots; ++hf) any_moved |= online_softmax_row(acc_s, hf, mul, row_max[hf], row_sum[hf], corr[hf]);
      if (warp_any(any_moved)) {
#pragma unroll
        for (int t = 0; t < kDTiles; ++t)
#pragma unroll
          for (int e = 0; e < kAccElems; ++e) acc_o[t].r[e] *= corr[e / kSlotElems];
      }

      // O += P V (the warp's 16 keys are one k-step; V columns past dv are zeros).
      const PFrag pa = p_frag<Elem>(acc_s, 0, lane);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        VFrag vb;
        load_v<D>(vb, sV, warp_key0, dp * 16, lane);
        mma_pv<Elem>(acc_o, dp, pa, vb);
      }
      slot = slot + 1 == kStages ? 0 : slot + 1;
    }
    cp_async_wait<0>();  // the trailing groups are empty; nothing may land in the scratch below
  }

  // ---- merge the warps' states (the ring is the scratch) -----------------------------------
  __syncthreads();  // every warp is done reading the ring
  float* sO = reinterpret_cast<float*>(ring);
  constexpr int kORow = D + DecodeTileConfig::kScratchPad;
#pragma unroll
  for (int hf = 0; hf < kSlots; ++hf) {
    const float l = query_sum(row_sum[hf]);
    const int r = AccLayout::row(lane, hf);
    if (query_leader(lane)) s_max[warp][r] = row_max[hf], s_sum[warp][r] = l;
#pragma unroll
    for (int t = 0; t < kDTiles; ++t) {
      float* dst = sO + (warp * kRows + r) * kORow + t * AccLayout::kCols + AccLayout::col(lane, 0);
      *reinterpret_cast<float2*>(dst) = make_float2(acc_o[t].r[hf * kSlotElems], acc_o[t].r[hf * kSlotElems + 1]);
    }
  }
  __syncthreads();

  // Thread -> (row, 16 columns): the block's rows finished, normalised, stored (out / lse, or
  // the split's fp32 partial).
  constexpr int kThreadsPerRow = NT / kRows;     // 8
  constexpr int kCols = D / kThreadsPerRow;      // 16
  static_assert(kCols % 8 == 0, "whole 16-byte output chunks per thread");
  {
    const int r = tid / kThreadsPerRow, c0 = (tid % kThreadsPerRow) * kCols;
    if (r < m_rows) {
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_max[w][r]);
      const float m_use = mx == -INFINITY ? 0.0f : mx;
      float l = 0.0f, o[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) o[c] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = fast_exp2(s_max[w][r] - m_use);  // 0 for a warp without keys
        l += s_sum[w][r] * f;
        const float* src = sO + (w * kRows + r) * kORow + c0;
#pragma unroll
        for (int c = 0; c < kCols; c += 4) {
          const float4 v = *reinterpret_cast<const float4*>(src + c);
          o[c] += f * v.x, o[c + 1] += f * v.y, o[c + 2] += f * v.z, o[c + 3] += f * v.w;
        }
      }
      const int i = row_i(r), h = row_h(r);
      const float o_scale = R.sinks != nullptr && split == 0 ? fold_sink(R.sinks[h] * kLog2e, mx, l) : 1.0f;
      const float inv = l > 0.0f ? o_scale / l : 0.0f;
      const float lse = l > 0.0f ? (mx + __log2f(l)) * kLn2 : -INFINITY;
      if (a.splits > 1) {
        const int64_t row = (int64_t(b) * a.hq + h) * a.seq.sq + i;
        float* dst = a.ws_o + (int64_t(split) * a.ws_rows + row) * a.dv;
        // dv is a multiple of 8 (planner) and the partials 256-byte aligned: 16-byte stores.
#pragma unroll
        for (int c = 0; c < kCols; c += 4)
          if (c0 + c < a.dv)
            *reinterpret_cast<float4*>(dst + c0 + c) = make_float4(o[c] * inv, o[c + 1] * inv, o[c + 2] * inv, o[c + 3] * inv);
        if (c0 == 0) a.ws_lse[int64_t(split) * a.ws_rows + row] = lse;
      } else {
        typename Elem::T* dst = static_cast<typename Elem::T*>(a.out) + a.out_addr.at(b, q_start, i, h);
#pragma unroll
        for (int c = 0; c < kCols; c += 8) {
          if (c0 + c >= a.dv) continue;
          if (a.out_vec16_ok) {
            uint4 w;
            w.x = Elem::pack(o[c] * inv, o[c + 1] * inv);
            w.y = Elem::pack(o[c + 2] * inv, o[c + 3] * inv);
            w.z = Elem::pack(o[c + 4] * inv, o[c + 5] * inv);
            w.w = Elem::pack(o[c + 6] * inv, o[c + 7] * inv);
            *reinterpret_cast<uint4*>(dst + c0 + c) = w;
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[c0 + c + e] = Elem::from_float(o[c + e] * inv);
          }
        }
        if (a.lse != nullptr && c0 == 0) a.lse[a.lse_addr.at(b, q_start, h, i)] = lse;
      }
    }
  }
  if (a.splits <= 1) return;

  // ---- the split block taking the last count merges the partials --------------------------
  // Once its partial is stored, a block takes one count of its (sequence, head)'s counter
  // (common/nonce_counter.cuh: it first waits for split 0's start, which came at that block's
  // start; the take is an acquire-release atomic add). Release: the barrier orders every thread's
  // partial stores before thread 0's take. The block whose take returns splits - 1 came last:
  // every other partial is stored before it (acquire); it merges, reading the partials through
  // L2 (__ldcg: never a stale L1 line), and its take set `ready` back to 0 so that a CUDA-graph
  // replay, which repeats the nonce, waits for split 0 again. One take and one atomic round trip
  // a block (the flags before session 20 took a fence, a store, a fence and a load of every
  // flag). The workspace needs no zeroing: a word not written by this call equals the nonce with
  // probability 2^-64.
  __shared__ int s_last;
  __syncthreads();
  if (tid == 0) s_last = nonce_counter_take(counter, a.call_nonce, true, a.splits) == a.splits - 1;
  __syncthreads();
  if (!s_last) return;
  // Thread -> (row, 4 columns). One pass over the splits, kMergeUnroll at a time (their loads in
  // flight together: at B=1, 32 splits are two L2 round trips), with a running max:
  //   lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) out_s; all empty: out 0, lse -inf.
  constexpr int kMergeUnroll = 16;
  constexpr int kItemsPerRow = D / 4;
  for (int item = tid; item < m_rows * kItemsPerRow; item += NT) {
    const int r = item / kItemsPerRow, c = (item % kItemsPerRow) * 4;
    if (c >= a.dv) continue;
    const int i = row_i(r), h = row_h(r);
    const int64_t row = (int64_t(b) * a.hq + h) * a.seq.sq + i;
    const float* lse_p = a.ws_lse + row;
    const float* o_p = a.ws_o + row * a.dv + c;
    float mx = -INFINITY, sum = 0.0f;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = 0; s0 < a.splits; s0 += kMergeUnroll) {
      float l[kMergeUnroll];
      float4 v[kMergeUnroll];
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        const bool ok = s0 + u < a.splits;
        const int64_t sp = ok ? s0 + u : 0;
        l[u] = ok ? __ldcg(lse_p + sp * a.ws_rows) : -INFINITY;
        v[u] = __ldcg(reinterpret_cast<const float4*>(o_p + sp * a.ws_rows * a.dv));
      }
      float m_new = mx;
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) m_new = fmaxf(m_new, l[u]);
      if (m_new == -INFINITY) continue;  // no keys in any split so far
      const float rescale = __expf(mx - m_new);  // 0 while mx is -inf (sum and acc are 0 then)
      sum *= rescale, acc.x *= rescale, acc.y *= rescale, acc.z *= rescale, acc.w *= rescale;
      mx = m_new;
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        const float w = l[u] == -INFINITY ? 0.0f : __expf(l[u] - mx);
        sum += w;
        if (w != 0.0f) acc.x += w * v[u].x, acc.y += w * v[u].y, acc.z += w * v[u].z, acc.w += w * v[u].w;
      }
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    typename Elem::T* dst = static_cast<typename Elem::T*>(a.out) + a.out_addr.at(b, q_start, i, h) + c;
    if (a.out_vec_ok) {
      *reinterpret_cast<uint32_t*>(dst) = Elem::pack(acc.x * inv, acc.y * inv);
      *reinterpret_cast<uint32_t*>(dst + 2) = Elem::pack(acc.z * inv, acc.w * inv);
    } else {
      dst[0] = Elem::from_float(acc.x * inv), dst[1] = Elem::from_float(acc.y * inv);
      dst[2] = Elem::from_float(acc.z * inv), dst[3] = Elem::from_float(acc.w * inv);
    }
    if (a.lse != nullptr && c == 0) a.lse[a.lse_addr.at(b, q_start, h, i)] = sum > 0.0f ? mx + __logf(sum) : -INFINITY;
  }
#endif
}

// ---- host side: per-device query and launch of the two instances (decode_d128.cu) -----------
template <bool kBf16>
using DecodeInstance = KernelInstance<decode_kernel<std::conditional_t<kBf16, BFloat16, Half>>,
                                      kDecodeTile.threads(), kDecodeTile.smem_bytes()>;

template <bool kBf16>
KernelInfo decode_kernel_info(int device) {
  return DecodeInstance<kBf16>::info(device);
}

template <bool kBf16>
gpuError_t launch_decode(const FwdArgs& a, dim3 grid, gpuStream_t stream) {
  return DecodeInstance<kBf16>::launch(a, grid, stream);
}

}  // namespace flashport::gpu
