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

constexpr int kMergeWarps = 4;   // merge_bwd_kernel's block; the merge's for many rows
constexpr int kMergeVec = 4;     // output columns a lane (one 16-byte fp32 / 8-byte 16-bit access)
constexpr int kMergeBatch = 32;  // splits whose partials are in flight together
constexpr int kAppendWarps = 4;  // append / rotary-q block: kAppendWarps warps
constexpr int kAppendHeads = 4;  // heads an append / rotary-q thread moves (cos/sin read once for them)

// The bits of `from` as `to` (same size): register type punning without aliasing rules broken.
// `from` must be a register value, not a reference into global memory (the copy would then be
// split into element loads).
template <typename To, typename From>
__device__ __forceinline__ void bits_copy(To& to, const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bits_copy: sizes differ");
  __builtin_memcpy(&to, &from, sizeof(To));
}

__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Whether every row (b, s, h) of a merge tensor starts on a 4-element boundary with its 4 columns
// contiguous: strides (4 of them, the column stride last) and base in units of 4 elements.
FP_HD bool merge_rows_vec(const void* base, int elem_bytes, const int64_t* stride, int64_t dv) {
  return (reinterpret_cast<uintptr_t>(base) & uintptr_t(4 * elem_bytes - 1)) == 0 && stride[3] == 1 &&
         ((stride[0] | stride[1] | stride[2] | dv) & 3) == 0;
}

// 4 consecutive partial columns at p (col0 + j < dv): one vector access (kVec), else 4 scalar ones.
template <typename Part, bool kVec>
__device__ __forceinline__ void load4(const typename Part::T* p, int64_t col0, int64_t dv, int64_t col_stride,
                                      float (&f)[kMergeVec]) {
  using T = typename Part::T;
  if constexpr (kVec) {
    if constexpr (sizeof(T) == 4) {
      const float4 r = *reinterpret_cast<const float4*>(p);
      f[0] = r.x, f[1] = r.y, f[2] = r.z, f[3] = r.w;
    } else {
      T e[kMergeVec];
      const uint2 r = *reinterpret_cast<const uint2*>(p);  // one 8-byte load, then the bits
      bits_copy(e, r);
#pragma unroll
      for (int j = 0; j < kMergeVec; ++j) f[j] = Part::to_float(e[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kMergeVec; ++j) f[j] = col0 + j < dv ? Part::to_float(p[j * col_stride]) : 0.0f;
  }
}

// One warp per (row, kWarpSize * kMergeVec-column chunk), kMergeVec output columns a lane:
//   lse = log sum_s exp(lse_s); out = sum_s exp(lse_s - lse) * out_s; all -inf => out 0, lse -inf.
// The partials of kBatch splits are loaded before the row's lse is reduced, so a decode combine
// waits for about one round trip, not one per split batch (their lse partials are read again
// after the reduction, from L1, to keep registers for the partials). Rows of 4-column vectors
// (kVec: one 16-byte fp32 / 8-byte 16-bit load a split) batch kMergeBatch splits, others a
// quarter of that (4 scalar loads a split). Per element the fp32 operations and their order are
// those of the one-column-a-lane kernel this replaced (splits in order, the same lse reduction):
// bit-identical results.
template <typename Part, bool kVec>
__device__ __forceinline__ void merge_columns(const MergeArgs& a, int64_t pbase, const float* lp, int64_t col0,
                                              int lane, float (&acc)[kMergeVec], float& lse) {
  using T = typename Part::T;
  constexpr int kBatch = kVec ? kMergeBatch : kMergeBatch / 4;
  const T* part = static_cast<const T*>(a.part) + pbase + col0 * a.part_stride[4];
  const bool live = col0 < a.dv;
  float v[kBatch][kMergeVec];
  auto load_batch = [&](int64_t s0) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t sp = s0 + u;
      if (sp < a.splits && live) {
        load4<Part, kVec>(part + sp * a.part_stride[0], col0, a.dv, a.part_stride[4], v[u]);
      } else {
#pragma unroll
        for (int j = 0; j < kMergeVec; ++j) v[u][j] = 0.0f;
      }
    }
  };
  load_batch(0);
  float mx = -INFINITY;
  for (int64_t sp = lane; sp < a.splits; sp += kWarpSize) mx = fmaxf(mx, lp[sp * a.lse_part_stride[0]]);
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) mx = fmaxf(mx, shfl_xor(mx, o));
  float sum = 0.0f;
  if (mx != -INFINITY)
    for (int64_t sp = lane; sp < a.splits; sp += kWarpSize) sum += __expf(lp[sp * a.lse_part_stride[0]] - mx);
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) sum += shfl_xor(sum, o);
  lse = sum > 0.0f ? mx + __logf(sum) : -INFINITY;
