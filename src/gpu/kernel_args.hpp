// Arguments of the GPU kernels: plain structs built on the host from a validated Problem and
// passed by value (no device allocation, nothing read back).
#pragma once
#include <cstdint>

#include "core/problem.hpp"

namespace flashport::gpu {

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
  // Split partials in the workspace: o [splits][rows][dv] fp32, lse [splits][rows], where
  // rows = B * Hq * Sq (row index (b * Hq + h) * Sq + i).
  float* ws_o = nullptr;
  float* ws_lse = nullptr;
  int64_t ws_rows = 0;
  // Fused split-KV combine: one arrival counter per (b, head, m-block) tile, zero at launch; the
  // tile's last split block merges the partials and resets it. Null: the combine kernel merges.
  uint32_t* ws_counters = nullptr;
};

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

}  // namespace flashport::gpu
