// The fp32 forward main loop (FlashAttention-2 style): one block of 8 or 4 warps (f32_launch.hpp's
// tiles) per (query block, query head, batch x split); warp w owns rows 16w .. 16w + 15. S = Q K^T
// and O += P V are 3xTF32 mma.sync m16n8k8 products (f32_common.cuh: the error of fp32 FMAs); the
// online softmax works on the C fragments (rows g and g + 8 of the warp, reduced over the 4 lanes
// of a quad) and P goes to the P V product from registers. Q sits in shared memory for the whole
// loop; K and V tiles stream through their own shared buffers (rows of D + 4 floats: conflict-free
// fragment reads) with cp.async, V's copy overlapping S = Q K^T and the next K's copy overlapping P
// V. Key tiles are visited last to first, as in the mma.sync kernel. Every score feature reads the
// shared rules (core/score_rules.hpp) and the shared addressing (core/problem.hpp); dropout keeps
// exactly the elements dropout_keep keeps in every other backend.
#include <algorithm>
#include <cstdio>

#include "core/heuristics.hpp"
#include "gpu/common/fwd_plan.hpp"
#include "gpu/common/kernel_info.cuh"
#include "gpu/common/tile_config.hpp"
#include "gpu/f32/f32_common.cuh"
#include "gpu/f32/f32_launch.hpp"
#include "gpu/f32/tf32_frag.hpp"