#pragma unroll
  for (int j = 0; j < kMergeVec; ++j) acc[j] = 0.0f;
  if (lse == -INFINITY) return;
#pragma unroll 1
  for (int64_t s0 = 0; s0 < a.splits; s0 += kBatch) {
    if (s0 > 0) load_batch(s0);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {  // the lse partials: L1 hits by now
      const float l = s0 + u < a.splits ? lp[(s0 + u) * a.lse_part_stride[0]] : -INFINITY;
      const float w = l == -INFINITY ? 0.0f : __expf(l - lse);
#pragma unroll
      for (int j = 0; j < kMergeVec; ++j) acc[j] += w != 0.0f ? w * v[u][j] : 0.0f;  // an empty split's partial may be anything
    }
  }
}

template <typename Part>
__device__ __forceinline__ void merge_columns(const MergeArgs& a, int64_t pbase, const float* lp, int64_t col0,
                                              int lane, float (&acc)[kMergeVec], float& lse) {
  const bool vec = merge_rows_vec(a.part, int(sizeof(typename Part::T)), a.part_stride + 1, a.dv) &&
                   (a.part_stride[0] & 3) == 0;
  if (vec) merge_columns<Part, true>(a, pbase, lp, col0, lane, acc, lse);
  else merge_columns<Part, false>(a, pbase, lp, col0, lane, acc, lse);
}

// 16 bytes of elements <-> floats.
template <typename Elem>
__device__ __forceinline__ void unpack16(const uint4& u, float (&f)[16 / sizeof(typename Elem::T)]) {
  typename Elem::T e[16 / sizeof(typename Elem::T)];
  bits_copy(e, u);
#pragma unroll
  for (int i = 0; i < int(16 / sizeof(typename Elem::T)); ++i) f[i] = Elem::to_float(e[i]);
}
template <typename Elem>
__device__ __forceinline__ uint4 pack16(const float (&f)[16 / sizeof(typename Elem::T)]) {
  if constexpr (sizeof(typename Elem::T) == 2) {
    return make_uint4(Elem::pack(f[0], f[1]), Elem::pack(f[2], f[3]), Elem::pack(f[4], f[5]), Elem::pack(f[6], f[7]));
  } else {
    uint4 u;
    bits_copy(u, f);
    return u;
  }
}

// Vector stores of the merged columns. On NVIDIA as explicit st.global.v4 / v2: written as plain
// uint4 / uint2 stores here, the compiler splits them into 32-bit ones (it folds them with the
// scalar fallback below; measured in the PTX).
__device__ __forceinline__ void store_v4(void* p, uint4 v) {
#if defined(FP_VENDOR_NVIDIA) && defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#else
  *static_cast<uint4*>(p) = v;
#endif
}
__device__ __forceinline__ void store_v2(void* p, uint32_t x, uint32_t y) {
#if defined(FP_VENDOR_NVIDIA) && defined(__CUDA_ARCH__)
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(x), "r"(y) : "memory");
#else
  uint2* q = static_cast<uint2*>(p);
  q->x = x, q->y = y;
#endif
}

