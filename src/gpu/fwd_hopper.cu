// Hopper (sm_90a) forward prefill: the FlashAttention-2 loop of fwd_kernel.cuh with both
// products on wgmma (HGMMA) instead of mma.sync. Compiled only for sm_90a (its own object
// library in CMakeLists.txt); scope and capability check in fwd_hopper.hpp.
//
// Block: 2 warpgroups, each owns 64 query rows (BM = 128); keys in steps of BN (128; 64 for
// D256; 112 for D128 under schedule v2).
//   S = Q K^T : wgmma m64nBNk16, Q and K from shared memory (both K-major).
//   online softmax in registers (exp2, scale folded), same feature hooks as the mma.sync loop;
//   O += P V  : wgmma m64n64k16 per 64-column panel of the head dim, P from registers (the
//               accumulator layout is the A-fragment layout), V from shared memory MN-major.
// Shared tiles are stored in 64-column panels of 128-byte rows, 16-byte chunks XOR-swizzled by
// row % 8: the 128B-swizzle canonical layout wgmma's descriptors describe. K/V stream through a
// 2-slot ring with cp.async, issued by all 256 threads (no producer warp, no TMA yet).
// Schedules (template kOverlap): v1 (default) waits for each product in turn, one barrier per
// tile, the load of tile n-1 overlapping tile n; v2 issues S of the next tile before P V of this
// one (FA3's intra-warpgroup overlap) -- correct, but measured slower here (gpu_hopper_v2.md).
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "fwd_hopper.hpp"
#include "fwd_hopper_wgmma.hpp"
#include "hopper_smem.hpp"
#include "kernel_info.cuh"
#include "tile_io.cuh"
#include "tile_mma.hpp"

