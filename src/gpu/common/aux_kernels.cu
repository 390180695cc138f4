// Small kernels around the main loop: the split-KV combine (also the public merge op) and the
// KV-cache append with rotary (plus rotary of q into the workspace). Memory-bound, one warp per
// row; dtypes are runtime branches (one instance each, no template fan-out).
//
// One source for CUDA and HIP (and tests/amd's CPU workgroup emulation, which includes this file
// after simt_emu.hpp): a warp is kWarpSize lanes (vendor.hpp: 32 on NVIDIA, the target's wave
// size on AMD), element types are the tile layer's Half/BFloat16. The HIP build compiles this
// file for every AMD target (hip.cmake); its launches take the device's wave size (the host pass
// has no single one). The AMD definitions live in the inline namespace of gpu_target.hpp.
#include <cstdint>

#include "gpu/mma/fwd_launch.hpp"
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/tile_layer.hpp"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

namespace {

// fp32 partials read through the same interface as the 16-bit storage types.
struct Float32 {
  using T = float;
  __device__ __forceinline__ static float to_float(T v) { return v; }
  __device__ __forceinline__ static T from_float(float v) { return v; }
};

__device__ __forceinline__ void store_f(void* p, fp_dtype t, int64_t i, float v) {
  switch (t) {
    case FP_F16: static_cast<Half::T*>(p)[i] = Half::from_float(v); break;
    case FP_BF16: static_cast<BFloat16::T*>(p)[i] = BFloat16::from_float(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

constexpr int kMergeWarps = 4;
constexpr int kMergeUnroll = 8;  // splits whose loads are in flight together
constexpr int kAppendWarps = 4;

// One warp per (row, kWarpSize-column chunk), one output column per lane:
//   lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) * out_s; all -inf => out 0, lse -inf.
// Loads of kMergeUnroll splits are issued before any is used (latency-bound for few rows).
template <typename Part>
__device__ __forceinline__ float merge_column(const MergeArgs& a, const typename Part::T* part, int64_t pbase,
                                              const float* lp, float lse, int64_t col) {
  float acc = 0.0f;
  if (lse == -INFINITY) return acc;
  for (int64_t s0 = 0; s0 < a.splits; s0 += kMergeUnroll) {
    float v[kMergeUnroll], l[kMergeUnroll];
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int64_t sp = s0 + u;
      const bool ok = sp < a.splits;
      l[u] = ok ? lp[sp * a.lse_part_stride[0]] : -INFINITY;
      v[u] = ok && col < a.dv ? Part::to_float(part[pbase + sp * a.part_stride[0] + col * a.part_stride[4]]) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const float w = l[u] == -INFINITY ? 0.0f : __expf(l[u] - lse);
      acc += w != 0.0f ? w * v[u] : 0.0f;  // an empty split's partial may be anything
    }
  }
  return acc;
}

__global__ void __launch_bounds__(kMergeWarps * kWarpSize) merge_kernel(const FP_GRID_CONSTANT MergeArgs a) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t chunks = (a.dv + kWarpSize - 1) / kWarpSize;
  const int64_t item = int64_t(blockIdx.x) * kMergeWarps + warp;
  if (item >= a.batch * a.seqlen * a.heads * chunks) return;
  const int64_t row = item / chunks, chunk = item % chunks;
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
  for (int64_t sp = lane; sp < a.splits; sp += kWarpSize) mx = fmaxf(mx, lp[sp * a.lse_part_stride[0]]);
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) mx = fmaxf(mx, shfl_xor(mx, o));
  float sum = 0.0f;
  if (mx != -INFINITY)
    for (int64_t sp = lane; sp < a.splits; sp += kWarpSize) sum += __expf(lp[sp * a.lse_part_stride[0]] - mx);
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) sum += shfl_xor(sum, o);
  const float lse = sum > 0.0f ? mx + __logf(sum) : -INFINITY;

