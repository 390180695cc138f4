// The resolved form of a validated call: shapes, per-sequence lengths, element addressing and
// score rules, as one trivially copyable struct that host code and GPU kernels both read.
// validate.cpp is the only producer (resolve_fwd / resolve_bwd / resolve_merge).
#pragma once
#include <cmath>
#include <cstdint>

#include "flashport/flashport.h"
#include "hd.hpp"
#include "score_rules.hpp"

namespace flashport {

enum class KvLayout : int32_t { Batched = 0, Packed = 1, Paged = 2 };

// Per-sequence lengths and row starts. Reads the int32 index tensors, so on a GPU it is only
// called from device code (the pointers are device pointers there).
struct SeqInfo {
  int64_t batch = 0;
  int64_t sq = 0;            // batched: q.shape[1]; varlen: max_seqlen_q
  int64_t sk = 0;            // batched/cache: k.shape[1] (cache capacity); varlen: max_seqlen_k
  int64_t snew = 0;          // rows of k_new (0 = no append)
  const int32_t* cu_q = nullptr;       // [B+1] or null (batched q)
  const int32_t* cu_k = nullptr;       // [B+1] or null
  const int32_t* seqused_k = nullptr;  // [B] or null
  KvLayout kv_layout = KvLayout::Batched;
  const int32_t* block_table = nullptr;  // [B, max_blocks]
  int64_t block_table_stride = 0;        // elements between rows of block_table
  int64_t max_blocks = 0;
  int64_t page_size = 0;
  const int32_t* cache_batch_idx = nullptr;  // [B] or null
  const int32_t* cache_leftpad = nullptr;    // [B] or null: first valid cache row (needs seqused_k)

  FP_HD int64_t q_len(int64_t b) const { return cu_q ? int64_t(cu_q[b + 1]) - cu_q[b] : sq; }
  // First packed row of sequence b (0 for batched q).
  FP_HD int64_t q_start(int64_t b) const { return cu_q ? int64_t(cu_q[b]) : 0; }
  // Cache rows in use before the append, counted from cache row 0 (a left pad included): what
  // seqused_k says, the full length otherwise. Appended row j lands at this row + j, and rotary
  // positions count from it.
  FP_HD int64_t cache_rows_used(int64_t b) const {
    if (seqused_k) return seqused_k[b];
    if (cu_k) return int64_t(cu_k[b + 1]) - cu_k[b];
    if (kv_layout == KvLayout::Paged) return max_blocks * page_size;
    return sk;
  }
  // Left pad of sequence b: its keys start at this cache row. Clamped to [0, cache_rows_used] so
  // that a bad device-resident value cannot address outside the rows in use (host values are
  // validated).
  FP_HD int64_t k_pad(int64_t b) const {
    if (!cache_leftpad) return 0;
    const int64_t pad = cache_leftpad[b], used = cache_rows_used(b);
    return pad < 0 ? 0 : (pad > used ? used : pad);
  }
  // Keys of sequence b (Lk): the rows in use plus the appended ones, less the left pad.
  FP_HD int64_t k_len(int64_t b) const {
    return cache_rows_used(b) + (seqused_k ? snew : 0) - k_pad(b);
  }
  // Cache row of key j (a packed layout's row within the sequence).
  FP_HD int64_t key_row(int64_t b, int64_t j) const { return k_pad(b) + j; }
  FP_HD int64_t k_start(int64_t b) const { return cu_k ? int64_t(cu_k[b]) : 0; }
};

// Addressing of q-like tensors (q, out, dout, dq, k_new, v_new): element (b, row, head, 0).
struct RowAddr {
  int64_t batch_stride = 0;  // 0 when packed
  int64_t row_stride = 0;
  int64_t head_stride = 0;
  bool packed = false;       // rows are offset by cu_q[b] (q side) or cu_k[b] (k side)
  FP_HD int64_t at(int64_t b, int64_t seq_start, int64_t row, int64_t h) const {
    return packed ? (seq_start + row) * row_stride + h * head_stride
                  : b * batch_stride + row * row_stride + h * head_stride;
  }
};

// Addressing of k-like tensors (k, v, dk, dv): batched, packed or paged.
struct KvAddr {
  int64_t s0 = 0, s1 = 0, s2 = 0;  // the tensor's first three strides
  KvLayout layout = KvLayout::Batched;
  // Element (b, key j, head h, 0): key j is cache row seq.key_row(b, j) (past the left pad).
  FP_HD int64_t at(const SeqInfo& seq, int64_t b, int64_t j, int64_t h) const {
    return at_row(seq, b, seq.key_row(b, j), h);
  }
  // Element (b, cache row `row`, head h, 0), rows counted from the sequence's first cache row:
  // the path of writes that address absolute rows (append, rotary positions).
  FP_HD int64_t at_row(const SeqInfo& seq, int64_t b, int64_t row, int64_t h) const {
    switch (layout) {
      case KvLayout::Packed:
        return (seq.k_start(b) + row) * s0 + h * s2;
      case KvLayout::Paged: {
        const int64_t page = seq.block_table[b * seq.block_table_stride + row / seq.page_size];
        return page * s0 + (row % seq.page_size) * s1 + h * s2;
      }
      default: {
        const int64_t cache = seq.cache_batch_idx ? int64_t(seq.cache_batch_idx[b]) : b;
        return cache * s0 + row * s1 + h * s2;
      }
    }
  }
};

// LSE addressing: batched [B, Hq, Sq] or packed [Hq, Tq].
struct LseAddr {
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0;
  bool packed = false;
  FP_HD int64_t at(int64_t b, int64_t seq_start, int64_t h, int64_t row) const {
    return packed ? h * head_stride + (seq_start + row) * row_stride
                  : b * batch_stride + h * head_stride + row * row_stride;
  }
};

// A validated forward call.
struct Problem {
  const fp_attn_params* raw = nullptr;  // the caller's struct (host memory)
  fp_dtype dtype = FP_F32;              // of q, k, v, out
  fp_device_type device = FP_DEVICE_CPU;
  int32_t device_index = 0;
  // Data pointers (device pointers for GPU calls), copied from raw so kernels can take them.
  const void* q_ptr = nullptr;
  void* k_ptr = nullptr;        // written by append-then-attend
  void* v_ptr = nullptr;
  void* out_ptr = nullptr;
  void* lse_ptr = nullptr;      // null when no LSE is requested
  const void* k_new_ptr = nullptr;
  const void* v_new_ptr = nullptr;
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t hq = 0, hkv = 0, d = 0, dv = 0;
  int64_t group = 1;                    // hq / hkv
  SeqInfo seq;
  RowAddr q, out;
  KvAddr k, v;
  bool has_lse = false;
  fp_dtype lse_dtype = FP_F32;
  LseAddr lse;
  ScoreRules rules;
  // Append-then-attend
  RowAddr k_new, v_new;   // batched [B, Snew, Hkv, *]
  int64_t rotary_dim = 0; // 0 = no rotary
  bool rotary_interleaved = false;
  fp_dtype rotary_dtype = FP_F32;
  int64_t rotary_row_stride = 0;  // of cos and sin (same layout required)
  int64_t rotary_rows = 0;        // S_ro
  int32_t num_splits = 0;         // as requested
  // Useful totals
  int64_t total_q_rows = 0;       // B*Sq or Tq (upper bound of query rows)
};

// A validated fp_attn_probs call: the forward (lse as an input) and the probs tensor
// [B, Hq, seq.sq, seq.sk].
struct ProbsProblem {
  Problem fwd;
  void* probs_ptr = nullptr;
  fp_dtype probs_dtype = FP_F32;
  int64_t probs_stride[4] = {0, 0, 0, 0};  // (b, h, i, j)
  FP_HD int64_t at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * probs_stride[0] + h * probs_stride[1] + i * probs_stride[2] + j * probs_stride[3];
  }
};

