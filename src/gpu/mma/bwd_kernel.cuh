// The backward main loop (FlashAttention-2 style: key blocks outer, query blocks inner), written
// once; the tile and the storage type are the only template arguments, every feature is a
// runtime hook behind a block-uniform branch, as in the forward.
//
// One block owns BN keys of one kv head. Per step (one query block of BM rows of one query head
// of the group) the warps work in three stages:
//   1. warp (kg, qg) computes S^T = K Q^T and dP^T = V dO^T for its 16 keys x BM/QW queries,
//      turns them into P (from the saved LSE, masks, softcap, ALiBi, dropout replay) and
//      dS = P (dP - D) (x softcap derivative), and writes dropout(P)^T and dS^T to shared memory;
//   2. the same warp adds dV += P^T dO and dK += dS^T Q for its 16 keys x D/QW columns
//      (registers, over every step of the block);
//   3. warp (mg, cg) computes dQ = dS K for 16 queries x D/CW columns and adds it to the fp32
//      accumulator (deterministic mode: after the previous key block has added its part).
// Q and dO are double-buffered with cp.async: the next step's copy overlaps this step's math.
#pragma once
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "gpu/mma/bwd_launch.hpp"
#include "gpu/common/kernel_info.cuh"
#include "core/philox.hpp"
#include "gpu/common/tile_io.cuh"
#include "gpu/common/tile_mma.hpp"

