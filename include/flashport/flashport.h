/*
 * flashport — exact FlashAttention for CPUs, NVIDIA GPUs and AMD GPUs.
 *
 * This is the one description of an attention call. The C++ API (flashport.hpp), the Python
 * bindings and every backend use these structs; nothing else describes a call.
 *
 * ---------------------------------------------------------------------------------------------
 * Semantics (those of flash_attn 2.8 unless stated):
 *
 *   Layouts (element strides are 64-bit and arbitrary, except the last dim is contiguous):
 *     batched : q [B, Sq, Hq, D]   k [B, Sk, Hkv, D]   v [B, Sk, Hkv, Dv]   out [B, Sq, Hq, Dv]
 *     varlen  : q [Tq, Hq, D] with cu_seqlens_q [B+1]; k/v [Tk, Hkv, D|Dv] with cu_seqlens_k [B+1]
 *     KV cache: k/v [B_cache, Sk_max, Hkv, D|Dv] (contiguous cache, optional cache_batch_idx [B])
 *               or k/v [num_blocks, page_size, Hkv, D|Dv] with block_table [B, max_blocks] (paged)
 *     lse     : fp32 [B, Hq, Sq] batched, [Hq, Tq] varlen. Natural log.
 *   Hq % Hkv == 0 (GQA/MQA: query head h reads kv head h / (Hq / Hkv)); 1 <= D, Dv <= 256.
 *
 *   Keys per sequence (Lk[b]):
 *     seqused_k[b] (+ Snew if k_new is given)   if seqused_k is given (flash_attn's cache_seqlens),
 *     cu_seqlens_k[b+1] - cu_seqlens_k[b]        else if varlen keys,
 *     max_blocks * page_size                     else if paged,
 *     Sk (k.shape[1])                            else.
 *   Queries per sequence (Lq[b]): cu_seqlens_q diff if varlen, else Sq.
 *
 *   Scores, for query row i < Lq and key j < Lk of sequence b, query head h:
 *     s  = softmax_scale * <q_i, k_j>                       (softmax_scale NaN => 1/sqrt(D))
 *     s  = softcap * tanh(s / softcap)                      if softcap > 0
 *     s += -alibi_slope[b?, h] * |i + shift - j|            if alibi_slopes is given
 *   where shift = Lk - Lq (bottom-right alignment, the default) or 0 (FP_CAUSAL_TOP_LEFT).
 *   Key j is visible from row i iff
 *     j >= i + shift - window_left    (when window_left  >= 0)
 *     j <= i + shift + window_right   (when window_right >= 0)
 *   causal = 1 intersects the window with the causal mask (as flash_attn): the effective
 *   window_right is 0 whatever window_right >= -1 was given; window_left applies as given.
 *
 *   Softmax over the visible keys; a per-head sink logit (sinks[h], fp32, already in score units)
 *   joins the denominator only:  P_ij = exp(s_ij - lse_i),
 *     lse_i = log( sum_j visible exp(s_ij) + exp(sinks[h]) ).     (the sink term only if given)
 *   The stored LSE includes the sink. A row that sees no key (and has no sink) gets out = 0 and
 *   lse = -inf, never NaN.
 *
 *   Dropout (dropout_p in [0, 1)): element (b, h, i, j) is kept iff its Philox4x32-10 byte
 *   (dropout_keep in src/core/philox.hpp: one call gives the bytes of 16 keys) is >= the
 *   threshold t = round(p * 256), clamped to [1, 255] for p > 0; p runs at 1/256 resolution,
 *   as in FlashAttention-2. Kept P are scaled by 256 / (256 - t), the inverse of the keep rate,
 *   so every output's expectation is exact. The LSE is that of the undropped softmax. Every
 *   backend keeps the same elements.
 *   (seed, offset) come from dropout_seed/dropout_offset, or from the dropout_rng tensor.
 *
 *   out_i = sum_j dropout(P_ij) * v_j.
 *   Packed rows past cu_seqlens[B] (padding) are neither read nor written.
 *
 *   KV cache append-then-attend: if k_new/v_new [B, Snew, Hkv, D|Dv] are given (they need
 *   seqused_k), they are written into the cache in place at rows seqused_k[b] .. +Snew-1 (after
 *   rotary, if any), then attention runs over Lk[b] = seqused_k[b] + Snew keys.
 *   Rotary (rotary_cos/sin [S_ro, rotary_dim/2], rotary_dim even and <= D; needs k_new):
 *   k_new row j is rotated at position seqused_k[b] + j; q row i at seqused_k[b] + i when causal
 *   or windowed, else at seqused_k[b]. Interleaved pairs (2t, 2t+1) or half-split (t, t+dim/2).
 *
 *   Left-padded cache (cache_leftpad, as flash_attn): the valid keys of sequence b are the cache
 *   rows [cache_leftpad[b], seqused_k[b] + Snew); key j of the formulas above is cache row
 *   cache_leftpad[b] + j, so Lk[b] = seqused_k[b] + Snew - cache_leftpad[b] and the causal/window
 *   alignment and ALiBi distances are those of the unpadded keys. Appended rows still land at cache
 *   rows seqused_k[b] + j, and rotary positions are cache rows (k_new row j at seqused_k[b] + j,
 *   q row i at seqused_k[b] (+ i)), as flash_attn does. Contiguous and paged caches.
 *
 *   Split-KV: num_splits 0 = heuristic, 1 = off, >= 2 = forced (clamped to the key blocks).
 *   Partials are merged with the same rule as fp_merge_fwd.
 *
 * Execution: every GPU call takes the caller's stream, allocates nothing (the caller passes a
 * workspace of at least the bytes fp_attn_fwd_workspace reports; it may hold anything on entry:
 * no call relies on it being zeroed), reads no device memory on the host and never synchronizes.
 * Index tensors (cu_seqlens, seqused_k, block_table, ...) are value-checked only where they live
 * in host memory; GPU kernels clamp instead of faulting.
 * ---------------------------------------------------------------------------------------------
 */
