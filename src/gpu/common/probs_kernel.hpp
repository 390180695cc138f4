// fp_attn_probs on CUDA (a testing aid): the arguments of the one probs kernel, built on the host
// from a validated ProbsProblem, and its launch. One thread per element of probs [B, Hq, Sq, Sk];
// scores from the shared addressing (SeqInfo/KvAddr: varlen, paged, cache_batch_idx, left pad) and
// the shared score rules (SeqScoreRules over ScoreRules: window/causal range, ALiBi, softcap;
// ScoreRules: dropout).
#pragma once
#include <cstdint>

#include "core/problem.hpp"
#include "gpu/common/kernel_args.hpp"
#include "gpu/common/vendor.hpp"

namespace flashport::gpu {

struct ProbsArgs {
  const void* q = nullptr;  // fp16/bf16/fp32 (q's dtype), as is k
  const void* k = nullptr;
  const float* lse = nullptr;
  void* probs = nullptr;
  SeqInfo seq;
  RowAddr q_addr;
  KvAddr k_addr;
  LseAddr lse_addr;
  ScoreRules rules;
  float softcap_in = 0.0f;   // scale / softcap (0: no softcap), natural-log units as rules.scale
  float softcap_out = 0.0f;  // softcap
  int64_t probs_stride[4] = {0, 0, 0, 0};  // (b, h, i, j)
  bool bf16 = false;         // q/k dtype: bf16, else fp16 (unless f32)
  bool f32 = false;          // q/k dtype: fp32
  bool probs_f32 = true;     // probs dtype: fp32, else q's dtype
  int64_t k_rows_cap = 0;    // batched / paged: cache rows per sequence (clamp), 0 = none
  int64_t num_pages = 0;     // paged: k.shape[0] (page ids are clamped to it)
  int32_t hq = 0, group = 1, d = 0;
};

inline ProbsArgs probs_args(const ProbsProblem& pp) {
  const Problem& p = pp.fwd;
  ProbsArgs a;
  a.q = p.q_ptr;
  a.k = p.k_ptr;
  a.lse = static_cast<const float*>(p.lse_ptr);
  a.probs = pp.probs_ptr;
  a.seq = p.seq;
  a.q_addr = p.q;
  a.k_addr = p.k;
  a.lse_addr = p.lse;
  a.rules = p.rules;
  a.softcap_in = p.rules.softcap > 0.0f ? p.rules.scale / p.rules.softcap : 0.0f;
  a.softcap_out = p.rules.softcap;
  for (int i = 0; i < 4; ++i) a.probs_stride[i] = pp.probs_stride[i];
  a.bf16 = p.dtype == FP_BF16;
  a.f32 = p.dtype == FP_F32;
  a.probs_f32 = pp.probs_dtype == FP_F32;
  a.k_rows_cap = kv_rows_cap(p);
  a.num_pages = kv_num_pages(p);
  a.hq = int32_t(p.hq), a.group = int32_t(p.group), a.d = int32_t(p.d);
  return a;
}

// Elements of probs: B * Hq * Sq_max * Sk_max.
FP_HD int64_t probs_elements(const ProbsArgs& a) { return a.seq.batch * a.hq * a.seq.sq * a.seq.sk; }

gpuError_t launch_probs(const ProbsArgs& a, gpuStream_t stream);

}  // namespace flashport::gpu
