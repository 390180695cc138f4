// Validation of the C structs (see the rules in include/flashport/flashport.h). Every rule has its
// own message "<argument>: <rule> (got ...)". Index tensors are value-checked only when they live
// in host memory; GPU kernels clamp instead.
#include "validate.hpp"

#include <cmath>
#include <string>

#include "dtype.hpp"
#include "philox.hpp"

namespace flashport {
namespace {

// ---- Formatting --------------------------------------------------------------------------------

// Plain string building, no iostreams: the library is linked into extensions that may carry
// their own libstdc++, and stream locale state across two copies crashed (seen on the H200 build).
std::string shape_str(const fp_tensor& t) {
  std::string s = std::to_string(t.ndim) + "-D [";
  for (int i = 0; i < t.ndim && i < FP_MAX_DIMS; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

std::string dims_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  int i = 0;
  for (int64_t d : dims) s += (i++ ? ", " : "") + std::to_string(d);
  return s + "]";
}

const char* device_type_name(fp_device_type d) {
  switch (d) {
    case FP_DEVICE_CPU: return "cpu";
    case FP_DEVICE_CUDA: return "cuda";
    case FP_DEVICE_HIP: return "hip";
  }
  return "?";
}

std::string device_str(const fp_tensor& t) {
  return std::string(device_type_name(t.device_type)) + ":" + std::to_string(t.device_index);
}

std::string dtype_str(fp_dtype t) {
  if (t < FP_F16 || t > FP_I32) return "dtype " + std::to_string(static_cast<int>(t));
  return dtype_name(t);
}

Status bad(const char* name, const std::string& rule, const std::string& got) {
  return invalid(std::string(name) + ": " + rule + " (got " + got + ")");
}

bool given(const fp_tensor& t) { return tensor_given(t); }

int64_t numel(const fp_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

bool is_float_dtype(fp_dtype t) {
  return t == FP_F16 || t == FP_BF16 || t == FP_F32 || t == FP_F64;
}

// ---- Generic tensor rules ----------------------------------------------------------------------

// Rules every given tensor obeys: rank, enums, sizes, data pointer, contiguous last dim.
Status check_basic(const fp_tensor& t, const char* name) {
  if (t.ndim < 1 || t.ndim > FP_MAX_DIMS)
    return bad(name, "ndim must be in [1, " + std::to_string(FP_MAX_DIMS) + "] for a given tensor",
               "ndim " + std::to_string(t.ndim));
  if (t.dtype < FP_F16 || t.dtype > FP_I32)
    return bad(name, "dtype is not a valid fp_dtype", std::to_string(static_cast<int>(t.dtype)));
  if (t.device_type < FP_DEVICE_CPU || t.device_type > FP_DEVICE_HIP)
    return bad(name, "device_type is not a valid fp_device_type",
               std::to_string(static_cast<int>(t.device_type)));
  if (t.device_index < 0)
    return bad(name, "device_index must be >= 0", std::to_string(t.device_index));
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] < 0) return bad(name, "sizes must be >= 0", shape_str(t));
  if (t.data == nullptr && numel(t) > 0)
    return bad(name, "data is NULL for a non-empty tensor", shape_str(t));
  const int last = t.ndim - 1;
  if (t.stride[last] != 1 && t.shape[last] > 1)
    return bad(name, "last dimension must be contiguous (stride 1)",
               "stride " + std::to_string(t.stride[last]) + " for " + shape_str(t));
  return Status::ok();
}

Status require(const fp_tensor& t, const char* name) {
  if (!given(t)) return bad(name, "is required", "an absent tensor");
  return check_basic(t, name);
}

Status check_ndim(const fp_tensor& t, const char* name, int ndim, const char* layout) {
  if (t.ndim != ndim)
    return bad(name, "must be " + std::to_string(ndim) + "-D " + layout, shape_str(t));
  return Status::ok();
}

Status check_dtype(const fp_tensor& t, const char* name, fp_dtype want, const char* why) {
  if (t.dtype != want)
    return bad(name, std::string("must be ") + dtype_name(want) + " " + why, dtype_str(t.dtype));
  return Status::ok();
}

Status check_shape(const fp_tensor& t, const char* name, std::initializer_list<int64_t> want,
                   const char* layout) {
  bool ok = t.ndim == static_cast<int>(want.size());
  int i = 0;
  for (int64_t d : want) {
    if (!ok) break;
    ok = t.shape[i++] == d;
  }
  if (!ok) return bad(name, std::string("must have shape ") + layout + " = " + dims_str(want),
                      shape_str(t));
  return Status::ok();
}

// Same device (type and index) as the first tensor of the call.
Status check_same_device(const fp_tensor& t, const char* name, const fp_tensor& ref,
                         const char* ref_name) {
  if (t.device_type != ref.device_type || t.device_index != ref.device_index)
    return bad(name, std::string("must be on the same device as ") + ref_name + " (" +
                         device_str(ref) + ")",
               device_str(t));
  return Status::ok();
}

Status check_execution(fp_backend backend, const void* stream, int32_t num_threads,
                       fp_device_type device) {
  if (backend < FP_BACKEND_AUTO || backend > FP_BACKEND_HIP)
    return bad("backend", "is not a valid fp_backend", std::to_string(static_cast<int>(backend)));
  if (num_threads < 0) return bad("num_threads", "must be >= 0", std::to_string(num_threads));
  if (device == FP_DEVICE_CPU && stream != nullptr)
    return bad("stream", "must be NULL for CPU tensors", "a non-NULL stream");
  return Status::ok();
}

// Reads element i of a host int32 tensor (1-D or row-major 2-D via the strides).
int32_t host_i32(const fp_tensor& t, int64_t i) { return static_cast<const int32_t*>(t.data)[i]; }

// cu_seqlens value rules (host memory only).
Status check_cu_seqlens_values(const fp_tensor& cu, const char* name, int64_t batch,
                               int64_t total_rows, int64_t max_seqlen, const char* max_name) {
  if (cu.device_type != FP_DEVICE_CPU || batch < 0) return Status::ok();
  const int64_t st = cu.stride[0];
  if (host_i32(cu, 0) != 0)
    return bad(name, "first entry must be 0", std::to_string(host_i32(cu, 0)));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = host_i32(cu, b * st), hi = host_i32(cu, (b + 1) * st);
    if (hi < lo)
      return bad(name, "must be non-decreasing",
                 "entry " + std::to_string(b + 1) + " = " + std::to_string(hi) + " < entry " +
                     std::to_string(b) + " = " + std::to_string(lo));
    if (hi - lo > max_seqlen)
      return bad(name, std::string("sequence length exceeds ") + max_name,
                 "sequence " + std::to_string(b) + " of length " + std::to_string(hi - lo) +
                     " > " + std::to_string(max_seqlen));
  }
  const int64_t last = host_i32(cu, batch * st);
  if (last > total_rows)
    return bad(name, "last entry must be <= the packed rows of the tensor",
               std::to_string(last) + " > " + std::to_string(total_rows));
  return Status::ok();
}

// ---- Forward -----------------------------------------------------------------------------------

struct FwdShapes {
  bool q_varlen = false;
  KvLayout kv = KvLayout::Batched;
  int64_t batch = 0, sq = 0, tq = 0, hq = 0, d = 0, dv = 0, hkv = 0;
  int64_t kv_batch = 0, sk = 0, tk = 0;  // batched: [kv_batch, sk]; packed: tk rows
  int64_t num_blocks = 0, page_size = 0, max_blocks = 0;
  int64_t snew = 0;
};

// What the call does with the forward's tensors: the forward writes out (lse optional); the
// backward and fp_attn_probs read lse; fp_attn_probs does not read out (optional there).
struct FwdUse {
  bool lse_required = false;
  bool out_required = true;
};

// Addressing of a validated q-like tensor: [B, S, H, D] (batch, row, head strides) or, packed
// by cu_q / cu_k, [T, H, D] (row, head strides).
RowAddr row_addr_of(const fp_tensor& t, bool packed) {
  RowAddr a;
  a.packed = packed;
  if (packed) {
    a.row_stride = t.stride[0];
    a.head_stride = t.stride[1];
  } else {
    a.batch_stride = t.stride[0];
    a.row_stride = t.stride[1];
    a.head_stride = t.stride[2];
  }
  return a;
}

// Addressing of a validated k-like tensor: its first three strides, or two when packed [T, H, D].
KvAddr kv_addr_of(const fp_tensor& t, KvLayout layout) {
  KvAddr a;
  a.layout = layout;
  a.s0 = t.stride[0];
  if (layout == KvLayout::Packed) {
    a.s2 = t.stride[1];
  } else {
    a.s1 = t.stride[1];
    a.s2 = t.stride[2];
  }
  return a;
}

Status resolve_fwd_impl(const fp_attn_params& p, Problem* out, FwdUse use) {
  Problem r;
  r.raw = &p;

  // Required main tensors and their generic rules.
  FP_RETURN_IF_ERROR(require(p.q, "q"));
  FP_RETURN_IF_ERROR(require(p.k, "k"));
  FP_RETURN_IF_ERROR(require(p.v, "v"));
  if (use.out_required) FP_RETURN_IF_ERROR(require(p.out, "out"));
  if (use.lse_required) FP_RETURN_IF_ERROR(require(p.lse, "lse"));
  const bool has_out = given(p.out);
  struct Opt { const fp_tensor& t; const char* name; };
  const Opt optional[] = {{p.out, "out"},
                          {p.lse, "lse"},
                          {p.cu_seqlens_q, "cu_seqlens_q"},
                          {p.cu_seqlens_k, "cu_seqlens_k"},
                          {p.seqused_k, "seqused_k"},
                          {p.block_table, "block_table"},
                          {p.cache_batch_idx, "cache_batch_idx"},
                          {p.cache_leftpad, "cache_leftpad"},
                          {p.k_new, "k_new"},
                          {p.v_new, "v_new"},
                          {p.rotary_cos, "rotary_cos"},
                          {p.rotary_sin, "rotary_sin"},
                          {p.alibi_slopes, "alibi_slopes"},
                          {p.sinks, "sinks"},
                          {p.dropout_rng, "dropout_rng"}};
  for (const Opt& o : optional)
    if (given(o.t)) FP_RETURN_IF_ERROR(check_basic(o.t, o.name));

  // One device for everything.
  const Opt others[] = {{p.k, "k"}, {p.v, "v"}};
  for (const Opt& o : others) FP_RETURN_IF_ERROR(check_same_device(o.t, o.name, p.q, "q"));
  for (const Opt& o : optional)
    if (given(o.t)) FP_RETURN_IF_ERROR(check_same_device(o.t, o.name, p.q, "q"));

  // Dtypes.
  if (!is_float_dtype(p.q.dtype))
    return bad("q", "dtype must be float16, bfloat16, float32 or float64", dtype_str(p.q.dtype));
  const fp_dtype dt = p.q.dtype;
  if (p.k.dtype != dt) return bad("k", std::string("must have q's dtype ") + dtype_name(dt), dtype_str(p.k.dtype));
  if (p.v.dtype != dt) return bad("v", std::string("must have q's dtype ") + dtype_name(dt), dtype_str(p.v.dtype));
  if (has_out && p.out.dtype != dt) return bad("out", std::string("must have q's dtype ") + dtype_name(dt), dtype_str(p.out.dtype));
  if (given(p.lse) && p.lse.dtype != FP_F32 && !(p.lse.dtype == FP_F64 && dt == FP_F64))
    return bad("lse", "must be float32 (float64 allowed only with float64 inputs)",
               dtype_str(p.lse.dtype) + " with " + dtype_name(dt) + " inputs");
  const Opt index_tensors[] = {{p.cu_seqlens_q, "cu_seqlens_q"}, {p.cu_seqlens_k, "cu_seqlens_k"},
                               {p.seqused_k, "seqused_k"}, {p.block_table, "block_table"},
                               {p.cache_batch_idx, "cache_batch_idx"},
                               {p.cache_leftpad, "cache_leftpad"}};
  for (const Opt& o : index_tensors)
    if (given(o.t)) FP_RETURN_IF_ERROR(check_dtype(o.t, o.name, FP_I32, "(an index tensor)"));
  if (given(p.alibi_slopes))
    FP_RETURN_IF_ERROR(check_dtype(p.alibi_slopes, "alibi_slopes", FP_F32, "(slopes are fp32)"));
  if (given(p.sinks)) FP_RETURN_IF_ERROR(check_dtype(p.sinks, "sinks", FP_F32, "(sink logits are fp32)"));
  if (given(p.k_new) && p.k_new.dtype != dt)
    return bad("k_new", std::string("must have q's dtype ") + dtype_name(dt), dtype_str(p.k_new.dtype));
  if (given(p.v_new) && p.v_new.dtype != dt)
    return bad("v_new", std::string("must have q's dtype ") + dtype_name(dt), dtype_str(p.v_new.dtype));
  const Opt rotary[] = {{p.rotary_cos, "rotary_cos"}, {p.rotary_sin, "rotary_sin"}};
  for (const Opt& o : rotary)
    if (given(o.t) && o.t.dtype != FP_F32 && o.t.dtype != dt)
      return bad(o.name, std::string("must be float32 or q's dtype ") + dtype_name(dt),
                 dtype_str(o.t.dtype));

  // Layout: which tensors are packed / paged, and the ranks that follow.
  FwdShapes s;
  s.q_varlen = given(p.cu_seqlens_q);
  if (given(p.cu_seqlens_k) && given(p.block_table))
    return bad("block_table", "cannot be combined with cu_seqlens_k (paged or packed keys, not both)",
               "both");
  s.kv = given(p.block_table) ? KvLayout::Paged
                              : (given(p.cu_seqlens_k) ? KvLayout::Packed : KvLayout::Batched);
  if (s.q_varlen) {
    FP_RETURN_IF_ERROR(check_ndim(p.q, "q", 3, "[Tq, Hq, D] with cu_seqlens_q"));
    if (has_out) FP_RETURN_IF_ERROR(check_ndim(p.out, "out", 3, "[Tq, Hq, Dv] with cu_seqlens_q"));
  } else {
    FP_RETURN_IF_ERROR(check_ndim(p.q, "q", 4, "[B, Sq, Hq, D]"));
    if (has_out) FP_RETURN_IF_ERROR(check_ndim(p.out, "out", 4, "[B, Sq, Hq, Dv]"));
  }
  const char* kv_layout = s.kv == KvLayout::Paged    ? "[num_blocks, page_size, Hkv, D|Dv] with block_table"
                          : s.kv == KvLayout::Packed ? "[Tk, Hkv, D|Dv] with cu_seqlens_k"
                                                     : "[B, Sk, Hkv, D|Dv]";
  const int kv_ndim = s.kv == KvLayout::Packed ? 3 : 4;
  FP_RETURN_IF_ERROR(check_ndim(p.k, "k", kv_ndim, kv_layout));
  FP_RETURN_IF_ERROR(check_ndim(p.v, "v", kv_ndim, kv_layout));

  // Sizes.
  if (s.q_varlen) {
    FP_RETURN_IF_ERROR(check_ndim(p.cu_seqlens_q, "cu_seqlens_q", 1, "[B + 1]"));
    if (p.cu_seqlens_q.shape[0] < 1)
      return bad("cu_seqlens_q", "must have B + 1 >= 1 entries", shape_str(p.cu_seqlens_q));
    s.batch = p.cu_seqlens_q.shape[0] - 1;
    s.tq = p.q.shape[0];
    if (p.max_seqlen_q < 0)
      return bad("max_seqlen_q", "must be >= 0 with cu_seqlens_q", std::to_string(p.max_seqlen_q));
    s.sq = p.max_seqlen_q;
  } else {
    if (p.max_seqlen_q != 0)
      return bad("max_seqlen_q", "is only meaningful with cu_seqlens_q (leave it 0)",
                 std::to_string(p.max_seqlen_q));
    s.batch = p.q.shape[0];
    s.sq = p.q.shape[1];
    s.tq = s.batch * s.sq;
  }
  s.hq = p.q.shape[p.q.ndim - 2];
  s.d = p.q.shape[p.q.ndim - 1];
  s.hkv = p.k.shape[p.k.ndim - 2];
  s.dv = p.v.shape[p.v.ndim - 1];
  if (s.hq < 1) return bad("q", "must have at least one head", shape_str(p.q));
  if (s.hkv < 1) return bad("k", "must have at least one head", shape_str(p.k));
  if (s.hq % s.hkv != 0)
    return bad("k", "query heads must be a multiple of key/value heads (Hq % Hkv == 0)",
               "Hq = " + std::to_string(s.hq) + ", Hkv = " + std::to_string(s.hkv));
  if (s.d < 1 || s.d > 256) return bad("q", "head dim D must be in [1, 256]", shape_str(p.q));
  if (s.dv < 1 || s.dv > 256) return bad("v", "head dim Dv must be in [1, 256]", shape_str(p.v));
  if (p.k.shape[p.k.ndim - 1] != s.d)
    return bad("k", "last dim must equal q's head dim D = " + std::to_string(s.d), shape_str(p.k));
  for (int i = 0; i < kv_ndim - 1; ++i)
    if (p.v.shape[i] != p.k.shape[i])
      return bad("v", "must match k in every dim but the last", shape_str(p.v) + " vs k " + shape_str(p.k));
  if (has_out && s.q_varlen)
    FP_RETURN_IF_ERROR(check_shape(p.out, "out", {s.tq, s.hq, s.dv}, "[Tq, Hq, Dv]"));
  else if (has_out)
    FP_RETURN_IF_ERROR(check_shape(p.out, "out", {s.batch, s.sq, s.hq, s.dv}, "[B, Sq, Hq, Dv]"));
  if (given(p.lse)) {
    if (s.q_varlen)
      FP_RETURN_IF_ERROR(check_shape(p.lse, "lse", {s.hq, s.tq}, "[Hq, Tq]"));
    else
      FP_RETURN_IF_ERROR(check_shape(p.lse, "lse", {s.batch, s.hq, s.sq}, "[B, Hq, Sq]"));
  }

  // Keys: batched / packed / paged.
  switch (s.kv) {
    case KvLayout::Packed:
      FP_RETURN_IF_ERROR(check_ndim(p.cu_seqlens_k, "cu_seqlens_k", 1, "[B + 1]"));
      if (p.cu_seqlens_k.shape[0] != s.batch + 1)
        return bad("cu_seqlens_k", "must have B + 1 = " + std::to_string(s.batch + 1) + " entries",
                   shape_str(p.cu_seqlens_k));
      if (p.max_seqlen_k < 0)
        return bad("max_seqlen_k", "must be >= 0 with cu_seqlens_k", std::to_string(p.max_seqlen_k));
      s.tk = p.k.shape[0];
      s.sk = p.max_seqlen_k;
      break;
    case KvLayout::Paged:
      FP_RETURN_IF_ERROR(check_ndim(p.block_table, "block_table", 2, "[B, max_blocks]"));
      if (p.block_table.shape[0] != s.batch)
        return bad("block_table", "must have B = " + std::to_string(s.batch) + " rows",
                   shape_str(p.block_table));
      s.num_blocks = p.k.shape[0];
      s.page_size = p.k.shape[1];
      s.max_blocks = p.block_table.shape[1];
      if (s.page_size < 1) return bad("k", "page_size (dim 1 of a paged cache) must be >= 1", shape_str(p.k));
      s.sk = s.max_blocks * s.page_size;
      break;
    case KvLayout::Batched:
      s.kv_batch = p.k.shape[0];
      s.sk = p.k.shape[1];
      if (!given(p.cache_batch_idx) && s.kv_batch != s.batch)
        return bad("k", "batch must equal q's batch B = " + std::to_string(s.batch) +
                            " (or pass cache_batch_idx)",
                   shape_str(p.k));
      break;
  }
  if (s.kv != KvLayout::Packed && p.max_seqlen_k != 0)
    return bad("max_seqlen_k", "is only meaningful with cu_seqlens_k (leave it 0)",
               std::to_string(p.max_seqlen_k));
  if (given(p.cache_batch_idx)) {
    if (s.kv != KvLayout::Batched)
      return bad("cache_batch_idx", "only applies to a contiguous cache (not with block_table or cu_seqlens_k)",
                 s.kv == KvLayout::Paged ? "block_table given" : "cu_seqlens_k given");
    FP_RETURN_IF_ERROR(check_shape(p.cache_batch_idx, "cache_batch_idx", {s.batch}, "[B]"));
  }
  if (given(p.seqused_k))
    FP_RETURN_IF_ERROR(check_shape(p.seqused_k, "seqused_k", {s.batch}, "[B]"));
  if (given(p.cache_leftpad)) {
    if (!given(p.seqused_k))
      return bad("cache_leftpad", "needs seqused_k (a KV-cache call: the cache's end rows)", "no seqused_k");
    if (s.kv == KvLayout::Packed)
      return bad("cache_leftpad", "applies to a KV cache (batched or paged k), not to cu_seqlens_k",
                 "cu_seqlens_k given");
    FP_RETURN_IF_ERROR(check_shape(p.cache_leftpad, "cache_leftpad", {s.batch}, "[B]"));
  }

  // Append-then-attend.
  if (given(p.k_new) != given(p.v_new))
    return bad(given(p.k_new) ? "v_new" : "k_new", "k_new and v_new must be given together",
               "only one of them");
  if (given(p.k_new)) {
    if (!given(p.seqused_k))
      return bad("k_new", "needs seqused_k (the rows already in the cache)", "no seqused_k");
    if (s.q_varlen) return bad("k_new", "needs batched q (not cu_seqlens_q)", "varlen q");
    if (s.kv == KvLayout::Packed) return bad("k_new", "needs a batched or paged cache (not cu_seqlens_k)", "packed k");
    FP_RETURN_IF_ERROR(check_ndim(p.k_new, "k_new", 4, "[B, Snew, Hkv, D]"));
    s.snew = p.k_new.shape[1];
    FP_RETURN_IF_ERROR(check_shape(p.k_new, "k_new", {s.batch, s.snew, s.hkv, s.d}, "[B, Snew, Hkv, D]"));
    FP_RETURN_IF_ERROR(check_shape(p.v_new, "v_new", {s.batch, s.snew, s.hkv, s.dv}, "[B, Snew, Hkv, Dv]"));
  }
  if (given(p.rotary_cos) != given(p.rotary_sin))
    return bad(given(p.rotary_cos) ? "rotary_sin" : "rotary_cos",
               "rotary_cos and rotary_sin must be given together", "only one of them");
  if (p.rotary_interleaved != 0 && p.rotary_interleaved != 1)
    return bad("rotary_interleaved", "must be 0 or 1", std::to_string(p.rotary_interleaved));
  if (given(p.rotary_cos)) {
    if (!given(p.k_new)) return bad("rotary_cos", "needs k_new (rotary applies to appended keys)", "no k_new");
    FP_RETURN_IF_ERROR(check_ndim(p.rotary_cos, "rotary_cos", 2, "[S_ro, rotary_dim / 2]"));
    const int64_t rows = p.rotary_cos.shape[0], half = p.rotary_cos.shape[1];
    if (half < 1 || 2 * half > s.d)
      return bad("rotary_cos", "rotary_dim = 2 * shape[1] must be even, >= 2 and <= D = " + std::to_string(s.d),
                 shape_str(p.rotary_cos));
    if (p.rotary_sin.ndim != 2 || p.rotary_sin.shape[0] != rows || p.rotary_sin.shape[1] != half ||
        p.rotary_sin.stride[0] != p.rotary_cos.stride[0] || p.rotary_sin.stride[1] != p.rotary_cos.stride[1] ||
        p.rotary_sin.dtype != p.rotary_cos.dtype)
      return bad("rotary_sin", "must have rotary_cos's shape, strides and dtype",
                 shape_str(p.rotary_sin) + " vs " + shape_str(p.rotary_cos));
    if (rows < s.sk)
      return bad("rotary_cos", "S_ro (rows) must cover the cache capacity " + std::to_string(s.sk), shape_str(p.rotary_cos));
  }

  // Scalars.
  if (std::isinf(p.softmax_scale))
    return bad("softmax_scale", "must be finite (or NaN for 1/sqrt(D))", std::to_string(p.softmax_scale));
  if (p.window_left < -1) return bad("window_left", "must be >= -1 (-1 = unbounded)", std::to_string(p.window_left));
  if (p.window_right < -1) return bad("window_right", "must be >= -1 (-1 = unbounded)", std::to_string(p.window_right));
  if (p.causal != 0 && p.causal != 1) return bad("causal", "must be 0 or 1", std::to_string(p.causal));
  if (p.causal_align != FP_CAUSAL_BOTTOM_RIGHT && p.causal_align != FP_CAUSAL_TOP_LEFT)
    return bad("causal_align", "is not a valid fp_causal_align", std::to_string(static_cast<int>(p.causal_align)));
  if (!std::isfinite(p.softcap) || p.softcap < 0)
    return bad("softcap", "must be finite and >= 0 (0 = off)", std::to_string(p.softcap));
  if (given(p.alibi_slopes)) {
    const bool per_head = p.alibi_slopes.ndim == 1 && p.alibi_slopes.shape[0] == s.hq;
    const bool per_batch = p.alibi_slopes.ndim == 2 && p.alibi_slopes.shape[0] == s.batch &&
                           p.alibi_slopes.shape[1] == s.hq;
    if (!per_head && !per_batch)
      return bad("alibi_slopes", "must have shape [Hq] or [B, Hq] = [" + std::to_string(s.batch) + ", " +
                                     std::to_string(s.hq) + "]",
                 shape_str(p.alibi_slopes));
  }
  if (given(p.sinks)) FP_RETURN_IF_ERROR(check_shape(p.sinks, "sinks", {s.hq}, "[Hq]"));
  if (!std::isfinite(p.dropout_p) || p.dropout_p < 0 || p.dropout_p >= 1)
    return bad("dropout_p", "must be finite and in [0, 1)", std::to_string(p.dropout_p));
  if (given(p.dropout_rng)) {
    FP_RETURN_IF_ERROR(check_dtype(p.dropout_rng, "dropout_rng", FP_I32, "({seed lo, seed hi, offset lo, offset hi})"));
    FP_RETURN_IF_ERROR(check_shape(p.dropout_rng, "dropout_rng", {4}, "[4]"));
    if (p.dropout_seed != 0 || p.dropout_offset != 0)
      return bad("dropout_rng", "excludes dropout_seed/dropout_offset (they must be 0 when it is given)",
                 "seed " + std::to_string(p.dropout_seed) + ", offset " + std::to_string(p.dropout_offset));
  }
  if (p.num_splits < 0) return bad("num_splits", "must be >= 0 (0 = heuristic, 1 = off)", std::to_string(p.num_splits));
  FP_RETURN_IF_ERROR(check_execution(p.backend, p.stream, p.num_threads, p.q.device_type));
  if (p.workspace_bytes > 0 && p.workspace == nullptr)
    return bad("workspace", "must be non-NULL when workspace_bytes > 0",
               "NULL with workspace_bytes " + std::to_string(p.workspace_bytes));

  // Index values, where they live in host memory.
  if (p.q.device_type == FP_DEVICE_CPU) {
    if (s.q_varlen)
      FP_RETURN_IF_ERROR(check_cu_seqlens_values(p.cu_seqlens_q, "cu_seqlens_q", s.batch, s.tq,
                                                 s.sq, "max_seqlen_q"));
    if (s.kv == KvLayout::Packed)
      FP_RETURN_IF_ERROR(check_cu_seqlens_values(p.cu_seqlens_k, "cu_seqlens_k", s.batch, s.tk,
                                                 s.sk, "max_seqlen_k"));
    auto capacity = [&](int64_t b) -> int64_t {
      if (s.kv == KvLayout::Packed)
        return int64_t(host_i32(p.cu_seqlens_k, (b + 1) * p.cu_seqlens_k.stride[0])) -
               host_i32(p.cu_seqlens_k, b * p.cu_seqlens_k.stride[0]);
      return s.sk;  // batched: Sk; paged: max_blocks * page_size
    };
    if (given(p.seqused_k)) {
      for (int64_t b = 0; b < s.batch; ++b) {
        const int64_t used = host_i32(p.seqused_k, b * p.seqused_k.stride[0]);
        const int64_t cap = capacity(b);
        if (used < 0 || used > cap)
          return bad("seqused_k", "entries must be in [0, capacity]",
                     "seqused_k[" + std::to_string(b) + "] = " + std::to_string(used) +
                         ", capacity " + std::to_string(cap));
        if (used + s.snew > cap)
          return bad("seqused_k", "seqused_k + Snew must fit the cache capacity",
                     "seqused_k[" + std::to_string(b) + "] = " + std::to_string(used) + " + Snew " +
                         std::to_string(s.snew) + " > capacity " + std::to_string(cap));
        if (given(p.cache_leftpad)) {
          const int64_t pad = host_i32(p.cache_leftpad, b * p.cache_leftpad.stride[0]);
          if (pad < 0 || pad > used)
            return bad("cache_leftpad", "entries must be in [0, seqused_k]",
                       "cache_leftpad[" + std::to_string(b) + "] = " + std::to_string(pad) +
                           ", seqused_k[" + std::to_string(b) + "] = " + std::to_string(used));
        }
        // Causal/windowed q rows rotate at seqused_k + i (GPU kernels clamp to the last row).
        const bool q_per_row = p.causal || p.window_left >= 0 || p.window_right >= 0;
        if (given(p.rotary_cos) && q_per_row && used + s.sq > p.rotary_cos.shape[0])
          return bad("rotary_cos", "S_ro (rows) must cover the query positions seqused_k + i",
                     "seqused_k[" + std::to_string(b) + "] = " + std::to_string(used) + " + Sq " +
                         std::to_string(s.sq) + " > S_ro " + std::to_string(p.rotary_cos.shape[0]));
      }
    }
    if (s.kv == KvLayout::Paged) {
      // Only the blocks a sequence reaches must be valid (padding entries, and the blocks wholly
      // inside a left pad, may be anything).
      for (int64_t b = 0; b < s.batch; ++b) {
        const int64_t len = given(p.seqused_k)
                                ? host_i32(p.seqused_k, b * p.seqused_k.stride[0]) + s.snew
                                : s.sk;
        const int64_t pad =
            given(p.cache_leftpad) ? host_i32(p.cache_leftpad, b * p.cache_leftpad.stride[0]) : 0;
        const int64_t blocks = (len + s.page_size - 1) / s.page_size;
        for (int64_t j = pad / s.page_size; j < blocks; ++j) {
          const int64_t e = host_i32(p.block_table, b * p.block_table.stride[0] + j * p.block_table.stride[1]);
          if (e < 0 || e >= s.num_blocks)
            return bad("block_table", "entries must be in [0, num_blocks = " + std::to_string(s.num_blocks) + ")",
                       "block_table[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(e));
        }
      }
    }
    if (given(p.cache_batch_idx)) {
      for (int64_t b = 0; b < s.batch; ++b) {
        const int64_t e = host_i32(p.cache_batch_idx, b * p.cache_batch_idx.stride[0]);
        if (e < 0 || e >= s.kv_batch)
          return bad("cache_batch_idx", "entries must be in [0, B_cache = " + std::to_string(s.kv_batch) + ")",
                     "cache_batch_idx[" + std::to_string(b) + "] = " + std::to_string(e));
      }
    }
  }

  // ---- Fill the Problem ----
  r.dtype = dt;
  r.device = p.q.device_type;
  r.device_index = p.q.device_index;
  r.q_ptr = p.q.data;
  r.k_ptr = p.k.data;
  r.v_ptr = p.v.data;
  r.out_ptr = has_out ? p.out.data : nullptr;
  r.lse_ptr = given(p.lse) ? p.lse.data : nullptr;
  r.k_new_ptr = given(p.k_new) ? p.k_new.data : nullptr;
  r.v_new_ptr = given(p.v_new) ? p.v_new.data : nullptr;
  r.rotary_cos = given(p.rotary_cos) ? p.rotary_cos.data : nullptr;
  r.rotary_sin = given(p.rotary_sin) ? p.rotary_sin.data : nullptr;
  r.hq = s.hq;
  r.hkv = s.hkv;
  r.d = s.d;
  r.dv = s.dv;
  r.group = s.hq / s.hkv;

  r.seq.batch = s.batch;
  r.seq.sq = s.sq;
  r.seq.sk = s.sk;
  r.seq.snew = s.snew;
  r.seq.cu_q = s.q_varlen ? static_cast<const int32_t*>(p.cu_seqlens_q.data) : nullptr;
  r.seq.cu_k = s.kv == KvLayout::Packed ? static_cast<const int32_t*>(p.cu_seqlens_k.data) : nullptr;
  r.seq.seqused_k = given(p.seqused_k) ? static_cast<const int32_t*>(p.seqused_k.data) : nullptr;
  r.seq.kv_layout = s.kv;
  if (s.kv == KvLayout::Paged) {
    r.seq.block_table = static_cast<const int32_t*>(p.block_table.data);
    r.seq.block_table_stride = p.block_table.stride[0];
    r.seq.max_blocks = s.max_blocks;
    r.seq.page_size = s.page_size;
  }
  r.seq.cache_batch_idx =
      given(p.cache_batch_idx) ? static_cast<const int32_t*>(p.cache_batch_idx.data) : nullptr;
  r.seq.cache_leftpad =
      given(p.cache_leftpad) ? static_cast<const int32_t*>(p.cache_leftpad.data) : nullptr;

  r.q = row_addr_of(p.q, s.q_varlen);
  if (has_out) r.out = row_addr_of(p.out, s.q_varlen);
  r.k = kv_addr_of(p.k, s.kv);
  r.v = kv_addr_of(p.v, s.kv);
  r.has_lse = given(p.lse);
  if (r.has_lse) {
    r.lse_dtype = p.lse.dtype;
    r.lse.packed = s.q_varlen;
    if (s.q_varlen) {
      r.lse.head_stride = p.lse.stride[0];
      r.lse.row_stride = p.lse.stride[1];
    } else {
      r.lse.batch_stride = p.lse.stride[0];
      r.lse.head_stride = p.lse.stride[1];
      r.lse.row_stride = p.lse.stride[2];
    }
  }

  ScoreRules& sr = r.rules;
  sr.scale = std::isnan(p.softmax_scale) ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.d)))
                                         : p.softmax_scale;
  sr.softcap = p.softcap;
  sr.window_left = p.window_left;
  // causal intersects the window (flash_attn): whatever window_right >= -1 was given, the
  // effective right edge is the diagonal; window_left applies as given.
  sr.window_right = p.causal ? 0 : p.window_right;
  sr.top_left = p.causal_align == FP_CAUSAL_TOP_LEFT;
  if (given(p.alibi_slopes)) {
    sr.alibi = static_cast<const float*>(p.alibi_slopes.data);
    sr.alibi_batch_stride = p.alibi_slopes.ndim == 2 ? p.alibi_slopes.stride[0] : 0;
  }
  sr.sinks = given(p.sinks) ? static_cast<const float*>(p.sinks.data) : nullptr;
  sr.dropout_p = p.dropout_p;
  sr.dropout_threshold = dropout_threshold(p.dropout_p);
  sr.dropout_scale = sr.dropout_threshold ? dropout_keep_scale(sr.dropout_threshold) : 1.0f;
  sr.dropout_seed = p.dropout_seed;
  sr.dropout_offset = p.dropout_offset;
  if (given(p.dropout_rng)) {
    const auto* w = static_cast<const uint32_t*>(p.dropout_rng.data);
    if (p.dropout_rng.device_type == FP_DEVICE_CPU) {  // host memory: read it once, here
      sr.dropout_seed = u64_from_words(w);
      sr.dropout_offset = u64_from_words(w + 2);
    } else {
      sr.dropout_rng = w;  // device memory: the kernel reads it
    }
  }

  if (given(p.k_new)) {
    r.k_new = row_addr_of(p.k_new, false);
    r.v_new = row_addr_of(p.v_new, false);
  }
  if (given(p.rotary_cos)) {
    r.rotary_dim = 2 * p.rotary_cos.shape[1];
    r.rotary_interleaved = p.rotary_interleaved != 0;
    r.rotary_dtype = p.rotary_cos.dtype;
    r.rotary_row_stride = p.rotary_cos.stride[0];
    r.rotary_rows = p.rotary_cos.shape[0];
  }
  r.num_splits = p.num_splits;
  r.total_q_rows = s.q_varlen ? s.tq : s.batch * s.sq;

  *out = r;
  return Status::ok();
}