namespace flashport::gpu {
namespace sm90 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D, typename Elem, bool kOverlap>
__global__ void __launch_bounds__(HopperTile::kThreads, 1) fwd_hopper_kernel(const __grid_constant__ FwdArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = HopperTile::kBlockM, BN = HopperTile::block_n(D, kOverlap), NT = HopperTile::kThreads;
  constexpr int kChunks = D / 8;     // 16-byte chunks per row
  constexpr int kPanels = D / 64;    // 64-column panels
  constexpr int kNTiles = BN / 8;    // 8-key accumulator tiles per step
  constexpr bool kBf16 = Elem::kIsBf16;
  constexpr int kTileElems = BN * D;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t base_u32 = (raw_u32 + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem_raw + (base_u32 - raw_u32));
  uint16_t* sKV = sQ + BM * D;  // slot s: K at sKV + 2*s*kTileElems, V right after
  const uint32_t sQ_u32 = base_u32;
  const uint32_t sKV_u32 = base_u32 + BM * D * 2;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7;             // warpgroup: rows [64 wg, 64 wg + 64) of the block
  const int wwarp = (tid >> 5) & 3;    // warp inside the warpgroup: 16 rows each
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest (causal) blocks first
  const int head = blockIdx.y;
  const int b = blockIdx.z;
  const ScoreRules& R = a.rules;

  int lq = static_cast<int>(a.seq.q_len(b));
  if (lq > a.seq.sq) lq = static_cast<int>(a.seq.sq);
  int64_t lk64 = a.seq.k_len(b);
  if (a.k_rows_cap > 0 && lk64 > a.k_rows_cap) lk64 = a.k_rows_cap;
  const int lk = lk64 < 0 ? 0 : static_cast<int>(lk64);
  if (m0 >= lq) return;
  const int64_t q_start = a.seq.q_start(b);
  const int kvh = head / a.group;
  const int shift = R.top_left ? 0 : lk - lq;
  const int wl = static_cast<int>(R.window_left), wr = static_cast<int>(R.window_right);
  auto vis_lo = [&](int i) -> int { const int lo = wl >= 0 ? i + shift - wl : 0; return lo < 0 ? 0 : lo; };
  auto vis_hi = [&](int i) -> int {
    const int hi = wr >= 0 ? i + shift + wr + 1 : lk;
    return hi > lk ? lk : (hi < 0 ? 0 : hi);
  };
  const int i_min = m0;
  const int i_max = (m0 + BM < lq ? m0 + BM : lq) - 1;
  const int key_lo = vis_lo(i_min);
  const int key_hi = vis_hi(i_max);
  const int n_lo = key_lo / BN;
  const int n_hi = key_hi > key_lo ? (key_hi + BN - 1) / BN : n_lo;

  // This thread's two rows (accumulator halves hf = 0, 1).
  const int row_loc0 = wg * 64 + wwarp * 16 + (lane >> 2);
  const int col_base = (lane & 3) * 2;

  float o_acc[kPanels][32];
#pragma unroll
  for (int p = 0; p < kPanels; ++p)
#pragma unroll
    for (int e = 0; e < 32; ++e) o_acc[p][e] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  if (n_lo < n_hi) {
    // K/V row base of this (sequence, kv head): batched or packed (the capability check
    // declines paged and cache layouts).
    const int64_t k_base = (a.k_addr.layout == KvLayout::Packed ? a.seq.k_start(b) * a.k_addr.s0
                                                                : int64_t(b) * a.k_addr.s0) + kvh * a.k_addr.s2;
    const int64_t v_base = (a.v_addr.layout == KvLayout::Packed ? a.seq.k_start(b) * a.v_addr.s0
                                                                : int64_t(b) * a.v_addr.s0) + kvh * a.v_addr.s2;
    const int64_t k_rs = a.k_addr.layout == KvLayout::Packed ? a.k_addr.s0 : a.k_addr.s1;
    const int64_t v_rs = a.v_addr.layout == KvLayout::Packed ? a.v_addr.s0 : a.v_addr.s1;

    // Each thread copies one 16-byte column chunk of every (NT / kChunks)-th row; that row step
    // is a multiple of 8, so the swizzled shared offset advances by a constant.
    constexpr int kRowStep = NT / kChunks;
    static_assert(kRowStep % 8 == 0 && BN % kRowStep == 0 && BM % kRowStep == 0, "load mapping");
    const int ld_row = tid / kChunks, ld_chunk = tid % kChunks;
    const int ld_soff = panel_offset(BN, ld_row, ld_chunk);
    const uint16_t* k_src = a.k + k_base + ld_chunk * 8;
    const uint16_t* v_src = a.v + v_base + ld_chunk * 8;
    // One tile of K (or V) rows into its slot: K of slot s at sKV + 2s tiles, V right after.
    auto load_rows = [&](uint16_t* dst, const uint16_t* src, int64_t rs, int nb) {
      const int j0 = nb * BN + ld_row;
#pragma unroll
      for (int k = 0; k < BN / kRowStep; ++k) {
        const int j = j0 + k * kRowStep;
        const bool in = j < lk;
        const int64_t jj = in ? j : 0;
        cp_async_16(dst + k * kRowStep * 64, src + jj * rs, in ? 16 : 0);
      }
    };
    auto load_k = [&](int slot, int nb) { load_rows(sKV + 2 * slot * kTileElems + ld_soff, k_src, k_rs, nb); };
    auto load_v = [&](int slot, int nb) { load_rows(sKV + (2 * slot + 1) * kTileElems + ld_soff, v_src, v_rs, nb); };
    auto load_kv = [&](int slot, int nb) {
      load_k(slot, nb);
      load_v(slot, nb);
    };
    // Q tile (rows past the sequence are zeros).
    {
      const int q_soff = panel_offset(BM, ld_row, ld_chunk);
#pragma unroll
      for (int k = 0; k < BM / kRowStep; ++k) {
        const int m = m0 + ld_row + k * kRowStep;
        const bool in = m < lq;
        const int64_t off = a.q_addr.at(b, q_start, in ? m : 0, head) + ld_chunk * 8;
        cp_async_16(sQ + q_soff + k * kRowStep * 64, a.q + off, in ? 16 : 0);
      }
    }
    load_kv(0, n_hi - 1);
    cp_async_commit();

    const bool transformed = a.softcap_in > 0.0f || R.alibi != nullptr || !(a.scale_log2 > 0.0f);
    const float mul = transformed ? 1.0f : a.scale_log2;
    const float slope = R.alibi ? -R.alibi_slope(b, head) * kLog2e : 0.0f;

    auto slot_k = [&](int slot) -> uint32_t { return sKV_u32 + uint32_t(2 * slot * kTileElems * 2); };
    // S = Q K^T for the tile in `slot` (issued, not waited for).
    auto issue_s = [&](float (&s)[BN / 2], int slot) {
      // Descriptors as base + offset (in 16-byte units); the opaque copy of the Q base keeps the
      // compiler from hoisting D/16 loop-invariant 64-bit descriptors into registers.
      uint64_t q_desc = make_desc(sQ_u32 + wg * (64 * 128), 16, 1024);
      asm volatile("" : "+l"(q_desc));
      uint64_t k_desc = make_desc(slot_k(slot), 16, 1024);
      asm volatile("" : "+l"(k_desc));
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t koff = uint32_t((ks & 3) * 32);  // 16 columns = 32 bytes inside the 128-byte row
        const uint64_t da = q_desc + (((ks >> 2) * (BM * 128) + koff) >> 4);
        const uint64_t db = k_desc + (((ks >> 2) * (BN * 128) + koff) >> 4);
        if constexpr (BN == 128) wgmma_ss_m64n128k16<kBf16>(s, da, db, ks > 0 ? 1 : 0);
        else if constexpr (BN == 112) wgmma_ss_m64n112k16<kBf16>(s, da, db, ks > 0 ? 1 : 0);
        else wgmma_ss_m64n64k16<kBf16>(s, da, db, ks > 0 ? 1 : 0);
      }
      wg_commit();
    };
    // O += P V for the tile in `slot` (issued, not waited for). V is [key][d]: MN-major for B;
    // 16 keys = 2048 bytes per k-step.
    auto issue_pv = [&](const uint32_t (&pa)[BN / 16][4], int slot) {
      uint64_t v_desc = make_desc(slot_k(slot) + uint32_t(kTileElems * 2), BN * 128, 1024);
      asm volatile("" : "+l"(v_desc));
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks)
#pragma unroll
        for (int p = 0; p < kPanels; ++p) {
          const uint64_t db = v_desc + ((p * (BN * 128) + ks * 2048) >> 4);
          wgmma_rs_m64n64k16_tb<kBf16>(o_acc[p], pa[ks], db, 1);
        }
      wg_commit();
    };
    // Feature hooks, masking and the online softmax of tile nb (base 2); S becomes P (fp32),
    // corr the factor the running O must be scaled by.
    auto softmax = [&](float (&s)[BN / 2], int nb, float (&corr)[2]) {
      const int n0 = nb * BN;
      const bool need_mask = n0 + BN > lk || (wr >= 0 && n0 + BN - 1 > i_min + shift + wr) ||
                             (wl >= 0 && n0 < i_max + shift - wl);
      if (transformed) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = m0 + row_loc0 + hf * 8;
          const int base = i + shift - n0;
#pragma unroll
          for (int t = 0; t < kNTiles; ++t)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              float& v = s[4 * t + 2 * hf + e2];
              v = a.softcap_in > 0.0f ? a.softcap_out * tanh_accurate(v * a.softcap_in) : v * a.scale_log2;
              const int dist = base - (t * 8 + col_base + e2);
              v += slope * float(dist < 0 ? -dist : dist);
            }
        }
      }
      if (need_mask) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = m0 + row_loc0 + hf * 8;
          const int lo = vis_lo(i) - n0, hi = vis_hi(i) - n0;