#ifndef FLASHPORT_H_
#define FLASHPORT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FP_MAX_DIMS 5

/* The enums are int-sized. In C++ they get int as their fixed underlying type, so any int a
 * caller (C, Python, an FFI) stores in an enum field is a value of the type, and the validation
 * rejects a bad one by name; without it such a value is undefined behaviour in C++ before any
 * check can run (UBSan's "not a valid value for type"). The layout is the C one (4 bytes). */
#ifdef __cplusplus
#define FP_ENUM(name) enum name : int
#else
#define FP_ENUM(name) enum name
#endif

typedef FP_ENUM(fp_status) {
  FP_OK = 0,
  FP_ERR_INVALID_ARGUMENT = 1, /* a tensor or scalar breaks a rule; the message names both */
  FP_ERR_UNSUPPORTED = 2,      /* valid call, but no (or not the forced) backend can run it */
  FP_ERR_WORKSPACE = 3,        /* workspace missing or smaller than required */
  FP_ERR_BACKEND_UNAVAILABLE = 4, /* backend compiled out, or no such device */
  FP_ERR_RUNTIME = 5           /* a device/runtime call failed */
} fp_status;

typedef FP_ENUM(fp_dtype) { FP_F16 = 0, FP_BF16 = 1, FP_F32 = 2, FP_F64 = 3, FP_I32 = 4 } fp_dtype;

typedef FP_ENUM(fp_device_type) {
  FP_DEVICE_CPU = 0,
  FP_DEVICE_CUDA = 1,
  FP_DEVICE_HIP = 2
} fp_device_type;

typedef FP_ENUM(fp_backend) {
  FP_BACKEND_AUTO = 0,      /* best available for the tensors' device (FLASHPORT_BACKEND overrides) */
  FP_BACKEND_REFERENCE = 1, /* fp64 oracle, CPU memory */
  FP_BACKEND_CPU = 2,       /* fast CPU kernels */
  FP_BACKEND_CUDA = 3,
  FP_BACKEND_HIP = 4
} fp_backend;

typedef FP_ENUM(fp_causal_align) {
  FP_CAUSAL_BOTTOM_RIGHT = 0, /* flash_attn >= 2.1: last query row aligned with last key */
  FP_CAUSAL_TOP_LEFT = 1      /* first query row aligned with first key (torch SDPA's is_causal) */
} fp_causal_align;
#undef FP_ENUM

/* A strided view of memory the caller owns. ndim == 0 (data == NULL) means "not given". */
typedef struct fp_tensor {
  void* data;
  fp_dtype dtype;
  int32_t ndim;
  int64_t shape[FP_MAX_DIMS];
  int64_t stride[FP_MAX_DIMS]; /* in elements; stride[ndim-1] must be 1 unless shape is 1 */
  fp_device_type device_type;
  int32_t device_index;
} fp_tensor;

