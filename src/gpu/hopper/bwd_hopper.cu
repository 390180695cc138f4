// Hopper (sm_90a) backward main loop: FlashAttention-3's structure on wgmma (HGMMA). Compiled
// only for sm_90a (its own object library in CMakeLists.txt); scope and capability check in
// bwd_hopper.hpp. The preprocess (D = rowsum(dO * O), LSE in log2 units, zeroed dq accumulator)
// and the dq conversion (with d_sinks) are the mma.sync backward's kernels (mma/bwd_aux_kernels.cuh), on the
// same workspace layout.
//
// D64/D128 (bwd_hopper_kernel): one block owns BN = 128 keys of one kv head (grid: key blocks x
// kv heads x batch) and walks every query block of every query head of its GQA group (a step:
// BM query rows of one head). The block is warp-specialised (HopperBwdTile), 3 warpgroups:
//   producer (warpgroup 0, 24 registers): K and V of the block once (cp.async, mbarrier kv);
//     warps 0-2 stream each step's Q, dO, LSE2, D into a 2-stage ring (load_step: Q and dO by
//     TMA boxes where the step's rows lie inside the sequence, else by cp.async; LSE2, D by
//     cp.async; the stage's `full` mbarrier counts one cp.async.mbarrier.arrive per loader and
//     thread 0's arrival with the boxes' bytes, its `empty` one arrival per MMA warp); warp 3
//     adds each step's dQ into the fp32 workspace, one bulk reduce for the step's tile (per
//     query row for padded head dims; bulk reduces beat 16-byte vector atomics:
//     bench/results/HISTORY.md).
//   MMA warpgroups 1, 2 (240 registers): warpgroup w owns keys [64w, 64w + 64) of the block; its
//     dK, dV (64 keys x D, fp32) stay in registers over the walk. Per step:
//   S^T  = K Q^T    wgmma SS, M = 64 keys, N = BM queries (K and Q K-major in shared memory)
//   dP^T = V dO^T   wgmma SS (V, dO K-major)
//   P^T  = exp2(S^T * scale * log2e - LSE2), with the forward's masks, softcap, ALiBi (registers);
//   dS^T = P^T (dP^T - D) (x softcap derivative)
//   dV  += P^T dO   wgmma RS: P^T from registers (the accumulator layout is the A-fragment
//                   layout), dO MN-major from the same shared tile
//   dK  += dS^T Q   wgmma RS, Q MN-major; once both have landed the warp releases the stage
//   dS^T -> shared memory (named barriers: the other's previous dQ has read it; each
//                   warpgroup announces its own half stored), then
//   dQ   = dS K     wgmma SS, dS and K both MN-major; D128: warpgroup w takes columns
//                   [64w, 64w + 64) of the 64 rows; D64: rows [64w, 64w + 64) of the 128;
//                   staged in shared memory (double-buffered) and handed to the writer warp on
//                   named barriers (buffer full / empty).
//   The MMA warpgroups take turns on the tensor cores (ping-pong, named barriers `turn`): 1 issues
//   a step's S^T and dP^T, then 2 its own, then 1 its dV, dK and dQ, then 2. Each one's
//   elementwise phase (P^T, dS^T) then runs under the other's products, and 1's dQ waits for 2's
//   dS^T half, which 2 has made while 1's dV and dK ran (+3-6% over both computing in lockstep:
//   bench/results/gpu_backward.md, session 14). No block-wide barrier inside the walk.
//   D128: a warpgroup whose 64 keys no row of the step sees (the causal diagonal's first step, a
//   window's edges) runs the step without its products and elementwise phase: turns, zeros as its
//   dS^T half, its part of dQ (+2.5-3.5% at S1k causal: gpu_backward.md, session 24).
//   After the walk, dK and dV leave through shared memory (the Q ring, free then) in whole 16-byte
//   row chunks (store_kv_grad_staged; D256 stages in K's tile): +3.5-7% at S1k over stores from the
//   accumulator layout, whose warp stores cover 8 rows with 16 bytes each (gpu_backward.md, session 27).
// D256 (bwd_hopper_d256_kernel): the same producer roles and ring (HopperBwdTileD256), 64-key
// blocks; one MMA warpgroup computes S^T, P^T and dV, the other dP^T, dS^T and dK (P^T handed over
// in fp32 through shared memory), both half of dQ's columns (bwd_hopper.hpp); a step's dQ is staged
// in its own ring stage, which the writer warp hands back to the loaders once the copy engine has
// read it.
// The elementwise phases have straight-line loops for the common case (no softcap/ALiBi,
// unswitched on the mask): per-element branches there cost v1 half its time (gpu_bwd_notes.md).
#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "gpu/hopper/bwd_hopper.hpp"
#include "gpu/hopper/bwd_hopper_wgmma.hpp"
#include "gpu/common/dropout_lanes.cuh"
#include "gpu/hopper/fwd_hopper_tma.cuh"
#include "gpu/hopper/hopper_smem.hpp"
#include "gpu/hopper/hopper_store.cuh"
#include "gpu/hopper/tma_maps.hpp"
#include "gpu/common/kernel_info.cuh"
#include "gpu/common/tile_io.cuh"
#include "gpu/common/tile_mma.hpp"
#include "gpu/mma/bwd_block.cuh"

namespace flashport::gpu {

// The kernels' parameters: the call's arguments and the TMA views of q and dout, (col, row, head,
// batch) in boxes of 64 columns x the instance's BM rows (packed tensors: one batch of all their
// rows), from which the producer loads a step's Q and dO (load_step). has_maps false (the encoder
// refused the views, or rows past a 32-bit coordinate): every step by the loaders' cp.async.
struct HopperBwdParams {
  BwdArgs a;
  CUtensorMap tq, tdo;
  bool has_maps = false;
};

namespace sm90 {

// 4 bytes global -> shared; src_bytes 0 stores zero.
__device__ __forceinline__ void cp_async_4(uint32_t smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
// Bulk reduce (copy engine): global[0, bytes) += shared[0, bytes) as fp32, one bulk group per
// issuing thread; 16-byte aligned addresses, bytes a multiple of 16.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, uint32_t smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem), "r"(smem),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The copy engine has finished reading the shared memory of all but the newest N groups.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Deterministic mode: the key blocks of a query block (b, h, m) add their dQ parts in a fixed order
// (descending key block, from the last one that sees the query block: SeqScoreRules::
// last_key_block, as the mma.sync backward), counted by a per-(b, h, m) semaphore in the workspace
// (zeroed by the preprocess). The launch walks the key blocks backwards (n = gridDim.x - 1 -
// blockIdx.x), so a block only waits for blocks dispatched before it: no deadlock whatever the
// residency. A block's turn passes once every issuer's bulk reduces are complete (wait_group 0),
// fenced (the reduces are async-proxy writes) and joined by the dQ-writer warp's __syncwarp
// (write_dq_tile).
__device__ __forceinline__ int32_t* dq_sema(const BwdArgs& a, int b, int h, int m) {
  return a.ws_sema + (int64_t(b) * a.hq + h) * a.m_blocks + m;
}
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// Spins until `target` parts were added to the query block (one lane; the warp syncs after).
__device__ __forceinline__ void dq_wait_turn(const int32_t* sema, int target) {
  for (;;) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sema) : "memory");
    if (v == target) break;
    __nanosleep(32);
  }
}
__device__ __forceinline__ void dq_pass_turn(int32_t* sema) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(sema), "r"(1) : "memory");
}
// An issuer's reduces are complete and ordered before the barrier that precedes dq_pass_turn.
__device__ __forceinline__ void dq_reduces_done() {
  bulk_wait_all();
  fence_proxy_async_global();
}

