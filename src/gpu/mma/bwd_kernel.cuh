// The backward main loop (FlashAttention-2 style: key blocks outer, query blocks inner), written
// once for NVIDIA (CUDA) and AMD (HIP); the tile and the storage type are the only template
// arguments, every feature is a runtime hook behind a block-uniform branch, as in the forward.
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
// Q and dO are double-buffered with cp.async on NVIDIA: the next step's copy overlaps this step's
// math; AMD has plain copies and one buffer (the tile row's q_buffers).
//
// What differs per vendor is the tile layer under the loop (tile_mma.hpp / tile_mma_amd.hpp, as
// for the forward) and the backward's view of it below: 16-column products C += A B on a row of
// accumulator tiles, with A and B read from row-major shared tiles either way round. The loop
// reads accumulator elements only through AccLayout (kRowSlots rows of each 16-row tile a lane
// holds, kSlotElems columns of each per kCols-column tile), so the same source runs on mma.sync's
// 16x8 tiles and on MFMA/WMMA's 16x16 tiles (products taken transposed there, as the forward does).
#pragma once
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "core/philox.hpp"
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/tile_io.cuh"
#include "gpu/mma/bwd_block.cuh"
#include "gpu/mma/bwd_launch.hpp"
#if defined(FP_TARGET_NVIDIA)
#include "gpu/common/dropout_lanes.cuh"
#endif

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

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

// ---- the backward's view of the tile layer ---------------------------------------------------
// Operands of C[16 rows][16 cols] += A[16][16 k] B[16 k][16 cols], read from row-major shared tiles:
//   load_op_a_rows: A[r][k] = tile[row0 + r][k0 + k]   (K, V, P^T, dS^T as stored)
//   load_op_a_kmaj: A[r][k] = tile[k0 + k][row0 + r]   (dS from the dS^T tile)
//   load_op_b_rows: B[k][c] = tile[n0 + c][k0 + k]     (Q^T, dO^T from Q, dO)
//   load_op_b_kmaj: B[k][c] = tile[k0 + k][n0 + c]     (dO, Q, K)
// mma16: the product into columns [16 c16, 16 c16 + 16) of a row of accumulator tiles.
#if defined(FP_TARGET_NVIDIA)
using BwdOpA = FragA;
using BwdOpB = FragBPair;

// 4 bytes global -> shared; src_bytes 0 stores zero (rows past the end).
__device__ __forceinline__ void bwd_cp_async_4(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
}