#pragma unroll
          for (int t = 0; t < kNTiles; ++t)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              const int j = t * 8 + col_base + e2;
              if (j < lo || j >= hi) s[4 * t + 2 * hf + e2] = -INFINITY;
            }
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t) mx = fmaxf(mx, fmaxf(s[4 * t + 2 * hf], s[4 * t + 2 * hf + 1]));
        mx = fmaxf(mx, shfl_xor(mx, 1));
        mx = fmaxf(mx, shfl_xor(mx, 2));
        const float m_new = fmaxf(row_max[hf], mx * mul);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        corr[hf] = fast_exp2(row_max[hf] - m_use);
        row_max[hf] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < kNTiles; ++t)
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            float& v = s[4 * t + 2 * hf + e2];
            v = fast_exp2(fmaf(v, mul, -m_use));
            sum += v;
          }
        row_sum[hf] = row_sum[hf] * corr[hf] + sum;
      }
    };
    auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
      for (int p = 0; p < kPanels; ++p)
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          o_acc[p][4 * t + 0] *= corr[0];
          o_acc[p][4 * t + 1] *= corr[0];
          o_acc[p][4 * t + 2] *= corr[1];
          o_acc[p][4 * t + 3] *= corr[1];
        }
    };
    // P to 16-bit A fragments: k-step ks takes the accumulator tiles 2ks and 2ks + 1.
    auto pack_p = [&](const float (&s)[BN / 2], uint32_t (&pa)[BN / 16][4]) {
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        pa[ks][0] = Elem::pack(s[8 * ks + 0], s[8 * ks + 1]);
        pa[ks][1] = Elem::pack(s[8 * ks + 2], s[8 * ks + 3]);
        pa[ks][2] = Elem::pack(s[8 * ks + 4], s[8 * ks + 5]);
        pa[ks][3] = Elem::pack(s[8 * ks + 6], s[8 * ks + 7]);
      }
    };

    if constexpr (!kOverlap) {
      // v1: per tile, S -> softmax -> P V, each product waited for before the next step.
      int slot = 0;
      for (int nb = n_hi - 1; nb >= n_lo; --nb) {
        cp_async_wait<0>();
        fence_proxy_async();  // cp.async writes (generic proxy) -> wgmma reads (async proxy)
        __syncthreads();      // tile nb landed everywhere; every warpgroup is done with the other slot
        if (nb > n_lo) {
          load_kv(slot ^ 1, nb - 1);
          cp_async_commit();
        }
        float s[BN / 2];
        wg_fence();
        issue_s(s, slot);
        wg_wait<0>();
        fence_regs(s);
        float corr[2];
        softmax(s, nb, corr);
        rescale_o(corr);
        uint32_t pa[BN / 16][4];
        pack_p(s, pa);
        wg_fence();
        issue_pv(pa, slot);
        wg_wait<0>();
#pragma unroll
        for (int p = 0; p < kPanels; ++p) fence_regs(o_acc[p]);
        slot ^= 1;
      }
    } else {
      // v2 (FA3's intra-warpgroup overlap): S of the next tile is issued before P V of this one,
      // so the next tile's softmax runs while the tensor cores do this tile's P V. Tiles walk
      // nb = n_hi-1 down to n_lo; tile t's K sits in K slot t & 1, its V in V slot t & 1. At the
      // top of step t (one barrier) K(t+1) and V(t) have landed, K(t) (read by S(t), waited in
      // step t-1) and V(t-1) (read by P V(t-1), waited in step t-1) are free: K(t+2) and V(t+1)
      // are loaded into them, a whole step ahead of use.
      const int count = n_hi - n_lo;
      if (count > 1) load_k(1, n_hi - 2);
      cp_async_commit();
      cp_async_wait<1>();  // Q, K(0), V(0) landed (K(1) may be in flight)
      fence_proxy_async();
      __syncthreads();
      float s[BN / 2];
      wg_fence();
      issue_s(s, 0);
      wg_wait<0>();
      fence_regs(s);
      float corr[2];
      softmax(s, n_hi - 1, corr);  // O is zero: no rescale
      uint32_t pa[BN / 16][4];
      pack_p(s, pa);
      // Steps 0 .. count-2 have a next tile: the same wgmma sequence every time (ptxas must see
      // a fixed group structure to keep the products asynchronous). The last step is peeled.
      int t = 0;
      for (; t + 1 < count; ++t) {
        const int slot = t & 1;
        cp_async_wait<0>();  // K(t+1), V(t): this thread's copies
        fence_proxy_async();
        __syncthreads();     // ... everyone's; K(t) and V(t-1) are free everywhere
        if (t + 2 < count) load_k(slot, n_hi - 3 - t);
        load_v(slot ^ 1, n_hi - 2 - t);
        cp_async_commit();
        wg_fence();
        issue_s(s, slot ^ 1);
        issue_pv(pa, slot);
        wg_wait<1>();  // S(t+1) done; P V(t) may still run
        fence_regs(s);
        softmax(s, n_hi - 2 - t, corr);
        wg_wait<0>();  // P V(t) done
#pragma unroll
        for (int p = 0; p < kPanels; ++p) fence_regs(o_acc[p]);
        rescale_o(corr);
        pack_p(s, pa);
      }
      cp_async_wait<0>();  // V(last)
      fence_proxy_async();
      __syncthreads();
      wg_fence();
      issue_pv(pa, t & 1);
      wg_wait<0>();
#pragma unroll
      for (int p = 0; p < kPanels; ++p) fence_regs(o_acc[p]);
    }
  }

  // Epilogue: finish the row sums, add the sink, normalise, store.
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int i = m0 + row_loc0 + hf * 8;
    float l = row_sum[hf];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    float mx = row_max[hf];
    if (i >= lq) continue;
    float o_scale = 1.0f;
    if (R.sinks != nullptr) {
      const float sink = R.sinks[head] * kLog2e;
      const float m_f = fmaxf(mx, sink);
      o_scale = fast_exp2(mx - m_f);
      l = l * o_scale + fast_exp2(sink - m_f);
      mx = m_f;
    }
    const float inv = l > 0.0f ? o_scale / l : 0.0f;
    const float lse = l > 0.0f ? (mx + __log2f(l)) * kLn2 : -INFINITY;
    typename Elem::T* dst = static_cast<typename Elem::T*>(a.out) + a.out_addr.at(b, q_start, i, head);