// A block's steps (BwdWalk): step s is query head kvh group + s / nm and query block m_at(s).
// In the descending dQ order above, key block n waits for block n + 1 at every query block, so the
// lag grows along the chain (block 0 adds last everywhere; the deterministic D256 backward ran at
// 0.71-0.74x the default one). The rotated walk (a.dq_rotated, where every key block sees every
// query block) starts key block n's walk of each head at query block n and wraps around: at any
// step the key blocks of a head add into different query blocks, and a block's predecessor in a
// query block's order added there a step earlier, so no block waits while the chain keeps pace.
// Query block m's order is then n = m, m - 1, ..., 0, nk - 1, ..., m + 1 (dq_turn), still fixed.
// Block nk - 1 waits for block 0, the chain's last launched: the plan rotates only when a head's
// key blocks fit in half a wave of the stream's SMs (hopper_bwd_plan), so they are resident
// together. A sequence with more key blocks than query blocks keeps the descending order.
// DqRotation<false> is the plain walk, with no state: the instances without the rotation
// (hopper_bwd_rotates) compile as before.
template <bool kRotates>
struct DqRotation {
  __device__ __forceinline__ DqRotation(const BwdArgs&, const BwdBlock&, int, int) {}
  __device__ __forceinline__ int first() const { return 0; }  // the first query block, past m_lo
  __device__ __forceinline__ int m_at(int m_lo, int nm, int s) const { return m_lo + s % nm; }
  // The next step's head h and query block m (k: the step's index in the head's walk).
  __device__ __forceinline__ void advance(int m_lo, int nm, int& h, int& m, int& /*k*/) const {
    if (++m == m_lo + nm) m = m_lo, ++h;
  }
  // Deterministic mode: the dQ parts added to query block m before this key block's.
  __device__ __forceinline__ int dq_turn(const KernelScoreRules& S, int m, int n_blk, int bm, int bn) const {
    return S.last_key_block(m, bm, bn) - n_blk;
  }
};
template <>
struct DqRotation<true> {
  int rot = 0, nk = 0;  // nk > 0: the rotated walk over the sequence's nk key blocks
  __device__ __forceinline__ DqRotation(const BwdArgs& a, const BwdBlock& blk, int bn, int nm) {
    const int n = (blk.seq.lk + bn - 1) / bn;
    if (a.dq_rotated && nm > 0 && n <= nm) rot = blk.n_blk, nk = n;
  }
  __device__ __forceinline__ int first() const { return rot; }
  __device__ __forceinline__ int m_at(int m_lo, int nm, int s) const {
    const int k = s % nm + rot;
    return m_lo + (k >= nm ? k - nm : k);
  }
  __device__ __forceinline__ void advance(int m_lo, int nm, int& h, int& m, int& k) const {
    if (++m == m_lo + nm) m = m_lo;
    if (++k == nm) k = 0, ++h;
  }
  __device__ __forceinline__ int dq_turn(const KernelScoreRules& S, int m, int n_blk, int bm, int bn) const {
    if (nk == 0) return S.last_key_block(m, bm, bn) - n_blk;
    return n_blk <= m ? min(m, nk - 1) - n_blk : m + nk - n_blk;
  }
};
template <int N>
__device__ __forceinline__ void fence_regs_u32(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

// This thread's 16-byte column chunk (8 columns) of the Q/K rows (the call's D columns) and of
// the V/dO rows (Dv columns): whether it is inside the row (head dims are multiples of 8:
// hopper_bwd_check) and its first column (0 past the row, so the address stays inside the row).
// A call whose head dims are below the instance's (64/128/256) runs padded: the chunks past D and
// Dv land as zeros, so S^T = K Q^T and dP^T = V dO^T are exact and the padded columns of dQ, dK,
// dV come out 0 (not stored).
struct RowChunk {
  bool qk_in, vo_in;
  int qk_col, vo_col;
  __device__ __forceinline__ RowChunk(int chunk, int d, int dv)
      : qk_in(8 * chunk < d), vo_in(8 * chunk < dv), qk_col(qk_in ? 8 * chunk : 0), vo_col(vo_in ? 8 * chunk : 0) {}
};

// The block's K and V rows [n0, n0 + BN) into their swizzled 64-column panels (rows past lk:
// zeros); this thread copies chunk ld_chunk (columns: rc) of rows ld_row + k kRowStep.
template <int BN, int kRowStep>
__device__ __forceinline__ void load_kv_block(const BwdArgs& a, int b, int kvh, int n0, int lk, int ld_row,
                                              int ld_chunk, const RowChunk& rc, uint16_t* sK, uint16_t* sV) {
  const bool kpacked = a.k_addr.layout == KvLayout::Packed;
  const int64_t k_base = (kpacked ? a.seq.k_start(b) * a.k_addr.s0 : int64_t(b) * a.k_addr.s0) + kvh * a.k_addr.s2;
  const int64_t v_base = (a.v_addr.layout == KvLayout::Packed ? a.seq.k_start(b) * a.v_addr.s0
                                                              : int64_t(b) * a.v_addr.s0) + kvh * a.v_addr.s2;
  const int64_t k_rs = kpacked ? a.k_addr.s0 : a.k_addr.s1;
  const int64_t v_rs = a.v_addr.layout == KvLayout::Packed ? a.v_addr.s0 : a.v_addr.s1;
  const int soff = panel_offset(BN, ld_row, ld_chunk);
#pragma unroll
  for (int k = 0; k < BN / kRowStep; ++k) {
    const int j = n0 + ld_row + k * kRowStep;
    const bool in = j < lk;
    const int64_t jj = in ? j : 0;
    cp_async_16(sK + soff + k * kRowStep * 64, a.k + k_base + jj * k_rs + rc.qk_col, in && rc.qk_in ? 16 : 0);
    cp_async_16(sV + soff + k * kRowStep * 64, a.v + v_base + jj * v_rs + rc.vo_col, in && rc.vo_in ? 16 : 0);
  }
}

// Epilogue: dK = scale * acc (kIsDk) or dV = acc of this thread's keys key0 and key0 + 8, 64-column
// panels [panel0, panel0 + kPanels); rows past Lk of a batched tensor get 0. Only the call's D
// columns of dK and Dv columns of dV are stored: a padded instance's others hold zeros (head dims
// are multiples of 8, so an 8-column chunk is all in or all out).
// Rows of dK / dV the epilogue stores: the sequence's keys, or (batched, k_rows_cap) every row of
// the tensor's sequence, those past Lk as zeros.
__device__ __forceinline__ int kv_grad_row_limit(const BwdArgs& a, int lk) {
  return a.k_rows_cap > 0 ? static_cast<int>(a.k_rows_cap) : lk;
}

template <bool kIsDk, int kPanels, typename Elem>
__device__ __forceinline__ void store_kv_grad(const BwdArgs& a, int b, int kvh, int lk, int key0, int panel0,
                                              int col_base, const float (&acc)[kPanels][32]) {
  const int row_limit = kv_grad_row_limit(a, lk);
  using T = typename Elem::T;
  const auto& addr = kIsDk ? a.dk_addr : a.dv_addr;
  const int cols = kIsDk ? a.d : a.dv;
  const float scale = kIsDk ? a.scale : 1.0f;
  // vec: one 32-bit store per column pair (4-byte aligned pairs); unswitched, outside the loops.
  auto store_rows = [&](auto vec) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int j = key0 + 8 * hf;
      if (j >= row_limit) continue;
      T* row = reinterpret_cast<T*>(kIsDk ? a.dk_ptr : a.dv_ptr) +
               (addr.layout == KvLayout::Packed ? (a.seq.k_start(b) + j) * addr.s0
                                                : int64_t(b) * addr.s0 + int64_t(j) * addr.s1) +
               kvh * addr.s2;
#pragma unroll
      for (int p = 0; p < kPanels; ++p)
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const int chunk_col = (panel0 + p) * 64 + t * 8, col = chunk_col + col_base;
          if (chunk_col >= cols) continue;
          const float x0 = acc[p][4 * t + 2 * hf] * scale, x1 = acc[p][4 * t + 2 * hf + 1] * scale;
          if constexpr (decltype(vec)::value) *reinterpret_cast<uint32_t*>(row + col) = Elem::pack(x0, x1);
          else row[col] = Elem::from_float(x0), row[col + 1] = Elem::from_float(x1);
        }
    }
  };
  if (a.kv_out_vec_ok) store_rows(std::true_type{});
  else store_rows(std::false_type{});
}
// The same rows through shared memory, in whole 16-byte row chunks (store_tile_staged; needs
// a.kv_out_vec16_ok): this warpgroup's 64 keys from key_row0, staged at `stage` (64 rows of kRowBytes).
template <bool kIsDk, int kRowBytes, typename Elem, int kPanels>
__device__ __forceinline__ void store_kv_grad_staged(const BwdArgs& a, int b, int kvh, int lk, int key_row0,
                                                     const float (&acc)[kPanels][32], const OutStage& stage) {
  const auto& addr = kIsDk ? a.dk_addr : a.dv_addr;
  const bool packed = addr.layout == KvLayout::Packed;
  const int rows = kv_grad_row_limit(a, lk) - key_row0;  // the rest: not stored
  using T = typename Elem::T;
  T* row0 = reinterpret_cast<T*>(kIsDk ? a.dk_ptr : a.dv_ptr) +
            (packed ? (a.seq.k_start(b) + key_row0) * addr.s0 : int64_t(b) * addr.s0 + int64_t(key_row0) * addr.s1) +
            int64_t(kvh) * addr.s2;
  const float scale = kIsDk ? a.scale : 1.0f;
  const float inv[2] = {scale, scale};
  store_tile_staged<Elem, kRowBytes>(acc, inv, row0, packed ? addr.s0 : addr.s1, 0, rows, kIsDk ? a.d : a.dv, stage);
}

template <int kPanels, typename Elem>
__device__ __forceinline__ void store_dk_dv(const BwdArgs& a, int b, int kvh, int lk, int key0, int panel0,
                                            int col_base, const float (&dk_acc)[kPanels][32],
                                            const float (&dv_acc)[kPanels][32]) {
  store_kv_grad<true, kPanels, Elem>(a, b, kvh, lk, key0, panel0, col_base, dk_acc);
  store_kv_grad<false, kPanels, Elem>(a, b, kvh, lk, key0, panel0, col_base, dv_acc);
}

// P of one element of P^T (key j, query i) from its raw score v, in the general form (softcap,
// ALiBi, mask; lse2 in log2 units), and the softcap derivative 1 - th^2 (1 without softcap). The
// common case (no softcap, no ALiBi) is exp2(v scale - lse2) and the mask, in straight-line loops.
__device__ __forceinline__ float bwd_prob(const KernelScoreRules& S, float v, int i, int j, float lse2,
                                          float slope_log2, bool need_mask, float& dtanh) {
  const auto sg = S.score_grad(v);
  float sc = sg.score;
  dtanh = sg.dtanh;
  if (S.alibi()) sc += S.alibi_bias(slope_log2, i, j);
  float p = fast_exp2(sc - lse2);
  if (need_mask && (j < S.vis_lo(i) || j >= S.vis_hi(i))) p = 0.0f;
  return p;
}

// P^T and dS^T of one step, in place (s_acc becomes P^T, dp_acc dS^T), as the two product groups
// land (S^T first, then dP^T). Element (key j, query i) is acc[4t + 2hf + e2] with j = key0 + 8hf,
// i = q0 + 8t + col_base + e2; tL, tD: LSE2 and D of query q0. The waits are unconditional (ptxas
// keeps the products asynchronous only when it sees a fixed group structure). The common case (no
// softcap, no ALiBi) has its own straight-line loops, unswitched on the mask, so it runs without
// per-element branches; P is computed while dP^T is still running. Softcap / ALiBi take the
// general loop after dP^T lands (softcap's derivative needs tanh of the score).
// kDropout: the call's dropout replayed with this thread's keep bits (bwd_keep_bits):
// dS^T = P^T (dP^T Z / (1 - p) - D), and s_acc becomes P^T Z / (1 - p) (for dV), Z the keep mask.
template <int kQTiles, bool kDropout>
__device__ __forceinline__ void p_and_ds(float (&s_acc)[4 * kQTiles], float (&dp_acc)[4 * kQTiles],
                                         const KernelScoreRules& S, bool transformed, bool need_mask,
                                         float slope_log2, int q0, int key0, int col_base,
                                         const float* tL, const float* tD,
                                         const uint32_t (&keep)[(4 * kQTiles + 31) / 32]) {
  auto prob = [&](float v, int t, int hf, int e2, float lse2, float& dtanh) -> float {
    return bwd_prob(S, v, q0 + 8 * t + col_base + e2, key0 + 8 * hf, lse2, slope_log2, need_mask, dtanh);
  };
  // Element e's factor: 1 / (keep rate) where kept, else 0.
  const float keep_scale = kDropout ? S.rules->dropout_scale : 1.0f;
  auto kept = [&](int e) -> float { return bwd_kept(keep, e) ? keep_scale : 0.0f; };
  wg_wait<1>();
  fence_regs(s_acc);
  auto plain_p = [&](auto masked) {
#pragma unroll
    for (int t = 0; t < kQTiles; ++t) {
      const float2 l2 = *reinterpret_cast<const float2*>(tL + 8 * t + col_base);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          float& v = s_acc[4 * t + 2 * hf + e2];
          v = fast_exp2(fmaf(v, *S.scale, -(e2 ? l2.y : l2.x)));
          if constexpr (decltype(masked)::value) {
            const int i = q0 + 8 * t + col_base + e2, j = key0 + 8 * hf;
            if (j < S.vis_lo(i) || j >= S.vis_hi(i)) v = 0.0f;
          }
        }
    }
  };
  if (!transformed) {
    if (need_mask) plain_p(std::true_type{});
    else plain_p(std::false_type{});
  }
  wg_wait<0>();
  fence_regs(dp_acc);
  // ---- dS^T = P^T (dP^T - D) (x softcap derivative) -----------------------------------------
  if (!transformed) {
#pragma unroll
    for (int t = 0; t < kQTiles; ++t) {
      const float2 d2 = *reinterpret_cast<const float2*>(tD + 8 * t + col_base);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          float& g = dp_acc[4 * t + 2 * hf + e2];
          if constexpr (kDropout) {
            float& v = s_acc[4 * t + 2 * hf + e2];
            const float z = kept(4 * t + 2 * hf + e2);
            g = v * (g * z - (e2 ? d2.y : d2.x));
            v *= z;
          } else {
            g = s_acc[4 * t + 2 * hf + e2] * (g - (e2 ? d2.y : d2.x));
          }
        }
    }
  } else {
#pragma unroll
    for (int t = 0; t < kQTiles; ++t) {
      const float2 d2 = *reinterpret_cast<const float2*>(tD + 8 * t + col_base);
      const float2 l2 = *reinterpret_cast<const float2*>(tL + 8 * t + col_base);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          float& v = s_acc[4 * t + 2 * hf + e2];
          float& g = dp_acc[4 * t + 2 * hf + e2];
          float dtanh = 1.0f;
          v = prob(v, t, hf, e2, e2 ? l2.y : l2.x, dtanh);
          if constexpr (kDropout) {
            const float z = kept(4 * t + 2 * hf + e2);
            g = v * (g * z - (e2 ? d2.y : d2.x)) * dtanh;
            v *= z;
          } else {
            g = v * (g - (e2 ? d2.y : d2.x)) * dtanh;
          }
        }
    }
  }
}

