// The fp32 backward (FlashAttention-2 style, 3xTF32 mma.sync m16n8k8 products), three launches on
// the caller's stream like the mma.sync backward (mma/bwd_launch.hpp), over the same workspace
// layout (bwd_workspace):
//   1. preprocess: D_i = dout_i . out_i, LSE in log2 units (+inf for rows that saw nothing),
//      zeroed fp32 dq accumulator and deterministic-mode semaphores;
//   2. main loop: one block (8 warps; Hopper's D256 tile 16) per (key block, kv head, batch)
//      keeps dK, dV of its keys in registers over every query block of every query head of its
//      GQA group, and adds dQ into the accumulator (atomics; deterministic mode orders the key
//      blocks of a query block with a per-(b, h, q-block) semaphore, so every dq element is summed
//      in the same order every run);
//   3. convert: dq = scale * accumulator; the sink gradient (mma/bwd_aux.cu's kernel).
// Stage 1: S^T = K Q^T and dP^T = V dO^T (a warp: 16 keys x its query tiles), then P and dS into
// shared memory per query row; stage 2: dV += P^T dO, dK += dS^T Q (16 keys x its column tiles);
// stage 3: dQ = dS K (16 queries x its column tiles). Fragment coordinates: tf32_frag.hpp.
#include <algorithm>
#include <cstdio>
#include <type_traits>

#include "gpu/common/fwd_plan.hpp"
#include "gpu/common/kernel_info.cuh"
#include "gpu/f32/f32_common.cuh"
#include "gpu/f32/f32_launch.hpp"
#include "gpu/f32/tf32_frag.hpp"
#include "gpu/mma/bwd_block.cuh"
#include "gpu/mma/bwd_launch.hpp"