  const int64_t pbase = b * a.part_stride[1] + s * a.part_stride[2] + h * a.part_stride[3];
  const int64_t col = chunk * kWarpSize + lane;
  float acc;
  switch (a.part_dtype) {
    case FP_F16: acc = merge_column<Half>(a, static_cast<const Half::T*>(a.part), pbase, lp, lse, col); break;
    case FP_BF16: acc = merge_column<BFloat16>(a, static_cast<const BFloat16::T*>(a.part), pbase, lp, lse, col); break;
    default: acc = merge_column<Float32>(a, static_cast<const float*>(a.part), pbase, lp, lse, col); break;
  }
  const int64_t obase = (a.out_packed ? out_row * a.out_stride[1]
                                      : b * a.out_stride[0] + s * a.out_stride[1]) +
                        h * a.out_stride[2];
  if (col < a.dv) store_f(a.out, a.out_dtype, obase + col * a.out_stride[3], acc);
  if (a.lse != nullptr && lane == 0 && chunk == 0) {
    const int64_t li = a.lse_packed ? h * a.lse_stride[1] + out_row * a.lse_stride[2]
                                    : b * a.lse_stride[0] + h * a.lse_stride[1] + s * a.lse_stride[2];
    a.lse[li] = lse;
  }
}

__device__ __forceinline__ float load_any(const void* p, fp_dtype t, int64_t i) {
  switch (t) {
    case FP_F16: return Half::to_float(static_cast<const Half::T*>(p)[i]);
    case FP_BF16: return BFloat16::to_float(static_cast<const BFloat16::T*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// One warp per (row, split); lanes over the columns.
__global__ void __launch_bounds__(kMergeWarps * kWarpSize) merge_bwd_kernel(const FP_GRID_CONSTANT MergeBwdArgs g) {
  const MergeArgs& a = g.fwd;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t item = int64_t(blockIdx.x) * kMergeWarps + warp;
  if (item >= a.batch * a.seqlen * a.heads * a.splits) return;
  const int64_t sp = item % a.splits, row = item / a.splits;
  const int64_t h = row % a.heads;
  const int64_t s = (row / a.heads) % a.seqlen;
  const int64_t b = row / (a.heads * a.seqlen);
  const float lse = a.lse[b * a.lse_stride[0] + h * a.lse_stride[1] + s * a.lse_stride[2]];
  const float li = a.lse_part[sp * a.lse_part_stride[0] + b * a.lse_part_stride[1] +
                              h * a.lse_part_stride[2] + s * a.lse_part_stride[3]];
  const float w = (li == -INFINITY || lse == -INFINITY) ? 0.0f : __expf(li - lse);
  const float dl = g.dlse ? g.dlse[b * g.dlse_stride[0] + h * g.dlse_stride[1] + s * g.dlse_stride[2]] : 0.0f;
  const int64_t obase = b * a.out_stride[0] + s * a.out_stride[1] + h * a.out_stride[2];
  const int64_t gbase = b * g.dout_stride[0] + s * g.dout_stride[1] + h * g.dout_stride[2];
  const int64_t pbase = sp * a.part_stride[0] + b * a.part_stride[1] + s * a.part_stride[2] + h * a.part_stride[3];
  const int64_t dpbase = sp * g.d_part_stride[0] + b * g.d_part_stride[1] + s * g.d_part_stride[2] +
                         h * g.d_part_stride[3];
  float dot = 0.0f;
  for (int64_t d = lane; d < a.dv; d += kWarpSize) {
    const float gd = load_any(g.dout, a.out_dtype, gbase + d * g.dout_stride[3]);
    if (w != 0.0f)
      dot += gd * (load_any(a.part, a.part_dtype, pbase + d * a.part_stride[4]) -
                   load_any(a.out, a.out_dtype, obase + d * a.out_stride[3]));
    store_f(g.d_part, a.part_dtype, dpbase + d * g.d_part_stride[4], w * gd);
  }
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) dot += shfl_xor(dot, o);
  if (lane == 0)
    g.d_lse_part[sp * g.d_lse_part_stride[0] + b * g.d_lse_part_stride[1] + h * g.d_lse_part_stride[2] +
                 s * g.d_lse_part_stride[3]] = w == 0.0f ? 0.0f : w * (dot + dl);
}

// cos / sin of pair t at table row `pos` (the table's dtype: fp32 or the elements').
template <typename Elem>
__device__ __forceinline__ void rotary_cs(const AppendArgs& a, int64_t pos, int t, float& c, float& sn) {
  const int64_t ci = pos * a.rot_stride + t;
  c = a.rot_f32 ? static_cast<const float*>(a.cos)[ci] : Elem::to_float(static_cast<const typename Elem::T*>(a.cos)[ci]);
  sn = a.rot_f32 ? static_cast<const float*>(a.sin)[ci] : Elem::to_float(static_cast<const typename Elem::T*>(a.sin)[ci]);
}

// 8 16-bit elements (one 16-byte chunk) <-> floats.
template <typename Elem>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const typename Elem::T* e = reinterpret_cast<const typename Elem::T*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = Elem::to_float(e[i]);
}
template <typename Elem>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(Elem::pack(f[0], f[1]), Elem::pack(f[2], f[3]), Elem::pack(f[4], f[5]), Elem::pack(f[6], f[7]));
}