/* One forward attention call. Initialise with fp_attn_params_init, then set what you need. */
typedef struct fp_attn_params {
  /* Main tensors */
  fp_tensor q, k, v; /* k, v are the KV cache when seqused_k / block_table / k_new are used */
  fp_tensor out;     /* written */
  fp_tensor lse;     /* optional output, fp32 (fp64 allowed with fp64 inputs) */

  /* Variable-length batches (packed rows) */
  fp_tensor cu_seqlens_q; /* int32 [B+1] */
  fp_tensor cu_seqlens_k; /* int32 [B+1] */
  int64_t max_seqlen_q;   /* required with cu_seqlens_q: an upper bound of Lq[b] */
  int64_t max_seqlen_k;   /* required with cu_seqlens_k: an upper bound of Lk[b] */

  /* KV cache */
  fp_tensor seqused_k;       /* int32 [B]: keys already valid per sequence (cache_seqlens) */
  fp_tensor block_table;     /* int32 [B, max_blocks]: paged cache, any page_size >= 1 */
  fp_tensor cache_batch_idx; /* int32 [B]: cache row of each sequence (contiguous cache only) */
  fp_tensor cache_leftpad;   /* int32 [B]: first valid cache row of each sequence (flash_attn's
                                cache_leftpad; needs seqused_k); see "Left-padded cache" above */
  fp_tensor k_new, v_new;    /* [B, Snew, Hkv, D|Dv]: appended in place before attending */
  fp_tensor rotary_cos, rotary_sin; /* [S_ro, rotary_dim/2], fp32 or q's dtype */
  int32_t rotary_interleaved;       /* 1: pairs (2t, 2t+1); 0: pairs (t, t + rotary_dim/2) */

  /* Score modifiers */
  float softmax_scale;          /* NaN (the init value) => 1/sqrt(D) */
  int32_t causal;               /* 1 => window_right = 0, intersected with the window */
  fp_causal_align causal_align; /* alignment of causal mask, window and ALiBi distance */
  int32_t window_left;          /* -1 = unbounded */
  int32_t window_right;         /* -1 = unbounded */
  float softcap;                /* 0 = off; > 0 enables softcap * tanh(s / softcap) */
  fp_tensor alibi_slopes;       /* fp32 [Hq] or [B, Hq] */
  fp_tensor sinks;              /* fp32 [Hq]: sink logit per query head */

  /* Dropout (Philox4x32-10; identical kept elements on every backend) */
  float dropout_p;
  uint64_t dropout_seed;
  uint64_t dropout_offset;
  /* Optional int32 [4], contiguous, on the tensors' device: {seed lo, seed hi, offset lo, offset hi}
     as 32-bit words. When given, (seed, offset) are read from it by the kernels, not from the two
     scalars above (which must then be 0): a GPU caller can keep the RNG state in device memory
     (JAX keys, CUDA-graph replays) and flashport still never reads device memory on the host. */
  fp_tensor dropout_rng;

  /* Split-KV: 0 = heuristic, 1 = off, >= 2 = forced */
  int32_t num_splits;

  /* Execution */
  fp_backend backend;     /* FP_BACKEND_AUTO or a forced backend */
  void* stream;           /* cudaStream_t / hipStream_t for GPU tensors; must be NULL on CPU */
  void* workspace;        /* caller-owned scratch, device memory of the tensors' device */
  size_t workspace_bytes; /* its size */
  /* Or the caller's allocator: when workspace is NULL and workspace_alloc is set, fp_attn_fwd /
     fp_attn_bwd call it once, after planning and before launching, with the plan's workspace size
     (never with 0), and run on the memory it returns (device memory of the tensors' device, valid
     for the call's work on `stream`, e.g. from a stream-ordered caching allocator); NULL fails the
     call with FP_ERR_WORKSPACE. One call then validates and plans exactly once. */
  void* (*workspace_alloc)(void* ctx, size_t bytes);
  void* workspace_alloc_ctx;
  int32_t num_threads;    /* fast CPU backend: 0 = FLASHPORT_NUM_THREADS or all cores;
                             the fp64 reference is single-threaded */
} fp_attn_params;