namespace flashport::gpu {
namespace f32 {

constexpr int kAuxWarps = 8;

// Workspace row r (of total_rows) of a head -> (b, i): batched rows are b * Sq + i; packed rows
// are addressed directly (b = 0, sequence start 0, row r).
struct RowRef {
  int64_t b, i;
};
__device__ __forceinline__ RowRef row_ref(const BwdArgs& a, int64_t r) {
  if (a.seq.cu_q != nullptr) return {0, r};
  return {r / a.seq.sq, r % a.seq.sq};
}

__global__ void __launch_bounds__(kAuxWarps * 32) bwd_f32_preprocess(const __grid_constant__ BwdArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t s = gtid; s < a.sema_count; s += int64_t(gridDim.x) * blockDim.x) a.ws_sema[s] = 0;
  const int64_t w = gtid >> 5;
  if (w >= a.total_rows * a.hq) return;
  const int64_t h = w / a.total_rows, r = w % a.total_rows;
  const RowRef rr = row_ref(a, r);
  const float* o = reinterpret_cast<const float*>(a.out) + a.out_addr.at(rr.b, 0, rr.i, h);
  const float* g = reinterpret_cast<const float*>(a.dout) + a.dout_addr.at(rr.b, 0, rr.i, h);
  const bool used = a.seq.cu_q == nullptr || r < a.seq.cu_q[a.seq.batch];  // packed rows past Tq: unread
  float dot = 0.0f;
  if (used)
    for (int c = lane; c < a.dv; c += 32) dot = fmaf(o[c], g[c], dot);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) dot += shfl_xor(dot, off);
  float* acc = a.ws_dq + w * a.dacc;
  for (int c = lane; c < a.dacc; c += 32) acc[c] = 0.0f;
  if (lane == 0) {
    const float lse = used ? a.lse[a.lse_addr.at(rr.b, 0, h, rr.i)] : -INFINITY;
    a.ws_dsum[w] = dot;
    a.ws_lse2[w] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

__global__ void __launch_bounds__(kAuxWarps * 32) bwd_f32_convert(const __grid_constant__ BwdArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (w >= a.total_rows * a.hq) return;
  const int64_t h = w / a.total_rows, r = w % a.total_rows;
  if (a.seq.cu_q != nullptr && r >= a.seq.cu_q[a.seq.batch]) return;  // not a row of any sequence
  const RowRef rr = row_ref(a, r);
  float* dst = reinterpret_cast<float*>(a.dq_ptr) + a.dq_addr.at(rr.b, 0, rr.i, h);
  const float* acc = a.ws_dq + w * a.dacc;
  for (int c = lane; c < a.d; c += 32) dst[c] = acc[c] * a.scale;
}

// dq_acc[0..1] += v0, v1: one vector reduction on sm_90, two scalar ones before.
__device__ __forceinline__ void add_pair(float* dst, float v0, float v1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(v0, v1));
#else
  atomicAdd(dst, v0);
  atomicAdd(dst + 1, v1);
#endif
}

// D64: two blocks per SM fit its shared memory, so registers are capped for them; D128 and D256
// take one block per SM (shared memory): 8 warps up to 255 registers, Hopper's D256 16 warps at 128.
template <int kTile>
__global__ void __launch_bounds__(kF32BwdTiles[kTile].threads, kTile == kF32BwdD64 ? 2 : 1) bwd_f32_kernel(const __grid_constant__ BwdArgs a) {
  constexpr F32Tile C = kF32BwdTiles[kTile];
  constexpr int D = C.head_dim, BM = C.block_m, BN = C.block_n, NT = C.threads, S = C.row_stride();
  constexpr int kWarps = NT / 32, DS = C.q_stride();
  // Stages 1 and 2: warp w owns the 16 keys of m-tile w % MK; stage 1 its NQ1 8-query tiles
  // (from (w / MK) NQ1), stage 2 its NC2 8-column tiles (from (w / MK) NC2). Stage 3: the 16
  // queries of m-tile w % MQ and NC3 8-column tiles (from (w / MQ) NC3).
  constexpr int MK = BN / 16, NQ1 = BM / 8 / (kWarps / MK), NC2 = D / 8 / (kWarps / MK);
  constexpr int MQ = BM / 16, NC3 = D / 8 / (kWarps / MQ);
  // Stage 1 with one product a warp (the H200 D256 tile): warps [0, kWarps / 2) compute S^T, the
  // others dP^T; warp p of a half owns the 16 keys of m-tile p % MK and NQ1P query tiles (from
  // (p / MK) NQ1P), twice a warp's NQ1, so each split A fragment serves twice the products. H200
  // (session 34, both orders): D256 +2.9-4.2%, D128 +-0.3%, D64 -8 to -9% (the round trip of S^T
  // and dP^T through shared memory and its barrier cost more than the fewer A splits save).
  constexpr bool kOneProductStage1 = kTile == kF32BwdD256;
  constexpr int NQ1P = kOneProductStage1 ? BM / 8 / (kWarps / 2 / MK) : NQ1;
  // S = 4 (mod 32) and DS = 4 (mod 32): every fragment read below hits 32 banks except stage 3's
  // A reads of dS (two ways).
  static_assert(kWarps % MK == 0 && kWarps % MQ == 0 && NQ1 >= 1 && NC2 >= 1 && NC3 >= 1 && NQ1 * 4 <= 32 &&
                    (!kOneProductStage1 || (kWarps / 2) % MK == 0) && S % 32 == 4 && DS % 32 == 4,
                "warp mapping");
  using F = Tf32Frag;

  extern __shared__ __align__(16) float smem[];
  float* sK = smem;
  float* sV = sK + BN * S;
  float* sQ = sV + BN * S;
  float* sdO = sQ + BM * S;
  float* sP = sdO + BM * S;   // [BM][BN + 4]: dropout(P), per query
  float* sdS = sP + BM * DS;  // [BM][BN + 4]: dS, per query
  float* sL = sdS + BM * DS;  // [BM] lse (log2 units)
  float* sDs = sL + BM;       // [BM] D

  // BwdArgs carries the tensors as untyped storage pointers; an fp32 call's are floats.
  const float* q = reinterpret_cast<const float*>(a.q);
  const float* k = reinterpret_cast<const float*>(a.k);
  const float* v = reinterpret_cast<const float*>(a.v);
  const float* dout = reinterpret_cast<const float*>(a.dout);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int key_tile = 16 * (warp % MK);        // stages 1, 2: the warp's first key (local)
  const int q_tile1 = 8 * NQ1 * (warp / MK);    // stage 1: the warp's first query (local)
  const int col2 = 8 * NC2 * (warp / MK);       // stage 2: the warp's first column
  const int q_tile3 = 16 * (warp % MQ);         // stage 3: the warp's first query (local)
  const int col3 = 8 * NC3 * (warp / MQ);       // stage 3: the warp's first column
  const BwdBlock blk(a, BN);
  const int n_blk = blk.n_blk, kvh = blk.kvh, b = blk.b, n0 = blk.n0;
  const int lq = blk.seq.lq, lk = blk.seq.lk;
  const int64_t q_start = blk.seq.q_start, ws_row0 = blk.seq.ws_row0;  // ws_row0: workspace row of i = 0
  const KernelScoreRules& seq_rules = blk.rules;
  const ScoreRules& R = a.rules;

  // dK, dV of keys key_tile + c_row(lane, e), columns col2 + 8c + c_col(lane, e).
  float acc_dk[NC2][4], acc_dv[NC2][4];
#pragma unroll
  for (int c = 0; c < NC2; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[c][e] = 0.0f, acc_dv[c][e] = 0.0f;

  if (blk.has_walk()) {
    const BwdWalk walk = blk.walk(a, BN, BM);
    const int m_lo = walk.m_lo, nm = walk.nm, steps = walk.steps;

    if (steps > 0) {
      load_rows<BN, D, S, NT, true>(sK, a.d, tid, k, [&](int r) -> const float* {
        const int j = n0 + r;
        return j < lk ? k + a.k_addr.at(a.seq, b, j, kvh) : nullptr;
      });
      load_rows<BN, D, S, NT, true>(sV, a.dv, tid, v, [&](int r) -> const float* {
        const int j = n0 + r;
        return j < lk ? v + a.v_addr.at(a.seq, b, j, kvh) : nullptr;
      });
      const float keep_scale = R.dropout_scale;
      const int d_steps = (a.d + 7) / 8, dv_steps = (a.dv + 7) / 8;
      // Step s: query head kvh * group + s / nm, query block m_lo + s % nm.
      auto step_head = [&](int s) { return kvh * a.group + s / nm; };
      auto step_block = [&](int s) { return m_lo + s % nm; };
      // The Q, dO, lse and D rows of step s, one cp.async group. Rows past Lq get lse 0 and D 0:
      // with their q and dO rows zero, their dS and dV contributions are exactly 0.
      auto load_step = [&](int s) {
        const int h = step_head(s), i0 = step_block(s) * BM;
        load_rows<BM, D, S, NT, true>(sQ, a.d, tid, q, [&](int r) -> const float* {
          const int i = i0 + r;
          return i < lq ? q + a.q_addr.at(b, q_start, i, h) : nullptr;
        });
        load_rows<BM, D, S, NT, true>(sdO, a.dv, tid, dout, [&](int r) -> const float* {
          const int i = i0 + r;
          return i < lq ? dout + a.dout_addr.at(b, q_start, i, h) : nullptr;
        });
        if (tid < BM) {
          const int i = i0 + tid;
          const bool in = i < lq;
          const int64_t wrow = in ? int64_t(h) * a.total_rows + ws_row0 + i : 0;
          cp_async_f32(sL + tid, a.ws_lse2 + wrow, in ? 4 : 0);
          cp_async_f32(sDs + tid, a.ws_dsum + wrow, in ? 4 : 0);
        }
        cp_async_commit();
      };
      // D64/D128 load the next step's rows while a step runs stage 3 and adds dQ (stage 3 reads
      // only dS and K), D256 at the start of the step. H200, session 33, both orders: +8.1-8.7%
      // (D64), +0.9-2.0% (D128), -1.4 to -2.4% (D256: the barrier before the copies costs more
      // than they would wait).
      constexpr bool kPrefetch = D <= 128;
      if constexpr (kPrefetch) load_step(0);

      for (int s = 0; s < steps; ++s) {
        const int h = step_head(s);
        const int m = step_block(s);
        const int i0 = m * BM;
        if constexpr (!kPrefetch) {
          __syncthreads();  // the previous step is done with sQ, sdO, sL, sDs
          load_step(s);
        }
        cp_async_wait<0>();
        __syncthreads();  // step s's rows are in; the previous step's stage 3 is done with sdS

        // ---- stage 1: S^T = K Q^T, dP^T = V dO^T (3xTF32; A = 16 key rows from key0, B = rows of
        // Q / dO: query q0 + 8n + b_n, column b_k) ----
        float sc[NQ1][4], dp[NQ1][4];
        auto dots = [&](auto& acc, const float* ta, const float* tb, int k_steps, int key0, int q0) {
          constexpr int N = std::extent_v<std::remove_reference_t<decltype(acc)>>;
#pragma unroll
          for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
          const float* pa = ta + key0 * S;
          const float* pb = tb + (q0 + F::b_n(lane)) * S;
#pragma unroll 1
          for (int k8 = 0; k8 < k_steps; ++k8) {
            const int col = 8 * k8;
            Tf32Split af[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) af[r] = split_tf32(pa[F::a_row(lane, r) * S + col + F::a_col(lane, r)]);
#pragma unroll
            for (int n = 0; n < N; ++n) {
              Tf32Split bf[2];
#pragma unroll
              for (int r = 0; r < 2; ++r) bf[r] = split_tf32(pb[8 * n * S + col + F::b_k(lane, r)]);
              mma_3xtf32(acc[n], af, bf);
            }
          }
        };
        if constexpr (kOneProductStage1) {
          // The C fragments go through shared memory (S^T into sP, dP^T into sdS, per query row:
          // banks g + 8t, no conflict) to the P and dS pass's layout, which overwrites them in place.
          const bool dp_warp = warp >= kWarps / 2;
          const int pw = warp % (kWarps / 2);
          const int key0 = 16 * (pw % MK), q0 = 8 * NQ1P * (pw / MK);
          float acc[NQ1P][4];
          dots(acc, dp_warp ? sV : sK, dp_warp ? sdO : sQ, dp_warp ? dv_steps : d_steps, key0, q0);
          float* dst = dp_warp ? sdS : sP;
#pragma unroll
          for (int n = 0; n < NQ1P; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dst[(q0 + 8 * n + F::c_col(lane, e)) * DS + key0 + F::c_row(lane, e)] = acc[n][e];
          __syncthreads();  // S^T and dP^T complete
#pragma unroll
          for (int n = 0; n < NQ1; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int at = (q_tile1 + 8 * n + F::c_col(lane, e)) * DS + key_tile + F::c_row(lane, e);
              sc[n][e] = sP[at], dp[n][e] = sdS[at];
            }
        } else {
          dots(sc, sK, sQ, d_steps, key_tile, q_tile1);
          dots(dp, sV, sdO, dv_steps, key_tile, q_tile1);
        }

        // ---- P and dS: element e of tile n is (key key_tile + c_row(lane, e), query q_tile1 + 8n +
        // c_col(lane, e)); both stored per query row ----
        const bool need_mask = seq_rules.tile_needs_mask(n_blk, BN, i0, i0 + BM - 1);
        const float slope = R.alibi ? -R.alibi_slope(b, h) * kLog2e : 0.0f;
        // Dropout keep bits (bwd_kept(keep_bits, 4n + e): element e of tile n kept): the layout of the
        // Hopper backward's P^T (common/dropout_lanes.cuh: one lane makes each call of a query's
        // 16 keys, the warp's slab; an 8 x 8 bit transpose hands out the bits).
        static_assert(NQ1 <= 8, "one keep word");
        uint32_t keep_bits[1] = {0xffffffffu};
        if (R.dropout_p > 0.0f) bwd_keep_bits<NQ1>(keep_bits, R, b, a.hq, h, i0 + q_tile1, n0 + key_tile + F::c_row(lane, 0));
#pragma unroll
        for (int n = 0; n < NQ1; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int jl = key_tile + F::c_row(lane, e), il = q_tile1 + 8 * n + F::c_col(lane, e);
            const int j = n0 + jl, i = i0 + il;
            const auto sg = seq_rules.score_grad(sc[n][e]);
            float x = sg.score;
            if (seq_rules.alibi()) x += seq_rules.alibi_bias(slope, i, j);
            float p = fast_exp2(x - sL[il]);
            if (need_mask && (j < seq_rules.vis_lo(i) || j >= seq_rules.vis_hi(i))) p = 0.0f;
            const float keep = bwd_kept(keep_bits, 4 * n + e) ? keep_scale : 0.0f;
            sdS[il * DS + jl] = p * (dp[n][e] * keep - sDs[il]) * sg.dtanh;
            sP[il * DS + jl] = p * keep;
          }
        __syncthreads();  // P, dS complete

        // ---- stage 2: dV += P^T dO, dK += dS^T Q (3xTF32, reduced over the BM queries) ----
        // Reduction index k of query step q8 stands for query q8 + pv_key(k): A reads P and dS
        // down a key column (queries 2t, 2t + 1: banks 8t + g), B reads dO and Q rows 2t, 2t + 1.
#pragma unroll 1
        for (int q8 = 0; q8 < BM; q8 += 8) {
          Tf32Split pf[4], df[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int at = (q8 + F::pv_key(F::a_col(lane, r))) * DS + key_tile + F::a_row(lane, r);
            pf[r] = split_tf32(sP[at]);
            df[r] = split_tf32(sdS[at]);
          }
#pragma unroll
          for (int c = 0; c < NC2; ++c) {
            Tf32Split of[2], qf[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int at = (q8 + F::pv_key(F::b_k(lane, r))) * S + col2 + 8 * c + F::b_n(lane);
              of[r] = split_tf32(sdO[at]);
              qf[r] = split_tf32(sQ[at]);
            }
            mma_3xtf32(acc_dv[c], pf, of);
            mma_3xtf32(acc_dk[c], df, qf);
          }
        }

        if (kPrefetch && s + 1 < steps) {
          __syncthreads();  // every warp is done with sQ, sdO (stage 2), sL and sDs (P and dS)
          load_step(s + 1);
        }

        // ---- stage 3: dQ = dS K (3xTF32, reduced over the BN keys; key order as in stage 2:
        // B reads K rows 2t, 2t + 1) ----
        float acc_dq[NC3][4];
#pragma unroll
        for (int c = 0; c < NC3; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[c][e] = 0.0f;
#pragma unroll 1
        for (int k8 = 0; k8 < BN; k8 += 8) {
          Tf32Split df[4];
#pragma unroll
          for (int r = 0; r < 4; ++r)
            df[r] = split_tf32(sdS[(q_tile3 + F::a_row(lane, r)) * DS + k8 + F::pv_key(F::a_col(lane, r))]);
#pragma unroll
          for (int c = 0; c < NC3; ++c) {
            Tf32Split kf[2];
#pragma unroll
            for (int r = 0; r < 2; ++r)
              kf[r] = split_tf32(sK[(k8 + F::pv_key(F::b_k(lane, r))) * S + col3 + 8 * c + F::b_n(lane)]);
            mma_3xtf32(acc_dq[c], df, kf);
          }
        }
        int32_t* sema = nullptr;
        if (a.deterministic) {
          // Wait until the key blocks after this one added their dQ part.
          sema = a.ws_sema + (int64_t(b) * a.hq + h) * a.m_blocks + m;
          if (tid == 0) {
            const int target = seq_rules.last_key_block(m, BM, BN) - n_blk;
            while (atomicAdd(sema, 0) != target) __nanosleep(64);
            __threadfence();
          }
          __syncthreads();
        }
        float* dq_base = a.ws_dq + (int64_t(h) * a.total_rows + ws_row0) * a.dacc;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = i0 + q_tile3 + F::c_row(lane, 2 * hr);
          if (i >= lq) continue;
          float* row = dq_base + int64_t(i) * a.dacc;
#pragma unroll
          for (int c = 0; c < NC3; ++c) {
            // Columns col, col + 1 lie inside the accumulator row (dacc is a multiple of 8);
            // those past d receive exact zeros (K's columns past d are zero).
            const int col = col3 + 8 * c + F::c_col(lane, 0);
            if (col < a.dacc) add_pair(row + col, acc_dq[c][2 * hr], acc_dq[c][2 * hr + 1]);
          }
        }
        if (a.deterministic) {
          __threadfence();
          __syncthreads();  // every thread's dQ part is visible
          if (tid == 0) atomicAdd(sema, 1);
        }
      }
    }
  }

  // ---- epilogue: dK = scale * acc, dV; rows past Lk of a batched tensor get 0 ----
  const int row_limit = a.k_rows_cap > 0 ? static_cast<int>(a.k_rows_cap) : lk;
  float* dk = reinterpret_cast<float*>(a.dk_ptr);
  float* dv = reinterpret_cast<float*>(a.dv_ptr);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int j = n0 + key_tile + F::c_row(lane, 2 * hr);
    if (j >= row_limit) continue;
    float* dk_row = dk + a.dk_addr.at(a.seq, b, j, kvh);
    float* dv_row = dv + a.dv_addr.at(a.seq, b, j, kvh);
#pragma unroll
    for (int c = 0; c < NC2; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = col2 + 8 * c + F::c_col(lane, e);
        if (col < a.d) dk_row[col] = acc_dk[c][2 * hr + e] * a.scale;
        if (col < a.dv) dv_row[col] = acc_dv[c][2 * hr + e];
      }
  }
}

}  // namespace f32

// ---- host side -----------------------------------------------------------------------------
namespace {

template <int kTile>
using F32BwdInstance =
    KernelInstance<f32::bwd_f32_kernel<kTile>, kF32BwdTiles[kTile].threads, kF32BwdTiles[kTile].bwd_smem_bytes()>;

KernelInfo f32_bwd_info_of(int tile, int device) {
  switch (tile) {
    case kF32BwdD64: return F32BwdInstance<kF32BwdD64>::info(device);
    case kF32BwdD128: return F32BwdInstance<kF32BwdD128>::info(device);
    case kF32BwdD256: return F32BwdInstance<kF32BwdD256>::info(device);
    case kF32BwdD128Rows32: return F32BwdInstance<kF32BwdD128Rows32>::info(device);
    case kF32BwdD256Rows32: return F32BwdInstance<kF32BwdD256Rows32>::info(device);
  }
  return KernelInfo{gpuErrorInvalidDevice};
}

gpuError_t launch_f32_bwd(int tile, const BwdArgs& a, dim3 grid, gpuStream_t stream) {
  switch (tile) {
    case kF32BwdD64: return F32BwdInstance<kF32BwdD64>::launch(a, grid, stream);
    case kF32BwdD128: return F32BwdInstance<kF32BwdD128>::launch(a, grid, stream);
    case kF32BwdD256: return F32BwdInstance<kF32BwdD256>::launch(a, grid, stream);
    case kF32BwdD128Rows32: return F32BwdInstance<kF32BwdD128Rows32>::launch(a, grid, stream);
    case kF32BwdD256Rows32: return F32BwdInstance<kF32BwdD256Rows32>::launch(a, grid, stream);
  }
  return gpuErrorInvalidDevice;
}

struct F32BwdLayout {
  int tile = 0;
  int64_t key_blocks = 0, m_blocks = 0;
  BwdWorkspace ws;
};

// The tile is the plan's (f32_bwd_tile_for: the device's shared memory decides it).
F32BwdLayout f32_bwd_layout(const BwdProblem& bp, int tile) {
  const Problem& p = bp.fwd;
  F32BwdLayout l;
  l.tile = tile;
  const F32Tile& C = kF32BwdTiles[l.tile];
  l.key_blocks = (p.seq.sk + C.block_n - 1) / C.block_n;  // batched: rows per sequence; varlen: max_seqlen_k
  l.m_blocks = (p.seq.sq + C.block_m - 1) / C.block_m;
  l.ws = bwd_workspace(p, bp.deterministic ? p.seq.batch * p.hq * l.m_blocks : 0);
  return l;
}

unsigned aux_blocks(const BwdArgs& a) {
  const int64_t warps = a.total_rows * a.hq;
  return static_cast<unsigned>(std::max<int64_t>(1, (warps + f32::kAuxWarps - 1) / f32::kAuxWarps));
}

}  // namespace

Status plan_bwd_f32(const BwdProblem& bp, int smem_optin, Plan* plan) {
  const Problem& p = bp.fwd;
  if (p.dtype != FP_F32) return unsupported("cuda backend: the fp32 backward takes float32 calls");
  if (!p.has_lse) return invalid("lse: required by the backward");
  if (const std::string why = bwd_shape_refusal(p); !why.empty()) return unsupported("cuda backend: " + why);
  const F32BwdLayout l = f32_bwd_layout(bp, f32_bwd_tile_for(std::max(p.d, p.dv), smem_optin));
  const F32Tile& C = kF32BwdTiles[l.tile];
  if (C.bwd_smem_bytes() > smem_optin)
    return unsupported(std::string("cuda backend: ") + C.name + " needs " + std::to_string(C.bwd_smem_bytes()) +
                       " bytes of shared memory per block, device has " + std::to_string(smem_optin));
  const KernelInfo ki = f32_bwd_info_of(l.tile, p.device_index);
  if (ki.status != gpuSuccess)
    return unsupported(std::string("cuda backend: kernel ") + C.name + " is not usable on this device (built archs: " FLASHPORT_GPU_ARCHS "): " +
                       gpuGetErrorString(ki.status));
  if (const std::string why = bwd_grid_refusal(p, l.key_blocks); !why.empty())
    return unsupported("cuda backend: " + why);
  *plan = Plan{};
  std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:%s:fp32%s", C.name,
                bp.deterministic ? ":deterministic" : ":atomic-dq");
  plan->workspace_bytes = l.ws.total;
  plan->num_splits = 1;
  plan->kernel_id = kKernelF32Bwd;
  PlanArgs::set(plan, l.tile, 1);
  return Status::ok();
}