__device__ __forceinline__ void store4(const MergeArgs& a, int64_t obase, int64_t col0, const float (&f)[kMergeVec]) {
  const int eb = a.out_dtype == FP_F32 ? 4 : 2;
  if (merge_rows_vec(a.out, eb, a.out_stride, a.dv)) {
    switch (a.out_dtype) {
      case FP_F16:
        store_v2(static_cast<Half::T*>(a.out) + obase + col0, Half::pack(f[0], f[1]), Half::pack(f[2], f[3]));
        return;
      case FP_BF16:
        store_v2(static_cast<BFloat16::T*>(a.out) + obase + col0, BFloat16::pack(f[0], f[1]), BFloat16::pack(f[2], f[3]));
        return;
      default:
        store_v4(static_cast<float*>(a.out) + obase + col0, pack16<Float32>(f));
        return;
    }
  }
#pragma unroll
  for (int j = 0; j < kMergeVec; ++j)
    if (col0 + j < a.dv) store_f(a.out, a.out_dtype, obase + (col0 + j) * a.out_stride[3], f[j]);
}

__global__ void __launch_bounds__(kMergeWarps * kWarpSize) merge_kernel(const FP_GRID_CONSTANT MergeArgs a) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  constexpr int64_t kChunk = int64_t(kWarpSize) * kMergeVec;
  const int64_t chunks = (a.dv + kChunk - 1) / kChunk;
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / kWarpSize) + warp;
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
  const int64_t pbase = b * a.part_stride[1] + s * a.part_stride[2] + h * a.part_stride[3];
  const int64_t col0 = (chunk * kWarpSize + lane) * kMergeVec;
  float acc[kMergeVec], lse;
  switch (a.part_dtype) {
    case FP_F16: merge_columns<Half>(a, pbase, lp, col0, lane, acc, lse); break;
    case FP_BF16: merge_columns<BFloat16>(a, pbase, lp, col0, lane, acc, lse); break;
    default: merge_columns<Float32>(a, pbase, lp, col0, lane, acc, lse); break;
  }
  const int64_t obase = (a.out_packed ? out_row * a.out_stride[1]
                                      : b * a.out_stride[0] + s * a.out_stride[1]) +
                        h * a.out_stride[2];
  if (col0 < a.dv) store4(a, obase, col0, acc);
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

// ---- KV-cache append + rotary, rotary of q -----------------------------------------------------
// A row (one head of one token) is cut into units; a thread moves one unit of kAppendHeads heads
// of one token (heads g, g + G, ...: a warp's loads of one head slot cover consecutive rows), all
// their loads issued before any store, the unit's cos/sin read once for all of them. Vector rows
// (every row 16-byte aligned, dim and rotary pairs in whole 16-byte chunks) have units of 16
// bytes: a chunk past rot_dim, an interleaved chunk (its own pairs), or a half-split pair of
// chunks (e0.., e0 + rot_dim / 2..). Other rows: a unit is one pair or one element past rot_dim.
// Per element the rotation is x0 * c - x1 * s, x0 * s + x1 * c in fp32, as before.
struct RowUnits {
  bool vec = false;
  int rot_units = 0;  // units that rotate (first), then the copied ones
  int units = 0;
};

FP_HD RowUnits row_units(int dim, int rot_dim, bool interleaved, int elem_bytes, bool aligned) {
  const int per = 16 / elem_bytes, half = rot_dim / 2;
  RowUnits r;
  r.vec = aligned && dim % per == 0 && rot_dim % per == 0 && (interleaved || half % per == 0);
  r.rot_units = r.vec ? (interleaved ? rot_dim / per : half / per) : half;
  r.units = r.rot_units + (r.vec ? (dim - rot_dim) / per : dim - rot_dim);
  return r;
}

// The launch of one pre-pass kernel: tokens x head groups x units threads.
struct AuxShape {
  RowUnits x, y;  // append: k (rotated) and v (copied); rotary-q: q only (y empty)
  int64_t tokens = 0, seq = 0;  // tokens = batch x seq
  int heads = 0, groups = 0;    // groups = ceil(heads / kAppendHeads)
  FP_HD int64_t threads() const { return tokens * groups * (x.units + y.units); }
  // `rows` rows per sequence of `heads` heads each, over `batch` sequences.
  FP_HD void set_rows(int64_t batch, int64_t rows, int n_heads) {
    seq = rows;
    tokens = batch * rows;
    heads = n_heads;
    groups = (n_heads + kAppendHeads - 1) / kAppendHeads;
  }
};

