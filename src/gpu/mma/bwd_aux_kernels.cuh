// The backward's memory-bound kernels around the main loop (bwd_launch.hpp): the preprocessing
// (D = rowsum(dout * out), LSE in log2 units, zeroed dq accumulator and semaphores), the dq
// conversion and the sink gradient. A group of lanes per (row, head) (aux_group); the dtype is a
// runtime branch.
//
// One source for CUDA (bwd_aux.cu), HIP (amd/bwd_amd.hip) and tests/amd's CPU workgroup emulation
// (included after simt_emu.hpp): a warp is kWarpSize lanes (32 on NVIDIA, the target's wave size on
// AMD); the AMD definitions live in the inline namespace of gpu_target.hpp.
#pragma once
#include <cstdint>

#include "gpu/common/gpu_target.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/tile_layer.hpp"
#include "gpu/mma/bwd_launch.hpp"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

namespace {

constexpr int kAuxWarps = 8;
constexpr int kLaneBits = kWarpSize == 64 ? 6 : 5;  // warp of a global thread index: >> kLaneBits
static_assert((1 << kLaneBits) == kWarpSize, "warp size is 32 or 64");

#if defined(FP_TARGET_NVIDIA)
__device__ __forceinline__ float bits_to_float(uint16_t v, bool bf16) {
  return bf16 ? __uint_as_float(uint32_t(v) << 16) : __half2float(__ushort_as_half(v));
}
__device__ __forceinline__ uint16_t float_to_bits(float v, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}
#else
__device__ __forceinline__ float bits_to_float(uint16_t v, bool bf16) {
  return bf16 ? BFloat16::bits_to_float(v) : Half::bits_to_float(v);
}
__device__ __forceinline__ uint16_t float_to_bits(float v, bool bf16) {
  return static_cast<uint16_t>(bf16 ? BFloat16::bits(v) : Half::bits(v));
}
#endif

// Workspace row r (of total_rows) of head h -> (b, i) addressing arguments: batched rows are
// b * Sq + i; packed rows are addressed directly (b = 0, sequence start 0, row r).
struct RowRef {
  int64_t b, i;
};
__device__ __forceinline__ RowRef row_ref(const BwdArgs& a, int64_t r) {
  if (a.seq.cu_q != nullptr) return {0, r};
  if (a.total_rows <= int64_t(UINT32_MAX)) {  // 32-bit division where it fits (every real call)
    const uint32_t b = uint32_t(r) / uint32_t(a.seq.sq);
    return {int64_t(b), r - int64_t(b) * a.seq.sq};
  }
  return {r / a.seq.sq, r % a.seq.sq};
}

// The preprocessing and the conversion give each (row, head) a group of aux_group(a) lanes, one
// per 8 columns (16 bytes of 16-bit data, 32 of fp32), so a warp moves whole 16-byte vectors per
// lane instead of one 2-byte element (measured on an H200 at D64: 187 / 122 us for the old warp
// per row, against 72 / 57 us for cuDNN's). A block holds the rows [rb * rows, + rows) of one
// head: block x = head * blocks_per_head + rb, so a thread finds its head and row with one 32-bit
// division. Rows and tensors that are not 16-byte aligned take the same lanes element by element.
constexpr int kAuxThreads = kAuxWarps * kWarpSize;
FP_HD int aux_group(const BwdArgs& a) {
  const int cols = a.d > a.dv ? a.d : a.dv;
  int g = 1;
  while (g * 8 < cols && g < kWarpSize) g *= 2;  // <= 32 lanes: D <= 256
  return g;
}
FP_HD int64_t aux_blocks_per_head(const BwdArgs& a) {
  const int64_t rows = kAuxThreads / aux_group(a);
  return (a.total_rows + rows - 1) / rows;
}

struct AuxItem {
  int64_t h, r;  // head, workspace row
  int sub, group;  // lane in the row's group, group size
  bool valid;
};
__device__ __forceinline__ AuxItem aux_item(const BwdArgs& a) {
  AuxItem it;
  it.group = aux_group(a);
  const uint32_t per_head = uint32_t(aux_blocks_per_head(a));
  const uint32_t h = blockIdx.x / per_head, rb = blockIdx.x - h * per_head;
  it.h = h;
  it.sub = int(threadIdx.x) & (it.group - 1);
  it.r = int64_t(rb) * (kAuxThreads / it.group) + int64_t(threadIdx.x) / it.group;
  it.valid = it.r < a.total_rows;
  return it;
}

// Lanes of a 16-bit tensor's row can use 16-byte accesses: every row 16-byte aligned and the
// column count a multiple of 8 elements.
__device__ __forceinline__ bool rows_vec16(const void* base, const RowAddr& addr, int cols) {
  return rows_aligned16(base, 2, addr) && cols % 8 == 0;
}

// 16-byte vectors (alignas: one 128-bit access, not four 32-bit ones).
struct alignas(16) Vec16 {
  uint32_t w[4];
};
struct alignas(16) Float4 {
  float v[4];
};
__device__ __forceinline__ float lo_half(uint32_t v, bool bf16) { return bits_to_float(uint16_t(v & 0xffffu), bf16); }
__device__ __forceinline__ float hi_half(uint32_t v, bool bf16) { return bits_to_float(uint16_t(v >> 16), bf16); }

__global__ void __launch_bounds__(kAuxThreads) bwd_preprocess_kernel(const FP_GRID_CONSTANT BwdArgs a) {
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t s = gtid; s < a.sema_count; s += int64_t(gridDim.x) * blockDim.x) a.ws_sema[s] = 0;
  const AuxItem it = aux_item(a);
  // Every lane of a group takes part in the shuffles below, rows past the end included.
  float dot = 0.0f;
  const RowRef rr = it.valid ? row_ref(a, it.r) : RowRef{0, 0};
  if (it.valid) {
    const uint16_t* o = a.out + a.out_addr.at(rr.b, 0, rr.i, it.h);
    const uint16_t* g = a.dout + a.dout_addr.at(rr.b, 0, rr.i, it.h);
    if (rows_vec16(a.out, a.out_addr, a.dv) && rows_vec16(a.dout, a.dout_addr, a.dv)) {
      for (int c = it.sub * 8; c < a.dv; c += it.group * 8) {
        const Vec16 ov = *reinterpret_cast<const Vec16*>(o + c);
        const Vec16 gv = *reinterpret_cast<const Vec16*>(g + c);
#pragma unroll
        for (int k = 0; k < 4; ++k)
          dot += lo_half(ov.w[k], a.bf16) * lo_half(gv.w[k], a.bf16) + hi_half(ov.w[k], a.bf16) * hi_half(gv.w[k], a.bf16);
      }
    } else {
      for (int c = it.sub; c < a.dv; c += it.group) dot += bits_to_float(o[c], a.bf16) * bits_to_float(g[c], a.bf16);
    }
  }
  for (int off = it.group / 2; off > 0; off >>= 1) dot += shfl_xor(dot, off);
  if (!it.valid) return;
  const int64_t w = it.h * a.total_rows + it.r;
  float* acc = a.ws_dq + w * a.dacc;  // dacc: a multiple of 8 floats
  if ((reinterpret_cast<uintptr_t>(a.ws_dq) & 15u) == 0) {
    for (int c = it.sub * 8; c < a.dacc; c += it.group * 8) {
      Vec16* dst = reinterpret_cast<Vec16*>(acc + c);  // all-zero bits: +0.0f
      dst[0] = Vec16{{0u, 0u, 0u, 0u}};
      dst[1] = Vec16{{0u, 0u, 0u, 0u}};
    }
  } else {
    for (int c = it.sub; c < a.dacc; c += it.group) acc[c] = 0.0f;
  }
  if (it.sub == 0) {
    const float lse = a.lse[a.lse_addr.at(rr.b, 0, it.h, rr.i)];
    a.ws_dsum[w] = dot;
    // A row that saw nothing (lse = -inf) has P = 0: +inf makes exp2(s - lse2) zero.
    a.ws_lse2[w] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

__global__ void __launch_bounds__(kAuxThreads) bwd_convert_kernel(const FP_GRID_CONSTANT BwdArgs a) {
  const AuxItem it = aux_item(a);
  if (!it.valid) return;
  if (a.seq.cu_q != nullptr && it.r >= a.seq.cu_q[a.seq.batch]) return;  // not a row of any sequence
  const RowRef rr = row_ref(a, it.r);
  uint16_t* dst = a.dq_ptr + a.dq_addr.at(rr.b, 0, rr.i, it.h);
  const float* acc = a.ws_dq + (it.h * a.total_rows + it.r) * a.dacc;
  if (rows_vec16(a.dq_ptr, a.dq_addr, a.d) && (reinterpret_cast<uintptr_t>(a.ws_dq) & 15u) == 0) {
    for (int c = it.sub * 8; c < a.d; c += it.group * 8) {
      const Float4 x = reinterpret_cast<const Float4*>(acc + c)[0], y = reinterpret_cast<const Float4*>(acc + c)[1];
      Vec16 out;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        out.w[k] = uint32_t(float_to_bits(x.v[2 * k] * a.scale, a.bf16)) |
                   (uint32_t(float_to_bits(x.v[2 * k + 1] * a.scale, a.bf16)) << 16);
        out.w[k + 2] = uint32_t(float_to_bits(y.v[2 * k] * a.scale, a.bf16)) |
                       (uint32_t(float_to_bits(y.v[2 * k + 1] * a.scale, a.bf16)) << 16);
      }
      *reinterpret_cast<Vec16*>(dst + c) = out;
    }
  } else {
    for (int c = it.sub; c < a.d; c += it.group) dst[c] = float_to_bits(acc[c] * a.scale, a.bf16);
  }
}

// d_sinks[h] = -sum over rows of exp(sink_h - lse_i) * D_i, one block per head, fixed order.
constexpr int kSinkThreads = 256;
__global__ void __launch_bounds__(kSinkThreads) bwd_sink_kernel(const FP_GRID_CONSTANT BwdArgs a) {
  __shared__ double part[kSinkThreads];
  const int h = blockIdx.x;
  int64_t rows = a.total_rows;
  if (a.seq.cu_q != nullptr) {
    const int64_t used = a.seq.cu_q[a.seq.batch];
    rows = used < rows ? (used < 0 ? 0 : used) : rows;
  }
  const float sink2 = a.rules.sinks[h] * kLog2e;
  double acc = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kSinkThreads) {
    const int64_t w = int64_t(h) * a.total_rows + r;
    const float l2 = a.ws_lse2[w];
    if (l2 != INFINITY) acc -= double(exp2f(sink2 - l2)) * double(a.ws_dsum[w]);
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kSinkThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < unsigned(s)) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) a.d_sinks[h] = static_cast<float>(part[0]);
}

// Blocks of the preprocess and conversion launches (kAuxThreads each): every head's rows in
// groups of aux_group lanes.
inline unsigned bwd_aux_blocks(const BwdArgs& a) {
  const int64_t blocks = int64_t(a.hq) * aux_blocks_per_head(a);
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

}  // namespace

FP_TARGET_NS_END
}  // namespace flashport::gpu
