// Scalar conversions for the storage types (host code; GPU code uses the vendor types).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashport/flashport.h"

namespace flashport {

inline size_t dtype_size(fp_dtype t) {
  switch (t) {
    case FP_F16: case FP_BF16: return 2;
    case FP_F32: case FP_I32: return 4;
    case FP_F64: return 8;
  }
  return 0;
}

inline const char* dtype_name(fp_dtype t) {
  switch (t) {
    case FP_F16: return "float16";
    case FP_BF16: return "bfloat16";
    case FP_F32: return "float32";
    case FP_F64: return "float64";
    case FP_I32: return "int32";
  }
  return "?";
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((m & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7F800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, with overflow to inf and gradual underflow.
inline uint16_t float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    float a;
    std::memcpy(&a, &abs, 4);
    const float scaled = a * 16777216.0f;  // a / 2^-24, exact
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));
    return static_cast<uint16_t>(sign | m);
  }
  const uint32_t e = (abs >> 23) - 112;
  uint32_t m = abs & 0x7FFFFFu;
  uint32_t h = (e << 10) | (m >> 13);
  const uint32_t rest = m & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Load/store one element of any floating storage type as double / float.
inline double load_as_double(const void* base, fp_dtype t, int64_t idx) {
  switch (t) {
    case FP_F16: return half_to_float(static_cast<const uint16_t*>(base)[idx]);
    case FP_BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[idx]);
    case FP_F32: return static_cast<const float*>(base)[idx];
    case FP_F64: return static_cast<const double*>(base)[idx];
    case FP_I32: return static_cast<const int32_t*>(base)[idx];
  }
  return 0.0;
}

inline void store_from_double(void* base, fp_dtype t, int64_t idx, double v) {
  switch (t) {
    case FP_F16: static_cast<uint16_t*>(base)[idx] = float_to_half(static_cast<float>(v)); break;
    case FP_BF16: static_cast<uint16_t*>(base)[idx] = float_to_bf16(static_cast<float>(v)); break;
    case FP_F32: static_cast<float*>(base)[idx] = static_cast<float>(v); break;
    case FP_F64: static_cast<double*>(base)[idx] = v; break;
    case FP_I32: static_cast<int32_t*>(base)[idx] = static_cast<int32_t>(v); break;
  }
}

}  // namespace flashport