Status run_bwd_f32(const BwdProblem& bp, const Plan& plan, void* workspace, gpuStream_t stream) {
  const Problem& p = bp.fwd;
  const int tile = PlanArgs::tile(plan);
  if (plan.kernel_id != kKernelF32Bwd || tile < 0 || tile >= kNumF32BwdTiles)
    return {FP_ERR_RUNTIME, "cuda backend: the plan is not an fp32 backward plan"};
  const F32BwdLayout l = f32_bwd_layout(bp, tile);
  if (l.ws.total != plan.workspace_bytes ||
      !f32_tile_serves(kF32BwdTiles[tile], std::max(p.d, p.dv)))
    return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
  if (p.seq.batch == 0) return Status::ok();
  BwdArgs a = bwd_common_args(bp, l.ws, workspace);
  a.m_blocks = static_cast<int32_t>(l.m_blocks);
  a.deterministic = bp.deterministic;
  a.ws_sema = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + l.ws.sema_off);
  a.sema_count = l.ws.sema_count;

  f32::bwd_f32_preprocess<<<aux_blocks(a), f32::kAuxWarps * 32, 0, stream>>>(a);
  if (gpuError_t e = gpuGetLastError(); e != gpuSuccess)
    return {FP_ERR_RUNTIME, std::string("cuda backend: fp32 backward preprocess launch: ") + gpuGetErrorString(e)};
  if (l.key_blocks > 0 && p.hkv > 0) {
    // Key blocks innermost: a unit's blocks share its Q and dO in L2, and its heaviest key block
    // (0: every query block sees it) starts first. Outermost, as the forward's uneven calls, was
    // 3-12% slower on causal calls (H200, session 33).
    const dim3 grid(unsigned(l.key_blocks), unsigned(p.hkv), unsigned(p.seq.batch));
    if (gpuError_t e = launch_f32_bwd(l.tile, a, grid, stream); e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("cuda backend: ") + kF32BwdTiles[l.tile].name + " launch: " +
                                  gpuGetErrorString(e)};
  }
  f32::bwd_f32_convert<<<aux_blocks(a), f32::kAuxWarps * 32, 0, stream>>>(a);
  if (gpuError_t e = gpuGetLastError(); e != gpuSuccess)
    return {FP_ERR_RUNTIME, std::string("cuda backend: fp32 backward dq conversion launch: ") + gpuGetErrorString(e)};
  if (gpuError_t e = launch_bwd_sink_grad(a, stream); e != gpuSuccess)
    return {FP_ERR_RUNTIME, std::string("cuda backend: sink gradient launch: ") + gpuGetErrorString(e)};
  return Status::ok();
}

}  // namespace flashport::gpu