// The D256 kernel's split of p_and_ds between its two MMA warpgroups (same accumulator layout:
// element e = 4t + 2hf + e2 is key key0 + 8hf, query q0 + 8t + col_base + e2 in both). The score
// side turns S^T into P^T in place, scaled by the keep mask (P^T Z / (1 - p): dV's A operand), and
// hands each element's P^T x softcap derivative to the gradient side in fp32, with the sign bit set
// where dropout drops the element (hand[t][tw]: elements 4t .. 4t + 3 of warpgroup thread tw; a
// warp's float4 stores and loads cover 512 contiguous bytes). The gradient side forms
// dS^T = |h| (dP^T Z / (1 - p) - D) in place from it: the fp32 P of p_and_ds, so the same dS.
template <int kQTiles, bool kDropout, int kT0 = 0, int kT1 = kQTiles>
__device__ __forceinline__ void bwd_probs_handoff(float (&acc)[4 * kQTiles], const KernelScoreRules& S,
                                                  bool transformed, bool need_mask, float slope_log2, int q0,
                                                  int key0, int col_base, const float* tL,
                                                  const uint32_t (&keep)[(4 * kQTiles + 31) / 32], float4* hand,
                                                  int tw) {
  const float keep_scale = kDropout ? S.rules->dropout_scale : 1.0f;
  // One element: P^T (p) and the softcap derivative (dt) -> the handoff value and dV's operand.
  auto finish = [&](int e, float p, float dt) -> float {
    float h = p * dt;
    if constexpr (kDropout) {
      const bool kept = bwd_kept(keep, e);
      acc[e] = kept ? p * keep_scale : 0.0f;
      h = __uint_as_float(__float_as_uint(h) | (kept ? 0u : 0x80000000u));
    } else {
      acc[e] = p;
    }
    return h;
  };
  auto plain = [&](auto masked) {
#pragma unroll
    for (int t = kT0; t < kT1; ++t) {
      const float2 l2 = *reinterpret_cast<const float2*>(tL + 8 * t + col_base);
      float h[4];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int e = 4 * t + 2 * hf + e2;
          float p = fast_exp2(fmaf(acc[e], *S.scale, -(e2 ? l2.y : l2.x)));
          if constexpr (decltype(masked)::value) {
            const int i = q0 + 8 * t + col_base + e2, j = key0 + 8 * hf;
            if (j < S.vis_lo(i) || j >= S.vis_hi(i)) p = 0.0f;
          }
          h[2 * hf + e2] = finish(e, p, 1.0f);
        }
      hand[t * 128 + tw] = make_float4(h[0], h[1], h[2], h[3]);
    }
  };
  if (!transformed) {
    if (need_mask) plain(std::true_type{});
    else plain(std::false_type{});
    return;
  }
#pragma unroll
  for (int t = kT0; t < kT1; ++t) {
    const float2 l2 = *reinterpret_cast<const float2*>(tL + 8 * t + col_base);
    float h[4];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int e = 4 * t + 2 * hf + e2;
        float dt = 1.0f;
        const float p = bwd_prob(S, acc[e], q0 + 8 * t + col_base + e2, key0 + 8 * hf, e2 ? l2.y : l2.x,
                                 slope_log2, need_mask, dt);
        h[2 * hf + e2] = finish(e, p, dt);
      }
    hand[t * 128 + tw] = make_float4(h[0], h[1], h[2], h[3]);
  }
}
template <int kQTiles, bool kDropout, int kT0 = 0, int kT1 = kQTiles>
__device__ __forceinline__ void bwd_dscores_from_handoff(float (&acc)[4 * kQTiles], float keep_scale,
                                                         int col_base, const float* tD, const float4* hand,
                                                         int tw) {
#pragma unroll
  for (int t = kT0; t < kT1; ++t) {
    const float2 d2 = *reinterpret_cast<const float2*>(tD + 8 * t + col_base);
    const float4 h4 = hand[t * 128 + tw];
    const float h[4] = {h4.x, h4.y, h4.z, h4.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float& g = acc[4 * t + k];
      const float d = (k & 1) ? d2.y : d2.x;
      if constexpr (kDropout) {
        const float z = signbit(h[k]) ? 0.0f : keep_scale;
        g = fabsf(h[k]) * (g * z - d);
      } else {
        g = h[k] * (g - d);
      }
    }
  }
}


// The loaders' copy of one step's Q and dO rows [i0, i0 + BM) of query head h into a ring stage
// (swizzled 64-column panels) by kLoaders threads (loader t: chunk t % kChunks of rows t / kChunks
// + k kRowStep). Rows past Lq: zeros (with LSE2 0, D 0 their P is finite and their dS, dV
// contributions exactly 0, as in the mma.sync loop). The step's row-0 addresses are the same for
// the whole warp (uniform registers): the producer has 24 registers.
template <int BM, int kChunks, int kLoaders>
__device__ __forceinline__ void load_q_do_rows(const BwdArgs& a, int b, int64_t q_start, int lq, int h, int i0,
                                               int t, uint16_t* sQ, uint16_t* sdO) {
  constexpr int kRowStep = kLoaders / kChunks;
  static_assert(kLoaders % kChunks == 0, "loader mapping");
  const uint16_t* q_step = a.q + a.q_addr.at(b, q_start, i0, h);
  const uint16_t* o_step = a.dout + a.dout_addr.at(b, q_start, i0, h);
  const int rows_in = lq - i0;  // rows of the step inside the sequence
  const int chunk = t % kChunks;
  const RowChunk rc(chunk, a.d, a.dv);
#pragma unroll 1
  for (int row = t / kChunks; row < BM; row += kRowStep) {
    const bool in = row < rows_in;
    const int64_t r = in ? row : 0;
    const int off = panel_offset(BM, row, chunk);
    // Unsigned columns: zero-extended for free, no sign word held over the loop.
    cp_async_16(sQ + off, q_step + r * a.q_addr.row_stride + unsigned(rc.qk_col), in && rc.qk_in ? 16 : 0);
    cp_async_16(sdO + off, o_step + r * a.dout_addr.row_stride + unsigned(rc.vo_col), in && rc.vo_in ? 16 : 0);
  }
}

// The producer's part of one step (both kernels): the step's Q and dO rows [i0, i0 + BM) of query
// head h into a ring stage, and their LSE2 and D, by kLoaders threads, announced on the stage's
// `full` barrier (kLoaders + 1 arrivals a phase: every loader's cp.async arrival, and thread 0's).
// A step whose rows all lie inside the sequence takes TMA boxes (thread 0: D / 64 boxes of 64
// columns x BM rows each of Q and dO, columns past D / Dv zero-filled by the maps; its arrival
// announces their bytes): a 16-byte cp.async per chunk cost the producer warps ~1,500 issued
// instructions a D128 step, 23% of the kernel's (ncu, bench/results/gpu_backward.md session 23). A
// tail step keeps the loaders' copies (load_q_do_rows: its rows past Lq must be zeros, and in a
// varlen call the rows after the sequence are the next one's), as does a call without maps.
// LSE2 / D: loader t copies rows t + k kLoaders (LSE2 0, D 0 past Lq).
template <int BM, int D, int kLoaders>
__device__ __forceinline__ void load_step(const HopperBwdParams& P, int b, int64_t q_start, int64_t ws_row0, int lq,
                                          int h, int i0, int t, uint16_t* sQ, uint16_t* sdO, float* sL, float* sDs,
                                          uint32_t full) {
  const BwdArgs& a = P.a;
  constexpr int kPanels = D / 64;
  if (P.has_maps && lq - i0 >= BM) {
    if (t == 0) {
      mbar_arrive_expect_tx(full, uint32_t(2 * BM * D * 2));
      const int q_row = a.q_addr.packed ? int(q_start) + i0 : i0, q_b = a.q_addr.packed ? 0 : b;
      const int o_row = a.dout_addr.packed ? int(q_start) + i0 : i0, o_b = a.dout_addr.packed ? 0 : b;
#pragma unroll
      for (int p = 0; p < kPanels; ++p) {
        tma_load_4d(smem_u32(sQ) + p * (BM * 128), &P.tq, full, p * 64, q_row, h, q_b);
        tma_load_4d(smem_u32(sdO) + p * (BM * 128), &P.tdo, full, p * 64, o_row, h, o_b);
      }
    }
  } else {
    load_q_do_rows<BM, D / 8, kLoaders>(a, b, q_start, lq, h, i0, t, sQ, sdO);
    if (t == 0) mbar_arrive(full);
  }
  const int rows_in = lq - i0;
  const int64_t wrow0 = int64_t(h) * a.total_rows + ws_row0 + i0;
#pragma unroll 1
  for (int row = t; row < BM; row += kLoaders) {
    const bool in = row < rows_in;
    const int64_t wrow = wrow0 + (in ? row : 0);
    cp_async_4(smem_u32(sL + row), a.ws_lse2 + wrow, in ? 4 : 0);
    cp_async_4(smem_u32(sDs + row), a.ws_dsum + wrow, in ? 4 : 0);
  }
  cp_async_arrive(full);  // arrives once this thread's copies have landed
}

