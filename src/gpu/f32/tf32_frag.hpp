// Fragment coordinates of mma.sync m16n8k8 with .tf32 operands (PTX ISA, "Matrix Fragments for
// mma.m16n8k8"), for lane `lane` of a warp (g = lane / 4, t = lane % 4), and the key order of the
// forward's P V product (P taken from the C fragments of S without a shared-memory round trip).
// Host and device: the fp32 kernels index their operands with these, and tests/gpu/f32_test.cpp
// checks them on the host against the PTX tables by emulating the products.
#pragma once

#if defined(__CUDACC__)
#define FP_TF32_HD __host__ __device__
#else
#define FP_TF32_HD
#endif

namespace flashport::gpu::f32 {

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
