// Conversions from foreign tensor descriptions (DLPack from nanobind, XLA FFI buffers) to the
// C API's fp_tensor view. Nothing here knows about torch or jax.
#pragma once
#include <cstdint>
#include <string>

#include "flashport/flashport.h"

namespace flashport_py {

// DLPack dtype (code, bits) -> fp_dtype; false when flashport has no such dtype.
inline bool dlpack_dtype_to_fp(uint8_t code, uint8_t bits, fp_dtype* out) {
  constexpr uint8_t kInt = 0, kFloat = 2, kBfloat = 4;
  if (code == kFloat && bits == 16) *out = FP_F16;
  else if (code == kBfloat && bits == 16) *out = FP_BF16;
  else if (code == kFloat && bits == 32) *out = FP_F32;
  else if (code == kFloat && bits == 64) *out = FP_F64;
  else if (code == kInt && bits == 32) *out = FP_I32;
  else return false;
  return true;
}

// DLPack device type -> fp_device_type (kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLROCM = 10).
inline bool dlpack_device_to_fp(int32_t dev, fp_device_type* out) {
  if (dev == 1 || dev == 3) *out = FP_DEVICE_CPU;
  else if (dev == 2) *out = FP_DEVICE_CUDA;
  else if (dev == 10) *out = FP_DEVICE_HIP;
  else return false;
  return true;
}

}  // namespace flashport_py