// ---- Merge -------------------------------------------------------------------------------------

Status resolve_merge_impl(const fp_merge_params& p, MergeProblem* out, bool lse_required) {
  MergeProblem r;
  r.raw = &p;
  FP_RETURN_IF_ERROR(require(p.out_partials, "out_partials"));
  FP_RETURN_IF_ERROR(require(p.lse_partials, "lse_partials"));
  FP_RETURN_IF_ERROR(require(p.out, "out"));
  if (lse_required) FP_RETURN_IF_ERROR(require(p.lse, "lse"));
  if (given(p.lse)) FP_RETURN_IF_ERROR(check_basic(p.lse, "lse"));
  FP_RETURN_IF_ERROR(check_same_device(p.lse_partials, "lse_partials", p.out_partials, "out_partials"));
  FP_RETURN_IF_ERROR(check_same_device(p.out, "out", p.out_partials, "out_partials"));
  if (given(p.lse)) FP_RETURN_IF_ERROR(check_same_device(p.lse, "lse", p.out_partials, "out_partials"));

  if (!is_float_dtype(p.out_partials.dtype))
    return bad("out_partials", "dtype must be float16, bfloat16, float32 or float64", dtype_str(p.out_partials.dtype));
  if (!is_float_dtype(p.out.dtype))
    return bad("out", "dtype must be float16, bfloat16, float32 or float64", dtype_str(p.out.dtype));
  if (p.lse_partials.dtype != FP_F32 && !(p.lse_partials.dtype == FP_F64 && p.out_partials.dtype == FP_F64))
    return bad("lse_partials", "must be float32 (float64 allowed only with float64 out_partials)",
               dtype_str(p.lse_partials.dtype));
  if (given(p.lse) && p.lse.dtype != p.lse_partials.dtype)
    return bad("lse", std::string("must have lse_partials' dtype ") + dtype_name(p.lse_partials.dtype),
               dtype_str(p.lse.dtype));

  const bool packed = p.out_partials.ndim == 4;
  if (p.out_partials.ndim != 4 && p.out_partials.ndim != 5)
    return bad("out_partials", "must be 5-D [N, B, S, H, Dv] or 4-D [N, T, H, Dv]", shape_str(p.out_partials));
  const fp_tensor& op = p.out_partials;
  r.splits = op.shape[0];
  if (r.splits < 1) return bad("out_partials", "must hold at least one partial (N >= 1)", shape_str(op));
  if (packed) {
    r.batch = 1;
    r.seqlen = op.shape[1];
    r.heads = op.shape[2];
    r.dv = op.shape[3];
    FP_RETURN_IF_ERROR(check_shape(p.lse_partials, "lse_partials", {r.splits, r.heads, r.seqlen}, "[N, H, T]"));
    FP_RETURN_IF_ERROR(check_shape(p.out, "out", {r.seqlen, r.heads, r.dv}, "[T, H, Dv]"));
    if (given(p.lse)) FP_RETURN_IF_ERROR(check_shape(p.lse, "lse", {r.heads, r.seqlen}, "[H, T]"));
    const int64_t* s = op.stride;
    r.part_stride[0] = s[0]; r.part_stride[1] = 0; r.part_stride[2] = s[1]; r.part_stride[3] = s[2]; r.part_stride[4] = s[3];
    const int64_t* l = p.lse_partials.stride;
    r.lse_part_stride[0] = l[0]; r.lse_part_stride[1] = 0; r.lse_part_stride[2] = l[1]; r.lse_part_stride[3] = l[2];
    const int64_t* o = p.out.stride;
    r.out_stride[0] = 0; r.out_stride[1] = o[0]; r.out_stride[2] = o[1]; r.out_stride[3] = o[2];
    if (given(p.lse)) { r.lse_stride[0] = 0; r.lse_stride[1] = p.lse.stride[0]; r.lse_stride[2] = p.lse.stride[1]; }
  } else {
    r.batch = op.shape[1];
    r.seqlen = op.shape[2];
    r.heads = op.shape[3];
    r.dv = op.shape[4];
    FP_RETURN_IF_ERROR(check_shape(p.lse_partials, "lse_partials", {r.splits, r.batch, r.heads, r.seqlen}, "[N, B, H, S]"));
    FP_RETURN_IF_ERROR(check_shape(p.out, "out", {r.batch, r.seqlen, r.heads, r.dv}, "[B, S, H, Dv]"));
    if (given(p.lse)) FP_RETURN_IF_ERROR(check_shape(p.lse, "lse", {r.batch, r.heads, r.seqlen}, "[B, H, S]"));
    for (int i = 0; i < 5; ++i) r.part_stride[i] = op.stride[i];
    for (int i = 0; i < 4; ++i) r.lse_part_stride[i] = p.lse_partials.stride[i];
    for (int i = 0; i < 4; ++i) r.out_stride[i] = p.out.stride[i];
    if (given(p.lse)) for (int i = 0; i < 3; ++i) r.lse_stride[i] = p.lse.stride[i];
  }
  FP_RETURN_IF_ERROR(check_execution(p.backend, p.stream, p.num_threads, op.device_type));
  r.device = op.device_type;
  r.part_dtype = op.dtype;
  r.out_dtype = p.out.dtype;
  r.lse_dtype = p.lse_partials.dtype;
  r.has_lse = given(p.lse);
  *out = r;
  return Status::ok();
}

