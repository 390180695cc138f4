// Hopper (sm_90a) forward prefill: the FlashAttention loop with both products on wgmma (HGMMA).
// Compiled only for sm_90a (its own object library in CMakeLists.txt); scope, capability check and
// schedule selection in fwd_hopper.hpp. Two schedules share the row side (fwd_hopper_rows.cuh):
//
// v1 (this file): 2 warpgroups x 64 query rows (BM = 128), keys in steps of BN (128; 64 for D256).
//   S = Q K^T : wgmma m64nBNk16, Q and K from shared memory (both K-major).
//   online softmax in registers (exp2, scale folded), the feature hooks of HopperRows;
//   O += P V  : wgmma m64n64k16 per 64-column panel of the head dim, P from registers (the
//               accumulator layout is the A-fragment layout), V from shared memory MN-major.
//   Shared tiles are 64-column panels of 128-byte rows, 16-byte chunks XOR-swizzled by row % 8
//   (the 128B-swizzle layout wgmma's descriptors describe). K/V stream through a 2-slot ring
//   with cp.async issued by all 256 threads; one barrier per tile; each product waited for in turn.
// v3 (fwd_hopper_v3.cuh): warp-specialised, FA3's structure: a producer warp issuing TMA into a
//   K/V ring guarded by mbarriers, setmaxnreg, two consumer warpgroups in named-barrier ping-pong,
//   S of the next tile issued before P V of this one; split-KV (partials + the combine kernel).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "gpu/hopper/fwd_hopper.hpp"
#include "gpu/hopper/fwd_hopper_rows.cuh"
#include "gpu/hopper/fwd_hopper_tma.cuh"
#include "gpu/hopper/fwd_hopper_v3.cuh"
#include "gpu/hopper/fwd_hopper_wgmma.hpp"
#include "gpu/hopper/hopper_smem.hpp"
#include "gpu/common/kernel_info.cuh"
#include "gpu/common/tile_io.cuh"
#include "gpu/common/tile_mma.hpp"

namespace flashport::gpu {
namespace sm90 {

template <int D, typename Elem>
__global__ void __launch_bounds__(HopperTile::kThreads, 1) fwd_hopper_kernel(const __grid_constant__ FwdArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = HopperTile::kBlockM, BN = HopperTile::block_n(D), NT = HopperTile::kThreads;
  constexpr int kChunks = D / 8;     // 16-byte chunks per row
  constexpr int kPanels = D / 64;    // 64-column panels
  constexpr bool kBf16 = Elem::kIsBf16;
  constexpr int kTileElems = BN * D;
  using Rows = HopperRows<BN>;

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
  Rows rows(a, b, head, m0, BM, wg * 64 + wwarp * 16 + (lane >> 2));
  if (rows.empty()) return;
  const int n_lo = rows.n_lo, n_hi = rows.n_hi, lk = rows.lk, lq = rows.lq;
  const int kvh = head / a.group;

  float o_acc[kPanels][32];
#pragma unroll
  for (int p = 0; p < kPanels; ++p)
#pragma unroll
    for (int e = 0; e < 32; ++e) o_acc[p][e] = 0.0f;

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
    auto load_kv = [&](int slot, int nb) {
      load_rows(sKV + 2 * slot * kTileElems + ld_soff, k_src, k_rs, nb);
      load_rows(sKV + (2 * slot + 1) * kTileElems + ld_soff, v_src, v_rs, nb);
    };
    // Q tile (rows past the sequence are zeros).
    {
      const int q_soff = panel_offset(BM, ld_row, ld_chunk);
#pragma unroll
      for (int k = 0; k < BM / kRowStep; ++k) {
        const int m = m0 + ld_row + k * kRowStep;
        const bool in = m < lq;
        const int64_t off = a.q_addr.at(b, rows.q_start, in ? m : 0, head) + ld_chunk * 8;
        cp_async_16(sQ + q_soff + k * kRowStep * 64, a.q + off, in ? 16 : 0);
      }
    }
    load_kv(0, n_hi - 1);
    cp_async_commit();

    auto slot_k = [&](int slot) -> uint32_t { return sKV_u32 + uint32_t(2 * slot * kTileElems * 2); };
    // S = Q K^T and O += P V for the tile in `slot` (issued, not waited for).
    auto issue_s = [&](float (&s)[BN / 2], int slot) {
      issue_qk<D, BM, BN, kBf16>(s, sQ_u32 + wg * (64 * 128), slot_k(slot));
    };
    auto issue_pv = [&](const uint32_t (&pa)[BN / 16][4], int slot) {
      sm90::issue_pv<BN, kPanels, kBf16>(o_acc, pa, slot_k(slot) + uint32_t(kTileElems * 2));
    };

    // Per tile: S -> softmax -> P V, each product waited for before the next step.
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
      rows.softmax(s, nb, corr);
      Rows::rescale_o(o_acc, corr);
      uint32_t pa[BN / 16][4];
      Rows::template pack_p<Elem>(s, pa);
      wg_fence();
      issue_pv(pa, slot);
      wg_wait<0>();
#pragma unroll
      for (int p = 0; p < kPanels; ++p) fence_regs(o_acc[p]);
      slot ^= 1;
    }
  }
  rows.template epilogue<Elem, kPanels>(o_acc);
#else
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)
    printf("flashport: the Hopper forward kernel needs sm_90a\n");
  __trap();