namespace flashport::gpu {

constexpr float kBwdLog2e = 1.4426950408889634f;

// Element offset of key row j of sequence b, head kvh in a batched or packed k-like tensor (the
// backward takes no paged cache and no cache_batch_idx: resolve_bwd declines them).
struct BwdKvRows {
  int64_t base = 0, stride = 0;
  __device__ __forceinline__ BwdKvRows(const SeqInfo& s, const KvAddr& a, int64_t b, int64_t kvh) {
    if (a.layout == KvLayout::Packed) {
      base = s.k_start(b) * a.s0 + kvh * a.s2;
      stride = a.s0;
    } else {
      base = b * a.s0 + kvh * a.s2;
      stride = a.s1;
    }
  }
  __device__ __forceinline__ int64_t at(int j) const { return base + int64_t(j) * stride; }
};

// 4 bytes global -> shared; src_bytes 0 stores zero (rows past the end).
__device__ __forceinline__ void bwd_cp_async_4(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
}

// dq_acc[0..1] += (x, y): one vector reduction on sm_90, two scalar ones before.
__device__ __forceinline__ void bwd_add_pair(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// A fragment of rows [row0, row0+16) x k columns [k0, k0+16) of the TRANSPOSE of a row-major
// shared tile stored [k][m] (dQ = dS K reads dS from the dS^T tile). Same register layout as
// load_a; ldmatrix .trans transposes each 8x8 matrix.
template <int kCols>
__device__ __forceinline__ void load_a_trans(FragA& a, const uint16_t* tile, int row0, int k0,
                                             int lane) {
  const int mat = lane >> 3;
  const int row = k0 + (lane & 7) + ((mat >> 1) << 3);
  const int chunk = (row0 >> 3) + (mat & 1);
  ldmatrix_x4_trans(a.r, smem_u32(tile + SmemTile<kCols>::offset(row, chunk)));
}

// Last key block that visits query block m (deterministic mode adds the key blocks' dQ parts in
// descending key order). Key block n visits m iff its query range [i_first(n), i_end(n)) meets
// [m*BM, min(m*BM+BM, lq)); both ends grow with n, so the visitors are a contiguous range of n.
// Descending order pipelines causal masks: the last visitor of a query block is the key block
// that starts there, so no block waits for a block that is still far from that query block.
__device__ __forceinline__ int last_key_block(int m, int bm, int bn, int lq, int lk, int shift, int wr) {
  const int last = (lk - 1) / bn;
  if (wr < 0) return last;
  const int top = (m + 1) * bm < lq ? (m + 1) * bm : lq;  // i_first(n) = n*bn - shift - wr < top
  const int x = top + shift + wr;                          // n*bn < x
  const int n = x <= 0 ? -1 : (x + bn - 1) / bn - 1;
  return n < last ? n : last;
}

template <int kTile, typename Elem>
__global__ void __launch_bounds__(kBwdTiles[kTile].threads(), kBwdTiles[kTile].min_blocks)
    bwd_kernel(const __grid_constant__ BwdArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  FP_REQUIRE_ARCH(kMinNvidiaArch);
#else
  constexpr BwdTile C = kBwdTiles[kTile];
  constexpr int D = C.head_dim, BM = C.block_m, BN = C.block_n, NT = C.threads(), W = C.warps;
  constexpr int KR = C.key_tiles, QR = C.dq_tiles;  // 16-row tiles per warp (keys; dQ rows)
  constexpr int KW = C.key_groups(), QW = C.col_groups();
  static_assert(KW * QW == W && BN == 16 * KR * KW, "warps = key groups x column groups");
  constexpr int SC = BM / QW, ST = SC / 8;  // stage 1: query columns per warp, 8-col tiles
  constexpr int DC = D / QW, DT = DC / 8;   // stage 2: dK/dV columns per warp
  constexpr int MR = BM / (16 * QR), CW = W / MR;  // stage 3: dQ row groups x column groups
  constexpr int QC = D / CW, QT = QC / 8;
  static_assert(ST % 2 == 0 && DT % 2 == 0 && QT % 2 == 0 && MR * CW == W, "tile shape");
  constexpr int kChunks = D / 8;

  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* sK = smem;
  uint16_t* sV = sK + BN * D;
  uint16_t* sQ = sV + BN * D;   // [2][BM * D]
  uint16_t* sdO = sQ + 2 * BM * D;  // [2][BM * D]
  uint16_t* sP = sdO + 2 * BM * D;  // [BN][BM] (P^T after dropout)
  uint16_t* sdS = sP + BN * BM;     // [BN][BM] (dS^T)
  float* sL = reinterpret_cast<float*>(sdS + BN * BM);  // [2][BM] lse (log2 units)
  float* sDs = sL + 2 * BM;                              // [2][BM] D

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Deterministic mode launches key blocks in descending order: a block only waits for blocks
  // launched before it (no deadlock whatever the residency).
  const int n_blk = a.deterministic ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int n0 = n_blk * BN;
  const ScoreRules& R = a.rules;

  int lq = static_cast<int>(a.seq.q_len(b));
  if (lq > a.seq.sq) lq = static_cast<int>(a.seq.sq);
  if (lq < 0) lq = 0;
  int64_t lk64 = a.seq.k_len(b);
  if (a.k_rows_cap > 0 && lk64 > a.k_rows_cap) lk64 = a.k_rows_cap;
  const int lk = lk64 < 0 ? 0 : static_cast<int>(lk64);
  const int64_t q_start = a.seq.q_start(b);
  const int64_t ws_row0 = a.seq.cu_q ? q_start : int64_t(b) * a.seq.sq;  // workspace row of i = 0
  const KernelScoreRules S(R, lq, lk, a.scale_log2, a.softcap_in, a.softcap_out);

  const int kg = warp % KW, qg = warp / KW;  // stages 1-2
  const int mg = warp % MR, cg = warp / MR;  // stage 3

  const int key0 = kg * 16 * KR;  // first key (in the block) of this warp's stage-1/2 rows
  const int qrow0 = mg * 16 * QR; // first query row (in the step) of this warp's dQ rows
  FragC acc_dk[KR][DT], acc_dv[KR][DT];
#pragma unroll
  for (int kr = 0; kr < KR; ++kr)
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[kr][t].r[e] = 0.0f, acc_dv[kr][t].r[e] = 0.0f;

  if (n0 < lk && lq > 0) {
    const int n1 = n0 + BN < lk ? n0 + BN : lk;
    const int i_first = S.rows_lo(n0), i_end = S.rows_end(n1);
    const int m_lo = i_first / BM;
    const int m_hi = i_end > i_first ? (i_end + BM - 1) / BM : m_lo;
    const int nm = m_hi - m_lo;
    const int steps = nm * a.group;

    if (steps > 0) {
      const BwdKvRows krows(a.seq, a.k_addr, b, kvh);
      const BwdKvRows vrows(a.seq, a.v_addr, b, kvh);
      for (int idx = tid; idx < BN * kChunks; idx += NT) {
        const int r = idx / kChunks, c = idx % kChunks;
        const int j = n0 + r;
        load_chunk(sK + SmemTile<D>::offset(r, c), j < lk ? a.k + krows.at(j) : nullptr, c, a.d, a.vec_ok);
        load_chunk(sV + SmemTile<D>::offset(r, c), j < lk ? a.v + vrows.at(j) : nullptr, c, a.dv, a.vec_ok);
      }
      // Q, dO, LSE, D of step s into buffer `buf`.
      auto load_step = [&](int s, int buf) {
        const int h = kvh * a.group + s / nm;
        const int m = m_lo + s % nm;
        uint16_t* q_dst = sQ + buf * BM * D;
        uint16_t* o_dst = sdO + buf * BM * D;
        for (int idx = tid; idx < BM * kChunks; idx += NT) {
          const int r = idx / kChunks, c = idx % kChunks;
          const int i = m * BM + r;
          const uint16_t* qs = i < lq ? a.q + a.q_addr.at(b, q_start, i, h) : nullptr;
          const uint16_t* os = i < lq ? a.dout + a.dout_addr.at(b, q_start, i, h) : nullptr;
          load_chunk(q_dst + SmemTile<D>::offset(r, c), qs, c, a.d, a.vec_ok);
          load_chunk(o_dst + SmemTile<D>::offset(r, c), os, c, a.dv, a.vec_ok);
        }
        // Rows past Lq get lse 0 and D 0: with their q and dO rows zero, their P is finite and
        // their dS and dV contributions are exactly 0 (dO = 0, dP = 0, D = 0).
        if (tid < BM) {
          const int i = m * BM + tid;
          const bool in = i < lq;
          const int64_t wrow = in ? int64_t(h) * a.total_rows + ws_row0 + i : 0;
          bwd_cp_async_4(sL + buf * BM + tid, a.ws_lse2 + wrow, in ? 4 : 0);
          bwd_cp_async_4(sDs + buf * BM + tid, a.ws_dsum + wrow, in ? 4 : 0);
        }
      };
      load_step(0, 0);
      cp_async_commit();

      const int q_ksteps = (a.d + 15) / 16;
      const bool full = a.d == D && a.dv == D;
      const int v_ksteps = (a.dv + 15) / 16;
      const float keep_scale = R.dropout_p > 0.0f ? 1.0f / (1.0f - R.dropout_p) : 1.0f;

      for (int s = 0; s < steps; ++s) {
        const int buf = s & 1;
        if (s + 1 < steps) {
          load_step(s + 1, buf ^ 1);
          cp_async_commit();
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();  // this step's tiles landed (and K, V on the first step)

        const int h = kvh * a.group + s / nm;
        const int m = m_lo + s % nm;
        const int i0 = m * BM;
        const uint16_t* tQ = sQ + buf * BM * D;
        const uint16_t* tdO = sdO + buf * BM * D;
        const float* tL = sL + buf * BM;
        const float* tDs = sDs + buf * BM;

        // ---- stage 1: S^T = K Q^T, dP^T = V dO^T --------------------------------------------
        FragC acc_s[KR][ST], acc_dp[KR][ST];
#pragma unroll
        for (int kr = 0; kr < KR; ++kr)
#pragma unroll
          for (int t = 0; t < ST; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[kr][t].r[e] = 0.0f, acc_dp[kr][t].r[e] = 0.0f;
        // kFull (head dims filling the bucket, the common case): straight-line loops the scheduler
        // can pipeline; otherwise the steps past d / dv are skipped.
        auto stage1 = [&](auto full_tag) {
          constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          if (kFull || ks < q_ksteps) {
            FragA ka[KR];
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) load_a<D>(ka[kr], sK, key0 + kr * 16, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < ST / 2; ++np) {
              FragBPair qb;
              load_b_rows<D>(qb, tQ, qg * SC + np * 16, ks * 16, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) {
                mma<Elem>(acc_s[kr][2 * np], ka[kr], qb.r[0], qb.r[1]);
                mma<Elem>(acc_s[kr][2 * np + 1], ka[kr], qb.r[2], qb.r[3]);
              }
            }
          }
          if (kFull || ks < v_ksteps) {
            FragA va[KR];
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) load_a<D>(va[kr], sV, key0 + kr * 16, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < ST / 2; ++np) {
              FragBPair ob;
              load_b_rows<D>(ob, tdO, qg * SC + np * 16, ks * 16, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) {
                mma<Elem>(acc_dp[kr][2 * np], va[kr], ob.r[0], ob.r[1]);
                mma<Elem>(acc_dp[kr][2 * np + 1], va[kr], ob.r[2], ob.r[3]);
              }
            }
          }
        }
        };
        if (full) stage1(std::true_type{}); else stage1(std::false_type{});

        // ---- P and dS (element (key j, query i)) ----------------------------------------------
        const bool need_mask = S.tile_needs_mask(n_blk, BN, i0, i0 + BM - 1);
        const float slope_log2 = R.alibi ? -R.alibi_slope(b, h) * kBwdLog2e : 0.0f;
#pragma unroll
        for (int kr = 0; kr < KR; ++kr)
#pragma unroll
        for (int t = 0; t < ST; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int jl = key0 + kr * 16 + c_row(lane, e);
            const int il = qg * SC + t * 8 + c_col(lane, e);
            const int j = n0 + jl, i = i0 + il;
            const auto sg = S.score_grad(acc_s[kr][t].r[e]);
            float sc = sg.score;
            if (S.alibi()) sc += S.alibi_bias(slope_log2, i, j);
            float p = fast_exp2(sc - tL[il]);
            if (need_mask && (j < S.vis_lo(i) || j >= S.vis_hi(i))) p = 0.0f;
            float keep = 1.0f;
            if (R.dropout_p > 0.0f)
              keep = dropout_keep(R.rng_seed(), R.rng_offset(), R.dropout_threshold, b, a.hq, h, i, j)
                         ? keep_scale : 0.0f;
            acc_dp[kr][t].r[e] = p * (acc_dp[kr][t].r[e] * keep - tDs[il]) * sg.dtanh;
            acc_s[kr][t].r[e] = p * keep;
          }
#pragma unroll
        for (int kr = 0; kr < KR; ++kr) {
          const int r0 = key0 + kr * 16 + (lane >> 2);
#pragma unroll
          for (int t = 0; t < ST; ++t) {
            const int col = qg * SC + t * 8 + (lane & 3) * 2;
            const int o0 = SmemTile<BM>::offset(r0, col >> 3) + (col & 7);
            const int o1 = SmemTile<BM>::offset(r0 + 8, col >> 3) + (col & 7);
            *reinterpret_cast<uint32_t*>(sP + o0) = Elem::pack(acc_s[kr][t].r[0], acc_s[kr][t].r[1]);
            *reinterpret_cast<uint32_t*>(sP + o1) = Elem::pack(acc_s[kr][t].r[2], acc_s[kr][t].r[3]);
            *reinterpret_cast<uint32_t*>(sdS + o0) = Elem::pack(acc_dp[kr][t].r[0], acc_dp[kr][t].r[1]);
            *reinterpret_cast<uint32_t*>(sdS + o1) = Elem::pack(acc_dp[kr][t].r[2], acc_dp[kr][t].r[3]);
          }
        }
        __syncthreads();  // P^T, dS^T complete

        // ---- stage 2: dV += P^T dO, dK += dS^T Q -------------------------------------------------
        auto stage2 = [&](auto full_tag) {
          constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int ks = 0; ks < BM / 16; ++ks) {
          FragA pa[KR], da[KR];
#pragma unroll
          for (int kr = 0; kr < KR; ++kr) {
            load_a<BM>(pa[kr], sP, key0 + kr * 16, ks * 16, lane);
            load_a<BM>(da[kr], sdS, key0 + kr * 16, ks * 16, lane);
          }
#pragma unroll
          for (int dp = 0; dp < DT / 2; ++dp) {
            const int col = qg * DC + dp * 16;
            if (kFull || col < a.dv) {
              FragBPair ob;
              load_b_trans<D>(ob, tdO, ks * 16, col, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) {
                mma<Elem>(acc_dv[kr][2 * dp], pa[kr], ob.r[0], ob.r[1]);
                mma<Elem>(acc_dv[kr][2 * dp + 1], pa[kr], ob.r[2], ob.r[3]);
              }
            }
            if (kFull || col < a.d) {
              FragBPair qb;
              load_b_trans<D>(qb, tQ, ks * 16, col, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) {
                mma<Elem>(acc_dk[kr][2 * dp], da[kr], qb.r[0], qb.r[1]);
                mma<Elem>(acc_dk[kr][2 * dp + 1], da[kr], qb.r[2], qb.r[3]);
              }
            }
          }
        }
        };
        if (full) stage2(std::true_type{}); else stage2(std::false_type{});

        // ---- stage 3: dQ += dS K -------------------------------------------------------------
        FragC acc_dq[QR][QT];
#pragma unroll
        for (int qr = 0; qr < QR; ++qr)
#pragma unroll
          for (int t = 0; t < QT; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dq[qr][t].r[e] = 0.0f;
        auto stage3 = [&](auto full_tag) {
          constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
          FragA sa[QR];
#pragma unroll
          for (int qr = 0; qr < QR; ++qr) load_a_trans<BM>(sa[qr], sdS, qrow0 + qr * 16, ks * 16, lane);
#pragma unroll
          for (int np = 0; np < QT / 2; ++np) {
            const int col = cg * QC + np * 16;
            if (kFull || col < a.d) {
              FragBPair kb;
              load_b_trans<D>(kb, sK, ks * 16, col, lane);
#pragma unroll
              for (int qr = 0; qr < QR; ++qr) {
                mma<Elem>(acc_dq[qr][2 * np], sa[qr], kb.r[0], kb.r[1]);
                mma<Elem>(acc_dq[qr][2 * np + 1], sa[qr], kb.r[2], kb.r[3]);
              }
            }
          }
        }
        };
        if (full) stage3(std::true_type{}); else stage3(std::false_type{});
        int32_t* sema = nullptr;
        if (a.deterministic) {
          // Wait until the key blocks after this one added their dQ part.
          sema = a.ws_sema + (int64_t(b) * a.hq + h) * a.m_blocks + m;
          if (tid == 0) {
            const int target = last_key_block(m, BM, BN, lq, lk, S.shift, S.wr) - n_blk;
            while (atomicAdd(sema, 0) != target) __nanosleep(64);
            __threadfence();
          }
          __syncthreads();
        }
        {
          float* dq_base = a.ws_dq + (int64_t(h) * a.total_rows + ws_row0) * a.dacc;
#pragma unroll
          for (int qr = 0; qr < QR; ++qr)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int i = i0 + qrow0 + qr * 16 + (lane >> 2) + hf * 8;
            if (i < lq) {
              float* row = dq_base + int64_t(i) * a.dacc;
#pragma unroll
              for (int t = 0; t < QT; ++t) {
                const int col = cg * QC + t * 8 + (lane & 3) * 2;
                if (col < a.d) bwd_add_pair(row + col, acc_dq[qr][t].r[hf * 2], acc_dq[qr][t].r[hf * 2 + 1]);
              }
            }
          }
        }
        if (a.deterministic) __threadfence();
        __syncthreads();  // every warp is done with this step's buffers (and its dQ is visible)
        if (a.deterministic && tid == 0) atomicAdd(sema, 1);
      }
    }
  }

  // ---- epilogue: dK = scale * acc, dV; rows past Lk of a batched tensor get 0 -----------------
  const int row_limit = a.k_rows_cap > 0 ? static_cast<int>(a.k_rows_cap) : lk;
  const BwdKvRows dkrows(a.seq, a.dk_addr, b, kvh);
  const BwdKvRows dvrows(a.seq, a.dv_addr, b, kvh);
  using T = typename Elem::T;