// One warpgroup's 64 x 64 fp32 panel of the step's dQ (accumulator layout) into its staging tile,
// row-major with D floats a row (the workspace's layout, so the writer adds the whole tile with one
// bulk reduce): this thread's rows row0, row0 + 8, columns col0 + 8c (col0 its column in the first
// 8-column chunk). A warp's 8 quads sit on rows D floats apart (the same banks), so store t of quad
// r writes chunk (t + rot) & 7, rot = r & 3 (the chunks rotated in registers by two select
// stages): every bank twice per store, the minimum for 256 bytes. Both kernels.
template <int D>
__device__ __forceinline__ void stage_dq_panel(float* tile, int row0, int col0, int rot, const float (&acc)[32]) {
  float y[32], z[32];
#pragma unroll
  for (int t = 0; t < 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) y[4 * t + e] = (rot & 1) ? acc[4 * ((t + 1) & 7) + e] : acc[4 * t + e];
#pragma unroll
  for (int t = 0; t < 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) z[4 * t + e] = (rot & 2) ? y[4 * ((t + 2) & 7) + e] : y[4 * t + e];
#pragma unroll
  for (int t = 0; t < 8; ++t)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      *reinterpret_cast<float2*>(tile + (row0 + 8 * hf) * D + col0 + 8 * ((t + rot) & 7)) =
          make_float2(z[4 * t + 2 * hf], z[4 * t + 2 * hf + 1]);
}

// A warpgroup's 64 x 64 of a step's dQ = dS K over the block's BN keys (D64 / D128 kernel), one
// commit group: dS^T (keys x queries) and K both MN-major in shared memory; ds_base: the
// warpgroup's query panel of dS^T, k_base: its column panel of K.
template <int BN, bool kBf16>
__device__ __forceinline__ void issue_dq_product(float (&dq_acc)[32], uint32_t ds_base, uint32_t k_base) {
  // Descriptors as base + offset: the opaque copies keep the compiler from hoisting them.
  uint64_t s_desc = make_desc(ds_base, BN * 128, 1024);
  asm volatile("" : "+l"(s_desc));
  uint64_t kt_desc = make_desc(k_base, BN * 128, 1024);
  asm volatile("" : "+l"(kt_desc));
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks)
    wgmma_ss_m64n64k16<kBf16, 1, 1>(dq_acc, s_desc + ((ks * 2048) >> 4), kt_desc + ((ks * 2048) >> 4), ks > 0 ? 1 : 0);
  wg_commit();
}

// The dQ writer warp's part of one step (both kernels): the step's dQ, staged in shared memory at
// `tile` as fp32 [BM][D] row-major, added into the workspace rows of query block m of head h. The
// step's rows (those below Lq) are contiguous there, so one bulk reduce takes the whole tile when
// the workspace rows are D floats (dacc = D); a padded call's rows (dacc < D) go one bulk reduce
// per row (lane l: rows l, l + 32, ...). (One reduce per row throughout made the writer the D64
// kernel's bottleneck: 128 serial issues a step.) Returns once the copy engine has read the tile.
// Deterministic mode: the warp first waits for this block's turn at the query block (dq_sema) and
// passes it on once its reduces are complete; only this warp waits, the MMA warpgroups go on.
template <int BM, int BN, int D, typename Rotation>
__device__ __forceinline__ void write_dq_tile(const BwdArgs& a, const KernelScoreRules& S, const Rotation& w, int b,
                                              int h, int m, int n_blk, int lq, int64_t ws_row0, uint32_t tile, int lane) {
  if (a.deterministic) {
    if (lane == 0) dq_wait_turn(dq_sema(a, b, h, m), w.dq_turn(S, m, n_blk, BM, BN));
    __syncwarp();
    fence_proxy_async_global();
  }
  const int rows_in = min(lq - m * BM, BM);
  float* dq_rows = a.ws_dq + (int64_t(h) * a.total_rows + ws_row0 + m * BM) * a.dacc;
  if (a.dacc == D) {
    if (lane == 0) bulk_reduce_add_f32(dq_rows, tile, rows_in * D * 4);
  } else {
#pragma unroll 1
    for (int row = lane; row < rows_in; row += 32)
      bulk_reduce_add_f32(dq_rows + int64_t(row) * a.dacc, tile + uint32_t(row * D * 4), a.dacc * 4);
  }
  bulk_commit();
  if (a.deterministic) {
    dq_reduces_done();
    __syncwarp();
    if (lane == 0) dq_pass_turn(dq_sema(a, b, h, m));
  } else {
    bulk_wait_read<0>();
  }
}

// kDropout: the call has dropout (its own instance: the step loop sits at the register limit, and a
// second copy of it in one function spilled in both copies).
// Roles (HopperBwdTile): warpgroup 0 is the producer (warps 0-2 copy Q, dO, LSE2, D into the ring,
// warp 3 adds each step's staged dQ into the workspace), warpgroups 1 and 2 compute.
template <int D, typename Elem, bool kDropout>
__global__ void __launch_bounds__(HopperBwdTile::kThreads, 1) bwd_hopper_kernel(const __grid_constant__ HopperBwdParams P) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const BwdArgs& a = P.a;
  using T = HopperBwdTile;
  constexpr int BN = T::kBlockN, BM = T::block_m(D), kStages = T::kStages;
  constexpr bool kBf16 = Elem::kIsBf16, kRotates = hopper_bwd_rotates(D);
  constexpr int kChunks = D / 8;    // 16-byte chunks per row
  constexpr int kPanels = D / 64;   // 64-column panels of the head dim
  constexpr int kQTiles = BM / 8;   // 8-query accumulator tiles of S^T / dP^T
  constexpr int kQSteps = BM / 16;  // k16 steps of dV / dK
  // dQ split between the warpgroups: by columns at D128 (BM = 64), by rows at D64 (BM = 128).
  constexpr bool kDqByCols = D == 128;
  static_assert(BM * D == 8192 && (kDqByCols ? kPanels == 2 : BM == 128), "dQ split: 64 x 64 per warpgroup");
  // Named barriers (0 is __syncthreads); on each, one side arrives and the other syncs, strictly
  // alternating, so no side can arrive a generation ahead. One per MMA warpgroup w:
  //   turn w: w may issue its next product group (the other has issued its own). The other's 128
  //     threads arrive and w's 128 sync, so the sync is also a barrier among w's own warps.
  //   dS^T stored w: w's half is in shared memory (the other syncs before its dQ).
  //   dS^T free w: w's dQ has read the step's dS^T (the other syncs before storing the next).
  // and dQ staging buffer full / empty, one each per buffer: the MMA side and the writer warp.
  // After the walk: both MMA warpgroups are done (walk done), and each one's staging tile for dK, dV
  // (stage w).
  constexpr int kBarTurn = 1, kBarDsStored = 3, kBarDsFree = 5, kBarDqFull = 7, kBarDqEmpty = 9;
  constexpr int kBarWalkDone = 11, kBarStage = 12;
  constexpr int kMmaThreads = 256, kDqSyncThreads = kMmaThreads + 32;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t base_u32 = (raw_u32 + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem_raw + (base_u32 - raw_u32));
  uint16_t* sV = sK + BN * D;
  uint16_t* sQ = sV + BN * D;                  // [kStages][BM * D]
  uint16_t* sdO = sQ + kStages * BM * D;       // [kStages][BM * D]
  uint16_t* sdS = sdO + kStages * BM * D;      // dS^T: [BN keys][BM queries], 64-query panels
  float* sL = reinterpret_cast<float*>(sdS + BN * BM);  // [kStages][BM] LSE2
  float* sDs = sL + kStages * BM;                       // [kStages][BM] D
  float* sDq = sDs + kStages * BM;  // [2][BM][D] dQ staging
  const uint32_t sK_u32 = base_u32;
  const uint32_t sV_u32 = sK_u32 + BN * D * 2;
  const uint32_t sQ_u32 = sV_u32 + BN * D * 2;
  const uint32_t sdO_u32 = sQ_u32 + kStages * BM * D * 2;
  const uint32_t sdS_u32 = sdO_u32 + kStages * BM * D * 2;
  // mbarriers: Q/dO/LSE2/D stage landed (full) / read by all 8 MMA warps (empty); K and V landed.
  const uint32_t bars = smem_u32(sDq + 2 * BM * D);
  auto full_bar = [&](int st) { return bars + 8u * uint32_t(st); };
  auto empty_bar = [&](int st) { return bars + 8u * uint32_t(kStages + st); };
  const uint32_t kv_bar = bars + 8u * uint32_t(2 * kStages);

  const int tid = threadIdx.x, lane = tid & 31;
  // The warp index through a shuffle: the compiler then knows it is warp-uniform, so the roles'
  // branches stay uniform and the producer's per-step values live in uniform registers.
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
  const int wg = warp >> 2;     // 0: producer; 1, 2: MMA warpgroups
  const int wwarp = warp & 3;   // warp inside the warpgroup
  const BwdBlock blk(a, BN);
  const int n_blk = blk.n_blk, kvh = blk.kvh, b = blk.b, n0 = blk.n0;
  const int lq = blk.seq.lq, lk = blk.seq.lk;
  const int64_t q_start = blk.seq.q_start, ws_row0 = blk.seq.ws_row0;  // ws_row0: workspace row of i = 0
  const KernelScoreRules& S = blk.rules;
  const ScoreRules& R = a.rules;
  // Steps (BwdWalk): step s is query head kvh group + s / nm, block dq_rot.m_at(m_lo, nm, s). Both
  // roles walk them.
  int m_lo = 0, nm = 0, steps = 0;
  if (blk.has_walk()) {
    const BwdWalk walk = blk.walk(a, BN, BM);
    m_lo = walk.m_lo, nm = walk.nm, steps = walk.steps;
  }
  const DqRotation<kRotates> dq_rot(a, blk, BN, nm);

  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      mbar_init(full_bar(st), T::kLoaders + 1);  // each loader's cp.async arrival, and thread 0's (load_step)
      mbar_init(empty_bar(st), kMmaThreads / 32);  // one arrival per MMA warp
    }
    mbar_init(kv_bar, 128);  // the producer warpgroup's K/V copies
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer warpgroup ---------------------------------------------------------------------
    regs_dec<T::kProducerRegs>();
    if (steps == 0) return;
    {
      constexpr int kRowStep = 128 / kChunks;
      static_assert(kRowStep % 8 == 0 && BN % kRowStep == 0, "load mapping");
      const int ld_row = tid / kChunks, ld_chunk = tid % kChunks;
      load_kv_block<BN, kRowStep>(a, b, kvh, n0, lk, ld_row, ld_chunk, RowChunk(ld_chunk, a.d, a.dv), sK, sV);
      cp_async_arrive(kv_bar);
    }
    if (warp < T::kLoaders / 32) {
      // Loaders: stage s % kStages once the MMA warps released its previous use (step s - kStages).
      int h = kvh * a.group, m = m_lo + dq_rot.first(), k = 0;  // step s's head and query block
      for (int s = 0; s < steps; ++s) {
        const int st = s % kStages;
        mbar_wait(empty_bar(st), ((s / kStages) & 1) ^ 1);
        load_step<BM, D, T::kLoaders>(P, b, q_start, ws_row0, lq, h, m * BM, tid, sQ + st * BM * D,
                                      sdO + st * BM * D, sL + st * BM, sDs + st * BM, full_bar(st));
        dq_rot.advance(m_lo, nm, h, m, k);
      }
      cp_async_wait<0>();
    } else {
      // dQ writer (warp 3): step s's dQ, staged in buffer s & 1, into the workspace (write_dq_tile);
      // the buffer is free again once the copy engine has read it.
      int h = kvh * a.group, m = m_lo + dq_rot.first(), k = 0;  // step s's head and query block
      for (int s = 0; s < steps; ++s) {
        const int sbuf = s & 1;
        named_sync<kDqSyncThreads>(kBarDqFull + sbuf);
        write_dq_tile<BM, BN, D>(a, S, dq_rot, b, h, m, n_blk, lq, ws_row0, smem_u32(sDq + sbuf * (BM * D)), lane);
        if (s + 2 < steps) named_arrive<kDqSyncThreads>(kBarDqEmpty + sbuf);
        dq_rot.advance(m_lo, nm, h, m, k);
      }
      bulk_wait_all();  // the staging tile must outlive the copy engine's reads
    }
    return;
  }

  // ---- MMA warpgroups -----------------------------------------------------------------------------
  regs_inc<T::kMmaRegs>();
  const int mwg = wg - 1;  // keys [64 mwg, 64 mwg + 64) of the block
  // This thread's accumulator rows (keys in S^T, dP^T, dK, dV): key_loc0 and key_loc0 + 8.
  const int key_loc0 = mwg * 64 + wwarp * 16 + (lane >> 2);
  const int col_base = (lane & 3) * 2;

  float dv_acc[kPanels][32], dk_acc[kPanels][32];
