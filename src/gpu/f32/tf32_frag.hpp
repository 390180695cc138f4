// Fragment coordinates of mma.sync m16n8k8 with .tf32 operands (PTX ISA, "Matrix Fragments for
// mma.m16n8k8"), for lane `lane` of a warp (g = lane / 4, t = lane % 4), and the key order of the
// forward's P V product (P taken from the C fragments of S without a shared-memory round trip).
// Host and device: the fp32 kernels index their operands with these, and tests/gpu/f32_test.cpp
// checks them on the host against the PTX tables by emulating the products.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP_TF32_HD __host__ __device__
#else
#define FP_TF32_HD
#endif

namespace flashport::gpu::f32 {

// ---- the 3xTF32 split (tests/gpu/f32_test.cpp checks it on the host, CudaF32Split) ----
// An fp32 operand x is split into big = tf32(x) and small = tf32(x - big) (both rounded to nearest,
// ties away); a*b ~ small_a*big_b + big_a*small_b + big_a*big_b, accumulated in fp32, the small
// terms first. The dropped small*small term is below 2^-22 |a b|: with the step-wise accumulation
// of mma_3xtf32 (f32_common.cuh) the error is that of fp32 FMAs.
//
// Without cvt.rna.tf32.f32: that is no single instruction on sm_80/sm_90 (ptxas emits an inf/NaN
// test, an add of half a tf32 ulp to the bits and a select), and mma reads only the top 19 bits of
// a .tf32 operand (kTf32Bits; ptxas's own lowering hands it the unmasked sum). So an operand is x's
// bits + 0x1000, half a tf32 ulp: read as tf32 that is x rounded to nearest, ties away, carry into
// the exponent included: what cvt.rna gives, for every finite x. big: that integer add (a NaN x
// may wrap to a zero there; its rest is NaN, so the product stays NaN); the rest x - big is exact;
// small: the half ulp 2^(e - 11) of a rest in [2^e, 2^(e + 1)) added as a float (one FMA), which
// keeps a NaN rest NaN. 5 instructions per split instead of 7.
struct Tf32Split {
  uint32_t big, small;
};
inline constexpr uint32_t kTf32Bits = 0xffffe000u;  // the bits of a .tf32 operand an mma reads

FP_TF32_HD inline uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}
FP_TF32_HD inline float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

FP_TF32_HD inline Tf32Split split_tf32(float x) {
  Tf32Split r;
  r.big = bits_of(x) + 0x1000u;
  const float rest = x - float_of(r.big & kTf32Bits);
  const float half_ulp_scale = float_of(bits_of(rest) & 0xff800000u);  // sign and exponent: +-2^e
  r.small = bits_of(fmaf(half_ulp_scale, 0x1p-11f, rest));
  return r;
}

struct Tf32Frag {
  // A (16 x 8, row): element r < 4 at (a_row, a_col).
  static constexpr FP_TF32_HD int a_row(int lane, int r) { return lane / 4 + 8 * (r & 1); }
  static constexpr FP_TF32_HD int a_col(int lane, int r) { return lane % 4 + 4 * (r >> 1); }
  // B (8 x 8, col): element r < 2 at (k = b_k, n = b_n).
  static constexpr FP_TF32_HD int b_k(int lane, int r) { return lane % 4 + 4 * r; }
  static constexpr FP_TF32_HD int b_n(int lane) { return lane / 4; }
  // C/D (16 x 8): element r < 4 at (c_row, c_col).
  static constexpr FP_TF32_HD int c_row(int lane, int r) { return lane / 4 + 8 * (r >> 1); }
  static constexpr FP_TF32_HD int c_col(int lane, int r) { return 2 * (lane % 4) + (r & 1); }

  // P V over 8 keys with P from the C fragment of S: reduction index k stands for key pv_key(k)
  // (k = t, t + 4 -> keys 2t, 2t + 1), so A element r is C element pv_from_c(r) of the same lane
  // and B element r reads V row pv_key(b_k(lane, r)).
  static constexpr FP_TF32_HD int pv_key(int k) { return 2 * (k % 4) + k / 4; }
  static constexpr FP_TF32_HD int pv_from_c(int r) { return ((r & 1) << 1) | (r >> 1); }
};

}  // namespace flashport::gpu::f32