template <int kCols>
__device__ __forceinline__ void load_op_a_rows(FragA& a, const uint16_t* tile, int row0, int k0, int lane) {
  load_a<kCols>(a, tile, row0, k0, lane);
}
// Same register layout as load_a; ldmatrix .trans transposes each 8x8 matrix.
template <int kCols>
__device__ __forceinline__ void load_op_a_kmaj(FragA& a, const uint16_t* tile, int row0, int k0, int lane) {
  const int mat = lane >> 3;
  const int row = k0 + (lane & 7) + ((mat >> 1) << 3);
  const int chunk = (row0 >> 3) + (mat & 1);
  ldmatrix_x4_trans(a.r, smem_u32(tile + SmemTile<kCols>::offset(row, chunk)));
}
template <int kCols>
__device__ __forceinline__ void load_op_b_rows(FragBPair& b, const uint16_t* tile, int n0, int k0, int lane) {
  load_b_rows<kCols>(b, tile, n0, k0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_op_b_kmaj(FragBPair& b, const uint16_t* tile, int k0, int n0, int lane) {
  load_b_trans<kCols>(b, tile, k0, n0, lane);
}
template <typename Elem, int N>
__device__ __forceinline__ void mma16(FragC (&c)[N], int c16, const FragA& a, const FragBPair& b) {
  mma<Elem>(c[2 * c16], a, b.r[0], b.r[1]);
  mma<Elem>(c[2 * c16 + 1], a, b.r[2], b.r[3]);
}

// AccLayout::col(lane, e2) of an even e2 (the first of an adjacent pair; a slot has 2 elements
// here, so e2 is 0), written as the mma.sync backward always wrote it (a different spelling of the
// same value changes ptxas's output).
static_assert(AccLayout::kSlotElems == 2 && AccLayout::kRowSlots == 2, "one pair a slot, two slots");
__device__ __forceinline__ int acc_pair_col(int lane, int /*e2*/) { return (lane & 3) * 2; }
// AccLayout::row(lane, hf) as first row + slot offset (slots 8 rows apart), spelled likewise.
__device__ __forceinline__ int acc_row0(int lane) { return lane >> 2; }
__device__ __forceinline__ int slot_offset(int hf) { return hf * 8; }
// Row and column of accumulator element e of a lane (AccLayout's, register index e).
__device__ __forceinline__ int acc_elem_row(int lane, int e) { return c_row(lane, e); }
__device__ __forceinline__ int acc_elem_col(int lane, int e) { return c_col(lane, e); }

// Two accumulator tiles of the same place (P and dS) into two row-major shared tiles of kCols
// columns, 16-bit: r0, col: the row and column of the lane's element 0.
template <int kCols, typename Elem>
__device__ __forceinline__ void store_tile_pair(uint16_t* dst_a, uint16_t* dst_b, const FragC& a, const FragC& b,
                                                int r0, int col, int /*lane*/) {
  const int o0 = SmemTile<kCols>::offset(r0, col >> 3) + (col & 7);
  const int o1 = SmemTile<kCols>::offset(r0 + 8, col >> 3) + (col & 7);
  *reinterpret_cast<uint32_t*>(dst_a + o0) = Elem::pack(a.r[0], a.r[1]);
  *reinterpret_cast<uint32_t*>(dst_a + o1) = Elem::pack(a.r[2], a.r[3]);
  *reinterpret_cast<uint32_t*>(dst_b + o0) = Elem::pack(b.r[0], b.r[1]);
  *reinterpret_cast<uint32_t*>(dst_b + o1) = Elem::pack(b.r[2], b.r[3]);
}

__device__ __forceinline__ void bwd_atomic_add(float* dst, float x) { atomicAdd(dst, x); }
// dq_acc[0..1] += (x, y): one vector reduction on sm_90, two scalar ones before.
__device__ __forceinline__ void bwd_add_pair(float* dst, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x, y));
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}
// Deterministic mode's wait for the key blocks after this one.
__device__ __forceinline__ void bwd_backoff() { __nanosleep(64); }
#else
// AMD: every operand is a 16x16 fragment whose register layout is symmetric in the A and B roles
// (amd_layouts.hpp), so C^T = B^T A^T is one instruction with the roles swapped: the lane then
// owns one row of C (AccLayout, amd::AttentionView), as in the forward.
using BwdOpA = Frag16;
using BwdOpB = Frag16;