// Rotates one row (x -> dst) at position `pos`; columns past rot_dim are copied. Rows whose
// pointers are 16-byte aligned, with dim a multiple of 8 and rotary pairs that never straddle a
// 16-byte chunk (rot_dim / 2 a multiple of 8, or interleaved pairs), move in 16-byte chunks, one
// a lane (the scalar path below moved 2 bytes a lane and ran the append + rotary pre-pass at a
// third of the memory bandwidth); the others element by element.
template <typename Elem>
__device__ void rotate_row(const AppendArgs& a, const typename Elem::T* x, typename Elem::T* dst,
                           int dim, int64_t pos, int lane) {
  if (pos >= a.rot_rows) pos = a.rot_rows - 1;  // clamp, don't fault
  if (pos < 0) pos = 0;
  const int half = a.rot_dim / 2;
  const bool chunked = (dim & 7) == 0 && (a.rot_dim & 7) == 0 && (a.interleaved || (half & 7) == 0) &&
                       ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
  if constexpr (sizeof(typename Elem::T) == 2) if (chunked) {
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    uint4* ds = reinterpret_cast<uint4*>(dst);
    for (int c = lane; c < dim / 8; c += kWarpSize) {
      const int e0 = 8 * c;
      if (e0 >= a.rot_dim) {
        ds[c] = xs[c];
      } else if (a.interleaved) {  // pairs (e0 + 2i, e0 + 2i + 1), pair index e0 / 2 + i
        float v[8], o[8];
        unpack8<Elem>(xs[c], v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float cs, sn;
          rotary_cs<Elem>(a, pos, e0 / 2 + i, cs, sn);
          o[2 * i] = v[2 * i] * cs - v[2 * i + 1] * sn;
          o[2 * i + 1] = v[2 * i] * sn + v[2 * i + 1] * cs;
        }
        ds[c] = pack8<Elem>(o);
      } else if (e0 < half) {  // pairs (e0 + i, e0 + half + i): this lane writes both chunks
        const int c1 = c + half / 8;
        float v0[8], v1[8], o0[8], o1[8];
        unpack8<Elem>(xs[c], v0);
        unpack8<Elem>(xs[c1], v1);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float cs, sn;
          rotary_cs<Elem>(a, pos, e0 + i, cs, sn);
          o0[i] = v0[i] * cs - v1[i] * sn;
          o1[i] = v0[i] * sn + v1[i] * cs;
        }
        ds[c] = pack8<Elem>(o0);
        ds[c1] = pack8<Elem>(o1);
      }
    }
    return;
  }
  if (a.rot_dim > 0) {
    for (int t = lane; t < half; t += kWarpSize) {
      const int i0 = a.interleaved ? 2 * t : t;
      const int i1 = a.interleaved ? 2 * t + 1 : t + half;
      float c, sn;
      rotary_cs<Elem>(a, pos, t, c, sn);
      const float x0 = Elem::to_float(x[i0]), x1 = Elem::to_float(x[i1]);
      dst[i0] = Elem::from_float(x0 * c - x1 * sn);
      dst[i1] = Elem::from_float(x0 * sn + x1 * c);
    }
  }
  // The columns past rot_dim; 16-bit elements two a lane when both rows allow 4-byte accesses.
  using T = typename Elem::T;
  const int rest = dim - a.rot_dim;
  const T* xs = x + a.rot_dim;
  T* ds = dst + a.rot_dim;
  if (sizeof(T) == 2 && (rest & 1) == 0 &&
      ((reinterpret_cast<uintptr_t>(xs) | reinterpret_cast<uintptr_t>(ds)) & 3) == 0) {
    for (int t = lane; t < rest / 2; t += kWarpSize)
      reinterpret_cast<uint32_t*>(ds)[t] = reinterpret_cast<const uint32_t*>(xs)[t];
  } else {
    for (int t = lane; t < rest; t += kWarpSize) ds[t] = xs[t];
  }
}