// `t` must be given, on `ref`'s device, with `ref`'s dtype and shape (strides may differ).
Status check_like(const fp_tensor& t, const char* name, const fp_tensor& ref, const char* ref_name) {
  FP_RETURN_IF_ERROR(require(t, name));
  FP_RETURN_IF_ERROR(check_same_device(t, name, ref, ref_name));
  if (t.dtype != ref.dtype)
    return bad(name, std::string("must have ") + ref_name + "'s dtype " + dtype_str(ref.dtype), dtype_str(t.dtype));
  bool same = t.ndim == ref.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == ref.shape[i];
  if (!same) return bad(name, std::string("must have ") + ref_name + "'s shape " + shape_str(ref), shape_str(t));
  return Status::ok();
}

}  // namespace

Status resolve_fwd(const fp_attn_params& params, Problem* out) {
  return resolve_fwd_impl(params, out, FwdUse{});
}

Status resolve_bwd(const fp_attn_bwd_params& params, BwdProblem* out) {
  const fp_attn_params& f = params.fwd;
  BwdProblem r;
  FP_RETURN_IF_ERROR(resolve_fwd_impl(f, &r.fwd, FwdUse{.lse_required = true}));
  FP_RETURN_IF_ERROR(check_like(params.dout, "dout", f.out, "out"));
  FP_RETURN_IF_ERROR(check_like(params.dq, "dq", f.q, "q"));
  FP_RETURN_IF_ERROR(check_like(params.dk, "dk", f.k, "k"));
  FP_RETURN_IF_ERROR(check_like(params.dv, "dv", f.v, "v"));
  if (given(params.d_sinks)) {
    FP_RETURN_IF_ERROR(check_basic(params.d_sinks, "d_sinks"));
    if (!given(f.sinks)) return bad("d_sinks", "needs sinks (the gradient of sink logits)", "no sinks");
    FP_RETURN_IF_ERROR(check_same_device(params.d_sinks, "d_sinks", f.q, "q"));
    FP_RETURN_IF_ERROR(check_dtype(params.d_sinks, "d_sinks", FP_F32, "(like sinks)"));
    FP_RETURN_IF_ERROR(check_shape(params.d_sinks, "d_sinks", {r.fwd.hq}, "[Hq]"));
  }
  if (params.deterministic != 0 && params.deterministic != 1)
    return bad("deterministic", "must be 0 or 1", std::to_string(params.deterministic));
  // KV-cache features have no gradient definition here.
  if (given(f.k_new)) return unsupported("backward: k_new/v_new (append to a KV cache) is not supported");
  if (given(f.block_table)) return unsupported("backward: block_table (paged KV cache) is not supported");
  if (given(f.cache_batch_idx)) return unsupported("backward: cache_batch_idx is not supported");
  if (given(f.cache_leftpad)) return unsupported("backward: cache_leftpad (left-padded KV cache) is not supported");
  if (given(f.rotary_cos)) return unsupported("backward: rotary embedding is not supported");

  r.dout_ptr = params.dout.data;
  r.dq_ptr = params.dq.data;
  r.dk_ptr = params.dk.data;
  r.dv_ptr = params.dv.data;
  r.dout = row_addr_of(params.dout, r.fwd.q.packed);
  r.dq = row_addr_of(params.dq, r.fwd.q.packed);
  r.dk = kv_addr_of(params.dk, r.fwd.k.layout);
  r.dv = kv_addr_of(params.dv, r.fwd.k.layout);
  r.d_sinks = given(params.d_sinks) ? static_cast<float*>(params.d_sinks.data) : nullptr;
  r.deterministic = params.deterministic != 0;
  r.fwd.raw = &params.fwd;
  *out = r;
  return Status::ok();
}

