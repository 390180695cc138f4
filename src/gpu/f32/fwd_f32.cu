// The fp32 forward main loop (FlashAttention-2 style, SIMT FFMA): one block of 128 threads per
// (query block, query head, batch x split). Thread (ty, tx) owns rows ty*RM .. ty*RM+RM-1 of the
// block, keys tx + 8c of each key tile (c < RN) and output columns 4tx + 32g .. 4tx + 32g + 3. Q
// sits in shared memory for the whole loop; K and V tiles stream through their own shared buffers
// (rows of D + 4 floats: float4 reads, conflict-free) with cp.async, V's copy overlapping S = Q K^T and the next K's copy overlapping P V. Key tiles
// are visited last to first, as in the mma.sync kernel. Every score feature reads the shared rules
// (core/score_rules.hpp) and the shared addressing (core/problem.hpp); dropout keeps exactly the
// elements dropout_keep keeps in every other backend.
#include <algorithm>
#include <cstdio>

#include "core/heuristics.hpp"
#include "gpu/common/kernel_info.cuh"
#include "gpu/common/tile_config.hpp"
#include "gpu/f32/f32_common.cuh"
#include "gpu/f32/f32_launch.hpp"

namespace flashport::gpu {
namespace f32 {

template <int kTile>
__global__ void __launch_bounds__(128, 2) fwd_f32_kernel(const __grid_constant__ FwdArgs a) {
  constexpr F32Tile C = kF32FwdTiles[kTile];
  constexpr int D = C.head_dim, BM = C.block_m, BN = C.block_n, NT = C.threads, S = C.row_stride();
  constexpr int TX = 8, TY = NT / TX;
  // Output columns of thread tx: 4 * tx + 32 * g + e (g < DG, e < 4): float4 reads of V rows.
  constexpr int RM = BM / TY, RN = BN / TX, DG = D / 32, DC = 4 * DG, PS = C.q_stride();
  static_assert(NT == 128 && BM % TY == 0 && BN % TX == 0 && D % 32 == 0 && BN % 4 == 0, "thread mapping");

  extern __shared__ __align__(16) float smem[];
  float* sQ = smem;
  float* sK = sQ + BM * S;
  float* sV = sK + BN * S;
  float* sP = sV + BN * S;  // [BM][BN + 1]

  // FwdArgs carries the tensors as untyped storage pointers; an fp32 call's are floats.
  const float* q = reinterpret_cast<const float*>(a.q);
  const float* k = reinterpret_cast<const float*>(a.k);
  const float* v = reinterpret_cast<const float*>(a.v);

  const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest query blocks first
  const int h = blockIdx.y;
  const int b = blockIdx.z / a.splits;
  const int split = blockIdx.z - b * a.splits;
  const ScoreRules& R = a.rules;

  int lq = static_cast<int>(a.seq.q_len(b));
  if (lq > a.seq.sq) lq = static_cast<int>(a.seq.sq);
  int64_t lk64 = a.seq.k_len(b);
  if (a.k_rows_cap > 0 && lk64 > a.k_rows_cap - a.seq.k_pad(b)) lk64 = a.k_rows_cap - a.seq.k_pad(b);
  const int lk = lk64 < 0 ? 0 : static_cast<int>(lk64);
  if (m0 >= lq) return;
  const int64_t q_start = a.seq.q_start(b);
  const int kvh = h / a.group;
  const int shift = static_cast<int>(R.shift(lq, lk));
  // Visible keys of the block's rows, cut to this split.
  const int i_last = (m0 + BM < lq ? m0 + BM : lq) - 1;
  const int key_lo = static_cast<int>(R.key_lo(m0, shift));
  const int key_hi = static_cast<int>(R.key_hi(i_last, shift, lk));
  int n_lo = key_lo / BN;
  int n_hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : n_lo;
  if (a.splits > 1) {
    const int total = (lk + BN - 1) / BN;
    const int per = (total + a.splits - 1) / a.splits;
    const int s_lo = split * per, s_hi = s_lo + per < total ? s_lo + per : total;
    n_lo = n_lo > s_lo ? n_lo : s_lo;
    n_hi = n_hi < s_hi ? n_hi : s_hi;
  }

  float acc[RM][DC];
  float row_max[RM], row_sum[RM];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    row_max[r] = -INFINITY, row_sum[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < DC; ++c) acc[r][c] = 0.0f;
  }
  // Score transforms (block-uniform): plain scores stay raw and the scale folds into exp2.
  const bool transformed = a.softcap_in > 0.0f || R.alibi != nullptr || !(a.scale_log2 > 0.0f);
  const float mul = transformed ? 1.0f : a.scale_log2;
  const float slope = R.alibi ? -R.alibi_slope(b, h) * kLog2e : 0.0f;
  const int wl = static_cast<int>(R.window_left), wr = static_cast<int>(R.window_right);
  const int d_steps = (a.d + 7) / 8;   // 8-column steps of q.k that hold real columns
  const int dv_cols = a.dv;