namespace flashport::gpu {
namespace f32 {

// Registers: 255 at most either way (8 warps: one block an SM; 4 warps: two).
template <int kTile>
__global__ void __launch_bounds__(kF32FwdTiles[kTile].threads, 256 / kF32FwdTiles[kTile].threads) fwd_f32_kernel(const __grid_constant__ FwdArgs a) {
  constexpr F32Tile C = kF32FwdTiles[kTile];
  constexpr int D = C.head_dim, BM = C.block_m, BN = C.block_n, NT = C.threads, S = C.row_stride();
  // Warp w owns rows 16w .. 16w + 15; SN 8-key tiles of S, ON 8-column tiles of O per warp.
  constexpr int kWarps = NT / 32, SN = BN / 8, ON = D / 8;
  // Rows of D + 4 floats (S = 4 mod 32): the fragment reads of Q, K (rows g, columns t) and V
  // (rows 2t, 2t + 1, columns g) hit 32 different banks.
  static_assert(BM == 16 * kWarps && BN % 8 == 0 && D % 8 == 0 && S % 32 == 4, "warp mapping");

  // kKvSplit: K and V tiles held as their tf32 big parts (sK, sV) and small parts (sKs, sVs),
  // split by the threads that copied them (split_own_rows); else split at every fragment read.
  // (Q the same way measured +1% at D64, session 32; not kept.)
  constexpr bool kKvSplit = C.kv_split;
  extern __shared__ __align__(16) float smem[];
  float* sQ = smem;
  float* sK = sQ + BM * S;
  float* sV = sK + BN * S;
  float* sKs = kKvSplit ? sV + BN * S : nullptr;
  float* sVs = kKvSplit ? sKs + BN * S : nullptr;

  // FwdArgs carries the tensors as untyped storage pointers; an fp32 call's are floats.
  const float* q = reinterpret_cast<const float*>(a.q);
  const float* k = reinterpret_cast<const float*>(a.k);
  const float* v = reinterpret_cast<const float*>(a.v);

  using F = Tf32Frag;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, t = lane % 4;
  const int row0 = 16 * warp + F::c_row(lane, 0);  // the thread's rows of the block: row0 and row0 + 8
  // Work tile: query block (heaviest first), head, batch x split; the grid's layout: f32_fwd_grid.
  const bool outer = a.query_blocks_outer;
  const int m0 = ((outer ? gridDim.z : gridDim.x) - 1 - (outer ? blockIdx.z : blockIdx.x)) * BM;
  const int head_idx = outer ? blockIdx.x : blockIdx.y;  // query head, or kv head when the GQA group's heads are packed
  const int bz = outer ? blockIdx.y : blockIdx.z;
  const int b = bz / a.splits;
  const int split = bz - b * a.splits;
  const ScoreRules& R = a.rules;

  const FwdSeqLengths lengths(a, b);
  const int lq = lengths.lq, lk = lengths.lk;
  // Packed GQA (the 64-row instances only, f32_fwd_tile_for): block row m is query row m / pack of
  // query head kvh * group + m % pack, so a decode step's heads share each K/V tile. The 128-row
  // instances fold pack to 1.
  const int pack = C.block_m == 64 ? a.pack : 1;
  const int m_rows = lq * pack;
  if (m0 >= m_rows) return;
  const int64_t q_start = a.seq.q_start(b);
  const int kvh = pack > 1 ? head_idx : head_idx / a.group;
  auto row_i = [&](int m) -> int { return pack > 1 ? m / pack : m; };
  auto row_h = [&](int m) -> int { return pack > 1 ? kvh * a.group + m % pack : head_idx; };
  const KernelScoreRules seq_rules(R, lq, lk, a.scale_log2, a.softcap_in, a.softcap_out);
  // Visible keys of the block's rows, cut to this split. Computed in 64 bits: in 32 bits the
  // compiler ties the key range to the loop's per-row mask bounds and D256's loop spills (ptxas).
  const int i_first = row_i(m0), i_last = row_i((m0 + BM < m_rows ? m0 + BM : m_rows) - 1);
  const SeqScoreRules<int64_t, float> block_rules(R, lq, lk, a.scale_log2, a.softcap_in, a.softcap_out);
  const int key_lo = static_cast<int>(block_rules.vis_lo(i_first));
  const int key_hi = static_cast<int>(block_rules.vis_hi(i_last));
  int n_lo = key_lo / BN;
  int n_hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : n_lo;
  clip_key_blocks_to_split(n_lo, n_hi, lk, BN, split, a.splits);

  // O accumulator in the C-fragment layout: o[n][0..1] row row0, o[n][2..3] row row0 + 8, columns
  // 8n + 2t, 8n + 2t + 1. Row statistics of rows row0 (index 0) and row0 + 8 (index 1).
  float o[ON][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < ON; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  // Score transforms (block-uniform): plain scores stay raw and the scale folds into exp2.
  const bool transformed = seq_rules.softcapped() || seq_rules.alibi() || !(*seq_rules.scale > 0.0f);
  const float mul = transformed ? 1.0f : *seq_rules.scale;
  // ALiBi slopes of the thread's rows row0, row0 + 8 (one head unless packed).
  float slope[2];
  slope[0] = R.alibi ? -R.alibi_slope(b, row_h(m0 + row0 < m_rows ? m0 + row0 : m0)) * kLog2e : 0.0f;
  slope[1] = pack == 1 ? slope[0]
                       : (R.alibi ? -R.alibi_slope(b, row_h(m0 + row0 + 8 < m_rows ? m0 + row0 + 8 : m0)) * kLog2e : 0.0f);
  const int d_steps = (a.d + 7) / 8;   // 8-column steps of q.k that hold real columns
  const int dv_cols = a.dv;

  if (n_lo < n_hi) {
    load_rows<BM, D, S, NT, true>(sQ, a.d, tid, q, [&](int r) -> const float* {
      const int m = m0 + r;
      return m < m_rows ? q + a.q_addr.at(b, q_start, row_i(m), row_h(m)) : nullptr;
    });
    auto load_kv = [&](float* tile, const float* base, const KvAddr& ad, int cols, int nb) {
      load_rows<BN, D, S, NT, true>(tile, cols, tid, base, [&](int r) -> const float* {
        const int j = nb * BN + r;
        return j < lk ? base + kv_key_offset(a.seq, ad, a.num_pages, b, j, kvh) : nullptr;
      });
    };
    auto split_kv = [&](float* big, float* small) {
      if constexpr (kKvSplit) split_own_rows<BN, D, S, NT>(big, small, tid);
    };
    load_kv(sK, k, a.k_addr, a.d, n_hi - 1);
    cp_async_commit();
    for (int nb = n_hi - 1; nb >= n_lo; --nb) {
      __syncthreads();  // the previous P V is done with sV
      load_kv(sV, v, a.v_addr, a.dv, nb);
      cp_async_commit();
      cp_async_wait<1>();
      split_kv(sK, sKs);
      __syncthreads();  // K (and Q) landed (and split)

      // S = Q K^T (3xTF32) over the 8-column steps holding real columns: A = rows of Q (the
      // warp's 16), B = rows of K (key 8n + b_n, column b_k).
      float s[SN][4];
#pragma unroll
      for (int n = 0; n < SN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const float* qa = sQ + 16 * warp * S;
      const int kb_row = F::b_n(lane) * S;
#pragma unroll 1
      for (int k8 = 0; k8 < d_steps; ++k8) {
        const int col = 8 * k8;
        Tf32Split qf[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) qf[r] = split_tf32(qa[F::a_row(lane, r) * S + col + F::a_col(lane, r)]);
#pragma unroll
        for (int n = 0; n < SN; ++n) {
          Tf32Split kf[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int at = kb_row + 8 * n * S + col + F::b_k(lane, r);
            kf[r] = kKvSplit ? Tf32Split{bits_of(sK[at]), bits_of(sKs[at])} : split_tf32(sK[at]);
          }
          mma_3xtf32(s[n], qf, kf);
        }
      }

      const int n0 = nb * BN;
      const bool need_mask = seq_rules.tile_needs_mask(nb, BN, i_first, i_last);
      // Element e of s[n]: row 16 warp + c_row(lane, e) = row0 + 8 (e / 2), key n0 + 8n +
      // c_col(lane, e) = n0 + 8n + 2t + e % 2.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = row_i(m0 + row0 + 8 * hr);
        if (transformed) {
          const int base = seq_rules.diagonal(i) - n0;  // ALiBi distance of tile column c: base - c
#pragma unroll
          for (int n = 0; n < SN; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[n][2 * hr + e];
              x = seq_rules.score(x);
              x += seq_rules.alibi_bias_at(slope[hr], base - (8 * n + F::c_col(lane, e)));
            }
        }
        if (need_mask) {
          const int lo = seq_rules.vis_lo(i) - n0, hi = seq_rules.vis_hi(i) - n0;  // relative to the tile
#pragma unroll
          for (int n = 0; n < SN; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = 8 * n + F::c_col(lane, e);
              if (j < lo || j >= hi) s[n][2 * hr + e] = -INFINITY;
            }
        }
        // Online softmax (base 2) over the 4 lanes of the quad sharing the row.
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < SN; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * hr], s[n][2 * hr + 1]));
        mx = fmaxf(mx, shfl_xor(mx, 1));
        mx = fmaxf(mx, shfl_xor(mx, 2));
        const float m_new = fmaxf(row_max[hr], mx * mul);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float corr = fast_exp2(row_max[hr] - m_use);
        row_max[hr] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < SN; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[n][2 * hr + e];
            x = fast_exp2(fmaf(x, mul, -m_use));
            sum += x;
          }
        row_sum[hr] = row_sum[hr] * corr + sum;
#pragma unroll
        for (int n = 0; n < ON; ++n) o[n][2 * hr] *= corr, o[n][2 * hr + 1] *= corr;
      }
      // Dropout on P after the sums (the LSE is that of the undropped softmax), both rows: the
      // m16n8 C layout of common/dropout_lanes.cuh (one lane of the quad makes each 16-key call,
      // shuffles hand out its bits).
      if (R.dropout_p > 0.0f) {
        uint32_t keep[2];
        const int m = m0 + row0 + 8 * (lane & 1);
        fwd_keep_bits<SN>(keep, R, b, a.hq, row_h(m < m_rows ? m : m0), row_i(m), n0);
        fwd_zero_dropped<SN>(keep, [&](int n, int e) -> float& { return s[n][e]; });
      }
      __syncthreads();  // every thread is done reading sK
      if (nb > n_lo) {
        load_kv(sK, k, a.k_addr, a.d, nb - 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      split_kv(sV, sVs);
      __syncthreads();  // V landed (and split)

      // O += P V (3xTF32), P straight from the S fragments: reduction index k of key step n
      // stands for key 8n + pv_key(k) (A columns t, t + 4 -> keys 2t, 2t + 1), so the A fragment
      // is s[n] reordered by pv_from_c and the B fragment reads V rows 8n + 2t and 8n + 2t + 1
      // (column b_n of each 8-column tile).
      // The tile's BN keys are one chunk summed in the tensor core (mma_3xtf32), added to O in fp32.
      const int vb_col = F::b_n(lane);
      Tf32Split pf[SN][4];
#pragma unroll
      for (int n = 0; n < SN; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) pf[n][r] = split_tf32(s[n][F::pv_from_c(r)]);
#pragma unroll
      for (int c = 0; c < ON; ++c) {
        float chunk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < SN; ++n) {
          Tf32Split vf[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int at = vb_col + (8 * n + F::pv_key(F::b_k(lane, r))) * S + 8 * c;
            vf[r] = kKvSplit ? Tf32Split{bits_of(sV[at]), bits_of(sVs[at])} : split_tf32(sV[at]);
          }
          mma_3xtf32_acc(chunk, pf[n], vf);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) o[c][e] += chunk[e];
      }
    }
  }