// No asynchronous copy: a plain 4-byte move (zero past the end).
__device__ __forceinline__ void bwd_cp_async_4(void* smem, const void* gmem, int src_bytes) {
  *static_cast<float*>(smem) = src_bytes > 0 ? *static_cast<const float*>(gmem) : 0.0f;
}
template <int kCols>
__device__ __forceinline__ void load_op_a_rows(Frag16& a, const uint16_t* tile, int row0, int k0, int lane) {
  load_rows<kCols>(a, tile, row0, k0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_op_a_kmaj(Frag16& a, const uint16_t* tile, int row0, int k0, int lane) {
  load_cols<kCols>(a, tile, k0, row0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_op_b_rows(Frag16& b, const uint16_t* tile, int n0, int k0, int lane) {
  load_rows<kCols>(b, tile, n0, k0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_op_b_kmaj(Frag16& b, const uint16_t* tile, int k0, int n0, int lane) {
  load_cols<kCols>(b, tile, k0, n0, lane);
}
template <typename Elem, int N>
__device__ __forceinline__ void mma16(FragC (&c)[N], int c16, const Frag16& a, const Frag16& b) {
  mma<Elem>(c[c16], b, a);
}
__device__ __forceinline__ int acc_pair_col(int lane, int e2) { return AccLayout::col(lane, e2); }
__device__ __forceinline__ int acc_row0(int lane) { return AccLayout::row(lane, 0); }
__device__ __forceinline__ int slot_offset(int hf) { return AccLayout::row(0, hf) - AccLayout::row(0, 0); }
__device__ __forceinline__ int acc_elem_row(int lane, int e) { return AccLayout::row(lane, e / AccLayout::kSlotElems); }
__device__ __forceinline__ int acc_elem_col(int lane, int e) { return AccLayout::col(lane, e % AccLayout::kSlotElems); }
// A lane holds one row (AccLayout::row) and kCElems columns of each tile: pairs where they are
// adjacent columns (AccLayout::kAdjacentPairs), else single elements.
template <int kCols, typename Elem>
__device__ __forceinline__ void store_tile_pair(uint16_t* dst_a, uint16_t* dst_b, const FragC& a, const FragC& b,
                                                int row, int col, int lane) {
  const int col0 = col - AccLayout::col(lane, 0);
#pragma unroll
  for (int e = 0; e < kAccElems; e += 2) {
    const int c0 = col0 + AccLayout::col(lane, e), c1 = col0 + AccLayout::col(lane, e + 1);
    const int o0 = SmemTile<kCols>::element(row, c0), o1 = SmemTile<kCols>::element(row, c1);
    if constexpr (AccLayout::kAdjacentPairs) {
      *reinterpret_cast<uint32_t*>(dst_a + o0) = Elem::pack(a.r[e], a.r[e + 1]);
      *reinterpret_cast<uint32_t*>(dst_b + o0) = Elem::pack(b.r[e], b.r[e + 1]);
    } else {
      dst_a[o0] = uint16_t(Elem::bits(a.r[e]));
      dst_a[o1] = uint16_t(Elem::bits(a.r[e + 1]));
      dst_b[o0] = uint16_t(Elem::bits(b.r[e]));
      dst_b[o1] = uint16_t(Elem::bits(b.r[e + 1]));
    }
  }
}
// dq_acc += x. HIP lowers atomicAdd on float to a compare-and-swap loop (no -munsafe-fp-atomics);
// the native global_atomic_add_f32 (__builtin_amdgcn_global_atomic_fadd_f32) put 20 bytes of
// scratch into the gfx90a/gfx942 kernels, which the ISA check rejects.
__device__ __forceinline__ void bwd_atomic_add(float* dst, float x) { atomicAdd(dst, x); }
__device__ __forceinline__ void bwd_add_pair(float* dst, float x, float y) {
  bwd_atomic_add(dst, x);
  bwd_atomic_add(dst + 1, y);
}
#if defined(FP_AMD_EMULATION)
__device__ __forceinline__ void bwd_backoff() { __nanosleep(64); }  // simt_emu.hpp: a wait that can't end fails
#else
__device__ __forceinline__ void bwd_backoff() { __builtin_amdgcn_s_sleep(1); }
#endif
#endif

// The loop's lambdas forced inline on MFMA targets: left to the inliner, gfx90a/gfx942 reach
// their SGPR limit and reserve a 20-byte scratch frame (register scavenging; no scratch access),
// which the ISA check rejects. On WMMA (wave32) forcing it costs VGPR spills instead; nothing on
// NVIDIA (ptxas output unchanged) or in the CPU emulation.
#if defined(FP_AMD_MFMA)
#define FP_BWD_INLINE __attribute__((always_inline))
#else
#define FP_BWD_INLINE
#endif

template <int kTile, typename Elem>
__global__ void FP_LAUNCH_BOUNDS(kBwdTiles[kTile].threads(kWarpSize), kBwdTiles[kTile].min_blocks)
    bwd_kernel(const FP_GRID_CONSTANT BwdArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  FP_REQUIRE_ARCH(kMinNvidiaArch);
#else
  constexpr BwdTile C = kBwdTiles[kTile];
  constexpr int D = C.head_dim, BM = C.block_m, BN = C.block_n, NT = C.threads(kWarpSize), W = C.warps;
  constexpr int KR = C.key_tiles, QR = C.dq_tiles;  // 16-row tiles per warp (keys; dQ rows)
  constexpr int KW = C.key_groups(), QW = C.col_groups();
  static_assert(KW * QW == W && BN == 16 * KR * KW, "warps = key groups x column groups");
  constexpr int kCols = AccLayout::kCols, kSlots = AccLayout::kRowSlots, kSlotElems = AccLayout::kSlotElems;
  constexpr int QS = C.score_col_groups();      // stage 1: query-column groups (<= QW; warps past them wait)
  static_assert(QS >= 1 && QS <= QW, "stage-1 column groups");
  constexpr int SC = BM / QS, ST = SC / kCols;  // stage 1: query columns per warp, accumulator tiles
  constexpr int DC = D / QW, DT = DC / kCols;   // stage 2: dK/dV columns per warp
  constexpr int MR = BM / (16 * QR), CW = W / MR;  // stage 3: dQ row groups x column groups
  constexpr int QC = D / CW / C.dq_passes, QT = QC / kCols;  // stage 3: dQ columns per warp and pass
  static_assert(SC % 16 == 0 && DC % 16 == 0 && QC % 16 == 0 && MR * CW == W, "tile shape");
  constexpr int kChunks = D / 8;
  constexpr int kQBufs = C.q_buffers;
  static_assert(kQBufs == 1 || kQBufs == 2, "one or two Q/dO buffers");
  using Tile = SmemTile<D>;    // K, V, Q, dO: [rows][D]
  using PTile = SmemTile<BM>;  // P^T, dS^T: [BN][BM]
  static_assert(Tile::kRowElems == D + C.smem_row_pad && PTile::kRowElems == BM + C.smem_row_pad,
                "tile rows and the layer's shared tile agree");
  constexpr int RD = Tile::kRowElems, RP = PTile::kRowElems;

  FP_EXTERN_SMEM(uint16_t, smem);
  uint16_t* sK = smem;
  uint16_t* sV = sK + BN * RD;
  uint16_t* sQ = sV + BN * RD;          // [kQBufs][BM * RD]
  uint16_t* sdO = sQ + kQBufs * BM * RD;  // [kQBufs][BM * RD]
  uint16_t* sP = sdO + kQBufs * BM * RD;  // [BN][RP] (P^T after dropout)
  uint16_t* sdS = sP + BN * RP;           // [BN][RP] (dS^T)
  float* sL = reinterpret_cast<float*>(sdS + BN * RP);  // [kQBufs][BM] lse (log2 units)
  float* sDs = sL + kQBufs * BM;                         // [kQBufs][BM] D

  constexpr int kLaneBits = kWarpSize == 64 ? 6 : 5;
  static_assert((1 << kLaneBits) == kWarpSize, "warp size is 32 or 64");
  const int tid = threadIdx.x, lane = tid & (kWarpSize - 1), warp = tid >> kLaneBits;
  const BwdBlock blk(a, BN);
  const int n_blk = blk.n_blk, kvh = blk.kvh, b = blk.b, n0 = blk.n0;
  const int lq = blk.seq.lq, lk = blk.seq.lk;
  const int64_t q_start = blk.seq.q_start, ws_row0 = blk.seq.ws_row0;  // ws_row0: workspace row of i = 0
  const KernelScoreRules& S = blk.rules;
  const ScoreRules& R = a.rules;

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
      for (int e = 0; e < kAccElems; ++e) acc_dk[kr][t].r[e] = 0.0f, acc_dv[kr][t].r[e] = 0.0f;

  if (blk.has_walk()) {
    const BwdWalk walk = blk.walk(a, BN, BM);
    const int m_lo = walk.m_lo, nm = walk.nm, steps = walk.steps;

    if (steps > 0) {
      const BwdKvRows krows(a.seq, a.k_addr, b, kvh);
      const BwdKvRows vrows(a.seq, a.v_addr, b, kvh);
      for (int idx = tid; idx < BN * kChunks; idx += NT) {
        const int r = idx / kChunks, c = idx % kChunks;
        const int j = n0 + r;
        load_chunk(sK + Tile::offset(r, c), j < lk ? a.k + krows.at(j) : nullptr, c, a.d, a.vec_ok);
        load_chunk(sV + Tile::offset(r, c), j < lk ? a.v + vrows.at(j) : nullptr, c, a.dv, a.vec_ok);
      }
      // Q, dO, LSE, D of step s into buffer `buf`.
      auto load_step = [&](int s, int buf) FP_BWD_INLINE {
        const int h = kvh * a.group + s / nm;
        const int m = m_lo + s % nm;
        uint16_t* q_dst = sQ + buf * BM * RD;
        uint16_t* o_dst = sdO + buf * BM * RD;
        for (int idx = tid; idx < BM * kChunks; idx += NT) {
          const int r = idx / kChunks, c = idx % kChunks;
          const int i = m * BM + r;
          const uint16_t* qs = i < lq ? a.q + a.q_addr.at(b, q_start, i, h) : nullptr;
          const uint16_t* os = i < lq ? a.dout + a.dout_addr.at(b, q_start, i, h) : nullptr;
          load_chunk(q_dst + Tile::offset(r, c), qs, c, a.d, a.vec_ok);
          load_chunk(o_dst + Tile::offset(r, c), os, c, a.dv, a.vec_ok);
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
      // Head dims filling the bucket (the common case), or a layer that runs the tail steps on the
      // zero-filled columns (AMD: kSkipTailSteps false, as in the forward): straight-line loops.
      const bool full = (a.d == D && a.dv == D) || !kSkipTailSteps;
      const int v_ksteps = (a.dv + 15) / 16;
      const float keep_scale = R.dropout_scale;

      for (int s = 0; s < steps; ++s) {
        int buf = 0;
        if constexpr (kQBufs == 2) {
          buf = s & 1;
          if (s + 1 < steps) {
            load_step(s + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
          } else {
            cp_async_wait<0>();
          }
        } else {
          if (s > 0) load_step(s, 0);  // the previous step ended with every warp done with the buffer
        }
        __syncthreads();  // this step's tiles landed (and K, V on the first step)

        const int h = kvh * a.group + s / nm;
        const int m = m_lo + s % nm;
        const int i0 = m * BM;
        const uint16_t* tQ = sQ + buf * BM * RD;
        const uint16_t* tdO = sdO + buf * BM * RD;
        const float* tL = sL + buf * BM;
        const float* tDs = sDs + buf * BM;

        // ---- stage 1: S^T = K Q^T, dP^T = V dO^T --------------------------------------------
        constexpr bool kAllScore = QS == QW;  // every warp computes scores (else the first QS groups)
        if (kAllScore || qg < QS) {
        FragC acc_s[KR][ST], acc_dp[KR][ST];
#pragma unroll
        for (int kr = 0; kr < KR; ++kr)
#pragma unroll
          for (int t = 0; t < ST; ++t)
#pragma unroll
            for (int e = 0; e < kAccElems; ++e) acc_s[kr][t].r[e] = 0.0f, acc_dp[kr][t].r[e] = 0.0f;
        // kFull (head dims filling the bucket, the common case): straight-line loops the scheduler
        // can pipeline; otherwise the steps past d / dv are skipped.
        auto stage1 = [&](auto full_tag) FP_BWD_INLINE {
          constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          if (kFull || ks < q_ksteps) {
            BwdOpA ka[KR];
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) load_op_a_rows<D>(ka[kr], sK, key0 + kr * 16, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < SC / 16; ++np) {
              BwdOpB qb;
              load_op_b_rows<D>(qb, tQ, qg * SC + np * 16, ks * 16, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) mma16<Elem>(acc_s[kr], np, ka[kr], qb);
            }
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) mma_fence(acc_s[kr]);
          }
          if (kFull || ks < v_ksteps) {
            BwdOpA va[KR];
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) load_op_a_rows<D>(va[kr], sV, key0 + kr * 16, ks * 16, lane);
#pragma unroll
            for (int np = 0; np < SC / 16; ++np) {
              BwdOpB ob;
              load_op_b_rows<D>(ob, tdO, qg * SC + np * 16, ks * 16, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) mma16<Elem>(acc_dp[kr], np, va[kr], ob);
            }
#pragma unroll
            for (int kr = 0; kr < KR; ++kr) mma_fence(acc_dp[kr]);
          }
        }
        };
        if (full) stage1(std::true_type{}); else stage1(std::false_type{});

        // ---- P and dS (element (key j, query i)) ----------------------------------------------
        const bool need_mask = S.tile_needs_mask(n_blk, BN, i0, i0 + BM - 1);
        const float slope_log2 = R.alibi ? -R.alibi_slope(b, h) * kLog2e : 0.0f;
#if defined(FP_TARGET_NVIDIA)
        // Dropout replay: the accumulator (keys x queries) is the layout of the Hopper backward's
        // P^T, so each Philox call (a query's 16 keys: the warp's 16-key slab) is made by one lane
        // and its bits reach the slab's lanes by an 8 x 8 bit transpose (common/dropout_lanes.cuh),
        // one call per 16 elements where each element made its own.
        constexpr int kKeepWords = (4 * ST + 31) / 32;
        uint32_t keep_bits[KR][kKeepWords];
        if (R.dropout_p > 0.0f) {
#pragma unroll
          for (int kr = 0; kr < KR; ++kr)
            bwd_keep_bits<ST>(keep_bits[kr], R, b, a.hq, h, i0 + qg * SC, n0 + key0 + kr * 16 + acc_row0(lane));
        }
#endif
#pragma unroll
        for (int kr = 0; kr < KR; ++kr)
#pragma unroll
        for (int t = 0; t < ST; ++t)
#pragma unroll
          for (int e = 0; e < kAccElems; ++e) {
            const int jl = key0 + kr * 16 + acc_elem_row(lane, e);
            const int il = qg * SC + t * kCols + acc_elem_col(lane, e);
            const int j = n0 + jl, i = i0 + il;
            const auto sg = S.score_grad(acc_s[kr][t].r[e]);
            float sc = sg.score;
            if (S.alibi()) sc += S.alibi_bias(slope_log2, i, j);
            float p = fast_exp2(sc - tL[il]);
            if (need_mask && (j < S.vis_lo(i) || j >= S.vis_hi(i))) p = 0.0f;
            float keep = 1.0f;
#if defined(FP_TARGET_NVIDIA)
            if (R.dropout_p > 0.0f) keep = bwd_kept(keep_bits[kr], 4 * t + e) ? keep_scale : 0.0f;  // e = 2hf + e2
#else
            if (R.dropout_p > 0.0f)
              keep = dropout_keep(R.rng_seed(), R.rng_offset(), R.dropout_threshold, b, a.hq, h, i, j)
                         ? keep_scale : 0.0f;
#endif
            acc_dp[kr][t].r[e] = p * (acc_dp[kr][t].r[e] * keep - tDs[il]) * sg.dtanh;
            acc_s[kr][t].r[e] = p * keep;
          }
        // P^T and dS^T to shared memory (16-bit).
#pragma unroll
        for (int kr = 0; kr < KR; ++kr) {
          const int r0 = key0 + kr * 16 + acc_row0(lane);
#pragma unroll
          for (int t = 0; t < ST; ++t) {
            const int col = qg * SC + t * kCols + acc_pair_col(lane, 0);
            store_tile_pair<BM, Elem>(sP, sdS, acc_s[kr][t], acc_dp[kr][t], r0, col, lane);
          }
        }
        }
        __syncthreads();  // P^T, dS^T complete

        // ---- stage 2: dV += P^T dO, dK += dS^T Q -------------------------------------------------
        auto stage2 = [&](auto full_tag) FP_BWD_INLINE {
          constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int ks = 0; ks < BM / 16; ++ks) {
          BwdOpA pa[KR], da[KR];
#pragma unroll
          for (int kr = 0; kr < KR; ++kr) {
            load_op_a_rows<BM>(pa[kr], sP, key0 + kr * 16, ks * 16, lane);
            load_op_a_rows<BM>(da[kr], sdS, key0 + kr * 16, ks * 16, lane);
          }
#pragma unroll
          for (int dp = 0; dp < DC / 16; ++dp) {
            const int col = qg * DC + dp * 16;
            if (kFull || col < a.dv) {
              BwdOpB ob;
              load_op_b_kmaj<D>(ob, tdO, ks * 16, col, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) mma16<Elem>(acc_dv[kr], dp, pa[kr], ob);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) mma_fence(acc_dv[kr], dp);
            }
            if (kFull || col < a.d) {
              BwdOpB qb;
              load_op_b_kmaj<D>(qb, tQ, ks * 16, col, lane);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) mma16<Elem>(acc_dk[kr], dp, da[kr], qb);
#pragma unroll
              for (int kr = 0; kr < KR; ++kr) mma_fence(acc_dk[kr], dp);
            }
          }
        }
        };
        if (full) stage2(std::true_type{}); else stage2(std::false_type{});

        // ---- stage 3: dQ += dS K, over dQ columns [cq * QC, cq * QC + QC) ---------------------
        // (kFirst: the deterministic wait before the first pass's adds; kLast: the step's end.)
        auto stage3_pass = [&](const int cq, auto first_tag, auto last_tag) FP_BWD_INLINE {
          constexpr bool kFirst = decltype(first_tag)::value, kLast = decltype(last_tag)::value;
        FragC acc_dq[QR][QT];
#pragma unroll
        for (int qr = 0; qr < QR; ++qr)
#pragma unroll
          for (int t = 0; t < QT; ++t)
#pragma unroll
            for (int e = 0; e < kAccElems; ++e) acc_dq[qr][t].r[e] = 0.0f;
        auto stage3 = [&](auto full_tag) FP_BWD_INLINE {
          constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
          BwdOpA sa[QR];
#pragma unroll
          for (int qr = 0; qr < QR; ++qr) load_op_a_kmaj<BM>(sa[qr], sdS, qrow0 + qr * 16, ks * 16, lane);
#pragma unroll
          for (int np = 0; np < QC / 16; ++np) {
            const int col = cq * QC + np * 16;
            if (kFull || col < a.d) {
              BwdOpB kb;
              load_op_b_kmaj<D>(kb, sK, ks * 16, col, lane);
#pragma unroll
              for (int qr = 0; qr < QR; ++qr) mma16<Elem>(acc_dq[qr], np, sa[qr], kb);
#pragma unroll
              for (int qr = 0; qr < QR; ++qr) mma_fence(acc_dq[qr], np);
            }
          }
        }
        };
        if (full) stage3(std::true_type{}); else stage3(std::false_type{});
        int32_t* sema = nullptr;
        if (a.deterministic) {
          sema = a.ws_sema + (int64_t(b) * a.hq + h) * a.m_blocks + m;
          if constexpr (kFirst) {
            // Wait until the key blocks after this one added their dQ part.
            if (tid == 0) {
              // Deterministic mode adds the key blocks' dQ parts in descending key order, from the
              // last key block that visits query block m (causal: the one that starts there, so
              // no block waits for one still far from this query block).
              const int target = S.last_key_block(m, BM, BN) - n_blk;
              while (atomicAdd(sema, 0) != target) bwd_backoff();
              __threadfence();
            }
            __syncthreads();
          }
        }
        {
          float* dq_base = a.ws_dq + (int64_t(h) * a.total_rows + ws_row0) * a.dacc;
#pragma unroll
          for (int qr = 0; qr < QR; ++qr)
#pragma unroll
          for (int hf = 0; hf < kSlots; ++hf) {
            const int i = i0 + qrow0 + qr * 16 + acc_row0(lane) + slot_offset(hf);
            if (i < lq) {
              float* row = dq_base + int64_t(i) * a.dacc;
#pragma unroll
              for (int t = 0; t < QT; ++t)
#pragma unroll
                for (int e2 = 0; e2 < kSlotElems; e2 += 2) {
                  const int col = cq * QC + t * kCols + acc_pair_col(lane, e2);
                  const int e = hf * kSlotElems + e2;
                  if constexpr (AccLayout::kAdjacentPairs) {
                    // Pairs start at even columns and dacc is D rounded up to 8: col + 1 < dacc.
                    if (col < a.d) bwd_add_pair(row + col, acc_dq[qr][t].r[e], acc_dq[qr][t].r[e + 1]);
                  } else {
                    const int col1 = cq * QC + t * kCols + AccLayout::col(lane, e2 + 1);
                    if (col < a.d) bwd_atomic_add(row + col, acc_dq[qr][t].r[e]);
                    if (col1 < a.d) bwd_atomic_add(row + col1, acc_dq[qr][t].r[e + 1]);
                  }
                }
            }
          }
        }
        if constexpr (kLast) {
          if (a.deterministic) __threadfence();
          __syncthreads();  // every warp is done with this step's buffers (and its dQ is visible)
          if (a.deterministic && tid == 0) atomicAdd(sema, 1);
        }
        };
        constexpr int kPasses = C.dq_passes;
        if constexpr (kPasses == 1) {
          stage3_pass(cg, std::true_type{}, std::true_type{});
        } else {
          stage3_pass(cg * kPasses, std::true_type{}, std::false_type{});
          for (int pass = 1; pass + 1 < kPasses; ++pass)
            stage3_pass(cg * kPasses + pass, std::false_type{}, std::false_type{});
          stage3_pass(cg * kPasses + kPasses - 1, std::false_type{}, std::true_type{});
        }
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
  for (int hf = 0; hf < kSlots; ++hf) {
    const int j = n0 + key0 + kr * 16 + acc_row0(lane) + slot_offset(hf);
    if (j >= row_limit) continue;
    T* dk_row = reinterpret_cast<T*>(a.dk_ptr) + dkrows.at(j);
    T* dv_row = reinterpret_cast<T*>(a.dv_ptr) + dvrows.at(j);
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
    for (int e2 = 0; e2 < kSlotElems; e2 += 2) {
      const int col = qg * DC + t * kCols + acc_pair_col(lane, e2);
      const int col1 = AccLayout::kAdjacentPairs ? col + 1 : qg * DC + t * kCols + AccLayout::col(lane, e2 + 1);
      const int e = hf * kSlotElems + e2;
      const float k0 = acc_dk[kr][t].r[e] * a.scale, k1 = acc_dk[kr][t].r[e + 1] * a.scale;
      const float v0 = acc_dv[kr][t].r[e], v1 = acc_dv[kr][t].r[e + 1];
      if (AccLayout::kAdjacentPairs && a.kv_out_vec_ok && col + 1 < a.d) {
        *reinterpret_cast<uint32_t*>(dk_row + col) = Elem::pack(k0, k1);
      } else {
        if (col < a.d) dk_row[col] = Elem::from_float(k0);
        if (col1 < a.d) dk_row[col1] = Elem::from_float(k1);
      }
      if (AccLayout::kAdjacentPairs && a.kv_out_vec_ok && col + 1 < a.dv) {
        *reinterpret_cast<uint32_t*>(dv_row + col) = Elem::pack(v0, v1);
      } else {
        if (col < a.dv) dv_row[col] = Elem::from_float(v0);
        if (col1 < a.dv) dv_row[col1] = Elem::from_float(v1);
      }
    }
  }
#endif
}

FP_TARGET_NS_END
}  // namespace flashport::gpu

// ---- host side: per-device setup and launch of one instance (CUDA; HIP: amd/bwd_amd.hip) ------
#if defined(FP_TARGET_NVIDIA)
#include "gpu/common/kernel_info.cuh"

namespace flashport::gpu {

template <int kTile, bool kBf16>
using BwdInstance = KernelInstance<bwd_kernel<kTile, std::conditional_t<kBf16, BFloat16, Half>>,
                                   kBwdTiles[kTile].threads(), kBwdTiles[kTile].smem_bytes()>;

template <int kTile, bool kBf16>
BwdKernelInfo bwd_kernel_info(int device) {
  return BwdInstance<kTile, kBf16>::info(device);
}

template <int kTile, bool kBf16>
gpuError_t launch_bwd(const BwdArgs& a, dim3 grid, gpuStream_t stream) {
  return BwdInstance<kTile, kBf16>::launch(a, grid, stream);
}

#define FP_INSTANTIATE_BWD(tile)                                                  \
  template BwdKernelInfo bwd_kernel_info<tile, false>(int);                       \
  template BwdKernelInfo bwd_kernel_info<tile, true>(int);                        \
  template gpuError_t launch_bwd<tile, false>(const BwdArgs&, dim3, gpuStream_t); \
  template gpuError_t launch_bwd<tile, true>(const BwdArgs&, dim3, gpuStream_t);

}  // namespace flashport::gpu
#endif  // FP_TARGET_NVIDIA
