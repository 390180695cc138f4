// A C shim over the public C API for the benchmark script: torch allocates the tensors (BSHD
// memory), Python passes their pointers and strides through ctypes, and flashport runs on the
// same stream in the same process as torch's SDPA backends.
#include <cstdint>
#include <cstring>

#include "flashport/flashport.h"

namespace {

fp_tensor make(void* data, fp_dtype t, int nd, const int64_t* shape, const int64_t* stride) {
  fp_tensor x{};
  x.data = data;
  x.dtype = t;
  x.ndim = nd;
  for (int i = 0; i < nd; ++i) x.shape[i] = shape[i], x.stride[i] = stride[i];
  x.device_type = FP_DEVICE_CUDA;
  x.device_index = 0;
  return x;
}

// Dropout probability of every fpb_fwd / fpb_bwd call (fpb_set_dropout; 0: none), fixed seed and offset.
float g_dropout_p = 0.0f;

// Append (+ rotary) of every fpb_fwd_cache call (fpb_set_append; k_new null: none): k_new, v_new
// dense [B, snew, Hkv, D], cos/sin dense [rows, rot_dim / 2] (fp32, or q's dtype with tables_f32 0).
struct AppendSetting {
  void *k_new = nullptr, *v_new = nullptr, *cos = nullptr, *sin = nullptr;
  int64_t snew = 0, rows = 0, rot_dim = 0;
  int interleaved = 0, tables_f32 = 1;
} g_append;

// cache_leftpad of every fpb_fwd_cache call (fpb_set_leftpad; null: none): int32 [B].
void* g_leftpad = nullptr;

// The forward call of dims (B, Sq, Sk, Hq, Hkv, D, Dv) over BSHD q, k, v, out (strides: 4 each,
// elements; lse [B, Hq, Sq] fp32 or null), dtype 0 fp16 / 1 bf16 / 2 fp32, torch's top-left causal.
void forward_params(fp_attn_params* p, const int64_t* dims, const int64_t* strides, void* q, void* k, void* v,
                    void* out, void* lse, int dtype, int causal, void* stream) {
  const int64_t B = dims[0], Sq = dims[1], Sk = dims[2], Hq = dims[3], Hkv = dims[4], D = dims[5],
                Dv = dims[6];
  const fp_dtype t = dtype == 2 ? FP_F32 : dtype == 1 ? FP_BF16 : FP_F16;
  fp_attn_params_init(p);
  const int64_t qs[4] = {B, Sq, Hq, D}, ks[4] = {B, Sk, Hkv, D}, vs[4] = {B, Sk, Hkv, Dv},
                os[4] = {B, Sq, Hq, Dv};
  p->q = make(q, t, 4, qs, strides);
  p->k = make(k, t, 4, ks, strides + 4);
  p->v = make(v, t, 4, vs, strides + 8);
  p->out = make(out, t, 4, os, strides + 12);
  if (lse) {
    const int64_t ls[3] = {B, Hq, Sq}, lst[3] = {Hq * Sq, Sq, 1};
    p->lse = make(lse, FP_F32, 3, ls, lst);
  }
  p->causal = causal;
  p->causal_align = FP_CAUSAL_TOP_LEFT;  // torch's is_causal
  p->dropout_p = g_dropout_p;
  p->dropout_seed = 1234;
  p->dropout_offset = 0;
  p->backend = FP_BACKEND_CUDA;
  p->stream = stream;
}

// Selects the forward call's kernel, reports its workspace, and runs it when ws_bytes covers that.
int select_and_run_fwd(fp_attn_params* p, void* ws, size_t ws_bytes, size_t* ws_needed, int* splits_used,
                       char* kernel) {
  fp_selection sel;
  fp_status st = fp_attn_fwd_select(p, &sel);
  if (st != FP_OK) return st;
  if (ws_needed) *ws_needed = sel.workspace_bytes;
  if (splits_used) *splits_used = sel.num_splits;
  if (kernel) std::memcpy(kernel, sel.kernel, sizeof(sel.kernel));
  if (sel.workspace_bytes > ws_bytes) return FP_ERR_WORKSPACE;
  p->workspace = ws;
  p->workspace_bytes = ws_bytes;
  return fp_attn_fwd(p);
}

}  // namespace