  // Epilogue: finish the row sums, add the sink (first split only), normalise, store.
  const float keep_scale = R.dropout_scale;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float l = row_sum[hr];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    const int m = m0 + row0 + 8 * hr;
    if (m >= m_rows) continue;
    const int i = row_i(m), h = row_h(m);
    float mx = row_max[hr];
    const float o_scale = R.sinks != nullptr && split == 0 ? fold_sink(R.sinks[h] * kLog2e, mx, l) : 1.0f;
    const float inv = l > 0.0f ? o_scale * keep_scale / l : 0.0f;
    const float lse = l > 0.0f ? (mx + log2f(l)) * kLn2 : -INFINITY;
    float* dst;
    if (a.splits > 1) {
      const int64_t row = (int64_t(b) * a.hq + h) * a.seq.sq + i;
      dst = a.ws_o + (int64_t(split) * a.ws_rows + row) * a.dv;
      if (t == 0) a.ws_lse[int64_t(split) * a.ws_rows + row] = lse;
    } else {
      dst = static_cast<float*>(a.out) + a.out_addr.at(b, q_start, i, h);
      if (a.lse != nullptr && t == 0) a.lse[a.lse_addr.at(b, q_start, h, i)] = lse;
    }
#pragma unroll
    for (int c = 0; c < ON; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * c + F::c_col(lane, e);
        if (col < dv_cols) dst[col] = o[c][2 * hr + e] * inv;
      }
  }
}

}  // namespace f32