#pragma unroll
  for (int p = 0; p < kPanels; ++p)
#pragma unroll
    for (int e = 0; e < 32; ++e) dv_acc[p][e] = 0.0f, dk_acc[p][e] = 0.0f;

  if (steps > 0) {
    const bool transformed = S.softcapped() || S.alibi();

    float dq_acc[32];
    const int dq_d_panel = kDqByCols ? mwg : 0;
    // This warpgroup's dQ product: its query panel of dS^T, its column panel of K.
    const uint32_t dq_ds_base = sdS_u32 + (kDqByCols ? 0 : mwg) * 64 * (BN * 2);
    const uint32_t dq_k_base = sK_u32 + dq_d_panel * (BN * 128);
    // This thread's fragment of the step's dQ into staging buffer `sbuf` (stage_dq_panel).
    auto stage_dq = [&](int sbuf) {
      const int row0 = (kDqByCols ? 0 : mwg * 64) + wwarp * 16 + (lane >> 2);
      stage_dq_panel<D>(sDq + sbuf * (BM * D), row0, dq_d_panel * 64 + col_base, (lane >> 2) & 3, dq_acc);
    };
    // Every thread of the warp has passed its wgmma wait: the warp's reads of the stage are done.
    auto release = [&](uint32_t bar) {
      __syncwarp();
      if (lane == 0) mbar_arrive(bar);
    };

    // Dropout: this thread's keep bits of step `step`. Step 0's are made before its products, the
    // next step's while this step's dV, dK, dQ products run (S^T and dP^T no longer hold
    // registers there).
    uint32_t keep[(4 * kQTiles + 31) / 32] = {};
    auto step_keep = [&](int step) {
      int m = m_lo + step % nm;  // (without the rotation, no capture of dq_rot: it changed the SASS)
      if constexpr (kRotates) m = dq_rot.m_at(m_lo, nm, step);
      bwd_keep_bits<kQTiles>(keep, R, b, a.hq, kvh * a.group + step / nm, m * BM, n0 + key_loc0);
    };
    if constexpr (kDropout) step_keep(0);

    // Turns: warpgroup 1 starts; the other's barrier id.
    const int my_turn = kBarTurn + mwg, other_turn = kBarTurn + (mwg ^ 1);
    mbar_wait(kv_bar, 0);
    for (int s = 0; s < steps; ++s) {
      const int st = s % kStages;
      const int h = kvh * a.group + s / nm;
      const int m = dq_rot.m_at(m_lo, nm, s);
      const int i0 = m * BM;
      // This warpgroup's 64 keys may be hidden from every row of the step (at D128, BM = 64: the
      // causal diagonal's first step, a window's edges): its P^T and dS^T are zeros, so it skips
      // its S^T, dP^T, dV, dK products and elementwise phase, and only takes its turns, stores
      // zeros as its half of dS^T and makes its part of dQ (bit-identical: the skipped terms are
      // exact zeros). D64's 128-row steps meet no hidden half on a causal diagonal: one body.
      bool live = true;
      if constexpr (D == 128) {
        const int i_end = i0 + BM < lq ? i0 + BM : lq;
        const int key_lo = n0 + mwg * 64, key_end = key_lo + 64 < lk ? key_lo + 64 : lk;
        live = key_lo < lk && S.rows_lo(key_lo) < i_end && S.rows_end(key_end) > i0;
      }
      if (live) {
        if (mwg == 1 || s > 0) named_sync<kMmaThreads>(my_turn);  // warpgroup 1's first turn needs none
        mbar_wait(full_bar(st), (s / kStages) & 1);
        fence_proxy_async();  // a tail step's cp.async writes (generic proxy) -> wgmma reads (async proxy)

        // ---- S^T = K Q^T and dP^T = V dO^T (two groups: P is computed while dP^T runs) ----
        float s_acc[BM / 2], dp_acc[BM / 2];
        {
          // Descriptors as base + offset (16-byte units); the opaque copies keep the compiler
          // from hoisting D/16 loop-invariant 64-bit descriptors into registers.
          uint64_t k_desc = make_desc(sK_u32 + mwg * (64 * 128), 16, 1024);
          asm volatile("" : "+l"(k_desc));
          uint64_t q_desc = make_desc(sQ_u32 + st * (BM * D * 2), 16, 1024);
          asm volatile("" : "+l"(q_desc));
          wg_fence();
#pragma unroll
          for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t koff = uint32_t((ks & 3) * 32);  // 16 columns = 32 bytes of the 128-byte row
            const uint64_t da = k_desc + (((ks >> 2) * (BN * 128) + koff) >> 4);
            const uint64_t db = q_desc + (((ks >> 2) * (BM * 128) + koff) >> 4);
            if constexpr (BM == 128) wgmma_ss_m64n128k16<kBf16, 0, 0>(s_acc, da, db, ks > 0 ? 1 : 0);
            else wgmma_ss_m64n64k16<kBf16, 0, 0>(s_acc, da, db, ks > 0 ? 1 : 0);
          }
          wg_commit();
          uint64_t v_desc = make_desc(sV_u32 + mwg * (64 * 128), 16, 1024);
          asm volatile("" : "+l"(v_desc));
          uint64_t o_desc = make_desc(sdO_u32 + st * (BM * D * 2), 16, 1024);
          asm volatile("" : "+l"(o_desc));
#pragma unroll
          for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t koff = uint32_t((ks & 3) * 32);
            const uint64_t da = v_desc + (((ks >> 2) * (BN * 128) + koff) >> 4);
            const uint64_t db = o_desc + (((ks >> 2) * (BM * 128) + koff) >> 4);
            if constexpr (BM == 128) wgmma_ss_m64n128k16<kBf16, 0, 0>(dp_acc, da, db, ks > 0 ? 1 : 0);
            else wgmma_ss_m64n64k16<kBf16, 0, 0>(dp_acc, da, db, ks > 0 ? 1 : 0);
          }
          wg_commit();
        }
        named_arrive<kMmaThreads>(other_turn);

        // ---- P^T, dS^T (s_acc[4t + 2hf + e2] is key n0 + key_loc0 + 8hf, query i0 + 8t + col_base + e2)
        p_and_ds<kQTiles, kDropout>(s_acc, dp_acc, S, transformed, S.tile_needs_mask(n_blk, BN, i0, i0 + BM - 1),
                                    R.alibi ? -R.alibi_slope(b, h) * kLog2e : 0.0f, i0, n0 + key_loc0, col_base,
                                    sL + st * BM, sDs + st * BM, keep);
        uint32_t pa[kQSteps][4], da[kQSteps][4];
#pragma unroll
        for (int ks = 0; ks < kQSteps; ++ks)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            pa[ks][r] = Elem::pack(s_acc[8 * ks + 2 * r], s_acc[8 * ks + 2 * r + 1]);
            da[ks][r] = Elem::pack(dp_acc[8 * ks + 2 * r], dp_acc[8 * ks + 2 * r + 1]);
          }
        // dS^T to shared memory for dQ: (key, queries 8t + col_base, +1) -> one 32-bit store;
        // pair (t, hf) is da[t / 2][(t & 1) * 2 + hf]. The other warpgroup's dQ of step s - 1
        // must have read the previous dS^T first.
        if (s > 0) named_sync<kMmaThreads>(kBarDsFree + (mwg ^ 1));
#pragma unroll
        for (int t = 0; t < kQTiles; ++t)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int off = panel_offset(BN, key_loc0 + 8 * hf, t) + col_base;
            *reinterpret_cast<uint32_t*>(sdS + off) = da[t >> 1][(t & 1) * 2 + hf];
          }
        fence_proxy_async();  // dS^T stores (generic proxy) -> wgmma reads (async proxy)
        named_arrive<kMmaThreads>(kBarDsStored + mwg);
        named_sync<kMmaThreads>(my_turn);  // the other has issued its S^T, dP^T

        // ---- dV += P^T dO, dK += dS^T Q (A from registers; dO, Q MN-major) -------------------
        {
          uint64_t o_desc = make_desc(sdO_u32 + st * (BM * D * 2), BM * 128, 1024);
          asm volatile("" : "+l"(o_desc));
          uint64_t q_desc = make_desc(sQ_u32 + st * (BM * D * 2), BM * 128, 1024);
          asm volatile("" : "+l"(q_desc));
          wg_fence();
#pragma unroll
          for (int ks = 0; ks < kQSteps; ++ks)
#pragma unroll
            for (int p = 0; p < kPanels; ++p)
              wgmma_rs_m64n64k16<kBf16, 1>(dv_acc[p], pa[ks], o_desc + ((p * (BM * 128) + ks * 2048) >> 4), 1);
#pragma unroll
          for (int ks = 0; ks < kQSteps; ++ks)
#pragma unroll
            for (int p = 0; p < kPanels; ++p)
              wgmma_rs_m64n64k16<kBf16, 1>(dk_acc[p], da[ks], q_desc + ((p * (BM * 128) + ks * 2048) >> 4), 1);
          wg_commit();
        }
        named_sync<kMmaThreads>(kBarDsStored + (mwg ^ 1));  // the other's dS^T half in shared memory

        // ---- dQ = dS K (64 x 64 per warpgroup; dS^T and K MN-major) ---------------------------
        issue_dq_product<BN, kBf16>(dq_acc, dq_ds_base, dq_k_base);
        if (s + 1 < steps || mwg == 0) named_arrive<kMmaThreads>(other_turn);
        if constexpr (kDropout) {
          if (s + 1 < steps) step_keep(s + 1);
        }
        wg_wait<1>();  // dV, dK done: this warp's reads of the stage (Q, dO; LSE2, D long read)
        fence_regs_u32(pa);
        fence_regs_u32(da);