// Splits a flat row index into (outer, middle, inner) for extents (., mid, inner): 32-bit
// arithmetic when the rows fit (64-bit division costs a warp per row more than the row's copy).
__device__ __forceinline__ void split_row(int64_t row, int64_t rows, int64_t mid, int64_t inner, int64_t& o,
                                          int64_t& m, int64_t& n) {
  if (rows <= INT32_MAX && mid <= INT32_MAX && inner <= INT32_MAX) {
    const uint32_t r = uint32_t(row), in = uint32_t(inner), md = uint32_t(mid);
    const uint32_t om = r / in;
    n = r - om * in;
    o = om / md;
    m = om - uint32_t(o) * md;
    return;
  }
  n = row % inner;
  m = (row / inner) % mid;
  o = row / (inner * mid);
}

// One warp per new row (b, j, kv head): rotary on k, then both written into the cache.
template <typename Elem>
__global__ void __launch_bounds__(kAppendWarps * kWarpSize) append_kv_kernel(const FP_GRID_CONSTANT AppendArgs a) {
  using T = typename Elem::T;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t(blockIdx.x) * kAppendWarps + (threadIdx.x / kWarpSize);
  const int64_t rows = a.seq.batch * a.seq.snew * a.hkv;
  if (row >= rows) return;
  int64_t b, j, h;
  split_row(row, rows, a.seq.snew, a.hkv, b, j, h);
  const int64_t pos = int64_t(a.seq.seqused_k[b]) + j;
  const int64_t cap = a.k_addr.layout == KvLayout::Paged ? a.seq.max_blocks * a.seq.page_size : a.seq.sk;
  if (pos < 0 || pos >= cap) return;  // out of the cache: clamp (skip), don't fault
  const T* kn = reinterpret_cast<const T*>(a.k_new) + a.k_new_addr.at(b, 0, j, h);
  const T* vn = reinterpret_cast<const T*>(a.v_new) + a.v_new_addr.at(b, 0, j, h);
  T* kd = reinterpret_cast<T*>(a.k) + kv_row_offset(a.seq, a.k_addr, a.num_pages, b, pos, h);
  T* vd = reinterpret_cast<T*>(a.v) + kv_row_offset(a.seq, a.v_addr, a.num_pages, b, pos, h);
  rotate_row<Elem>(a, kn, kd, a.d, pos, lane);
  constexpr int kPerChunk = int(16 / sizeof(T));  // elements in 16 bytes
  if (a.dv % kPerChunk == 0 && ((reinterpret_cast<uintptr_t>(vn) | reinterpret_cast<uintptr_t>(vd)) & 15) == 0) {
    for (int c = lane; c < a.dv / kPerChunk; c += kWarpSize)
      reinterpret_cast<uint4*>(vd)[c] = reinterpret_cast<const uint4*>(vn)[c];
  } else {
    for (int t = lane; t < a.dv; t += kWarpSize) vd[t] = vn[t];
  }
}

// One warp per q row (b, i, head): rotated copy into the workspace.
template <typename Elem>
__global__ void __launch_bounds__(kAppendWarps * kWarpSize) rotate_q_kernel(const FP_GRID_CONSTANT AppendArgs a) {
  using T = typename Elem::T;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t(blockIdx.x) * kAppendWarps + (threadIdx.x / kWarpSize);
  const int64_t rows = a.seq.batch * a.seq.sq * a.hq;
  if (row >= rows) return;
  int64_t b, i, h;
  split_row(row, rows, a.seq.sq, a.hq, b, i, h);
  if (i >= a.seq.q_len(b)) return;
  const int64_t qs = a.seq.q_start(b);
  // Rotary positions are cache rows (a left pad does not move them), as flash_attn.
  const int64_t pos = int64_t(a.seq.seqused_k[b]) + (a.q_pos_per_row ? i : 0);
  rotate_row<Elem>(a, reinterpret_cast<const T*>(a.q) + a.q_addr.at(b, qs, i, h),
                   reinterpret_cast<T*>(a.q_rot) + a.q_rot_addr.at(b, qs, i, h),
                   a.d, pos, lane);
}