// ---- host side -----------------------------------------------------------------------------
namespace {

template <int kTile>
using F32FwdInstance =
    KernelInstance<f32::fwd_f32_kernel<kTile>, kF32FwdTiles[kTile].threads, kF32FwdTiles[kTile].fwd_smem_bytes()>;

KernelInfo f32_fwd_info_of(int tile, int device) {
  switch (tile) {
    case kF32FwdD64: return F32FwdInstance<kF32FwdD64>::info(device);
    case kF32FwdD128: return F32FwdInstance<kF32FwdD128>::info(device);
    case kF32FwdD256: return F32FwdInstance<kF32FwdD256>::info(device);
    case kF32FwdD64Rows64: return F32FwdInstance<kF32FwdD64Rows64>::info(device);
    case kF32FwdD128Rows64: return F32FwdInstance<kF32FwdD128Rows64>::info(device);
    case kF32FwdD256Rows64: return F32FwdInstance<kF32FwdD256Rows64>::info(device);
    case kF32FwdD64Unsplit: return F32FwdInstance<kF32FwdD64Unsplit>::info(device);
    case kF32FwdD128Unsplit: return F32FwdInstance<kF32FwdD128Unsplit>::info(device);
  }
  return KernelInfo{gpuErrorInvalidDevice};
}

}  // namespace

namespace {
// The grid's work units of a plan: query blocks (of packed rows when GQA heads are packed) and
// heads (kv heads when packed).
struct F32FwdUnits {
  int64_t m_blocks, heads;
};
F32FwdUnits f32_fwd_units(const Problem& p, const F32Tile& C, int pack) {
  return {(p.seq.sq * pack + C.block_m - 1) / C.block_m, pack > 1 ? p.hkv : p.hq};
}
}  // namespace