  if (n_lo < n_hi) {
    load_rows<BM, D, S, NT, true>(sQ, a.d, tid, q, [&](int r) -> const float* {
      const int i = m0 + r;
      return i < lq ? q + a.q_addr.at(b, q_start, i, h) : nullptr;
    });
    auto load_kv = [&](float* tile, const float* base, const KvAddr& ad, int cols, int nb) {
      load_rows<BN, D, S, NT, true>(tile, cols, tid, base, [&](int r) -> const float* {
        const int j = nb * BN + r;
        return j < lk ? base + kv_offset(a.seq, ad, a.num_pages, b, j, kvh) : nullptr;
      });
    };
    load_kv(sK, k, a.k_addr, a.d, n_hi - 1);
    cp_async_commit();
    for (int nb = n_hi - 1; nb >= n_lo; --nb) {
      __syncthreads();  // the previous P V is done with sV and sP
      load_kv(sV, v, a.v_addr, a.dv, nb);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();  // K (and Q) landed

      // S = Q K^T over the 8-column steps holding real columns, 4 columns per shared read
      // (the FFMAs run in column order: the same sums as a scalar loop).
      float s[RM][RN];
#pragma unroll
      for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < RN; ++c) s[r][c] = 0.0f;
#pragma unroll 1
      for (int k8 = 0; k8 < d_steps; ++k8) {
#pragma unroll
        for (int k4 = 0; k4 < 8; k4 += 4) {
          const int col = k8 * 8 + k4;
          float4 qv[RM], kv[RN];
#pragma unroll
          for (int r = 0; r < RM; ++r) qv[r] = *reinterpret_cast<const float4*>(sQ + (ty * RM + r) * S + col);
#pragma unroll
          for (int c = 0; c < RN; ++c) kv[c] = *reinterpret_cast<const float4*>(sK + (tx + TX * c) * S + col);
#pragma unroll
          for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int c = 0; c < RN; ++c) {
              s[r][c] = fmaf(qv[r].x, kv[c].x, s[r][c]);
              s[r][c] = fmaf(qv[r].y, kv[c].y, s[r][c]);
              s[r][c] = fmaf(qv[r].z, kv[c].z, s[r][c]);
              s[r][c] = fmaf(qv[r].w, kv[c].w, s[r][c]);
            }
        }
      }

