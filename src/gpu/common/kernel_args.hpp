// Arguments of the GPU kernels: plain structs built on the host from a validated Problem and
// passed by value (no device allocation, nothing read back).
#pragma once
#include <cstdint>
#include <cstring>

#include "core/problem.hpp"

namespace flashport::gpu {

// A counter in the caller's workspace with any initial contents, so no memset precedes the
// kernel (common/nonce_counter.cuh): one block starts it (count 0, then the call's nonce in
// `ready`); a block waits for that before its first take (an atomic add on `count`), and the
// call's last take sets `ready` back to 0, so a graph replaying the call with the same nonce waits
// for the start again. A 64-bit nonce: workspace bytes that happen to equal it (a block then
// reading a stale count) are a 2^-64 chance. The Hopper forward's dynamic walk over work tiles
// (block 0 starts it; a take is a tile) and the decode kernel's split merge (split 0 of each
// (sequence, head) starts its counter; the split taking the last count merges).
struct NonceCounter {
  unsigned long long ready;
  int32_t count;
};

struct FwdArgs {
  const uint16_t* q = nullptr;  // fp16/bf16 bits
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;         // null: no LSE requested
  SeqInfo seq;
  RowAddr q_addr, out_addr;
  KvAddr k_addr, v_addr;
  LseAddr lse_addr;
  ScoreRules rules;
  int64_t k_rows_cap = 0;       // rows addressable per sequence in batched K/V (clamp), 0 = none
  int64_t num_pages = 0;        // paged: k.shape[0] (page ids are clamped to it)
  int32_t hq = 0, hkv = 0, d = 0, dv = 0, group = 1;
  int32_t pack = 1;             // query heads of a GQA group packed into the M dimension
  int32_t splits = 1;
  float scale_log2 = 0.0f;      // softmax_scale * log2(e)
  float softcap_in = 0.0f;      // scale / softcap
  float softcap_out = 0.0f;     // softcap * log2(e)
  bool vec_ok = false;          // 16-byte aligned rows and strides: cp.async path
  bool out_vec_ok = false;      // 4-byte aligned output pairs
  bool out_vec16_ok = false;    // 16-bit outputs: 16-byte aligned rows and strides, Dv a multiple of 8
  // Split partials in the workspace: o [splits][rows][dv] fp32, lse [splits][rows], where
  // rows = B * Hq * Sq (row index (b * Hq + h) * Sq + i).
  float* ws_o = nullptr;
  float* ws_lse = nullptr;
  int64_t ws_rows = 0;
  // The decode kernel's split counters ([sequence][block head], NonceCounter): the split block
  // that takes its pair's last count merges the partials (mma/decode_kernel.cuh). Null otherwise.
  NonceCounter* split_counters = nullptr;
  // The call's nonce (fwd_plan.hpp next_call_nonce: never 0, fixed in a captured graph): the
  // decode kernel's split counters and the Hopper forward's tile walk (NonceCounter). 0: neither.
  uint64_t call_nonce = 0;
  // fp32 forward: the grid is (heads, batch x splits, query blocks) instead of (query blocks,
  // heads, batch x splits), so blocks start every unit's heaviest query block first (f32_fwd_grid).
  bool query_blocks_outer = false;
};

// The lengths of sequence b in a forward call (every forward kernel: mma.sync, fp32, Hopper):
// query rows lq, clamped to Sq (device-side lengths are clamped, never trusted to fault), and
// keys lk: cache rows [k_pad, k_pad + lk) clamped into the cache rows.
struct FwdSeqLengths {
  int lq, lk;
  FP_HD FwdSeqLengths(const FwdArgs& a, int64_t b) {
    lq = static_cast<int>(a.seq.q_len(b));
    if (lq > a.seq.sq) lq = static_cast<int>(a.seq.sq);
    int64_t lk64 = a.seq.k_len(b);
    if (a.k_rows_cap > 0 && lk64 > a.k_rows_cap - a.seq.k_pad(b)) lk64 = a.k_rows_cap - a.seq.k_pad(b);
    lk = lk64 < 0 ? 0 : static_cast<int>(lk64);
  }
};

// Split-KV: the key blocks [n_lo, n_hi) (of bn keys) a forward work tile visits, cut to split
// `split` of `splits` contiguous shares of the sequence's ceil(lk / bn) blocks (every forward
// kernel, each in its own bn). The cut may miss the tile's visible keys (n_lo >= n_hi): the tile
// then stores empty partials (O = 0, LSE = -inf), which the combine skips.
FP_HD void clip_key_blocks_to_split(int& n_lo, int& n_hi, int lk, int bn, int split, int splits) {
  if (splits <= 1) return;
  const int total = (lk + bn - 1) / bn;
  const int per = (total + splits - 1) / splits;
  const int s_lo = split * per, s_hi = s_lo + per < total ? s_lo + per : total;
  n_lo = n_lo > s_lo ? n_lo : s_lo;
  n_hi = n_hi < s_hi ? n_hi : s_hi;
}

// Merge of split partials (the internal split-KV combine and the public fp_merge_fwd).
// Shapes normalised to (split, b, s, h, d); the output may be packed by cu_q (varlen).
struct MergeArgs {
  const void* part = nullptr;
  fp_dtype part_dtype = FP_F32;
  const float* lse_part = nullptr;
  void* out = nullptr;
  fp_dtype out_dtype = FP_F32;
  float* lse = nullptr;
  int64_t splits = 0, batch = 0, seqlen = 0, heads = 0, dv = 0;
  int64_t part_stride[5] = {0, 0, 0, 0, 0};  // split, b, s, h, d
  int64_t lse_part_stride[4] = {0, 0, 0, 0}; // split, b, h, s
  int64_t out_stride[4] = {0, 0, 0, 0};      // b, s, h, d
  int64_t lse_stride[3] = {0, 0, 0};         // b, h, s
  const int32_t* cu_q = nullptr;  // varlen: rows of sequence b are cu_q[b]..; out/lse packed
  bool out_packed = false, lse_packed = false;
};

// Backward of the merge: d_part_s = w_s * dout, d_lse_s = w_s * (dlse + <dout, part_s - out>),
// w_s = exp(lse_s - lse) (0 where either is -inf). Strides as in MergeArgs (no packed output).
struct MergeBwdArgs {
  MergeArgs fwd;             // part, lse_part, out (read), lse (read), shapes and strides
  const void* dout = nullptr;
  const float* dlse = nullptr;
  void* d_part = nullptr;
  float* d_lse_part = nullptr;
  int64_t dout_stride[4] = {0, 0, 0, 0};
  int64_t dlse_stride[3] = {0, 0, 0};
  int64_t d_part_stride[5] = {0, 0, 0, 0, 0};
  int64_t d_lse_part_stride[4] = {0, 0, 0, 0};
};

// KV-cache append (with rotary) and rotary of q into the workspace.
struct AppendArgs {
  SeqInfo seq;
  const uint16_t* k_new = nullptr;
  const uint16_t* v_new = nullptr;
  RowAddr k_new_addr, v_new_addr;
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
  KvAddr k_addr, v_addr;
  int64_t num_pages = 0;
  const uint16_t* q = nullptr;
  RowAddr q_addr;
  uint16_t* q_rot = nullptr;    // workspace copy of q, rotated ([B|T, Sq, Hq, D] dense)
  RowAddr q_rot_addr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  bool rot_f32 = true;          // cos/sin dtype: fp32, else q's dtype
  int64_t rot_stride = 0, rot_rows = 0;
  int32_t rot_dim = 0;
  bool interleaved = false;
  bool q_pos_per_row = false;   // causal or windowed: q row i at seqused + i
  int32_t hq = 0, hkv = 0, d = 0, dv = 0;
};

// ---- host-side builders shared by the CUDA and HIP backends --------------------------------

// The rotated-q copy in the workspace: dense [B|T, Sq, Hq, round8(D)] rows of `row_stride`.
inline RowAddr q_rot_addr(const Problem& p, int64_t row_stride) {
  RowAddr r;
  r.packed = p.q.packed;
  r.head_stride = (p.d + 7) / 8 * 8;
  r.row_stride = row_stride;
  r.batch_stride = p.q.packed ? 0 : p.seq.sq * row_stride;
  return r;
}

// The append / rotary pre-pass arguments. `q_rot`: the workspace copy q is rotated into (with
// rows of `q_rot_row_stride`), or null when q is not rotated.
inline AppendArgs append_args(const Problem& p, uint16_t* q_rot, int64_t q_rot_row_stride) {
  AppendArgs ap;
  ap.seq = p.seq;
  ap.k_new = static_cast<const uint16_t*>(p.k_new_ptr);
  ap.v_new = static_cast<const uint16_t*>(p.v_new_ptr);
  ap.k_new_addr = p.k_new;
  ap.v_new_addr = p.v_new;
  ap.k = static_cast<uint16_t*>(p.k_ptr);
  ap.v = static_cast<uint16_t*>(p.v_ptr);
  ap.k_addr = p.k;
  ap.v_addr = p.v;
  ap.num_pages = p.raw->k.shape[0];
  ap.q = static_cast<const uint16_t*>(p.q_ptr);
  ap.q_addr = p.q;
  ap.cos = p.rotary_cos;
  ap.sin = p.rotary_sin;
  ap.rot_f32 = p.rotary_dtype == FP_F32;
  ap.rot_stride = p.rotary_row_stride;
  ap.rot_rows = p.rotary_rows;
  ap.rot_dim = static_cast<int32_t>(p.rotary_dim);
  ap.interleaved = p.rotary_interleaved;
  ap.q_pos_per_row = p.rules.window_left >= 0 || p.rules.window_right >= 0;
  ap.hq = int32_t(p.hq), ap.hkv = int32_t(p.hkv), ap.d = int32_t(p.d), ap.dv = int32_t(p.dv);
  if (q_rot != nullptr) {
    ap.q_rot = q_rot;
    ap.q_rot_addr = q_rot_addr(p, q_rot_row_stride);
  }
  return ap;
}

// The clamps of device-resident key lengths and page ids (the kernels don't fault on bad tables):
// cache rows a sequence may address (batched: sk; paged: pages x page size; packed: 0 = none) and
// the pages of the pool (paged: k.shape[0]; else 0).
inline int64_t kv_rows_cap(const Problem& p) {
  return p.seq.kv_layout == KvLayout::Batched ? p.seq.sk
         : p.seq.kv_layout == KvLayout::Paged ? p.seq.max_blocks * p.seq.page_size : 0;
}
inline int64_t kv_num_pages(const Problem& p) {
  return p.seq.kv_layout == KvLayout::Paged ? p.raw->k.shape[0] : 0;
}

// A page id read from a device-resident block table, clamped into the pool of `num_pages` pages
// (0 when the pool is empty): a bad table reads a wrong page, never faults. `Int`: the caller's
// index width (the Hopper producer keeps 32-bit registers).
template <typename Int>
FP_HD Int clamp_page_id(Int id, Int num_pages) {
  const Int last = num_pages - 1;
  id = id > last ? last : id;
  return id < 0 ? Int(0) : id;
}

// Whether every row base + b * s0 + r * s1 + h * s2 of a tensor is 16-byte aligned (the device
// side's 16-byte row accesses: the aux kernels, the backward's preprocess and dQ conversion).
FP_HD bool rows_aligned16(const void* base, int elem_bytes, int64_t s0, int64_t s1, int64_t s2) {
  const int64_t per = 16 / elem_bytes;
  return (reinterpret_cast<uintptr_t>(base) & 15) == 0 && s0 % per == 0 && s1 % per == 0 && s2 % per == 0;
}
FP_HD bool rows_aligned16(const void* base, int elem_bytes, const RowAddr& r) {
  return rows_aligned16(base, elem_bytes, r.batch_stride, r.row_stride, r.head_stride);
}
FP_HD bool rows_aligned16(const void* base, int elem_bytes, const KvAddr& r) {
  return rows_aligned16(base, elem_bytes, r.s0, r.s1, r.s2);
}

// Element offset of cache row `row` of sequence b, kv head h (KvAddr::at_row: rows counted from
// the sequence's first cache row; key j is row seq.key_row(b, j)), a paged page id clamped.
FP_HD int64_t kv_row_offset(const SeqInfo& seq, const KvAddr& ad, int64_t num_pages, int64_t b, int64_t row,
                            int64_t h) {
  if (ad.layout != KvLayout::Paged) return ad.at_row(seq, b, row, h);
  const int64_t page = clamp_page_id<int64_t>(seq.block_table[b * seq.block_table_stride + row / seq.page_size],
                                              num_pages);
  return page * ad.s0 + (row % seq.page_size) * ad.s1 + h * ad.s2;
}

// The same for key j of sequence b (KvAddr::at: cache row seq.key_row(b, j), past the left pad).
FP_HD int64_t kv_key_offset(const SeqInfo& seq, const KvAddr& ad, int64_t num_pages, int64_t b, int64_t j,
                            int64_t h) {
  if (ad.layout != KvLayout::Paged) return ad.at(seq, b, j, h);
  return kv_row_offset(seq, ad, num_pages, b, seq.key_row(b, j), h);
}

// The main loop's arguments for q at (q, q_addr): the caller's q or its rotated workspace copy.
// The split-KV workspace areas (ws_o, ws_lse, ws_rows) are the caller's to set (fwd_plan.hpp).
inline FwdArgs fwd_args(const Problem& p, const uint16_t* q, const RowAddr& q_addr, int pack, int splits) {
  auto aligned16 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  auto mult8 = [](int64_t x) { return (x & 7) == 0; };
  FwdArgs a;
  a.q = q;
  a.q_addr = q_addr;
  a.k = static_cast<const uint16_t*>(p.k_ptr);
  a.v = static_cast<const uint16_t*>(p.v_ptr);
  a.out = p.out_ptr;
  a.lse = p.has_lse ? static_cast<float*>(p.lse_ptr) : nullptr;
  a.seq = p.seq;
  a.out_addr = p.out;
  a.k_addr = p.k;
  a.v_addr = p.v;
  a.lse_addr = p.lse;
  a.rules = p.rules;
  a.k_rows_cap = kv_rows_cap(p);
  a.num_pages = kv_num_pages(p);
  a.hq = int32_t(p.hq), a.hkv = int32_t(p.hkv), a.d = int32_t(p.d), a.dv = int32_t(p.dv);
  a.group = int32_t(p.group);
  a.pack = pack;
  a.splits = splits;
  a.scale_log2 = p.rules.scale * kLog2e;
  if (p.rules.softcap > 0.0f) {
    a.softcap_in = p.rules.scale / p.rules.softcap;
    a.softcap_out = p.rules.softcap * kLog2e;
  }
  a.vec_ok = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && mult8(a.q_addr.row_stride) &&
             mult8(a.q_addr.head_stride) && mult8(a.q_addr.batch_stride) && mult8(p.k.s0) && mult8(p.k.s1) &&
             mult8(p.k.s2) && mult8(p.v.s0) && mult8(p.v.s1) && mult8(p.v.s2);
  a.out_vec_ok = (reinterpret_cast<uintptr_t>(a.out) & 3) == 0 && (p.out.row_stride & 1) == 0 &&
                 (p.out.head_stride & 1) == 0 && (p.out.batch_stride & 1) == 0;
  a.out_vec16_ok = aligned16(a.out) && mult8(p.out.row_stride) && mult8(p.out.head_stride) &&
                   mult8(p.out.batch_stride) && p.dv % 8 == 0;
  return a;
}

// The split-KV combine of the main loop's partials (ws_o [splits][ws_rows][dv] fp32, ws_lse
// [splits][ws_rows]) into out / lse, normalised (split, b, s, h, d) like the public merge op.
inline MergeArgs split_combine_args(const Problem& p, const float* ws_o, const float* ws_lse, int64_t ws_rows,
                                    int64_t splits) {
  MergeArgs m;
  m.part = ws_o;
  m.part_dtype = FP_F32;
  m.lse_part = ws_lse;
  m.out = p.out_ptr;
  m.out_dtype = p.dtype;
  m.lse = p.has_lse ? static_cast<float*>(p.lse_ptr) : nullptr;
  m.splits = splits, m.batch = p.seq.batch, m.seqlen = p.seq.sq, m.heads = p.hq, m.dv = p.dv;
  const int64_t S = p.seq.sq, H = p.hq, DV = p.dv;
  const int64_t ps[5] = {ws_rows * DV, H * S * DV, DV, S * DV, 1};
  const int64_t ls[4] = {ws_rows, H * S, S, 1};  // (split, b, h, s)
  std::memcpy(m.part_stride, ps, sizeof(ps));
  std::memcpy(m.lse_part_stride, ls, sizeof(ls));
  const int64_t os[4] = {p.out.batch_stride, p.out.row_stride, p.out.head_stride, 1};
  std::memcpy(m.out_stride, os, sizeof(os));
  const int64_t lss[3] = {p.lse.batch_stride, p.lse.head_stride, p.lse.row_stride};
  std::memcpy(m.lse_stride, lss, sizeof(lss));
  m.cu_q = p.seq.cu_q;
  m.out_packed = p.out.packed;
  m.lse_packed = p.lse.packed;
  return m;
}

}  // namespace flashport::gpu
