// Interface between the CPU backend's baseline-compiled code (cpu_backend.cpp, cpu_rows.cpp) and
// its per-ISA kernel files (cpu_kernels_<isa>.cpp, each the same cpu_kernels.inc compiled with
// different target flags).
//
// ODR rule for the ISA files: they must not instantiate or out-of-line any function with external
// linkage that baseline code could also use (std:: containers, header inline helpers), because the
// linker may keep the AVX-512 copy for everyone. So kernels only read plain struct fields and call
// the non-inline helpers declared below; everything they define lives in an anonymous namespace.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/problem.hpp"

namespace flashport::cpu {

// Tile sizes shared by the planner and every kernel. Block rows are (query position, group head)
// pairs, position-major, so one K/V block serves the whole GQA group. The forward walks 128 keys
// per step (halves the per-step O rescale and accumulator traffic of P.V; the last visible block
// is trimmed to the rows' visible keys so causal diagonals do not pay for it). Decode takes at
// most 64, fewer where the prefetched next block would not fit half the L2
// (cpu_info.hpp decode_block_keys), and the backward 64 (its causal diagonal blocks are not
// trimmed, and 128 measured no faster).
constexpr int kBlockQ = 64;
constexpr int kBlockK = 128;  // forward, and the size of the forward's tiles (decode's too)
constexpr int kBlockKBwd = 64;

struct SeqGeom {
  int64_t lq = 0, lk = 0;  // queries / keys of this sequence
  int64_t q_start = 0;     // first packed row (0 for batched q)
  int64_t shift = 0;       // i + shift is the key aligned with row i
};

struct FwdTask {
  int64_t b, hk, chunk, split;  // chunk: a run of row blocks of one (batch, kv head)
};
struct FwdCall {
  const Problem* p = nullptr;
  int num_splits = 1;
  int num_chunks = 1;        // row chunks per (batch, kv head)
  bool decode = false;       // tasks are (batch, split) and walk all kv heads at once
  int block_k = kBlockK;     // keys per step: kBlockK, or decode_block_keys() when decode
  float qscale = 1.0f;       // folded into Q: softmax_scale (/ softcap when softcap is on)
  float* part_out = nullptr; // splits > 1: [split][total_q_rows][hq][dv], normalised partial out
  float* part_lse = nullptr; // splits > 1: [split][total_q_rows][hq], without the sink
};

struct BwdTask {
  int64_t b, hk, chunk;
};
struct BwdCall {
  const BwdProblem* p = nullptr;
  float qscale = 1.0f;
  int num_chunks = 1;          // row chunks per (b, kv head); > 1 => dk/dv partials below
  int64_t lk_max = 0;
  float* dk_part = nullptr;    // [(b*hkv + hk)*chunks + c][lk_max][d]
  float* dv_part = nullptr;    // [(b*hkv + hk)*chunks + c][lk_max][dv]
  float* dsink_part = nullptr; // [(b*hkv + hk)*chunks + c][group]
};

struct KernelTable {
  const char* isa;
  int vec_width;  // floats per SIMD vector
  void (*fwd)(const FwdCall&, const FwdTask&);
  void (*bwd)(const BwdCall&, const BwdTask&);
};

const KernelTable& kernels_portable();
#if defined(__x86_64__) || defined(_M_X64)
#define FLASHPORT_CPU_X86 1
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();
const KernelTable& kernels_avx512bf16();
#endif

// ---- Helpers for the kernels (cpu_rows.cpp, baseline ISA, never inline) ------------------------
SeqGeom seq_geom(const Problem& p, int64_t b);
// Element offset of key row j (within sequence b) of kv head h in a k-like tensor.
int64_t kv_row_offset(const Problem& p, const KvAddr& a, int64_t b, int64_t j, int64_t h);
// Row stride when rows j0 .. j0+n-1 are evenly spaced in memory, else 0.
int64_t kv_block_stride(const Problem& p, const KvAddr& a, int64_t b, int64_t j0, int64_t n);
// Element offset of row i of head h in a q-like tensor.
int64_t q_row_offset(const RowAddr& a, const SeqGeom& g, int64_t b, int64_t i, int64_t h);
// Global row index into split partials: b*sq + i (batched) or q_start + i (packed).
int64_t q_global_row(const Problem& p, const SeqGeom& g, int64_t b, int64_t i);
int64_t lse_offset(const LseAddr& a, const SeqGeom& g, int64_t b, int64_t h, int64_t i);
// Rotary on the first rotary_dim elements of a row at position pos (clamped to the table).
void rotate_row(const Problem& p, int64_t pos, float* x);
// Query row as fp32, with rotary applied (append-then-attend) and rounded to q's dtype.
void load_q_row(const Problem& p, const SeqGeom& g, int64_t b, int64_t i, int64_t h, float* dst);
void load_row(fp_dtype t, const void* base, int64_t off, int64_t n, float* dst);
// dst[off + c] = src[c] * mul, rounded to t.
void store_row(fp_dtype t, void* base, int64_t off, int64_t n, const float* src, float mul);
// Thread-local, 64-byte aligned scratch; slot buffers are independent and grow as needed.
float* scratch(int slot, size_t nfloats);

}  // namespace flashport::cpu
