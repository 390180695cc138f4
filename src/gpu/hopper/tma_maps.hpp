// Host side of the Hopper kernels' TMA loads: the driver's tensor-map encoder and the 128B-swizzled
// views both kernel families read (the forward's q/k/v and paged pools, the backward's q and dout).
// Included by fwd_hopper.cu and bwd_hopper.cu only (sm_90a object library).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "gpu/common/driver_entry.hpp"

namespace flashport::gpu {

using TensorMapEncoder = PFN_cuTensorMapEncodeTiled_v12000;

// The driver's encoder through the runtime (no -lcuda link); null when the driver lacks it.
inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder fn =
      reinterpret_cast<TensorMapEncoder>(driver_entry_point("cuTensorMapEncodeTiled", 12000));
  return fn;
}

// A tensor map of 16-bit elements, 128B-swizzled boxes (the panel layout wgmma reads), rank 4 or 5:
// dims innermost first, byte strides of dims 1.., box extents. `what` names the view in the error.
inline std::string encode_swizzled_map(CUtensorMap* map, const void* base, cuuint32_t rank, const cuuint64_t* dims,
                                       const cuuint64_t* strides, const cuuint32_t* box, const char* what) {
  const TensorMapEncoder enc = tensor_map_encoder();
  if (enc == nullptr) return "hopper path: the driver has no cuTensorMapEncodeTiled";
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, rank, const_cast<void*>(base), dims, strides, box,
                         elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return std::string("hopper path: tensor map rejected the ") + what + " (error " + std::to_string(int(r)) + ")";
  return std::string();
}

// A (col, row, head, batch) view of 16-bit elements with the given element strides, read in
// boxes of 64 columns x box_rows rows, 128B-swizzled (a box lands as one 64-column panel; columns
// and rows past the view are zero-filled). Strides of extent-1 dimensions are never used; they get
// a harmless value (the encoder wants multiples of 16 bytes).
inline std::string encode_rows_map(CUtensorMap* map, const void* base, int64_t cols, int64_t rows, int64_t heads,
                                   int64_t batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                                   int box_rows) {
  const int64_t span = std::max({row_stride * rows, head_stride * heads, int64_t(8)});
  auto stride_bytes = [&](int64_t stride, int64_t extent) {
    return cuuint64_t((extent <= 1 || stride <= 0 ? span : stride) * 2);
  };
  const cuuint64_t dims[4] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {stride_bytes(row_stride, rows), stride_bytes(head_stride, heads),
                                 stride_bytes(batch_stride, batch)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  return encode_swizzled_map(map, base, 4, dims, strides, box, "layout");
}

}  // namespace flashport::gpu