#pragma unroll
        for (int p = 0; p < kPanels; ++p) fence_regs(dv_acc[p]), fence_regs(dk_acc[p]);
      } else {
        // Hidden keys: the turns and dS^T handshakes of the step above, zeros as this half of
        // dS^T, and this warpgroup's part of dQ.
        if (mwg == 1 || s > 0) named_sync<kMmaThreads>(my_turn);
        mbar_wait(full_bar(st), (s / kStages) & 1);
        named_arrive<kMmaThreads>(other_turn);
        if (s > 0) named_sync<kMmaThreads>(kBarDsFree + (mwg ^ 1));
#pragma unroll
        for (int t = 0; t < kQTiles; ++t)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf)
            *reinterpret_cast<uint32_t*>(sdS + panel_offset(BN, key_loc0 + 8 * hf, t) + col_base) = 0u;
        fence_proxy_async();  // dS^T stores (generic proxy) -> wgmma reads (async proxy)
        named_arrive<kMmaThreads>(kBarDsStored + mwg);
        named_sync<kMmaThreads>(my_turn);
        named_sync<kMmaThreads>(kBarDsStored + (mwg ^ 1));
        issue_dq_product<BN, kBf16>(dq_acc, dq_ds_base, dq_k_base);
        if (s + 1 < steps || mwg == 0) named_arrive<kMmaThreads>(other_turn);
        if constexpr (kDropout) {
          if (s + 1 < steps) step_keep(s + 1);
        }
      }
      release(empty_bar(st));
      wg_wait<0>();  // dQ done: this warpgroup's reads of dS^T
      fence_regs(dq_acc);
      if (s + 1 < steps) named_arrive<kMmaThreads>(kBarDsFree + mwg);
      // Staging buffer s & 1 held step s - 2's dQ: the writer frees it once the copy engine read it.
      if (s >= 2) named_sync<kDqSyncThreads>(kBarDqEmpty + (s & 1));
      stage_dq(s & 1);
      fence_proxy_async();  // staging stores (generic proxy) -> the bulk reduce's reads (async proxy)
      named_arrive<kDqSyncThreads>(kBarDqFull + (s & 1));
    }
  }

  // ---- epilogue ---------------------------------------------------------------------------------
  // dK and dV through shared memory (store_kv_grad_staged): warpgroup w stages its 64 keys' rows
  // in half of the Q ring (64 x D x 2 bytes of its 2 x BM x D x 2), which no product reads once
  // both warpgroups have left the walk and no loader writes after it.
  static_assert(2 * 64 <= kStages * BM, "two 64-row staging tiles in the Q ring");
  if (a.kv_out_vec16_ok) {
    named_sync<kMmaThreads>(kBarWalkDone);
    const OutStage stage{sQ_u32 + uint32_t(mwg) * uint32_t(64 * D * 2), kBarStage + mwg};
    store_kv_grad_staged<true, D * 2, Elem>(a, b, kvh, lk, n0 + mwg * 64, dk_acc, stage);
    store_kv_grad_staged<false, D * 2, Elem>(a, b, kvh, lk, n0 + mwg * 64, dv_acc, stage);
  } else {
    store_dk_dv<kPanels, Elem>(a, b, kvh, lk, n0 + key_loc0, 0, col_base, dk_acc, dv_acc);
  }
#else
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    printf("flashport: the Hopper backward kernel needs sm_90a\n");
  __trap();
#endif
}

// ---- D256 (HopperBwdTileD256; layout and reasons in bwd_hopper.hpp) ---------------------------
// One block: BN = 64 keys of one kv head, walking every (query head of the group, BM = 64 query
// block), warp-specialised as bwd_hopper_kernel: the producer warpgroup (K, V once; warps 0-2 each
// step's Q, dO, LSE2, D into the 2-stage ring; warp 3 the dQ writer) and MMA warpgroups 1, 2 with
// a role each. Per step (every product M = 64 keys or queries, N = 64, K = 16):
//   score side (warpgroup 1):    S^T = K Q^T (SS), P^T in registers -> the handoff (fp32, shared
//                                memory), dV += P^T dO (RS: A = P^T from registers, dO MN-major)
//   gradient side (warpgroup 2): dP^T = V dO^T (SS), dS^T from the handoff -> shared memory,
//                                dK += dS^T Q (RS)
//   both: dQ columns [128 mwg, +128) = dS K (SS, dS and K MN-major).
// S^T and dP^T of all 64 queries are N = 64 products (as 32-query halves per warpgroup they were
// N = 32: 3 KB of shared memory per 16 tensor-core cycles, 1.5x what the SM's shared memory
// delivers), and dV / dK take A from registers. dK / dV of one warpgroup cover all 256 columns
// (128 registers, the two halves' 64 + 64 before). Order on the tensor cores: the gradient side
// issues dP^T once the score side has issued S^T, so P^T is made while dP^T runs; P^T / dS^T go
// over in two query halves, each half's dV / dK products issued as soon as it is made, so the
// gradient side's dS^T runs under the score side's P^T and dV; dQ's two column panels are two
// groups, panel 0 staged while panel 1 runs (+4-8% together over the query-half split; dropout
// +5-8% before the panel split: bench/results/gpu_backward.md, session 21). The step's dQ (fp32
// 64 x 256) is staged in the step's own ring stage (its Q and dO, 64 KB, once both warpgroups'
// dV / dK products have read them); the writer releases the stage to the loaders once the copy
// engine has read the tile.
template <typename Elem, bool kDropout>
__global__ void __launch_bounds__(HopperBwdTileD256::kThreads, 1) bwd_hopper_d256_kernel(const __grid_constant__ HopperBwdParams P) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const BwdArgs& a = P.a;
  using T = HopperBwdTileD256;
  constexpr int D = T::kD, BN = T::kBlockN, BM = T::kBlockM, kStages = T::kStages;
  constexpr bool kBf16 = Elem::kIsBf16, kRotates = hopper_bwd_rotates(D);
  constexpr int kChunks = D / 8;       // 16-byte chunks per row
  constexpr int kPanels = D / 64;      // 64-column panels of dK / dV
  constexpr int kQTiles = BM / 8;      // 8-query accumulator tiles of S^T / dP^T
  constexpr int kQSteps = BM / 16;     // k16 steps of dV / dK
  constexpr int kOwnPanels = 2;        // 64-column panels of dQ per MMA warpgroup
  constexpr int kStageElems = 2 * BM * D;  // a ring stage: Q, then dO; at the step's end its fp32 dQ
  // Named barriers (0 is __syncthreads). Handoff, one per query half: the score side arrives once
  // the half's P^T is in shared memory, the gradient side syncs (the next arrival follows the
  // stage-read sync, so never a generation ahead). dS^T ready: both sync once the gradient side
  // stored dS^T. Stage read: both warpgroups' dV / dK products of the step are done, so Q and dO
  // may be overwritten, and the gradient side has read the handoff; dQ's products may still read
  // dS^T, whose next store waits for the score side's next handoff, after its dQ. dQ staged, one per
  // ring stage: the MMA side arrives, the writer syncs; an id's next use is two steps later, after
  // the writer released the stage (the `full` wait), so no side arrives a generation ahead.
  // Scores issued: the score side arrives once its S^T products are issued, the gradient side
  // syncs before issuing dP^T, so each tensor core runs S^T first and P^T is made while dP^T runs
  // (the score side's next arrival follows the stage-read sync: never a generation ahead).
  // Ids: dQ staged takes 4 and 5 (one per ring stage), the handoff 7 and 8 (one per query half).
  // After the walk: both MMA warpgroups done (walk done) and each one's dK / dV staging tile (stage w).
  constexpr int kBarDsReady = 2, kBarStageRead = 3, kBarDqFull = 4, kBarScoresIssued = 6, kBarHandoff = 7;
  constexpr int kBarWalkDone = 9, kBarStage = 10;
  constexpr int kMmaThreads = 256, kDqSyncThreads = kMmaThreads + 32;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t base_u32 = (raw_u32 + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem_raw + (base_u32 - raw_u32));
  uint16_t* sV = sK + BN * D;
  uint16_t* sQ = sV + BN * D;                  // [kStages][Q: BM * D, dO: BM * D]
  uint16_t* sdS = sQ + kStages * kStageElems;  // dS^T: [BN keys][BM queries], one 64-query panel
  float4* sH = reinterpret_cast<float4*>(sdS + BN * BM);  // the P^T handoff: [kQTiles][128 threads]
  float* sL = reinterpret_cast<float*>(sH + kQTiles * 128);  // [kStages][BM] LSE2
  float* sDs = sL + kStages * BM;                            // [kStages][BM] D
  const uint32_t sK_u32 = base_u32;
  const uint32_t sV_u32 = sK_u32 + BN * D * 2;
  const uint32_t sQ_u32 = sV_u32 + BN * D * 2;
  const uint32_t sdS_u32 = sQ_u32 + kStages * kStageElems * 2;
  // mbarriers: stage landed (full) / released by the dQ writer (empty); K and V landed.
  const uint32_t bars = smem_u32(sDs + kStages * BM);
  auto full_bar = [&](int st) { return bars + 8u * uint32_t(st); };
  auto empty_bar = [&](int st) { return bars + 8u * uint32_t(kStages + st); };
  const uint32_t kv_bar = bars + 8u * uint32_t(2 * kStages);

  const int tid = threadIdx.x, lane = tid & 31;
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);  // warp-uniform (bwd_hopper_kernel)
  const int wg = warp >> 2;     // 0: producer; 1, 2: MMA warpgroups
  const int wwarp = warp & 3;   // warp inside the warpgroup: 16 keys of each accumulator
  const BwdBlock blk(a, BN);
  const int n_blk = blk.n_blk, kvh = blk.kvh, b = blk.b, n0 = blk.n0;
  const int lq = blk.seq.lq, lk = blk.seq.lk;
  const int64_t q_start = blk.seq.q_start, ws_row0 = blk.seq.ws_row0;  // ws_row0: workspace row of i = 0
  const KernelScoreRules& S = blk.rules;
  const ScoreRules& R = a.rules;
  // Steps as in bwd_hopper_kernel: step s is head kvh group + s / nm, query block
  // dq_rot.m_at(m_lo, nm, s).
  int m_lo = 0, nm = 0, steps = 0;
  if (blk.has_walk()) {
    const BwdWalk walk = blk.walk(a, BN, BM);
    m_lo = walk.m_lo, nm = walk.nm, steps = walk.steps;
  }
  const DqRotation<kRotates> dq_rot(a, blk, BN, nm);

  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      mbar_init(full_bar(st), T::kLoaders + 1);  // each loader's cp.async arrival, and thread 0's (load_step)
      mbar_init(empty_bar(st), 1);           // the dQ writer, once the stage's dQ tile was read
    }
    mbar_init(kv_bar, 128);  // the producer warpgroup's K/V copies
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer warpgroup ---------------------------------------------------------------------
    regs_dec<T::kProducerRegs>();
    if (steps == 0) return;
    {
      // Thread t: chunk t % 32 of rows t / 32 + 4k; load_kv_block's row step keeps the swizzle
      // phase (a multiple of 8 rows), so rows t / 32 + 8k, then t / 32 + 4 + 8k.
      const int ld_chunk = tid % kChunks;
      const RowChunk rc(ld_chunk, a.d, a.dv);
#pragma unroll 1
      for (int half = 0; half < 2; ++half)
        load_kv_block<BN, 8>(a, b, kvh, n0, lk, tid / kChunks + 4 * half, ld_chunk, rc, sK, sV);
      cp_async_arrive(kv_bar);
    }
    if (warp < T::kLoaders / 32) {
      // Loaders: stage s % kStages once the writer released its previous use (step s - kStages).
      int h = kvh * a.group, m = m_lo + dq_rot.first(), k = 0;  // step s's head and query block
      for (int s = 0; s < steps; ++s) {
        const int st = s % kStages;
        mbar_wait(empty_bar(st), ((s / kStages) & 1) ^ 1);
        uint16_t* stage = sQ + st * kStageElems;
        load_step<BM, D, T::kLoaders>(P, b, q_start, ws_row0, lq, h, m * BM, tid, stage, stage + BM * D,
                                      sL + st * BM, sDs + st * BM, full_bar(st));
        dq_rot.advance(m_lo, nm, h, m, k);
      }
      cp_async_wait<0>();
    } else {
      // dQ writer (warp 3): step s's dQ, staged in ring stage s % kStages, into the workspace
      // (write_dq_tile); then the stage goes back to the loaders.
      int h = kvh * a.group, m = m_lo + dq_rot.first(), k = 0;  // step s's head and query block
      for (int s = 0; s < steps; ++s) {
        const int st = s % kStages;
        named_sync<kDqSyncThreads>(kBarDqFull + st);
        write_dq_tile<BM, BN, D>(a, S, dq_rot, b, h, m, n_blk, lq, ws_row0, sQ_u32 + st * (kStageElems * 2), lane);
        __syncwarp();  // every lane's reduces have read the tile
        if (lane == 0) mbar_arrive(empty_bar(st));
        dq_rot.advance(m_lo, nm, h, m, k);
      }
      bulk_wait_all();  // the staging tile must outlive the copy engine's reads
    }
    return;
  }

  // ---- MMA warpgroups -----------------------------------------------------------------------------
  regs_inc<T::kMmaRegs>();
  const int mwg = wg - 1;  // 0: the score side, 1: the gradient side; dQ columns [128 mwg, +128)
  const bool score_side = mwg == 0;
  const int tw = tid & 127;  // thread of the warpgroup: its slots of the handoff
  // This thread's accumulator rows (keys) in S^T, dP^T, dK, dV: key_loc0 and key_loc0 + 8.
  const int key_loc0 = wwarp * 16 + (lane >> 2);
  const int col_base = (lane & 3) * 2;

  float kv_acc[kPanels][32];  // dV (score side) or dK (gradient side): 64 keys x 256 columns