      const int n0 = nb * BN;
      const bool need_mask = n0 + BN > lk || (wr >= 0 && n0 + BN - 1 > m0 + shift + wr) ||
                             (wl >= 0 && n0 < i_last + shift - wl);
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        const int i = m0 + ty * RM + r;
        if (transformed) {
#pragma unroll
          for (int c = 0; c < RN; ++c) {
            float& x = s[r][c];
            x = a.softcap_in > 0.0f ? a.softcap_out * tanh_accurate(x * a.softcap_in) : x * a.scale_log2;
            const int dist = i + shift - (n0 + tx + TX * c);
            x += slope * float(dist < 0 ? -dist : dist);
          }
        }
        if (need_mask) {
          const int lo = static_cast<int>(R.key_lo(i, shift)), hi = static_cast<int>(R.key_hi(i, shift, lk));
#pragma unroll
          for (int c = 0; c < RN; ++c) {
            const int j = n0 + tx + TX * c;
            if (j < lo || j >= hi) s[r][c] = -INFINITY;
          }
        }
        // Online softmax (base 2) over the 8 lanes sharing the row.
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < RN; ++c) mx = fmaxf(mx, s[r][c]);
        mx = fmaxf(mx, shfl_xor(mx, 1));
        mx = fmaxf(mx, shfl_xor(mx, 2));
        mx = fmaxf(mx, shfl_xor(mx, 4));
        const float m_new = fmaxf(row_max[r], mx * mul);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float corr = fast_exp2(row_max[r] - m_use);
        row_max[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < RN; ++c) {
          s[r][c] = fast_exp2(fmaf(s[r][c], mul, -m_use));
          sum += s[r][c];
        }
        row_sum[r] = row_sum[r] * corr + sum;
#pragma unroll
        for (int c = 0; c < DC; ++c) acc[r][c] *= corr;
        // Dropout on P after the sum (the LSE is that of the undropped softmax).
        if (R.dropout_p > 0.0f) {
          // Keep bits in a rolled loop (small code), applied with constant indices.
          const uint64_t seed = R.rng_seed(), offset = R.rng_offset();
          uint32_t keep = 0;
#pragma unroll 1
          for (int c = 0; c < RN; ++c)
            keep |= uint32_t(dropout_keeps(R, seed, offset, b, a.hq, h, i, n0 + tx + TX * c)) << c;
#pragma unroll
          for (int c = 0; c < RN; ++c)
            if (!((keep >> c) & 1u)) s[r][c] = 0.0f;
        }
#pragma unroll
        for (int c = 0; c < RN; ++c) sP[(ty * RM + r) * PS + tx + TX * c] = s[r][c];
      }
      __syncthreads();  // sP complete; every thread is done reading sK
      if (nb > n_lo) {
        load_kv(sK, k, a.k_addr, a.d, nb - 1);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // V landed

      // O += P V (columns past dv are zero in sV), 4 keys of P and 4 columns of V per read.
#pragma unroll 2
      for (int j4 = 0; j4 < BN; j4 += 4) {
        float4 pv[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) pv[r] = *reinterpret_cast<const float4*>(sP + (ty * RM + r) * PS + j4);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          float4 vv[DG];
#pragma unroll
          for (int g = 0; g < DG; ++g) vv[g] = *reinterpret_cast<const float4*>(sV + (j4 + jj) * S + 4 * tx + 32 * g);
#pragma unroll
          for (int r = 0; r < RM; ++r) {
            const float p = jj == 0 ? pv[r].x : jj == 1 ? pv[r].y : jj == 2 ? pv[r].z : pv[r].w;
#pragma unroll
            for (int g = 0; g < DG; ++g) {
              acc[r][4 * g] = fmaf(p, vv[g].x, acc[r][4 * g]);
              acc[r][4 * g + 1] = fmaf(p, vv[g].y, acc[r][4 * g + 1]);
              acc[r][4 * g + 2] = fmaf(p, vv[g].z, acc[r][4 * g + 2]);
              acc[r][4 * g + 3] = fmaf(p, vv[g].w, acc[r][4 * g + 3]);
            }
          }
        }
      }
    }
  }

  // Epilogue: finish the row sums, add the sink (first split only), normalise, store.
  const float keep_scale = R.dropout_p > 0.0f ? 1.0f / (1.0f - R.dropout_p) : 1.0f;
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    float l = row_sum[r];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    l += shfl_xor(l, 4);
    const int i = m0 + ty * RM + r;
    if (i >= lq) continue;
    float mx = row_max[r];
    float o_scale = 1.0f;
    if (R.sinks != nullptr && split == 0) {
      const float sink = R.sinks[h] * kLog2e;
      const float m_f = fmaxf(mx, sink);
      o_scale = fast_exp2(mx - m_f);
      l = l * o_scale + fast_exp2(sink - m_f);
      mx = m_f;
    }
    const float inv = l > 0.0f ? o_scale * keep_scale / l : 0.0f;
    const float lse = l > 0.0f ? (mx + log2f(l)) * kLn2 : -INFINITY;
    float* dst;
    if (a.splits > 1) {
      const int64_t row = (int64_t(b) * a.hq + h) * a.seq.sq + i;
      dst = a.ws_o + (int64_t(split) * a.ws_rows + row) * a.dv;
      if (tx == 0) a.ws_lse[int64_t(split) * a.ws_rows + row] = lse;
    } else {
      dst = static_cast<float*>(a.out) + a.out_addr.at(b, q_start, i, h);
      if (a.lse != nullptr && tx == 0) a.lse[a.lse_addr.at(b, q_start, h, i)] = lse;
    }