/* Backward of one forward call: the forward params (with out and lse as inputs) plus grads. */
typedef struct fp_attn_bwd_params {
  fp_attn_params fwd;     /* q, k, v, out, lse (required), masks, dropout: as in the forward */
  fp_tensor dout;         /* like out */
  fp_tensor dq, dk, dv;   /* written; like q, k, v (dk/dv summed over each GQA group) */
  fp_tensor d_sinks;      /* optional fp32 [Hq]: gradient of the sink logits (written, not added) */
  int32_t deterministic;  /* 1 => bit-identical results run after run */
} fp_attn_bwd_params;

/* Merge of split partials:  lse = log sum_i exp(lse_i),  out = sum_i exp(lse_i - lse) * out_i.
 *   batched: out_partials [N, B, S, H, Dv], lse_partials [N, B, H, S] -> out [B, S, H, Dv], lse [B, H, S]
 *   packed : out_partials [N, T, H, Dv],    lse_partials [N, H, T]    -> out [T, H, Dv],    lse [H, T]
 * Partials with lse = -inf contribute nothing; if all are -inf, out = 0 and lse = -inf. */
typedef struct fp_merge_params {
  fp_tensor out_partials; /* fp32 / fp16 / bf16 / fp64 */
  fp_tensor lse_partials; /* fp32 (fp64 with fp64 partials) */
  fp_tensor out;          /* written */
  fp_tensor lse;          /* optional, written */
  fp_backend backend;
  void* stream;
  int32_t num_threads;
} fp_merge_params;

typedef struct fp_merge_bwd_params {
  fp_merge_params fwd;       /* out and lse (required) are the forward results */
  fp_tensor dout;            /* like out */
  fp_tensor dlse;            /* optional, like lse */
  fp_tensor d_out_partials;  /* written, like out_partials */
  fp_tensor d_lse_partials;  /* written, like lse_partials */
} fp_merge_bwd_params;

/* Which backend and kernel a call would run, and the workspace it needs. */
typedef struct fp_selection {
  fp_backend backend;
  char kernel[96];
  size_t workspace_bytes;
  int32_t num_splits; /* the split count that would be used (1 = no split) */
} fp_selection;

void fp_attn_params_init(fp_attn_params* p);
void fp_attn_bwd_params_init(fp_attn_bwd_params* p);
void fp_merge_params_init(fp_merge_params* p);
void fp_merge_bwd_params_init(fp_merge_bwd_params* p);

/* Validate and select. FP_OK and a filled selection, or an error with fp_last_error() set. */
fp_status fp_attn_fwd_select(const fp_attn_params* p, fp_selection* sel);
fp_status fp_attn_bwd_select(const fp_attn_bwd_params* p, fp_selection* sel);
/* The workspace bytes the call needs (the selection's workspace_bytes; 0 = none). */
fp_status fp_attn_fwd_workspace(const fp_attn_params* p, size_t* bytes);
fp_status fp_attn_bwd_workspace(const fp_attn_bwd_params* p, size_t* bytes);

fp_status fp_attn_fwd(const fp_attn_params* p);
/* The attention probabilities of a forward call (flash_attn's return_attn_probs / S_dmask), a
 * testing aid. p is the forward's params with its lse as an INPUT (required: the forward's LSE;
 * out is not read and may be absent; k_new/v_new must be absent: call it after the forward, with
 * seqused_k covering the appended rows). Writes every element of
 *   probs [B, Hq, Sq_max, Sk_max]   Sq_max = Sq (batched) or max_seqlen_q (varlen);
 *                                   Sk_max = k.shape[1] (batched cache), max_blocks * page_size
 *                                   (paged) or max_seqlen_k (varlen keys),
 * dtype float32 or q's dtype:  probs[b, h, i, j] = exp(s_ij - lse_i) for visible keys j < Lk[b]
 * of rows i < Lq[b] (the undropped P of the header's rules: softcap, ALiBi, window, sinks through
 * lse), negated where dropout drops the element (flash_attn's encoding); 0 elsewhere. GPU: one
 * kernel on the caller's stream, no workspace, no allocation. */
fp_status fp_attn_probs(const fp_attn_params* p, fp_tensor probs);
fp_status fp_attn_bwd(const fp_attn_bwd_params* p);
fp_status fp_merge_fwd(const fp_merge_params* p);
fp_status fp_merge_bwd(const fp_merge_bwd_params* p);

/* The message of the last error on this thread ("" after a success). */
const char* fp_last_error(void);
const char* fp_status_name(fp_status s);
const char* fp_backend_name(fp_backend b);
/* 1 if the backend is compiled in and (for GPUs) a device is present. */
int fp_backend_available(fp_backend b);
const char* fp_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHPORT_H_ */