#pragma unroll
  for (int p = 0; p < kPanels; ++p)
#pragma unroll
    for (int e = 0; e < 32; ++e) kv_acc[p][e] = 0.0f;

  if (steps > 0) {
    const bool transformed = S.softcapped() || S.alibi();

    float dq_acc[kOwnPanels][32];  // dQ: 64 queries x columns [128 mwg, +128)
    // This thread's dQ fragment of column panel `panel` into ring stage `st` (stage_dq_panel).
    auto stage_dq = [&](int st, auto panel) {
      constexpr int p = decltype(panel)::value;
      stage_dq_panel<D>(reinterpret_cast<float*>(sQ + st * kStageElems), wwarp * 16 + (lane >> 2),
                        (mwg * kOwnPanels + p) * 64 + col_base, (lane >> 2) & 3, dq_acc[p]);
    };

    // Dropout: the score side's keep bits of step `step` (step 0's before its products, the next
    // step's while this step's dV and dQ products run); the gradient side reads them from the
    // handoff's sign bits.
    uint32_t keep[(4 * kQTiles + 31) / 32] = {};
    auto step_keep = [&](int step) {
      int m = m_lo + step % nm;  // (without the rotation, no capture of dq_rot: it changed the SASS)
      if constexpr (kRotates) m = dq_rot.m_at(m_lo, nm, step);
      bwd_keep_bits<kQTiles>(keep, R, b, a.hq, kvh * a.group + step / nm, m * BM, n0 + key_loc0);
    };
    if constexpr (kDropout) {
      if (score_side) step_keep(0);
    }

    mbar_wait(kv_bar, 0);
    for (int s = 0; s < steps; ++s) {
      const int st = s % kStages;
      const int h = kvh * a.group + s / nm;
      const int m = dq_rot.m_at(m_lo, nm, s);
      const int i0 = m * BM;
      const uint32_t sQs_u32 = sQ_u32 + st * (kStageElems * 2), sdOs_u32 = sQs_u32 + BM * D * 2;
      mbar_wait(full_bar(st), (s / kStages) & 1);
      fence_proxy_async();  // a tail step's cp.async writes (generic proxy) -> wgmma reads (async proxy)

      // ---- S^T = K Q^T (score side) or dP^T = V dO^T (gradient side), all 64 queries -----------
      float acc[4 * kQTiles];
      {
        // Descriptors as base + offset (16-byte units); the opaque copies keep the compiler from
        // hoisting loop-invariant 64-bit descriptors into registers.
        uint64_t a_desc = make_desc(score_side ? sK_u32 : sV_u32, 16, 1024);
        asm volatile("" : "+l"(a_desc));
        uint64_t b_desc = make_desc(score_side ? sQs_u32 : sdOs_u32, 16, 1024);
        asm volatile("" : "+l"(b_desc));
        if (!score_side) named_sync<kMmaThreads>(kBarScoresIssued);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          const uint32_t koff = uint32_t((ks & 3) * 32);  // 16 columns = 32 bytes of the 128-byte row
          wgmma_ss_m64n64k16<kBf16, 0, 0>(acc, a_desc + (((ks >> 2) * (BN * 128) + koff) >> 4),
                                          b_desc + (((ks >> 2) * (BM * 128) + koff) >> 4), ks > 0 ? 1 : 0);
        }
        wg_commit();
        if (score_side) named_arrive<kMmaThreads>(kBarScoresIssued);
        wg_wait<0>();
        fence_regs(acc);
      }

      // ---- P^T (score side) -> the handoff; dS^T (gradient side) from it -> shared memory ------
      // (acc[4t + 2hf + e2] is key n0 + key_loc0 + 8hf, query i0 + 8t + col_base + e2)
      // In two query halves, each handed over (and its dV / dK products issued) as soon as it is
      // made: the gradient side's first half and the first dV products run under the score
      // side's second half.
      const bool need_mask = S.tile_needs_mask(n_blk, BN, i0, i0 + BM - 1);
      const float slope_log2 = R.alibi ? -R.alibi_slope(b, h) * kLog2e : 0.0f;
      uint32_t frag[kQSteps][4];  // P^T / dS^T as the RS products' A operand
      auto half = [&](auto hv) {
        constexpr int kHalf = decltype(hv)::value;
        constexpr int kT0 = kHalf * kQTiles / 2, kT1 = kT0 + kQTiles / 2;
        if (score_side) {
          bwd_probs_handoff<kQTiles, kDropout, kT0, kT1>(acc, S, transformed, need_mask, slope_log2, i0,
                                                         n0 + key_loc0, col_base, sL + st * BM, keep, sH, tw);
          named_arrive<kMmaThreads>(kBarHandoff + kHalf);
        } else {
          named_sync<kMmaThreads>(kBarHandoff + kHalf);
          bwd_dscores_from_handoff<kQTiles, kDropout, kT0, kT1>(acc, kDropout ? R.dropout_scale : 1.0f, col_base,
                                                                sDs + st * BM, sH, tw);
        }
#pragma unroll
        for (int ks = kT0 / 2; ks < kT1 / 2; ++ks)
#pragma unroll
          for (int r = 0; r < 4; ++r) frag[ks][r] = Elem::pack(acc[8 * ks + 2 * r], acc[8 * ks + 2 * r + 1]);
        if (!score_side) {
          // dS^T to shared memory for dQ: (key, queries 8t + col_base, +1) -> one 32-bit store;
          // pair (t, hf) is frag[t / 2][(t & 1) * 2 + hf]. The previous step's dQ products read it
          // before its stage-read barrier.
#pragma unroll
          for (int t = kT0; t < kT1; ++t)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
              const int off = panel_offset(BN, key_loc0 + 8 * hf, t) + col_base;
              *reinterpret_cast<uint32_t*>(sdS + off) = frag[t >> 1][(t & 1) * 2 + hf];
            }
          if constexpr (kHalf == 1) fence_proxy_async();  // dS^T stores (generic) -> wgmma reads (async)
        }
        // dV += P^T dO (score side) or dK += dS^T Q (gradient side) over this half's queries.
        uint64_t b_desc = make_desc(score_side ? sdOs_u32 : sQs_u32, BM * 128, 1024);
        asm volatile("" : "+l"(b_desc));
        wg_fence();
#pragma unroll
        for (int ks = kT0 / 2; ks < kT1 / 2; ++ks)
#pragma unroll
          for (int p = 0; p < kPanels; ++p)
            wgmma_rs_m64n64k16<kBf16, 1>(kv_acc[p], frag[ks], b_desc + ((p * (BM * 128) + ks * 2048) >> 4), 1);
        wg_commit();
      };
      half(std::integral_constant<int, 0>{});
      half(std::integral_constant<int, 1>{});
      named_sync<kMmaThreads>(kBarDsReady);  // dS^T in shared memory

      // ---- dQ = dS K, columns [128 mwg, +128) ---------------------------------------------------
      {
        uint64_t s_desc = make_desc(sdS_u32, BN * 128, 1024);  // dS: MN-major view of dS^T
        asm volatile("" : "+l"(s_desc));
        uint64_t kt_desc = make_desc(sK_u32 + mwg * kOwnPanels * (BN * 128), BN * 128, 1024);
        asm volatile("" : "+l"(kt_desc));
        wg_fence();
        // One group per 64-column panel: panel 0 is staged while panel 1's products run.
#pragma unroll
        for (int p = 0; p < kOwnPanels; ++p) {
#pragma unroll
          for (int ks = 0; ks < BN / 16; ++ks)
            wgmma_ss_m64n64k16<kBf16, 1, 1>(dq_acc[p], s_desc + ((ks * 2048) >> 4),
                                            kt_desc + ((p * (BN * 128) + ks * 2048) >> 4), ks > 0 ? 1 : 0);
          wg_commit();
        }
      }
      if constexpr (kDropout) {
        if (score_side && s + 1 < steps) step_keep(s + 1);
      }
      wg_wait<1>();  // dV / dK and dQ's panel 0 done (the sdS^T reads of panel 1 go on: the next
                     // dS^T store waits for the score side's handoff, after its wait below)
      fence_regs_u32(frag);