#pragma unroll
    for (int c = 0; c < DC; ++c) {
      const int col = 4 * tx + 32 * (c / 4) + c % 4;
      if (col < dv_cols) dst[col] = acc[r][c] * inv;
    }
  }
}

}  // namespace f32

// ---- host side -----------------------------------------------------------------------------
namespace {

template <int kTile>
KernelInfo f32_fwd_info(int device) {
  return cached_kernel_info<f32::fwd_f32_kernel<kTile>>(device, kF32FwdTiles[kTile].threads,
                                                        kF32FwdTiles[kTile].fwd_smem_bytes());
}

KernelInfo f32_fwd_info_of(int tile, int device) {
  switch (tile) {
    case kF32D64: return f32_fwd_info<kF32D64>(device);
    case kF32D128: return f32_fwd_info<kF32D128>(device);
    case kF32D256: return f32_fwd_info<kF32D256>(device);
  }
  return KernelInfo{gpuErrorInvalidDevice};
}

}  // namespace

std::string f32_fwd_candidate(const Problem& p, int sm_count, int smem_optin, F32FwdChoice* out) {
  F32FwdChoice c;
  c.tile = f32_tile_for(std::max(p.d, p.dv));
  const F32Tile& C = kF32FwdTiles[c.tile];
  if (C.fwd_smem_bytes() > smem_optin)
    return std::string("cuda backend: ") + C.name + " needs " + std::to_string(C.fwd_smem_bytes()) +
           " bytes of shared memory per block, device has " + std::to_string(smem_optin);
  const KernelInfo ki = f32_fwd_info_of(c.tile, p.device_index);
  if (ki.status != gpuSuccess)
    return std::string("cuda backend: kernel ") + C.name + " is not usable on this device (built archs: " FLASHPORT_GPU_ARCHS "): " +
           gpuGetErrorString(ki.status);
  const int64_t m_blocks = (p.seq.sq + C.block_m - 1) / C.block_m;
  const int64_t work_tiles = m_blocks * p.hq * p.seq.batch;
  const int64_t kv_rows = p.seq.kv_layout == KvLayout::Paged ? p.seq.max_blocks * p.seq.page_size : p.seq.sk;
  const int64_t key_blocks = std::max<int64_t>(1, (kv_rows + C.block_n - 1) / C.block_n);
  const int64_t slots = int64_t(sm_count) * std::max(1, ki.blocks_per_sm);
  c.splits = resolve_num_splits(p.num_splits, work_tiles, key_blocks, slots, kMaxSplits, p.seq.sq <= 16);
  if (m_blocks > 0x7fffffff || p.hq > 65535 || p.seq.batch * c.splits > 65535)
    return "cuda backend: grid too large (batch * splits <= 65535, heads <= 65535)";
  *out = c;
  return std::string();
}

dim3 f32_fwd_grid(const Problem& p, int tile, int splits) {
  const F32Tile& C = kF32FwdTiles[tile];
  return dim3(unsigned((p.seq.sq + C.block_m - 1) / C.block_m), unsigned(p.hq), unsigned(p.seq.batch * splits));
}

gpuError_t launch_f32_fwd(int tile, const FwdArgs& a, dim3 grid, gpuStream_t stream) {
  switch (tile) {
#define FP_CASE(t)                                                                                  \
  case t:                                                                                           \
    f32::fwd_f32_kernel<t><<<grid, kF32FwdTiles[t].threads, kF32FwdTiles[t].fwd_smem_bytes(), stream>>>(a); \
    return gpuGetLastError();
    FP_CASE(kF32D64) FP_CASE(kF32D128) FP_CASE(kF32D256)
#undef FP_CASE
  }
  return gpuErrorInvalidDevice;
}

}  // namespace flashport::gpu
