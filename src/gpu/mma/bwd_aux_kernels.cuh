// The backward's memory-bound kernels around the main loop (bwd_launch.hpp): the preprocessing
// (D = rowsum(dout * out), LSE in log2 units, zeroed dq accumulator and semaphores), the dq
// conversion and the sink gradient. One warp per (row, head); the dtype is a runtime branch.
//
// One source for CUDA (bwd_aux.cu), HIP (amd/bwd_amd.hip) and tests/amd's CPU workgroup emulation
// (included after simt_emu.hpp): a warp is kWarpSize lanes (32 on NVIDIA, the target's wave size on
// AMD); the AMD definitions live in the inline namespace of gpu_target.hpp.
#pragma once
#include <cstdint>

#include "gpu/common/gpu_target.hpp"
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
  return {r / a.seq.sq, r % a.seq.sq};
}

__global__ void __launch_bounds__(kAuxWarps * kWarpSize) bwd_preprocess_kernel(const FP_GRID_CONSTANT BwdArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t gtid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t s = gtid; s < a.sema_count; s += int64_t(gridDim.x) * blockDim.x) a.ws_sema[s] = 0;
  const int64_t w = gtid >> kLaneBits;
  if (w >= a.total_rows * a.hq) return;
  const int64_t h = w / a.total_rows, r = w % a.total_rows;
  const RowRef rr = row_ref(a, r);
  const uint16_t* o = a.out + a.out_addr.at(rr.b, 0, rr.i, h);
  const uint16_t* g = a.dout + a.dout_addr.at(rr.b, 0, rr.i, h);
  float dot = 0.0f;
  for (int c = lane; c < a.dv; c += kWarpSize) dot += bits_to_float(o[c], a.bf16) * bits_to_float(g[c], a.bf16);
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) dot += shfl_xor(dot, off);
  float* acc = a.ws_dq + w * a.dacc;
  for (int c = lane; c < a.dacc; c += kWarpSize) acc[c] = 0.0f;
  if (lane == 0) {
    const float lse = a.lse[a.lse_addr.at(rr.b, 0, h, rr.i)];
    a.ws_dsum[w] = dot;
    // A row that saw nothing (lse = -inf) has P = 0: +inf makes exp2(s - lse2) zero.
    a.ws_lse2[w] = lse == -INFINITY ? INFINITY : lse * kLog2e;
  }
}

__global__ void __launch_bounds__(kAuxWarps * kWarpSize) bwd_convert_kernel(const FP_GRID_CONSTANT BwdArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> kLaneBits;
  if (w >= a.total_rows * a.hq) return;
  const int64_t h = w / a.total_rows, r = w % a.total_rows;
  if (a.seq.cu_q != nullptr && r >= a.seq.cu_q[a.seq.batch]) return;  // not a row of any sequence
  const RowRef rr = row_ref(a, r);
  uint16_t* dst = a.dq_ptr + a.dq_addr.at(rr.b, 0, rr.i, h);
  const float* acc = a.ws_dq + w * a.dacc;
  for (int c = lane; c < a.d; c += kWarpSize) dst[c] = float_to_bits(acc[c] * a.scale, a.bf16);
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

// Blocks of the preprocess and conversion launches: one warp per (row, head).
inline unsigned bwd_aux_blocks(const BwdArgs& a) {
  const int64_t warps = a.total_rows * a.hq;
  return static_cast<unsigned>(warps < 1 ? 1 : (warps + kAuxWarps - 1) / kAuxWarps);
}

}  // namespace

FP_TARGET_NS_END
}  // namespace flashport::gpu