#pragma unroll
      for (int p = 0; p < kPanels; ++p) fence_regs(kv_acc[p]);
      fence_regs(dq_acc[0]);
      named_sync<kMmaThreads>(kBarStageRead);  // both warpgroups' dV / dK products are done with the stage
      stage_dq(st, std::integral_constant<int, 0>{});
      wg_wait<0>();
      fence_regs(dq_acc[1]);
      stage_dq(st, std::integral_constant<int, 1>{});
      fence_proxy_async();  // staging stores (generic proxy) -> the bulk reduce's reads (async proxy)
      named_arrive<kDqSyncThreads>(kBarDqFull + st);
    }
  }

  // ---- epilogue: dV (score side) or dK (gradient side), every column ----------------------------
  // Through shared memory where the rows allow (store_kv_grad_staged): warpgroup w stages 128
  // columns a pass in half of K's tile, which no product reads once both have left the walk (the
  // Q ring's stages may still hold a dQ tile the copy engine reads).
  if (a.kv_out_vec16_ok) {
    named_sync<kMmaThreads>(kBarWalkDone);
    const OutStage stage{sK_u32 + uint32_t(mwg) * uint32_t(64 * 256), kBarStage + mwg};
    if (score_side) store_kv_grad_staged<false, 256, Elem>(a, b, kvh, lk, n0, kv_acc, stage);
    else store_kv_grad_staged<true, 256, Elem>(a, b, kvh, lk, n0, kv_acc, stage);
  } else if (score_side) {
    store_kv_grad<false, kPanels, Elem>(a, b, kvh, lk, n0 + key_loc0, 0, col_base, kv_acc);
  } else {
    store_kv_grad<true, kPanels, Elem>(a, b, kvh, lk, n0 + key_loc0, 0, col_base, kv_acc);
  }
#else
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    printf("flashport: the Hopper backward kernel needs sm_90a\n");
  __trap();
#endif
}

}  // namespace sm90

// ---- host side -----------------------------------------------------------------------------

template <int D, typename Elem, bool kDropout>
constexpr auto hopper_bwd_kernel_for() {
  if constexpr (D == 256) return sm90::bwd_hopper_d256_kernel<Elem, kDropout>;
  else return sm90::bwd_hopper_kernel<D, Elem, kDropout>;
}
constexpr int hopper_bwd_threads(int d) { return d == 256 ? HopperBwdTileD256::kThreads : HopperBwdTile::kThreads; }
template <int D, bool kBf16, bool kDropout>
using HopperBwdInstance = KernelInstance<hopper_bwd_kernel_for<D, std::conditional_t<kBf16, BFloat16, Half>, kDropout>(),
                                         hopper_bwd_threads(D), hopper_bwd_smem_bytes(D)>;

// Both instances of the head dim (without and with dropout), so the check holds for either launch
// and both kernels get their shared-memory attribute: the first failure, else the lower occupancy.
template <int D, bool kBf16>
BwdKernelInfo hopper_bwd_kernel_info(int device) {
  const BwdKernelInfo plain = HopperBwdInstance<D, kBf16, false>::info(device);
  const BwdKernelInfo drop = HopperBwdInstance<D, kBf16, true>::info(device);
  if (plain.status != gpuSuccess) return plain;
  return drop.status != gpuSuccess || drop.blocks_per_sm < plain.blocks_per_sm ? drop : plain;
}

namespace {
// The TMA views of q and dout (HopperBwdParams) for boxes of `block_m` rows; false where a view
// breaks the encoder's rules or a row coordinate would pass 2^31 (the kernel then copies by rows).
bool encode_bwd_maps(const BwdArgs& a, int block_m, CUtensorMap* tq, CUtensorMap* tdo) {
  auto encode = [&](CUtensorMap* map, const void* base, int64_t cols, const RowAddr& r) {
    const int64_t rows = r.packed ? a.total_rows : a.seq.sq, batch = r.packed ? 1 : a.seq.batch;
    if (rows > int64_t(INT32_MAX) || batch > int64_t(INT32_MAX)) return false;  // TMA coordinates are int32
    return encode_rows_map(map, base, cols, rows, a.hq, batch, r.row_stride, r.head_stride, r.batch_stride, block_m)
        .empty();
  };
  return encode(tq, a.q, a.d, a.q_addr) && encode(tdo, a.dout, a.dv, a.dout_addr);
}
}  // namespace

template <int D, bool kBf16>
gpuError_t launch_hopper_bwd(const BwdArgs& a, dim3 grid, gpuStream_t stream) {
  constexpr int kBlockM = D == 256 ? HopperBwdTileD256::kBlockM : HopperBwdTile::block_m(D);
  HopperBwdParams prm;
  prm.a = a;
  prm.has_maps = encode_bwd_maps(a, kBlockM, &prm.tq, &prm.tdo);
  if (a.rules.dropout_p > 0.0f) return HopperBwdInstance<D, kBf16, true>::launch(prm, grid, stream);
  return HopperBwdInstance<D, kBf16, false>::launch(prm, grid, stream);
}

#define FP_INSTANTIATE_HOPPER_BWD(D, bf16)                           \
  template BwdKernelInfo hopper_bwd_kernel_info<D, bf16>(int);       \
  template gpuError_t launch_hopper_bwd<D, bf16>(const BwdArgs&, dim3, gpuStream_t);
FP_INSTANTIATE_HOPPER_BWD(64, false)
FP_INSTANTIATE_HOPPER_BWD(64, true)
FP_INSTANTIATE_HOPPER_BWD(128, false)
FP_INSTANTIATE_HOPPER_BWD(128, true)
FP_INSTANTIATE_HOPPER_BWD(256, false)
FP_INSTANTIATE_HOPPER_BWD(256, true)

namespace {

const char* hopper_bwd_name(int d) {
  return d == 64 ? "sm90_wgmma_bwd_d64_m128n128" : d == 128 ? "sm90_wgmma_bwd_d128_m64n128" : "sm90_wgmma_bwd_d256_m64n64";
}

// Query blocks per sequence of the instance (the semaphores of deterministic mode per (b, h)).
int64_t hopper_bwd_m_blocks(const Problem& p) {
  const int bucket = hopper_bwd_head_bucket(p);
  const int bm = bucket == 256 ? HopperBwdTileD256::kBlockM : HopperBwdTile::block_m(bucket);
  return (p.seq.sq + bm - 1) / bm;
}
// The workspace layout of the mma.sync backward (mma/bwd_launch.hpp); semaphores in deterministic mode.
BwdWorkspace hopper_bwd_workspace(const BwdProblem& bp) {
  const Problem& p = bp.fwd;
  return bwd_workspace(p, bp.deterministic ? p.seq.batch * p.hq * hopper_bwd_m_blocks(p) : 0);
}

}  // namespace

bool hopper_bwd_plan(const BwdProblem& bp, int64_t wave_slots, Plan* plan) {
  const Problem& p = bp.fwd;
  *plan = Plan{};
  plan->workspace_bytes = hopper_bwd_workspace(bp).total;
  const int bucket = hopper_bwd_head_bucket(p);
  // The rotated deterministic walk (DqRotation): every key block sees every query block, and a
  // head's key blocks (the grid's x) fit in half a wave of the stream's SMs, so they are resident
  // together with room left for other work on the device.
  const int64_t key_blocks = (p.seq.sk + hopper_bwd_block_n(bucket) - 1) / hopper_bwd_block_n(bucket);
  const bool rotated = bp.deterministic && hopper_bwd_rotates(bucket) && p.rules.window_left < 0 &&
                       p.rules.window_right < 0 && 2 * key_blocks <= wave_slots;
  plan->backend_args[0] = rotated ? 1 : 0;
  std::snprintf(plan->kernel, sizeof(plan->kernel), "cuda:%s:%s%s:%s", hopper_bwd_name(bucket),
                p.dtype == FP_BF16 ? "bf16" : "fp16", HopperDimsTag(p, bucket).text,
                !bp.deterministic ? "atomic-dq" : rotated ? "deterministic-rotated" : "deterministic");
  plan->num_splits = 1;
  plan->kernel_id = kKernelHopperBwd;
  return true;
}

Status run_bwd_hopper(const BwdProblem& bp, const Plan& plan, void* workspace, gpuStream_t stream) {
  const Problem& p = bp.fwd;
  const BwdWorkspace w = hopper_bwd_workspace(bp);
  if (w.total != plan.workspace_bytes || plan.kernel_id != kKernelHopperBwd)
    return {FP_ERR_RUNTIME, "cuda backend: plan does not match the call (re-select after changing it)"};
  if (p.seq.batch == 0) return Status::ok();
  BwdArgs a = bwd_common_args(bp, w, workspace);
  a.vec_ok = true;  // checked by hopper_bwd_check
  a.deterministic = bp.deterministic;
  a.dq_rotated = bp.deterministic && plan.backend_args[0] == 1;
  a.m_blocks = static_cast<int32_t>(hopper_bwd_m_blocks(p));
  a.ws_sema = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + w.sema_off);
  a.sema_count = w.sema_count;

  if (gpuError_t e = launch_bwd_preprocess(a, stream); e != gpuSuccess)
    return {FP_ERR_RUNTIME, std::string("cuda backend: backward preprocess launch: ") + gpuGetErrorString(e)};
  const int bucket = hopper_bwd_head_bucket(p);  // the instance; smaller head dims run padded
  const int block_n = hopper_bwd_block_n(bucket);
  const int64_t key_blocks = (p.seq.sk + block_n - 1) / block_n;
  if (key_blocks > 0 && p.hkv > 0) {
    const dim3 grid(unsigned(key_blocks), unsigned(p.hkv), unsigned(p.seq.batch));
    const bool bf16 = a.bf16;
    const gpuError_t e =
        bucket == 64    ? (bf16 ? launch_hopper_bwd<64, true>(a, grid, stream) : launch_hopper_bwd<64, false>(a, grid, stream))
        : bucket == 128 ? (bf16 ? launch_hopper_bwd<128, true>(a, grid, stream) : launch_hopper_bwd<128, false>(a, grid, stream))
                     : (bf16 ? launch_hopper_bwd<256, true>(a, grid, stream) : launch_hopper_bwd<256, false>(a, grid, stream));
    if (e != gpuSuccess)
      return {FP_ERR_RUNTIME, std::string("cuda backend: ") + hopper_bwd_name(bucket) + " launch: " + gpuGetErrorString(e)};
  }
  if (gpuError_t e = launch_bwd_convert(a, stream); e != gpuSuccess)
    return {FP_ERR_RUNTIME, std::string("cuda backend: backward dq conversion launch: ") + gpuGetErrorString(e)};
  return Status::ok();
}

}  // namespace flashport::gpu