FP_HD AuxShape append_kv_shape(const AppendArgs& a, int elem_bytes) {
  AuxShape s;
  s.x = row_units(a.d, a.rot_dim, a.interleaved, elem_bytes,
                  rows_aligned16(a.k_new, elem_bytes, a.k_new_addr) && rows_aligned16(a.k, elem_bytes, a.k_addr));
  s.y = row_units(a.dv, 0, false, elem_bytes,
                  rows_aligned16(a.v_new, elem_bytes, a.v_new_addr) && rows_aligned16(a.v, elem_bytes, a.v_addr));
  s.set_rows(a.seq.batch, a.seq.snew, a.hkv);
  return s;
}

FP_HD AuxShape rotate_q_shape(const AppendArgs& a, int elem_bytes) {
  AuxShape s;
  if (a.q_rot == nullptr) return s;
  s.x = row_units(a.d, a.rot_dim, a.interleaved, elem_bytes,
                  rows_aligned16(a.q, elem_bytes, a.q_addr) && rows_aligned16(a.q_rot, elem_bytes, a.q_rot_addr));
  s.set_rows(a.seq.batch, a.seq.sq, a.hq);
  return s;
}

// Thread index -> (b, token row, head group, unit); 32-bit divisions when the launch fits.
struct AuxThread {
  int64_t b = 0, row = 0;
  int group = 0, unit = 0;
  bool valid = false;
};
__device__ __forceinline__ AuxThread aux_thread(const AuxShape& s, int64_t block) {
  AuxThread t;
  const int64_t i = block * blockDim.x + threadIdx.x;
  const int64_t total = s.threads();
  if (i >= total) return t;
  const int units = s.x.units + s.y.units;
  if (total <= INT32_MAX && s.seq <= INT32_MAX) {
    const uint32_t i32 = uint32_t(i), u = uint32_t(units), g = uint32_t(s.groups), sq = uint32_t(s.seq);
    const uint32_t r = i32 / u, tok = r / g;
    t.unit = int(i32 - r * u);
    t.group = int(r - tok * g);
    t.b = tok / sq;
    t.row = tok - uint32_t(t.b) * sq;
  } else {
    t.unit = int(i % units);
    const int64_t r = i / units, tok = r / s.groups;
    t.group = int(r % s.groups);
    t.b = tok / s.seq;
    t.row = tok % s.seq;
  }
  t.valid = true;
  return t;
}