// Launch shapes, read by the launches below and by tests/amd (which runs every workgroup of them):
// warps of `wave` lanes, kMergeWarps / kAppendWarps warps a block.
inline int64_t merge_items(const MergeArgs& a, int wave) {
  return a.batch * a.seqlen * a.heads * ((a.dv + wave - 1) / wave);
}
inline int64_t merge_bwd_items(const MergeBwdArgs& a) {
  return a.fwd.batch * a.fwd.seqlen * a.fwd.heads * a.fwd.splits;
}
inline int64_t append_kv_rows(const AppendArgs& a) { return a.seq.batch * a.seq.snew * a.hkv; }
inline int64_t rotate_q_rows(const AppendArgs& a) { return a.q_rot != nullptr ? a.seq.batch * a.seq.sq * a.hq : 0; }

#if !defined(FP_AMD_EMULATION)
template <typename Elem>
gpuError_t launch_append_t(const AppendArgs& a, int wave, gpuStream_t stream) {
  const int64_t kv_rows = append_kv_rows(a), q_rows = rotate_q_rows(a);
  const unsigned threads = unsigned(kAppendWarps * wave);
  if (kv_rows > 0)
    append_kv_kernel<Elem><<<unsigned((kv_rows + kAppendWarps - 1) / kAppendWarps), threads, 0, stream>>>(a);
  if (q_rows > 0)
    rotate_q_kernel<Elem><<<unsigned((q_rows + kAppendWarps - 1) / kAppendWarps), threads, 0, stream>>>(a);
  return gpuGetLastError();
}

gpuError_t launch_merge_w(const MergeArgs& a, int wave, gpuStream_t stream) {
  const int64_t items = merge_items(a, wave);
  if (items <= 0) return gpuSuccess;
  merge_kernel<<<unsigned((items + kMergeWarps - 1) / kMergeWarps), unsigned(kMergeWarps * wave), 0, stream>>>(a);
  return gpuGetLastError();
}

gpuError_t launch_merge_bwd_w(const MergeBwdArgs& a, int wave, gpuStream_t stream) {
  const int64_t items = merge_bwd_items(a);
  if (items <= 0) return gpuSuccess;
  merge_bwd_kernel<<<unsigned((items + kMergeWarps - 1) / kMergeWarps), unsigned(kMergeWarps * wave), 0, stream>>>(a);
  return gpuGetLastError();
}
#endif  // !FP_AMD_EMULATION

}  // namespace

#if defined(FP_TARGET_NVIDIA)
gpuError_t launch_merge(const MergeArgs& a, gpuStream_t stream) { return launch_merge_w(a, kWarpSize, stream); }
gpuError_t launch_merge_bwd(const MergeBwdArgs& a, gpuStream_t stream) {
  return launch_merge_bwd_w(a, kWarpSize, stream);
}
gpuError_t launch_append(const AppendArgs& a, bool bf16, gpuStream_t stream) {
  return bf16 ? launch_append_t<BFloat16>(a, kWarpSize, stream) : launch_append_t<Half>(a, kWarpSize, stream);
}
gpuError_t launch_append_f32(const AppendArgs& a, gpuStream_t stream) {
  return launch_append_t<Float32>(a, kWarpSize, stream);
}
#elif !defined(FP_AMD_EMULATION)
// HIP: the device's wave size (the gate has checked it is the one these code objects were built for).
gpuError_t launch_merge_amd(const MergeArgs& a, int wave_size, gpuStream_t stream) {
  return launch_merge_w(a, wave_size, stream);
}
gpuError_t launch_merge_bwd_amd(const MergeBwdArgs& a, int wave_size, gpuStream_t stream) {
  return launch_merge_bwd_w(a, wave_size, stream);
}
gpuError_t launch_append_amd(const AppendArgs& a, bool bf16, int wave_size, gpuStream_t stream) {
  return bf16 ? launch_append_t<BFloat16>(a, wave_size, stream) : launch_append_t<Half>(a, wave_size, stream);
}
#endif

FP_TARGET_NS_END
}  // namespace flashport::gpu