#pragma unroll
    for (int p = 0; p < kPanels; ++p)
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const int col = p * 64 + t * 8 + col_base;
        const float v0 = o_acc[p][4 * t + 2 * hf] * inv, v1 = o_acc[p][4 * t + 2 * hf + 1] * inv;
        if (a.out_vec_ok) {
          *reinterpret_cast<uint32_t*>(dst + col) = Elem::pack(v0, v1);
        } else {
          dst[col] = Elem::from_float(v0);
          dst[col + 1] = Elem::from_float(v1);
        }
      }
    if (a.lse != nullptr && (lane & 3) == 0) a.lse[a.lse_addr.at(b, q_start, head, i)] = lse;
  }
#else
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    printf("flashport: the Hopper forward kernel needs sm_90a\n");
  __trap();
#endif
}

}  // namespace sm90

template <int D, bool kBf16, bool kOverlap>
KernelInfo hopper_fwd_kernel_info(int device) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  return cached_kernel_info<sm90::fwd_hopper_kernel<D, Elem, kOverlap>>(device, HopperTile::kThreads,
                                                                          HopperTile::smem_bytes(D, kOverlap));
}

template <int D, bool kBf16, bool kOverlap>
gpuError_t launch_hopper_fwd(const FwdArgs& a, dim3 grid, gpuStream_t stream) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  sm90::fwd_hopper_kernel<D, Elem, kOverlap><<<grid, HopperTile::kThreads, HopperTile::smem_bytes(D, kOverlap), stream>>>(a);
  return gpuGetLastError();
}

#define FP_INSTANTIATE_HOPPER(D, bf16, ovl)                        \
  template KernelInfo hopper_fwd_kernel_info<D, bf16, ovl>(int); \
  template gpuError_t launch_hopper_fwd<D, bf16, ovl>(const FwdArgs&, dim3, gpuStream_t);
#define FP_INSTANTIATE_HOPPER_D(D)                                                 \
  FP_INSTANTIATE_HOPPER(D, false, false) FP_INSTANTIATE_HOPPER(D, true, false)     \
  FP_INSTANTIATE_HOPPER(D, false, true) FP_INSTANTIATE_HOPPER(D, true, true)
FP_INSTANTIATE_HOPPER_D(64)
FP_INSTANTIATE_HOPPER_D(128)
FP_INSTANTIATE_HOPPER_D(256)

}  // namespace flashport::gpu
