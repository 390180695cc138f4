// Forward attention tile on the AMD tile-MMA layer (tile_mma_amd.hpp): one workgroup computes
// 16 query rows per wave of one head against all their visible keys, FlashAttention-2 style,
// from the same FwdArgs the CUDA main loop takes. It is written only against the layer's
// operations (no lane arithmetic, wave size or accumulator layout of its own), so the one source
// compiles to MFMA on gfx90a/gfx942, WMMA on gfx1100/gfx1201 and the plain path elsewhere.
//
// Covered: batched / varlen / paged K-V addressing, GQA, causal and sliding-window masks with both
// alignments, softcap, ALiBi, sinks, dropout (the shared Philox rule), LSE, key and query tails.
// Not covered here (the CUDA main loop has them): split-KV partials, packed-GQA decode rows, the
// rotary/append pre-pass.
// Products are taken transposed: S^T = K Q^T and O^T = V^T P^T (see amd_layouts.hpp).
#pragma once
#include <cstdint>

#include "tile_mma_amd.hpp"  // first: hip_runtime.h defines what hd.hpp's FP_HD expands to
#include "core/philox.hpp"
#include "kernel_args.hpp"

namespace flashport::gpu {

// The tile of each head-dim bucket (64, 128, 256): waves per workgroup (16 query rows each) and
// keys per main-loop step, sized so the Q, K and V tiles fit a workgroup's 64 KiB of LDS. Read by
// the kernel and by the host (launch shape, LDS gate), so the two can't disagree.
struct AmdTile {
  int head_dim, waves, block_n;
  constexpr int rows() const { return 16 * waves; }
  constexpr int lds_bytes() const { return (rows() + 2 * block_n) * (head_dim + 8) * 2; }  // LdsTile rows
};
constexpr int amd_head_dim_bucket(int64_t d) { return d <= 64 ? 64 : (d <= 128 ? 128 : 256); }
constexpr AmdTile amd_tile(int head_dim) {
  return head_dim <= 64 ? AmdTile{64, 4, 64} : head_dim <= 128 ? AmdTile{128, 4, 64} : AmdTile{256, 2, 32};
}
static_assert(amd_tile(256).lds_bytes() <= 64 * 1024, "d256 tile fits 64 KiB of LDS");

// The kernel arguments of a validated call (host side; shared by the HIP backend and the CPU
// emulation test, so what is tested is what is launched).
inline FwdArgs amd_fwd_args(const Problem& p) {
  auto aligned16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  auto mult8 = [](int64_t x) { return (x & 7) == 0; };
  FwdArgs a;
  a.q = static_cast<const uint16_t*>(p.q_ptr);
  a.k = static_cast<const uint16_t*>(p.k_ptr);
  a.v = static_cast<const uint16_t*>(p.v_ptr);
  a.out = p.out_ptr;
  a.lse = p.has_lse ? static_cast<float*>(p.lse_ptr) : nullptr;
  a.seq = p.seq;
  a.q_addr = p.q;
  a.out_addr = p.out;
  a.k_addr = p.k;
  a.v_addr = p.v;
  a.lse_addr = p.lse;
  a.rules = p.rules;
  a.k_rows_cap = p.seq.kv_layout == KvLayout::Batched ? p.seq.sk
                 : p.seq.kv_layout == KvLayout::Paged ? p.seq.max_blocks * p.seq.page_size : 0;
  a.num_pages = p.seq.kv_layout == KvLayout::Paged ? p.raw->k.shape[0] : 0;
  a.hq = int32_t(p.hq), a.hkv = int32_t(p.hkv), a.d = int32_t(p.d), a.dv = int32_t(p.dv);
  a.group = int32_t(p.group);
  a.scale_log2 = p.rules.scale * 1.4426950408889634f;
  if (p.rules.softcap > 0.0f) {
    a.softcap_in = p.rules.scale / p.rules.softcap;
    a.softcap_out = p.rules.softcap * 1.4426950408889634f;
  }
  a.vec_ok = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && mult8(p.q.row_stride) &&
             mult8(p.q.head_stride) && mult8(p.q.batch_stride) && mult8(p.k.s0) && mult8(p.k.s1) &&
             mult8(p.k.s2) && mult8(p.v.s0) && mult8(p.v.s1) && mult8(p.v.s2);
  return a;
}

// Launches the tile of head-dim bucket `head_dim` (64, 128 or 256: the bucket of max(d, dv)) with
// amd_tile(head_dim).waves waves of the device's wave size; grid = (row blocks, query heads,
// batch). Defined in attn_tile_amd.hip.
gpuError_t launch_attn_tile_amd(int head_dim, bool bf16, const FwdArgs& a, dim3 grid, int wave_size,
                                gpuStream_t stream);

namespace attn_detail {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// tanh through exp (the fast-math tanh is too coarse for softcaps of 30-50).
__device__ __forceinline__ float tanh_accurate(float x) {
  const float e = __expf(-2.0f * fabsf(x));
  return copysignf((1.0f - e) / (1.0f + e), x);
}

// Element offset of key row j of sequence b, kv head h; page ids clamped into the pool.
__device__ __forceinline__ int64_t kv_offset(const FwdArgs& a, const KvAddr& ad, int b, int j, int h) {
  if (ad.layout == KvLayout::Paged) {
    int64_t page = a.seq.block_table[b * a.seq.block_table_stride + j / a.seq.page_size];
    page = page < 0 ? 0 : (a.num_pages > 0 && page >= a.num_pages ? a.num_pages - 1 : page);
    return page * ad.s0 + (j % a.seq.page_size) * ad.s1 + int64_t(h) * ad.s2;
  }
  return ad.at(a.seq, b, j, h);
}

// One 16-byte chunk (8 elements from column c*8) of a row into a shared tile; rows past the end
// (src == nullptr) and columns past `limit` are zeros; unaligned tensors take the scalar path.
__device__ __forceinline__ void lds_chunk(uint16_t* dst, const uint16_t* src_row, int c, int limit, bool vec_ok) {
  const int col = c * 8;
  if (src_row != nullptr && vec_ok && col + 8 <= limit) {
    copy_16(dst, src_row + col, 16);
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const uint32_t lo = (src_row != nullptr && col + 2 * t < limit) ? src_row[col + 2 * t] : 0u;
    const uint32_t hi = (src_row != nullptr && col + 2 * t + 1 < limit) ? src_row[col + 2 * t + 1] : 0u;
    w[t] = lo | (hi << 16);
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace attn_detail

template <int kD, typename Elem>
__global__ void __launch_bounds__(amd_tile(kD).waves * kWarpSize) attn_tile_kernel(const FwdArgs a) {
  using namespace attn_detail;
  using Tile = LdsTile<kD>;
  constexpr AmdTile kTile = amd_tile(kD);
  static_assert(kTile.head_dim == kD, "one tile per head-dim bucket");
  constexpr int BM = kTile.rows(), BN = kTile.block_n, NT = kTile.waves * kWarpSize;
  constexpr int kKeyTiles = BN / 16, kDimTiles = kD / 16;
  static_assert(Tile::bytes(BM + 2 * BN) == kTile.lds_bytes(), "host and kernel LDS agree");
  if constexpr (kTile.lds_bytes() > amd::lds_bytes_per_workgroup(FP_AMD_GFX)) {
    FP_AMD_TRAP("attn_tile_kernel (LDS over the workgroup limit)");
  } else {
    __shared__ __attribute__((aligned(16))) uint16_t smem[(BM + 2 * BN) * Tile::kStride];
    uint16_t* sQ = smem;
    uint16_t* sK = sQ + BM * Tile::kStride;
    uint16_t* sV = sK + BN * Tile::kStride;

    const int tid = threadIdx.x, lane = tid % kWarpSize, wave = tid / kWarpSize;
    const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
    const ScoreRules& R = a.rules;
    int lq = static_cast<int>(a.seq.q_len(b));
    if (lq > a.seq.sq) lq = static_cast<int>(a.seq.sq);  // clamp device-side lengths, don't fault
    int64_t lk64 = a.seq.k_len(b);
    if (a.k_rows_cap > 0 && lk64 > a.k_rows_cap) lk64 = a.k_rows_cap;
    const int lk = lk64 < 0 ? 0 : static_cast<int>(lk64);
    if (m0 >= lq) return;
    const int64_t q_start = a.seq.q_start(b);
    const int kvh = h / a.group;
    const int shift = R.top_left ? 0 : lk - lq;
    const int wl = static_cast<int>(R.window_left), wr = static_cast<int>(R.window_right);
    auto vis_lo = [&](int i) { const int lo = wl >= 0 ? i + shift - wl : 0; return lo < 0 ? 0 : lo; };
    auto vis_hi = [&](int i) {
      const int hi = wr >= 0 ? i + shift + wr + 1 : lk;
      return hi > lk ? lk : (hi < 0 ? 0 : hi);
    };
    const int i_min = m0, i_max = (m0 + BM < lq ? m0 + BM : lq) - 1;
    const int key_lo = vis_lo(i_min), key_hi = vis_hi(i_max);
    const int n_lo = key_lo / BN;
    const int n_hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : n_lo;

    // This lane's query (its accumulator column) and its running softmax state.
    const int q_row = m0 + wave * 16 + acc_col(lane);
    const float slope = R.alibi ? -R.alibi_slope(b, h) * kLog2e : 0.0f;
    Acc16 acc_o[kDimTiles];
#pragma unroll
    for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
      for (int e = 0; e < kAccElems; ++e) acc_o[t].r[e] = 0.0f;
    float row_max = -INFINITY, row_sum = 0.0f;  // row_sum: this lane's part of the column

    if (n_lo < n_hi) {
      for (int idx = tid; idx < BM * Tile::kChunks; idx += NT) {
        const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
        const uint16_t* src = m0 + r < lq ? a.q + a.q_addr.at(b, q_start, m0 + r, h) : nullptr;
        lds_chunk(sQ + Tile::offset(r, c * 8), src, c, a.d, a.vec_ok);
      }
      for (int nb = n_hi - 1; nb >= n_lo; --nb) {
        const int n0 = nb * BN;
        __syncthreads();  // the previous step is done with sK / sV
        for (int idx = tid; idx < BN * Tile::kChunks; idx += NT) {
          const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
          const int j = n0 + r;
          lds_chunk(sK + Tile::offset(r, c * 8), j < lk ? a.k + kv_offset(a, a.k_addr, b, j, kvh) : nullptr,
                    c, a.d, a.vec_ok);
          lds_chunk(sV + Tile::offset(r, c * 8), j < lk ? a.v + kv_offset(a, a.v_addr, b, j, kvh) : nullptr,
                    c, a.dv, a.vec_ok);
        }
        copy_commit();
        copy_wait<0>();
        __syncthreads();

        // S^T = K Q^T: s[t].r[e] is the score of key n0 + 16t + acc_row(lane, e) for q_row.
        Acc16 s[kKeyTiles];
#pragma unroll
        for (int t = 0; t < kKeyTiles; ++t)
#pragma unroll
          for (int e = 0; e < kAccElems; ++e) s[t].r[e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
          if (ks * 16 < a.d) {
            Frag16 qf;
            load_rows<kD>(qf, sQ, wave * 16, ks * 16, lane);
#pragma unroll
            for (int t = 0; t < kKeyTiles; ++t) {
              Frag16 kf;
              load_rows<kD>(kf, sK, t * 16, ks * 16, lane);
              mma<Elem>(s[t], kf, qf);
            }
          }
        }

        // Scores to log2 units, then the feature hooks (block-uniform branches).
        const bool need_mask = n0 + BN > lk || (wr >= 0 && n0 + BN - 1 > i_min + shift + wr) ||
                               (wl >= 0 && n0 < i_max + shift - wl);
        const int lo = vis_lo(q_row) - n0, hi = vis_hi(q_row) - n0;  // visible keys, tile-relative
        float mx = row_max;
#pragma unroll
        for (int t = 0; t < kKeyTiles; ++t)
#pragma unroll
          for (int e = 0; e < kAccElems; ++e) {
            const int j = t * 16 + acc_row(lane, e);
            float& x = s[t].r[e];
            x = a.softcap_in > 0.0f ? a.softcap_out * tanh_accurate(x * a.softcap_in) : x * a.scale_log2;
            if (R.alibi != nullptr) {
              const int dist = q_row + shift - (n0 + j);
              x += slope * float(dist < 0 ? -dist : dist);
            }
            if (need_mask && (j < lo || j >= hi)) x = -INFINITY;
            mx = fmaxf(mx, x);
          }
        // Online softmax (base 2) over the lanes sharing this query.
        mx = query_max(mx);
        const float m_use = mx == -INFINITY ? 0.0f : mx;
        const float corr = fast_exp2(row_max - m_use);
        row_max = mx;
        row_sum *= corr;
#pragma unroll
        for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
          for (int e = 0; e < kAccElems; ++e) acc_o[t].r[e] *= corr;
#pragma unroll
        for (int t = 0; t < kKeyTiles; ++t)
#pragma unroll
          for (int e = 0; e < kAccElems; ++e) {
            s[t].r[e] = fast_exp2(s[t].r[e] - m_use);
            row_sum += s[t].r[e];
          }
        // Dropout on P after the sum (the LSE is that of the undropped softmax). One Philox call
        // covers 4 aligned keys; a lane's keys are runs of 4 (MFMA) or 8 (gfx12), or stride 2 (gfx11).
        if (R.dropout_p > 0.0f) {
#pragma unroll
          for (int t = 0; t < kKeyTiles; ++t) {
            Philox4 w{};
#pragma unroll
            for (int e = 0; e < kAccElems; ++e) {
              const int j = n0 + t * 16 + acc_row(lane, e);
              if (e == 0 || (acc_row(lane, e) >> 2) != (acc_row(lane, e - 1) >> 2))
                w = dropout_words(R.rng_seed(), R.rng_offset(), b, a.hq, h, q_row, j);
              const int c = j & 3;  // selects, not an indexed load: keeps w in registers
              const uint32_t word = c == 0 ? w.x[0] : c == 1 ? w.x[1] : c == 2 ? w.x[2] : w.x[3];
              if (word < R.dropout_threshold) s[t].r[e] = 0.0f;
            }
          }
        }

        // O^T += V^T P^T, P^T straight from S^T's accumulators.
#pragma unroll
        for (int t = 0; t < kKeyTiles; ++t) {
          const Frag16 pf = acc_to_operand<Elem>(s[t], lane);
#pragma unroll
          for (int dt = 0; dt < kDimTiles; ++dt) {
            if (dt * 16 < a.dv) {
              Frag16 vf;
              load_cols<kD>(vf, sV, t * 16, dt * 16, lane);
              mma<Elem>(acc_o[dt], vf, pf);
            }
          }
        }
      }
    }

    // Epilogue: finish the row sum, add the sink, normalise, store O and the LSE.
    float l = query_sum(row_sum);
    float mx = row_max;
    if (q_row >= lq) return;
    float o_scale = 1.0f;
    if (R.sinks != nullptr) {
      const float sink = R.sinks[h] * kLog2e;
      const float m_f = fmaxf(mx, sink);
      o_scale = fast_exp2(mx - m_f);
      l = l * o_scale + fast_exp2(sink - m_f);
      mx = m_f;
    }
    const float keep_scale = R.dropout_p > 0.0f ? 1.0f / (1.0f - R.dropout_p) : 1.0f;
    const float inv = l > 0.0f ? o_scale * keep_scale / l : 0.0f;
    typename Elem::T* dst = static_cast<typename Elem::T*>(a.out) + a.out_addr.at(b, q_start, q_row, h);
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt)
#pragma unroll
      for (int e = 0; e < kAccElems; ++e) {
        const int col = dt * 16 + acc_row(lane, e);
        if (col < a.dv) dst[col] = Elem::from_float(acc_o[dt].r[e] * inv);
      }
    if (a.lse != nullptr && query_leader(lane))
      a.lse[a.lse_addr.at(b, q_start, h, q_row)] = l > 0.0f ? (mx + __log2f(l)) * kLn2 : -INFINITY;
  }
}

}  // namespace flashport::gpu