Status resolve_probs(const fp_attn_params& params, const fp_tensor& probs, ProbsProblem* out) {
  ProbsProblem r;
  FP_RETURN_IF_ERROR(resolve_fwd_impl(params, &r.fwd, FwdUse{.lse_required = true, .out_required = false}));
  if (given(params.k_new))
    return bad("k_new", "must be absent in fp_attn_probs (it does not append: call it after the forward, "
                        "with seqused_k covering the appended rows)", "k_new given");
  FP_RETURN_IF_ERROR(require(probs, "probs"));
  FP_RETURN_IF_ERROR(check_same_device(probs, "probs", params.q, "q"));
  const fp_dtype dt = r.fwd.dtype;
  if (probs.dtype != FP_F32 && probs.dtype != dt)
    return bad("probs", std::string("must be float32 or q's dtype ") + dtype_name(dt), dtype_str(probs.dtype));
  const SeqInfo& seq = r.fwd.seq;
  FP_RETURN_IF_ERROR(check_shape(probs, "probs", {seq.batch, r.fwd.hq, seq.sq, seq.sk},
                                 "[B, Hq, Sq_max, Sk_max]"));
  r.probs_ptr = probs.data;
  r.probs_dtype = probs.dtype;
  for (int i = 0; i < 4; ++i) r.probs_stride[i] = probs.stride[i];
  *out = r;
  return Status::ok();
}

