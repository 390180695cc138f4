// The load layer: small device helpers shared by the forward (every vendor) and the NVIDIA
// backward main loops, on the tile-MMA layer of the target being compiled (tile_mma.hpp on NVIDIA,
// tile_mma_amd.hpp on AMD: its cp_async_* are plain copies there).
#pragma once
#include <cstdint>

#include "gpu/common/gpu_target.hpp"
#include "gpu/common/tile_layer.hpp"

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

// One 16-byte chunk (8 elements from column c*8) of a row into a swizzled shared tile. Rows past
// the end (src == nullptr) and columns past `limit` are zeros; unaligned tensors take the scalar
// path.
__device__ __forceinline__ void load_chunk(uint16_t* dst, const uint16_t* src_row, int c,
                                           int limit, bool vec_ok) {
  const int col = c * 8;
  if (src_row != nullptr && vec_ok && col + 8 <= limit) {
    cp_async_16(dst, src_row + col, 16);
    return;
  }
  uint16_t e[8];
#pragma unroll
  for (int t = 0; t < 8; ++t) e[t] = (src_row != nullptr && col + t < limit) ? src_row[col + t] : 0;
  uint4 w;
  w.x = e[0] | (uint32_t(e[1]) << 16);
  w.y = e[2] | (uint32_t(e[3]) << 16);
  w.z = e[4] | (uint32_t(e[5]) << 16);
  w.w = e[6] | (uint32_t(e[7]) << 16);
  *reinterpret_cast<uint4*>(dst) = w;
}

// A finished row's softmax state (max mx and sum l, log2 units) with the attention sink (a logit,
// log2 units) joining the denominator: updates mx and l, returns the factor the row's
// unnormalised O is scaled by. Every forward epilogue (mma.sync, fp32, Hopper) folds it this way.
__device__ __forceinline__ float fold_sink(float sink_log2, float& mx, float& l) {
  const float m_f = fmaxf(mx, sink_log2);
  const float o_scale = fast_exp2(mx - m_f);
  l = l * o_scale + fast_exp2(sink_log2 - m_f);
  mx = m_f;
  return o_scale;
}

FP_TARGET_NS_END
}  // namespace flashport::gpu
