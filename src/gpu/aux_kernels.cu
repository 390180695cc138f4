// Small kernels around the main loop: the split-KV combine (also the public merge op) and the
// KV-cache append with rotary (plus rotary of q into the workspace). Memory-bound, one warp per
// row; dtypes are runtime branches (one instance each, no template fan-out).
#include <cstdint>

#include "fwd_launch.hpp"
#include "tile_mma.hpp"

namespace flashport::gpu {

namespace {

__device__ __forceinline__ float load_f(const void* p, fp_dtype t, int64_t i) {
  switch (t) {
    case FP_F16: return __half2float(static_cast<const __half*>(p)[i]);
    case FP_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_f(void* p, fp_dtype t, int64_t i, float v) {
  switch (t) {
    case FP_F16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case FP_BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

constexpr int kMergeWarps = 4;
constexpr int kMergeChunk = 128;  // split weights staged per pass
constexpr int kMergeCols = 8;     // output columns per lane per pass (256 per warp)

// lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) * out_s; all -inf => out 0, lse -inf.
__global__ void __launch_bounds__(kMergeWarps * 32) merge_kernel(const __grid_constant__ MergeArgs a) {
  __shared__ float weights[kMergeWarps][kMergeChunk];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = int64_t(blockIdx.x) * kMergeWarps + warp;
  if (row >= a.batch * a.seqlen * a.heads) return;
  const int64_t h = row % a.heads;
  const int64_t s = (row / a.heads) % a.seqlen;
  const int64_t b = row / (a.heads * a.seqlen);
  int64_t out_row = s;  // row index inside out / lse (packed: cu_q[b] + s)
  if (a.cu_q != nullptr) {
    const int64_t lq = int64_t(a.cu_q[b + 1]) - a.cu_q[b];
    if (s >= lq) return;
    out_row = a.cu_q[b] + s;
  }
  const float* lp = a.lse_part + b * a.lse_part_stride[1] + h * a.lse_part_stride[2] +
                    s * a.lse_part_stride[3];
  float mx = -INFINITY;
  for (int64_t sp = lane; sp < a.splits; sp += 32) mx = fmaxf(mx, lp[sp * a.lse_part_stride[0]]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, shfl_xor(mx, o));
  float sum = 0.0f;
  if (mx != -INFINITY)
    for (int64_t sp = lane; sp < a.splits; sp += 32) sum += __expf(lp[sp * a.lse_part_stride[0]] - mx);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += shfl_xor(sum, o);
  const float lse = sum > 0.0f ? mx + __logf(sum) : -INFINITY;

  const int64_t pbase = b * a.part_stride[1] + s * a.part_stride[2] + h * a.part_stride[3];
  const int64_t obase = (a.out_packed ? out_row * a.out_stride[1]
                                      : b * a.out_stride[0] + s * a.out_stride[1]) +
                        h * a.out_stride[2];
  for (int64_t c0 = 0; c0 < a.dv; c0 += 32 * kMergeCols) {
    float acc[kMergeCols];
#pragma unroll
    for (int t = 0; t < kMergeCols; ++t) acc[t] = 0.0f;
    for (int64_t s0 = 0; s0 < a.splits; s0 += kMergeChunk) {
      __syncwarp();
      for (int t = lane; t < kMergeChunk; t += 32) {
        const int64_t sp = s0 + t;
        weights[warp][t] = (sp < a.splits && lse != -INFINITY)
                               ? __expf(lp[sp * a.lse_part_stride[0]] - lse) : 0.0f;
      }
      __syncwarp();
      const int64_t n = a.splits - s0 < kMergeChunk ? a.splits - s0 : kMergeChunk;
      for (int64_t t = 0; t < n; ++t) {
        const float w = weights[warp][t];
        if (w == 0.0f) continue;  // empty split: its partial may be anything
        const int64_t sb = pbase + (s0 + t) * a.part_stride[0];
#pragma unroll
        for (int k = 0; k < kMergeCols; ++k) {
          const int64_t col = c0 + k * 32 + lane;
          if (col < a.dv) acc[k] += w * load_f(a.part, a.part_dtype, sb + col * a.part_stride[4]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kMergeCols; ++k) {
      const int64_t col = c0 + k * 32 + lane;
      if (col < a.dv) store_f(a.out, a.out_dtype, obase + col * a.out_stride[3], acc[k]);
    }
  }
  if (a.lse != nullptr && lane == 0) {
    const int64_t li = a.lse_packed ? h * a.lse_stride[1] + out_row * a.lse_stride[2]
                                    : b * a.lse_stride[0] + h * a.lse_stride[1] + s * a.lse_stride[2];
    a.lse[li] = lse;
  }
}

// Element offset of cache row `pos` of sequence b, kv head h (page ids clamped into the pool).
__device__ __forceinline__ int64_t cache_row(const SeqInfo& seq, const KvAddr& ad, int64_t num_pages,
                                             int64_t b, int64_t pos, int64_t h) {
  if (ad.layout == KvLayout::Paged) {
    int64_t page = seq.block_table[b * seq.block_table_stride + pos / seq.page_size];
    page = page < 0 ? 0 : (num_pages > 0 && page >= num_pages ? num_pages - 1 : page);
    return page * ad.s0 + (pos % seq.page_size) * ad.s1 + h * ad.s2;
  }
  return ad.at(seq, b, pos, h);
}

// Rotates one row (x -> dst) at position `pos`; columns past rot_dim are copied.
template <typename Elem>
__device__ void rotate_row(const AppendArgs& a, const typename Elem::T* x, typename Elem::T* dst,
                           int dim, int64_t pos, int lane) {
  if (a.rot_dim > 0) {
    if (pos >= a.rot_rows) pos = a.rot_rows - 1;  // clamp, don't fault
    if (pos < 0) pos = 0;
    const int half = a.rot_dim / 2;
    for (int t = lane; t < half; t += 32) {
      const int i0 = a.interleaved ? 2 * t : t;
      const int i1 = a.interleaved ? 2 * t + 1 : t + half;
      const int64_t ci = pos * a.rot_stride + t;
      const float c = a.rot_f32 ? static_cast<const float*>(a.cos)[ci]
                                : Elem::to_float(static_cast<const typename Elem::T*>(a.cos)[ci]);
      const float sn = a.rot_f32 ? static_cast<const float*>(a.sin)[ci]
                                 : Elem::to_float(static_cast<const typename Elem::T*>(a.sin)[ci]);
      const float x0 = Elem::to_float(x[i0]), x1 = Elem::to_float(x[i1]);
      dst[i0] = Elem::from_float(x0 * c - x1 * sn);
      dst[i1] = Elem::from_float(x0 * sn + x1 * c);
    }
  }
  for (int t = a.rot_dim + lane; t < dim; t += 32) dst[t] = x[t];
}

// One warp per new row (b, j, kv head): rotary on k, then both written into the cache.
template <typename Elem>
__global__ void __launch_bounds__(128) append_kv_kernel(const __grid_constant__ AppendArgs a) {
  using T = typename Elem::T;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (row >= a.seq.batch * a.seq.snew * a.hkv) return;
  const int64_t h = row % a.hkv;
  const int64_t j = (row / a.hkv) % a.seq.snew;
  const int64_t b = row / (a.hkv * a.seq.snew);
  const int64_t pos = int64_t(a.seq.seqused_k[b]) + j;
  const int64_t cap = a.k_addr.layout == KvLayout::Paged ? a.seq.max_blocks * a.seq.page_size : a.seq.sk;
  if (pos < 0 || pos >= cap) return;  // out of the cache: clamp (skip), don't fault
  const T* kn = reinterpret_cast<const T*>(a.k_new) + a.k_new_addr.at(b, 0, j, h);
  const T* vn = reinterpret_cast<const T*>(a.v_new) + a.v_new_addr.at(b, 0, j, h);
  T* kd = reinterpret_cast<T*>(a.k) + cache_row(a.seq, a.k_addr, a.num_pages, b, pos, h);
  T* vd = reinterpret_cast<T*>(a.v) + cache_row(a.seq, a.v_addr, a.num_pages, b, pos, h);
  rotate_row<Elem>(a, kn, kd, a.d, pos, lane);
  for (int t = lane; t < a.dv; t += 32) vd[t] = vn[t];
}

// One warp per q row (b, i, head): rotated copy into the workspace.
template <typename Elem>
__global__ void __launch_bounds__(128) rotate_q_kernel(const __grid_constant__ AppendArgs a) {
  using T = typename Elem::T;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (row >= a.seq.batch * a.seq.sq * a.hq) return;
  const int64_t h = row % a.hq;
  const int64_t i = (row / a.hq) % a.seq.sq;
  const int64_t b = row / (a.hq * a.seq.sq);
  if (i >= a.seq.q_len(b)) return;
  const int64_t qs = a.seq.q_start(b);
  const int64_t pos = int64_t(a.seq.seqused_k[b]) + (a.q_pos_per_row ? i : 0);
  rotate_row<Elem>(a, reinterpret_cast<const T*>(a.q) + a.q_addr.at(b, qs, i, h),
                   reinterpret_cast<T*>(a.q_rot) + a.q_rot_addr.at(b, qs, i, h),
                   a.d, pos, lane);
}

template <typename Elem>
gpuError_t launch_append_t(const AppendArgs& a, gpuStream_t stream) {
  const int64_t kv_rows = a.seq.batch * a.seq.snew * a.hkv;
  if (kv_rows > 0) append_kv_kernel<Elem><<<unsigned((kv_rows + 3) / 4), 128, 0, stream>>>(a);
  if (a.q_rot != nullptr) {
    const int64_t q_rows = a.seq.batch * a.seq.sq * a.hq;
    if (q_rows > 0) rotate_q_kernel<Elem><<<unsigned((q_rows + 3) / 4), 128, 0, stream>>>(a);
  }
  return gpuGetLastError();
}

}  // namespace

gpuError_t launch_merge(const MergeArgs& a, gpuStream_t stream) {
  const int64_t rows = a.batch * a.seqlen * a.heads;
  if (rows <= 0) return gpuSuccess;
  merge_kernel<<<unsigned((rows + kMergeWarps - 1) / kMergeWarps), kMergeWarps * 32, 0, stream>>>(a);
  return gpuGetLastError();
}

gpuError_t launch_append(const AppendArgs& a, bool bf16, gpuStream_t stream) {
  return bf16 ? launch_append_t<BFloat16>(a, stream) : launch_append_t<Half>(a, stream);
}

}  // namespace flashport::gpu