Status resolve_merge(const fp_merge_params& params, MergeProblem* out) {
  return resolve_merge_impl(params, out, /*lse_required=*/false);
}

Status resolve_merge_bwd(const fp_merge_bwd_params& params, MergeBwdProblem* out) {
  MergeBwdProblem r;
  r.raw = &params;
  FP_RETURN_IF_ERROR(resolve_merge_impl(params.fwd, &r.fwd, /*lse_required=*/true));
  const fp_merge_params& f = params.fwd;
  FP_RETURN_IF_ERROR(check_like(params.dout, "dout", f.out, "out"));
  if (given(params.dlse)) FP_RETURN_IF_ERROR(check_like(params.dlse, "dlse", f.lse, "lse"));
  FP_RETURN_IF_ERROR(check_like(params.d_out_partials, "d_out_partials", f.out_partials, "out_partials"));
  FP_RETURN_IF_ERROR(check_like(params.d_lse_partials, "d_lse_partials", f.lse_partials, "lse_partials"));
  const bool packed = f.out_partials.ndim == 4;
  const int64_t* o = params.dout.stride;
  if (packed) {
    r.dout_stride[0] = 0; r.dout_stride[1] = o[0]; r.dout_stride[2] = o[1]; r.dout_stride[3] = o[2];
  } else {
    for (int i = 0; i < 4; ++i) r.dout_stride[i] = o[i];
  }
  r.has_dlse = given(params.dlse);
  if (r.has_dlse) {
    const int64_t* l = params.dlse.stride;
    if (packed) { r.dlse_stride[0] = 0; r.dlse_stride[1] = l[0]; r.dlse_stride[2] = l[1]; }
    else for (int i = 0; i < 3; ++i) r.dlse_stride[i] = l[i];
  }
  const int64_t* dp = params.d_out_partials.stride;
  const int64_t* dl = params.d_lse_partials.stride;
  if (packed) {
    r.d_part_stride[0] = dp[0]; r.d_part_stride[1] = 0; r.d_part_stride[2] = dp[1]; r.d_part_stride[3] = dp[2]; r.d_part_stride[4] = dp[3];
    r.d_lse_part_stride[0] = dl[0]; r.d_lse_part_stride[1] = 0; r.d_lse_part_stride[2] = dl[1]; r.d_lse_part_stride[3] = dl[2];
  } else {
    for (int i = 0; i < 5; ++i) r.d_part_stride[i] = dp[i];
    for (int i = 0; i < 4; ++i) r.d_lse_part_stride[i] = dl[i];
  }
  r.fwd.raw = &params.fwd;
  *out = r;
  return Status::ok();
}

}  // namespace flashport