#endif
}

}  // namespace sm90

// ---- v3 tensor maps (host) ----------------------------------------------------------------------

namespace {

using TensorMapEncoder = PFN_cuTensorMapEncodeTiled_v12000;

// The driver's encoder through the runtime (no -lcuda link); null when the driver lacks it.
TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder fn = []() -> TensorMapEncoder {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<TensorMapEncoder>(f);
  }();
  return fn;
}

// A (col, row, head, batch) view of 16-bit elements with the given element strides, read in
// boxes of 64 columns x box_rows rows, 128B-swizzled. Strides of extent-1 dimensions are never
// used; they get a harmless value (the encoder wants multiples of 16 bytes).
std::string encode_rows_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows, int64_t heads,
                            int64_t batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                            int box_rows) {
  const TensorMapEncoder enc = tensor_map_encoder();
  if (enc == nullptr) return "hopper path v3: the driver has no cuTensorMapEncodeTiled";
  const int64_t span = std::max({row_stride * rows, head_stride * heads, int64_t(8)});
  auto stride_bytes = [&](int64_t stride, int64_t extent) {
    return cuuint64_t((extent <= 1 || stride <= 0 ? span : stride) * 2);
  };
  const cuuint64_t dims[4] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {stride_bytes(row_stride, rows), stride_bytes(head_stride, heads),
                                 stride_bytes(batch_stride, batch)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box,
                         elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return "hopper path v3: tensor map rejected the layout (error " + std::to_string(int(r)) + ")";
  return std::string();
}

// q, k, v maps of a call (q is the caller's: the check declines rotary). Packed (varlen) tensors
// are one batch of all their rows; batched ones index the batch as the 4th coordinate.
std::string make_v3_maps(const Problem& p, HopperV3Params* prm) {
  const fp_attn_params& raw = *p.raw;
  const int bn = HopperTileV3::block_n(int(p.d));
  const bool q_packed = p.q.packed;
  std::string why = encode_rows_map(&prm->tq, p.q_ptr, p.d, q_packed ? raw.q.shape[0] : p.seq.sq, p.hq,
                                    q_packed ? 1 : p.seq.batch, p.q.row_stride, p.q.head_stride,
                                    p.q.batch_stride, HopperTileV3::kBlockM);
  if (!why.empty()) return why;
  const bool kv_packed = p.seq.kv_layout == KvLayout::Packed;
  const int64_t kv_rows = kv_packed ? raw.k.shape[0] : p.seq.sk;
  const int64_t kv_batch = kv_packed ? 1 : raw.k.shape[0];
  // Packed: (row s0, head s2); batched: (batch s0, row s1, head s2).
  why = encode_rows_map(&prm->tk, p.k_ptr, p.d, kv_rows, p.hkv, kv_batch, kv_packed ? p.k.s0 : p.k.s1, p.k.s2,
                        kv_packed ? 0 : p.k.s0, bn);
  if (!why.empty()) return why;
  return encode_rows_map(&prm->tv, p.v_ptr, p.dv, kv_rows, p.hkv, kv_batch, kv_packed ? p.v.s0 : p.v.s1, p.v.s2,
                         kv_packed ? 0 : p.v.s0, bn);
}

// Multiprocessors of a device (host attribute, cached).
int sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return 1;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n > 0) return n;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) {
    cudaGetLastError();
    return 1;
  }
  cache[device].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace

std::string hopper_v3_maps_reason(const Problem& p, int splits) {
  const int64_t tiles =
      (p.seq.sq + HopperTileV3::kBlockM - 1) / HopperTileV3::kBlockM * p.hq * p.seq.batch * std::max(splits, 1);
  if (tiles > int64_t(INT32_MAX)) return "hopper path v3: more than 2^31 work tiles";
  HopperV3Params prm;
  return make_v3_maps(p, &prm);
}

template <int D, bool kBf16, int kSched>
KernelInfo hopper_fwd_kernel_info(int device) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  if constexpr (kSched == 3)
    return cached_kernel_info<sm90::fwd_hopper_v3_kernel<D, Elem>>(device, HopperTileV3::kThreads,
                                                                  HopperTileV3::smem_bytes(D));
  else
    return cached_kernel_info<sm90::fwd_hopper_kernel<D, Elem>>(device, HopperTile::kThreads, HopperTile::smem_bytes(D));
}

template <int D, bool kBf16, int kSched>
gpuError_t launch_hopper_fwd(const Problem& p, const FwdArgs& a, dim3 grid, gpuStream_t stream) {
  using Elem = std::conditional_t<kBf16, BFloat16, Half>;
  if constexpr (kSched == 3) {
    HopperV3Params prm;
    prm.a = a;
    prm.pingpong = hopper_pingpong() ? 1 : 0;
    if (!make_v3_maps(p, &prm).empty()) return cudaErrorInvalidValue;  // the check encoded the same maps
    prm.m_blocks = int32_t(grid.x);
    // Split-KV: a.splits work tiles per (query block, head, sequence); the check bounds the count.
    prm.work_tiles = int32_t(int64_t(grid.x) * grid.y * grid.z * std::max(a.splits, 1));
    int blocks = prm.work_tiles;
    if (hopper_persistent()) blocks = std::min(blocks, sm_count(p.device_index));
    sm90::fwd_hopper_v3_kernel<D, Elem><<<unsigned(blocks), HopperTileV3::kThreads, HopperTileV3::smem_bytes(D), stream>>>(prm);
  } else {
    (void)p;
    if (a.splits > 1) return cudaErrorInvalidValue;  // v1 has no split-KV (the check declines it)
    sm90::fwd_hopper_kernel<D, Elem><<<grid, HopperTile::kThreads, HopperTile::smem_bytes(D), stream>>>(a);
  }
  return gpuGetLastError();
}

#define FP_INSTANTIATE_HOPPER(D, bf16, sched)                        \
  template KernelInfo hopper_fwd_kernel_info<D, bf16, sched>(int); \
  template gpuError_t launch_hopper_fwd<D, bf16, sched>(const Problem&, const FwdArgs&, dim3, gpuStream_t);
#define FP_INSTANTIATE_HOPPER_D(D)                                           \
  FP_INSTANTIATE_HOPPER(D, false, 1) FP_INSTANTIATE_HOPPER(D, true, 1)       \
  FP_INSTANTIATE_HOPPER(D, false, 3) FP_INSTANTIATE_HOPPER(D, true, 3)
FP_INSTANTIATE_HOPPER_D(64)
FP_INSTANTIATE_HOPPER_D(128)
FP_INSTANTIATE_HOPPER_D(256)

}  // namespace flashport::gpu