// n cos/sin values of pairs p0.. at table row `pos` (fp32 or the elements' dtype), with the
// widest aligned accesses.
template <typename Tab, int n>
__device__ __forceinline__ void load_tab(const void* table, int64_t ci, float (&f)[n]) {
  using T = typename Tab::T;
  constexpr int kPer16 = int(16 / sizeof(T)), bytes = n * int(sizeof(T));
  const T* p = static_cast<const T*>(table) + ci;
  if constexpr (bytes % 16 == 0) {
    if (aligned_to(p, 16)) {
#pragma unroll
      for (int c = 0; c < bytes / 16; ++c) {
        T e[kPer16];
        const uint4 r = reinterpret_cast<const uint4*>(p)[c];
        bits_copy(e, r);
#pragma unroll
        for (int i = 0; i < kPer16; ++i) f[c * kPer16 + i] = Tab::to_float(e[i]);
      }
      return;
    }
  } else if constexpr (bytes == 8) {
    if (aligned_to(p, 8)) {
      T e[n];
      const uint2 r = *reinterpret_cast<const uint2*>(p);
      bits_copy(e, r);
#pragma unroll
      for (int i = 0; i < n; ++i) f[i] = Tab::to_float(e[i]);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < n; ++i) f[i] = Tab::to_float(p[i]);
}
template <typename Elem, int n>
__device__ __forceinline__ void rotary_cs(const AppendArgs& a, int64_t pos, int64_t p0, float (&c)[n], float (&s)[n]) {
  const int64_t ci = pos * a.rot_stride + p0;
  if (a.rot_f32) {
    load_tab<Float32, n>(a.cos, ci, c);
    load_tab<Float32, n>(a.sin, ci, s);
  } else {
    load_tab<Elem, n>(a.cos, ci, c);
    load_tab<Elem, n>(a.sin, ci, s);
  }
}

// Unit `u` of the rows src + h * src_hs -> dst + h * dst_hs of heads h = h0 + k * hstep < heads
// (k < kAppendHeads), rotary on the first rot_dim elements (0: a copy) at table row pos.
template <typename Elem>
__device__ __forceinline__ void move_unit(const AppendArgs& a, const RowUnits& ru, int rot_dim, int u,
                                          const typename Elem::T* src, int64_t src_hs, typename Elem::T* dst,
                                          int64_t dst_hs, int h0, int hstep, int heads, int64_t pos) {
  using T = typename Elem::T;
  constexpr int kPer = int(16 / sizeof(T));
  constexpr int kH = kAppendHeads;
  const int half = rot_dim / 2;
  bool on[kH];
  const T* s[kH];
  T* d[kH];
#pragma unroll
  for (int k = 0; k < kH; ++k) {
    const int h = h0 + k * hstep;
    on[k] = h < heads;
    s[k] = src + int64_t(h) * src_hs;
    d[k] = dst + int64_t(h) * dst_hs;
  }
  if (ru.vec) {
    if (u >= ru.rot_units) {  // a chunk past rot_dim: copied
      const int c = rot_dim / kPer + (u - ru.rot_units);
      uint4 x[kH];
#pragma unroll
      for (int k = 0; k < kH; ++k)
        if (on[k]) x[k] = reinterpret_cast<const uint4*>(s[k])[c];
#pragma unroll
      for (int k = 0; k < kH; ++k)
        if (on[k]) reinterpret_cast<uint4*>(d[k])[c] = x[k];
    } else if (a.interleaved) {  // chunk u: pairs (2i, 2i + 1) of pair index u * kPer / 2 + i
      constexpr int kPairs = kPer / 2;
      float cs[kPairs], sn[kPairs];
      rotary_cs<Elem, kPairs>(a, pos, int64_t(u) * kPairs, cs, sn);
      uint4 x[kH];
#pragma unroll
      for (int k = 0; k < kH; ++k)
        if (on[k]) x[k] = reinterpret_cast<const uint4*>(s[k])[u];
#pragma unroll
      for (int k = 0; k < kH; ++k) {
        if (!on[k]) continue;
        float v[kPer], o[kPer];
        unpack16<Elem>(x[k], v);
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          o[2 * i] = v[2 * i] * cs[i] - v[2 * i + 1] * sn[i];
          o[2 * i + 1] = v[2 * i] * sn[i] + v[2 * i + 1] * cs[i];
        }
        reinterpret_cast<uint4*>(d[k])[u] = pack16<Elem>(o);
      }
    } else {  // chunks u and u + half / kPer: pairs (e0 + i, e0 + half + i), pair index e0 + i
      const int c1 = u + half / kPer;
      float cs[kPer], sn[kPer];
      rotary_cs<Elem, kPer>(a, pos, int64_t(u) * kPer, cs, sn);
      uint4 x0[kH], x1[kH];
#pragma unroll
      for (int k = 0; k < kH; ++k)
        if (on[k]) x0[k] = reinterpret_cast<const uint4*>(s[k])[u], x1[k] = reinterpret_cast<const uint4*>(s[k])[c1];
#pragma unroll
      for (int k = 0; k < kH; ++k) {
        if (!on[k]) continue;
        float v0[kPer], v1[kPer], o0[kPer], o1[kPer];
        unpack16<Elem>(x0[k], v0);
        unpack16<Elem>(x1[k], v1);
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          o0[i] = v0[i] * cs[i] - v1[i] * sn[i];
          o1[i] = v0[i] * sn[i] + v1[i] * cs[i];
        }
        reinterpret_cast<uint4*>(d[k])[u] = pack16<Elem>(o0);
        reinterpret_cast<uint4*>(d[k])[c1] = pack16<Elem>(o1);
      }
    }
    return;
  }
  if (u >= ru.rot_units) {  // element rot_dim + (u - rot_units): copied
    const int e = rot_dim + (u - ru.rot_units);
    T x[kH];
#pragma unroll
    for (int k = 0; k < kH; ++k)
      if (on[k]) x[k] = s[k][e];
#pragma unroll
    for (int k = 0; k < kH; ++k)
      if (on[k]) d[k][e] = x[k];
    return;
  }
  // pair u: (2u, 2u + 1) interleaved, (u, u + half) half-split
  const int i0 = a.interleaved ? 2 * u : u, i1 = a.interleaved ? 2 * u + 1 : u + half;
  float c[1], sn[1];
  rotary_cs<Elem, 1>(a, pos, u, c, sn);
  T x0[kH], x1[kH];