#pragma unroll
  for (int kr = 0; kr < KR; ++kr)
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int j = n0 + key0 + kr * 16 + (lane >> 2) + hf * 8;
    if (j >= row_limit) continue;
    T* dk_row = reinterpret_cast<T*>(a.dk_ptr) + dkrows.at(j);
    T* dv_row = reinterpret_cast<T*>(a.dv_ptr) + dvrows.at(j);
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      const int col = qg * DC + t * 8 + (lane & 3) * 2;
      const float k0 = acc_dk[kr][t].r[hf * 2] * a.scale, k1 = acc_dk[kr][t].r[hf * 2 + 1] * a.scale;
      const float v0 = acc_dv[kr][t].r[hf * 2], v1 = acc_dv[kr][t].r[hf * 2 + 1];
      if (a.kv_out_vec_ok && col + 1 < a.d) {
        *reinterpret_cast<uint32_t*>(dk_row + col) = Elem::pack(k0, k1);
      } else {
        if (col < a.d) dk_row[col] = Elem::from_float(k0);
        if (col + 1 < a.d) dk_row[col + 1] = Elem::from_float(k1);
      }
      if (a.kv_out_vec_ok && col + 1 < a.dv) {
        *reinterpret_cast<uint32_t*>(dv_row + col) = Elem::pack(v0, v1);
      } else {
        if (col < a.dv) dv_row[col] = Elem::from_float(v0);
        if (col + 1 < a.dv) dv_row[col + 1] = Elem::from_float(v1);
      }
    }
  }
#endif
}

// ---- host side -----------------------------------------------------------------------------
template <int kTile, bool kBf16>
BwdKernelInfo bwd_kernel_info(int device) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  constexpr BwdTile C = kBwdTiles[kTile];
  return cached_kernel_info<bwd_kernel<kTile, Elem>>(device, C.threads(), C.smem_bytes());
}

template <int kTile, bool kBf16>
gpuError_t launch_bwd(const BwdArgs& a, dim3 grid, gpuStream_t stream) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  constexpr BwdTile C = kBwdTiles[kTile];
  bwd_kernel<kTile, Elem><<<grid, C.threads(), C.smem_bytes(), stream>>>(a);
  return gpuGetLastError();
}

#define FP_INSTANTIATE_BWD(tile)                                                  \
  template BwdKernelInfo bwd_kernel_info<tile, false>(int);                       \
  template BwdKernelInfo bwd_kernel_info<tile, true>(int);                        \
  template gpuError_t launch_bwd<tile, false>(const BwdArgs&, dim3, gpuStream_t); \
  template gpuError_t launch_bwd<tile, true>(const BwdArgs&, dim3, gpuStream_t);

}  // namespace flashport::gpu