std::string f32_fwd_candidate(const Problem& p, int sm_count, int smem_optin, F32FwdChoice* out) {
  F32FwdChoice c;
  c.pack = gqa_pack(p);
  c.tile = f32_fwd_tile_for(std::max(p.d, p.dv), p.seq.sq, smem_optin, c.pack);
  const F32Tile& C = kF32FwdTiles[c.tile];
  if (C.fwd_smem_bytes() > smem_optin)
    return std::string("cuda backend: ") + C.name + " needs " + std::to_string(C.fwd_smem_bytes()) +
           " bytes of shared memory per block, device has " + std::to_string(smem_optin);
  const KernelInfo ki = f32_fwd_info_of(c.tile, p.device_index);
  if (ki.status != gpuSuccess)
    return std::string("cuda backend: kernel ") + C.name + " is not usable on this device (built archs: " FLASHPORT_GPU_ARCHS "): " +
           gpuGetErrorString(ki.status);
  const F32FwdUnits u = f32_fwd_units(p, C, c.pack);
  const int64_t work_tiles = u.m_blocks * u.heads * p.seq.batch;
  const int64_t key_blocks = std::max<int64_t>(1, (max_kv_rows(p) + C.block_n - 1) / C.block_n);
  const int64_t slots = int64_t(sm_count) * std::max(1, ki.blocks_per_sm);
  c.splits = resolve_num_splits(p.num_splits, work_tiles, key_blocks, slots, kMaxSplits, p.seq.sq <= 16);
  if (u.m_blocks > 0x7fffffff || u.heads > 65535 || p.seq.batch * c.splits > 65535)
    return "cuda backend: grid too large (batch * splits <= 65535, heads <= 65535)";
  *out = c;
  return std::string();
}

// Blocks start in index order (x fastest) as SMs free up. With tiles of equal cost the grid is
// (query blocks, heads, batch x splits): a unit's blocks (a head of a sequence or split) run side
// by side and share its K/V in L2. With uneven tiles (causal, windows, varlen, caches, splits)
// that order starts the last units' heavy query blocks last, and the call ends on them while other
// SMs idle; there the query blocks go outermost, (heads, batch x splits, query blocks): every
// unit's heaviest block first, then every second one, ... (longest first over the grid; as
// work_order.hpp's TailOrder with every unit in the tail). One 128-row fp32 block fills an SM;
// H200 session 33, causal forward: +2% / +5% / +11% at D64 / D128 / D256 with 16-32 heads, 1.1x /
// 1.2x / 1.5x with 4-8 heads (fewer units: the tail was a larger share). The backward keeps its
// order (bwd_f32.cu). Query blocks stay innermost past the z limit (65535).
dim3 f32_fwd_grid(const Problem& p, int tile, int pack, int splits, bool* query_blocks_outer) {
  const F32FwdUnits u = f32_fwd_units(p, kF32FwdTiles[tile], pack);
  const unsigned m_blocks = unsigned(u.m_blocks), heads = unsigned(u.heads), bz = unsigned(p.seq.batch * splits);
  *query_blocks_outer = (splits > 1 || !equal_cost_tiles(p)) && m_blocks > 1 && m_blocks <= 65535;
  return *query_blocks_outer ? dim3(heads, bz, m_blocks) : dim3(m_blocks, heads, bz);
}

gpuError_t launch_f32_fwd(int tile, const FwdArgs& a, dim3 grid, gpuStream_t stream) {
  switch (tile) {
    case kF32FwdD64: return F32FwdInstance<kF32FwdD64>::launch(a, grid, stream);
    case kF32FwdD128: return F32FwdInstance<kF32FwdD128>::launch(a, grid, stream);
    case kF32FwdD256: return F32FwdInstance<kF32FwdD256>::launch(a, grid, stream);
    case kF32FwdD64Rows64: return F32FwdInstance<kF32FwdD64Rows64>::launch(a, grid, stream);
    case kF32FwdD128Rows64: return F32FwdInstance<kF32FwdD128Rows64>::launch(a, grid, stream);
    case kF32FwdD256Rows64: return F32FwdInstance<kF32FwdD256Rows64>::launch(a, grid, stream);
    case kF32FwdD64Unsplit: return F32FwdInstance<kF32FwdD64Unsplit>::launch(a, grid, stream);
    case kF32FwdD128Unsplit: return F32FwdInstance<kF32FwdD128Unsplit>::launch(a, grid, stream);
  }
  return gpuErrorInvalidDevice;
}

}  // namespace flashport::gpu