extern "C" {

void fpb_set_dropout(float p) { g_dropout_p = p; }
void fpb_set_append(void* k_new, void* v_new, int64_t snew, void* cos, void* sin, int64_t rows, int64_t rot_dim,
                    int interleaved, int tables_f32) {
  g_append = AppendSetting{k_new, v_new, cos, sin, snew, rows, rot_dim, interleaved, tables_f32};
}
void fpb_set_leftpad(void* pad) { g_leftpad = pad; }

// dims: B, Sq, Sk, Hq, Hkv, D, Dv. strides: q, k, v, out (4 each, elements). dtype: 0 fp16, 1 bf16, 2 fp32.
// Returns fp_status; on FP_ERR_WORKSPACE (or ws == null) *ws_needed says how much to pass.
int fpb_fwd(const int64_t* dims, const int64_t* strides, void* q, void* k, void* v, void* out,
            void* lse, int dtype, int causal, int num_splits, void* ws, size_t ws_bytes,
            void* stream, size_t* ws_needed, int* splits_used, char* kernel /* 96 bytes */) {
  fp_attn_params p;
  forward_params(&p, dims, strides, q, k, v, out, lse, dtype, causal, stream);
  p.num_splits = num_splits;
  return select_and_run_fwd(&p, ws, ws_bytes, ws_needed, splits_used, kernel);
}

// The backward of an fpb_fwd call (same dims; out and lse from that call). strides: q, k, v, out,
// dout, dq, dk, dv (4 each, elements). Same workspace protocol as fpb_fwd.
int fpb_bwd(const int64_t* dims, const int64_t* strides, void* q, void* k, void* v, void* out, void* lse,
            void* dout, void* dq, void* dk, void* dv, int dtype, int causal, int deterministic, void* ws,
            size_t ws_bytes, void* stream, size_t* ws_needed, char* kernel /* 96 bytes */) {
  fp_attn_bwd_params p;
  fp_attn_bwd_params_init(&p);
  forward_params(&p.fwd, dims, strides, q, k, v, out, lse, dtype, causal, stream);
  const fp_tensor& o = p.fwd.out;
  p.dout = make(dout, o.dtype, 4, o.shape, strides + 16);
  p.dq = make(dq, o.dtype, 4, p.fwd.q.shape, strides + 20);
  p.dk = make(dk, o.dtype, 4, p.fwd.k.shape, strides + 24);
  p.dv = make(dv, o.dtype, 4, p.fwd.v.shape, strides + 28);
  p.deterministic = deterministic;
  fp_selection sel;
  fp_status st = fp_attn_bwd_select(&p, &sel);
  if (st != FP_OK) return st;
  if (ws_needed) *ws_needed = sel.workspace_bytes;
  if (kernel) std::memcpy(kernel, sel.kernel, sizeof(sel.kernel));
  if (sel.workspace_bytes > ws_bytes) return FP_ERR_WORKSPACE;
  p.fwd.workspace = ws;
  p.fwd.workspace_bytes = ws_bytes;
  return fp_attn_bwd(&p);
}

// A KV-cache forward (flash_attn_with_kvcache's prefill chunk, bottom-right causal): q [B, Sq, Hq, D];
// k, v the cache, kshape [B, rows, Hkv, D] (contiguous) or [blocks, page, Hkv, D] with block_table
// int32 [B, max_blocks] (bt_cols > 0: paged); seqused_k int32 [B]. strides: q, k, v, out (4 each).
int fpb_fwd_cache(const int64_t* qshape, const int64_t* kshape, const int64_t* strides, void* q, void* k, void* v,
                  void* out, void* seqused_k, void* block_table, int64_t bt_cols, int dtype, int causal, void* ws,
                  size_t ws_bytes, void* stream, size_t* ws_needed, char* kernel /* 96 bytes */) {
  const int64_t B = qshape[0];
  const int64_t dims[7] = {B, qshape[1], kshape[1], qshape[2], kshape[2], qshape[3], kshape[3]};
  fp_attn_params p;
  forward_params(&p, dims, strides, q, k, v, out, nullptr, dtype, causal, stream);
  p.causal_align = FP_CAUSAL_BOTTOM_RIGHT;  // flash_attn_with_kvcache's
  p.k = make(k, p.k.dtype, 4, kshape, strides + 4);
  p.v = make(v, p.v.dtype, 4, kshape, strides + 8);
  const int64_t bs[1] = {B}, bst[1] = {1};
  p.seqused_k = make(seqused_k, FP_I32, 1, bs, bst);
  if (g_leftpad != nullptr) p.cache_leftpad = make(g_leftpad, FP_I32, 1, bs, bst);
  if (bt_cols > 0) {
    const int64_t ts[2] = {B, bt_cols}, tst[2] = {bt_cols, 1};
    p.block_table = make(block_table, FP_I32, 2, ts, tst);
  }
  if (g_append.k_new != nullptr) {  // appended rows (rotated) land at cache rows seqused_k[b] + j
    const int64_t Hkv = kshape[2], D = kshape[3], snew = g_append.snew;
    const int64_t ns[4] = {B, snew, Hkv, D}, nst[4] = {snew * Hkv * D, Hkv * D, D, 1};
    p.k_new = make(g_append.k_new, p.q.dtype, 4, ns, nst);
    p.v_new = make(g_append.v_new, p.q.dtype, 4, ns, nst);
    if (g_append.rot_dim > 0) {
      const int64_t half = g_append.rot_dim / 2;
      const int64_t ts[2] = {g_append.rows, half}, tst[2] = {half, 1};
      const fp_dtype tab = g_append.tables_f32 ? FP_F32 : p.q.dtype;
      p.rotary_cos = make(g_append.cos, tab, 2, ts, tst);
      p.rotary_sin = make(g_append.sin, tab, 2, ts, tst);
      p.rotary_interleaved = g_append.interleaved;
    }
  }
  return select_and_run_fwd(&p, ws, ws_bytes, ws_needed, nullptr, kernel);
}

const char* fpb_last_error(void) { return fp_last_error(); }

}  // extern "C"
