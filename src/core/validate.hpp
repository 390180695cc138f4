// Validation: the C structs become resolved Problems, or a Status naming the argument and the
// rule it breaks. The only producer of Problem / BwdProblem / MergeProblem / MergeBwdProblem.
// Nothing is written (not even *out) when an error is returned.
#pragma once
#include "problem.hpp"
#include "status.hpp"

namespace flashport {

Status resolve_fwd(const fp_attn_params& params, Problem* out);
Status resolve_bwd(const fp_attn_bwd_params& params, BwdProblem* out);
// fp_attn_probs: the forward's params (lse required as an input, out optional, no k_new) and the
// probs tensor [B, Hq, Sq_max, Sk_max], float32 or q's dtype.
Status resolve_probs(const fp_attn_params& params, const fp_tensor& probs, ProbsProblem* out);
Status resolve_merge(const fp_merge_params& params, MergeProblem* out);
Status resolve_merge_bwd(const fp_merge_bwd_params& params, MergeBwdProblem* out);

// True if the tensor is given (ndim > 0 or data non-null).
inline bool tensor_given(const fp_tensor& t) { return t.ndim != 0 || t.data != nullptr; }

}  // namespace flashport
