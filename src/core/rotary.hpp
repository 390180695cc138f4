// The rotary-embedding rule of the host backends (the fp64 reference and the CPU backend): the
// table row a query row is rotated at and the rotation of one row. The GPU's copy of the rotation
// is device code (gpu/common/aux_kernels.cu, rotate_row).
#pragma once
#include <cstdint>

#include "core/dtype.hpp"
#include "core/problem.hpp"

namespace flashport {

// Table row at which query row i of sequence b is rotated (flash_attn: seqused_k[b] + i when
// causal or windowed, else seqused_k[b]; cache rows, so a left pad does not move it).
inline int64_t q_rotary_pos(const Problem& p, int64_t b, int64_t i) {
  const bool windowed = p.rules.window_left >= 0 || p.rules.window_right >= 0;
  return p.seq.cache_rows_used(b) + (windowed ? i : 0);
}

// Rotates the first rotary_dim entries of x by table row pos, in double: pairs (t, t + half), or
// (2t, 2t + 1) when interleaved.
template <typename T>
void apply_rotary(const Problem& p, int64_t pos, T* x) {
  const int64_t half = p.rotary_dim / 2;
  for (int64_t t = 0; t < half; ++t) {
    const double c = load_as_double(p.rotary_cos, p.rotary_dtype, pos * p.rotary_row_stride + t);
    const double s = load_as_double(p.rotary_sin, p.rotary_dtype, pos * p.rotary_row_stride + t);
    const int64_t i0 = p.rotary_interleaved ? 2 * t : t;
    const int64_t i1 = p.rotary_interleaved ? 2 * t + 1 : t + half;
    const double x0 = x[i0], x1 = x[i1];
    x[i0] = static_cast<T>(x0 * c - x1 * s);
    x[i1] = static_cast<T>(x0 * s + x1 * c);
  }
}

}  // namespace flashport