#pragma unroll
  for (int k = 0; k < kH; ++k)
    if (on[k]) x0[k] = s[k][i0], x1[k] = s[k][i1];
#pragma unroll
  for (int k = 0; k < kH; ++k) {
    if (!on[k]) continue;
    const float f0 = Elem::to_float(x0[k]), f1 = Elem::to_float(x1[k]);
    d[k][i0] = Elem::from_float(f0 * c[0] - f1 * sn[0]);
    d[k][i1] = Elem::from_float(f0 * sn[0] + f1 * c[0]);
  }
}

__device__ __forceinline__ int64_t clamp_table_row(const AppendArgs& a, int64_t pos) {
  if (pos >= a.rot_rows) pos = a.rot_rows - 1;  // clamp, don't fault
  return pos < 0 ? 0 : pos;
}

// The appended rows: thread (token (b, j), head group, unit of k's then v's units) of block
// `block` of the append's blocks (shape sh: append_kv_shape); k rotated at its cache row, both
// written into the cache.
template <typename Elem>
__device__ __forceinline__ void append_kv_rows(const AppendArgs& a, const AuxShape& sh, int64_t block) {
  using T = typename Elem::T;
  const AuxThread t = aux_thread(sh, block);
  if (!t.valid) return;
  const int64_t b = t.b, j = t.row;
  const int64_t pos = int64_t(a.seq.seqused_k[b]) + j;
  const int64_t cap = a.k_addr.layout == KvLayout::Paged ? a.seq.max_blocks * a.seq.page_size : a.seq.sk;
  if (pos < 0 || pos >= cap) return;  // out of the cache: clamp (skip), don't fault
  if (t.unit < sh.x.units) {
    const T* kn = reinterpret_cast<const T*>(a.k_new) + a.k_new_addr.at(b, 0, j, 0);
    T* kd = reinterpret_cast<T*>(a.k) + kv_row_offset(a.seq, a.k_addr, a.num_pages, b, pos, 0);
    move_unit<Elem>(a, sh.x, a.rot_dim, t.unit, kn, a.k_new_addr.head_stride, kd, a.k_addr.s2, t.group,
                    sh.groups, sh.heads, a.rot_dim > 0 ? clamp_table_row(a, pos) : 0);
  } else {
    const T* vn = reinterpret_cast<const T*>(a.v_new) + a.v_new_addr.at(b, 0, j, 0);
    T* vd = reinterpret_cast<T*>(a.v) + kv_row_offset(a.seq, a.v_addr, a.num_pages, b, pos, 0);
    move_unit<Elem>(a, sh.y, 0, t.unit - sh.x.units, vn, a.v_new_addr.head_stride, vd, a.v_addr.s2,
                    t.group, sh.groups, sh.heads, 0);
  }
}