struct BwdProblem {
  Problem fwd;            // out and lse (required) are inputs here
  const void* dout_ptr = nullptr;
  void* dq_ptr = nullptr;
  void* dk_ptr = nullptr;
  void* dv_ptr = nullptr;
  RowAddr dout, dq;
  KvAddr dk, dv;
  float* d_sinks = nullptr;
  bool deterministic = false;
};

// Merge: all shapes normalised to batched (packed => batch 1, seq = T).
struct MergeProblem {
  const fp_merge_params* raw = nullptr;
  fp_device_type device = FP_DEVICE_CPU;
  int64_t splits = 0, batch = 0, seqlen = 0, heads = 0, dv = 0;
  fp_dtype part_dtype = FP_F32, out_dtype = FP_F32, lse_dtype = FP_F32;
  int64_t part_stride[5] = {0, 0, 0, 0, 0};   // (split, b, s, h, d)
  int64_t lse_part_stride[4] = {0, 0, 0, 0};  // (split, b, h, s)
  int64_t out_stride[4] = {0, 0, 0, 0};       // (b, s, h, d)
  int64_t lse_stride[3] = {0, 0, 0};          // (b, h, s)
  bool has_lse = false;
};

struct MergeBwdProblem {
  const fp_merge_bwd_params* raw = nullptr;  // data pointers of dout, dlse, d_*_partials
  MergeProblem fwd;
  int64_t dout_stride[4] = {0, 0, 0, 0};
  bool has_dlse = false;
  int64_t dlse_stride[3] = {0, 0, 0};
  int64_t d_part_stride[5] = {0, 0, 0, 0, 0};
  int64_t d_lse_part_stride[4] = {0, 0, 0, 0};
};

}  // namespace flashport
