// Addressing, conversion and rotary helpers the CPU kernels call (baseline ISA).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "core/dtype.hpp"
#include "core/rotary.hpp"
#include "cpu_kernels.hpp"

namespace flashport::cpu {

SeqGeom seq_geom(const Problem& p, int64_t b) {
  SeqGeom g;
  g.lq = p.seq.q_len(b);
  g.lk = p.seq.k_len(b);
  g.q_start = p.seq.q_start(b);
  g.shift = p.rules.shift(g.lq, g.lk);
  return g;
}

int64_t kv_row_offset(const Problem& p, const KvAddr& a, int64_t b, int64_t j, int64_t h) {
  return a.at(p.seq, b, j, h);
}

int64_t kv_block_stride(const Problem& p, const KvAddr& a, int64_t b, int64_t j0, int64_t n) {
  switch (a.layout) {
    case KvLayout::Packed:
      return a.s0;
    case KvLayout::Paged: {
      const int64_t page = p.seq.page_size;
      if ((p.seq.key_row(b, j0) % page) + n > page) return 0;  // crosses a page boundary
      return n == 1 ? 1 : a.s1;
    }
    default:
      return a.s1;
  }
}

int64_t q_row_offset(const RowAddr& a, const SeqGeom& g, int64_t b, int64_t i, int64_t h) {
  return a.at(b, g.q_start, i, h);
}

int64_t q_global_row(const Problem& p, const SeqGeom& g, int64_t b, int64_t i) {
  return p.seq.cu_q ? g.q_start + i : b * p.seq.sq + i;
}

int64_t lse_offset(const LseAddr& a, const SeqGeom& g, int64_t b, int64_t h, int64_t i) {
  return a.at(b, g.q_start, h, i);
}

void load_row(fp_dtype t, const void* base, int64_t off, int64_t n, float* dst) {
  switch (t) {
    case FP_F32:
      std::memcpy(dst, static_cast<const float*>(base) + off, n * sizeof(float));
      return;
    case FP_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int64_t c = 0; c < n; ++c) dst[c] = bf16_to_float(s[c]);
      return;
    }
    case FP_F16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int64_t c = 0; c < n; ++c) dst[c] = half_to_float(s[c]);
      return;
    }
    default:
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<float>(load_as_double(base, t, off + c));
  }
}

void store_row(fp_dtype t, void* base, int64_t off, int64_t n, const float* src, float mul) {
  switch (t) {
    case FP_F32: {
      float* d = static_cast<float*>(base) + off;
      for (int64_t c = 0; c < n; ++c) d[c] = src[c] * mul;
      return;
    }
    case FP_BF16: {
      uint16_t* d = static_cast<uint16_t*>(base) + off;
      for (int64_t c = 0; c < n; ++c) d[c] = float_to_bf16(src[c] * mul);
      return;
    }
    case FP_F16: {
      uint16_t* d = static_cast<uint16_t*>(base) + off;
      for (int64_t c = 0; c < n; ++c) d[c] = float_to_half(src[c] * mul);
      return;
    }
    default:
      for (int64_t c = 0; c < n; ++c) store_from_double(base, t, off + c, double(src[c]) * mul);
  }
}

static float round_to(fp_dtype t, float x) {
  switch (t) {
    case FP_BF16: return bf16_to_float(float_to_bf16(x));
    case FP_F16: return half_to_float(float_to_half(x));
    default: return x;
  }
}

void rotate_row(const Problem& p, int64_t pos, float* x) {
  apply_rotary(p, pos < p.rotary_rows ? pos : p.rotary_rows - 1, x);
}

void load_q_row(const Problem& p, const SeqGeom& g, int64_t b, int64_t i, int64_t h, float* dst) {
  load_row(p.dtype, p.q_ptr, p.q.at(b, g.q_start, i, h), p.d, dst);
  if (p.rotary_dim == 0) return;
  // The rotated q is a tensor of q's dtype in flash_attn, so round like it.
  rotate_row(p, q_rotary_pos(p, b, i), dst);
  for (int64_t t = 0; t < p.rotary_dim; ++t) dst[t] = round_to(p.dtype, dst[t]);
}

namespace {
struct AlignedFree {
  void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
struct ScratchSlot {
  std::unique_ptr<float[], AlignedFree> data;
  size_t size = 0;
};
constexpr int kScratchSlots = 32;
thread_local ScratchSlot t_scratch[kScratchSlots];
}  // namespace

float* scratch(int slot, size_t nfloats) {
  ScratchSlot& s = t_scratch[slot];
  if (nfloats == 0) nfloats = 1;
  if (s.size < nfloats) {
    // Round up so small growth steps do not reallocate every call; +16 floats of slack so a
    // full-vector access at the end of a padded row stays inside.
    const size_t want = (nfloats + 16 + 1023) & ~size_t(1023);
    s.data.reset(new (std::align_val_t(64)) float[want]);
    s.size = want - 16;
  }
  return s.data.get();
}

}  // namespace flashport::cpu