// The rotated copy of q in the workspace: thread (q row (b, i), head group, unit) of block `block`
// of the rotation's blocks (shape sh: rotate_q_shape).
template <typename Elem>
__device__ __forceinline__ void rotate_q_rows(const AppendArgs& a, const AuxShape& sh, int64_t block) {
  using T = typename Elem::T;
  const AuxThread t = aux_thread(sh, block);
  if (!t.valid) return;
  const int64_t b = t.b, i = t.row;
  if (i >= a.seq.q_len(b)) return;
  const int64_t qs = a.seq.q_start(b);
  // Rotary positions are cache rows (a left pad does not move them), as flash_attn.
  const int64_t pos = clamp_table_row(a, int64_t(a.seq.seqused_k[b]) + (a.q_pos_per_row ? i : 0));
  move_unit<Elem>(a, sh.x, a.rot_dim, t.unit, reinterpret_cast<const T*>(a.q) + a.q_addr.at(b, qs, i, 0),
                  a.q_addr.head_stride, reinterpret_cast<T*>(a.q_rot) + a.q_rot_addr.at(b, qs, i, 0),
                  a.q_rot_addr.head_stride, t.group, sh.groups, sh.heads, pos);
}

// Blocks of `threads` threads over a shape's threads.
FP_HD int64_t aux_blocks(const AuxShape& s, int64_t threads) { return (s.threads() + threads - 1) / threads; }

// The KV-cache pre-pass in one launch: blocks [0, append blocks) append k_new / v_new, the rest
// write the rotated q, so the two overlap instead of the rotation waiting for the append's tail
// (as two launches on one stream: 9.0 + 11.8 us on an H200 for 16 + 32 MB, B2 x 1024 rows, Hq/Hkv
// 32/8, D128, rotary dim 64).
template <typename Elem>
__global__ void __launch_bounds__(kAppendWarps * kWarpSize) append_rotate_kernel(const FP_GRID_CONSTANT AppendArgs a) {
  constexpr int kElemBytes = int(sizeof(typename Elem::T));
  const AuxShape kv = append_kv_shape(a, kElemBytes);
  const int64_t kv_blocks = aux_blocks(kv, blockDim.x);
  if (int64_t(blockIdx.x) < kv_blocks) append_kv_rows<Elem>(a, kv, blockIdx.x);
  else rotate_q_rows<Elem>(a, rotate_q_shape(a, kElemBytes), int64_t(blockIdx.x) - kv_blocks);
}

// Launch shapes, read by the launches below and by tests/amd (which runs every workgroup of them):
// warps of `wave` lanes.
struct AuxLaunch {
  unsigned blocks = 0, threads = 0;
};
// The merge: kMergeWarps warps a block, one a block for few rows (a decode combine: its 32 rows
// on 32 SMs, not 8).
inline AuxLaunch merge_launch(const MergeArgs& a, int wave) {
  const int64_t chunk = int64_t(wave) * kMergeVec;
  const int64_t items = a.batch * a.seqlen * a.heads * ((a.dv + chunk - 1) / chunk);
  const int64_t warps = items >= 2048 ? kMergeWarps : 1;
  return {unsigned((items + warps - 1) / warps), unsigned(warps * wave)};
}
inline int64_t merge_bwd_items(const MergeBwdArgs& a) {
  return a.fwd.batch * a.fwd.seqlen * a.fwd.heads * a.fwd.splits;
}
// The KV-cache pre-pass (append_rotate_kernel): kAppendWarps warps a block, the append's blocks
// then the rotation's.
inline AuxLaunch append_rotate_launch(const AppendArgs& a, int elem_bytes, int wave) {
  const int64_t threads = int64_t(kAppendWarps) * wave;
  return {unsigned(aux_blocks(append_kv_shape(a, elem_bytes), threads) + aux_blocks(rotate_q_shape(a, elem_bytes), threads)),
          unsigned(threads)};
}


#if !defined(FP_AMD_EMULATION)
template <typename Elem>
gpuError_t launch_append_t(const AppendArgs& a, int wave, gpuStream_t stream) {
  const AuxLaunch l = append_rotate_launch(a, int(sizeof(typename Elem::T)), wave);
  if (l.blocks > 0) append_rotate_kernel<Elem><<<l.blocks, l.threads, 0, stream>>>(a);
  return gpuGetLastError();
}

gpuError_t launch_merge_w(const MergeArgs& a, int wave, gpuStream_t stream) {
  const AuxLaunch l = merge_launch(a, wave);
  if (l.blocks == 0) return gpuSuccess;
  merge_kernel<<<l.blocks, l.threads, 0, stream>>>(a);
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
