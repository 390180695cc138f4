// Valid calls to mutate one rule at a time, and the check that a rejected call names its argument
// and writes nothing (through resolve_* and through the C API).
#pragma once
#include <string>

#include "core/validate.hpp"
#include "flashport/flashport.hpp"
#include "test_util.hpp"

namespace flashport::test {

// A valid batched forward call: q [2,3,4,8], k/v [2,5,2,8], out [2,3,4,8], lse [2,4,3], fp32.
struct FwdCall {
  int64_t B = 2, Sq = 3, Sk = 5, Hq = 4, Hkv = 2, D = 8, Dv = 8;
  HostTensor q, k, v, out, lse;
  AttnParams p;

  explicit FwdCall(fp_dtype dt = FP_F32)
      : q(dt, {B, Sq, Hq, D}), k(dt, {B, Sk, Hkv, D}), v(dt, {B, Sk, Hkv, Dv}),
        out(dt, {B, Sq, Hq, Dv}), lse(FP_F32, {B, Hq, Sq}) {
    q.fill_normal();
    k.fill_normal();
    v.fill_normal();
    out.fill_poison();
    lse.fill_poison();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
  }
};

// A valid varlen call: B=2 sequences of q lengths {3, 2} (Tq=5) and k lengths {4, 6} (Tk=10).
struct VarlenCall {
  int64_t B = 2, Tq = 5, Tk = 10, Hq = 4, Hkv = 2, D = 8, Dv = 8;
  HostTensor q, k, v, out, lse, cu_q, cu_k;
  AttnParams p;

  VarlenCall()
      : q(FP_F32, {Tq, Hq, D}), k(FP_F32, {Tk, Hkv, D}), v(FP_F32, {Tk, Hkv, Dv}),
        out(FP_F32, {Tq, Hq, Dv}), lse(FP_F32, {Hq, Tq}),
        cu_q(HostTensor::i32({3}, {0, 3, 5})), cu_k(HostTensor::i32({3}, {0, 4, 10})) {
    q.fill_normal();
    k.fill_normal();
    v.fill_normal();
    out.fill_poison();
    lse.fill_poison();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    p.cu_seqlens_q = cu_q.view();
    p.cu_seqlens_k = cu_k.view();
    p.max_seqlen_q = 3;
    p.max_seqlen_k = 6;
  }
};

// A valid paged KV-cache call with append: cache [num_blocks=6, page=4, Hkv, D], B=2,
// block_table [2, 3], seqused_k {5, 2}, k_new/v_new [2, 1, Hkv, D].
struct PagedCall {
  int64_t B = 2, Sq = 1, Hq = 4, Hkv = 2, D = 8, Dv = 8, num_blocks = 6, page = 4, max_blocks = 3;
  int64_t Snew = 1;
  HostTensor q, k, v, out, lse, block_table, seqused, k_new, v_new;
  AttnParams p;

  PagedCall()
      : q(FP_F32, {B, Sq, Hq, D}), k(FP_F32, {num_blocks, page, Hkv, D}),
        v(FP_F32, {num_blocks, page, Hkv, Dv}), out(FP_F32, {B, Sq, Hq, Dv}),
        lse(FP_F32, {B, Hq, Sq}), block_table(HostTensor::i32({2, 3}, {5, 0, 3, 1, 2, 4})),
        seqused(HostTensor::i32({2}, {5, 2})), k_new(FP_F32, {B, Snew, Hkv, D}),
        v_new(FP_F32, {B, Snew, Hkv, Dv}) {
    for (HostTensor* t : {&q, &k, &v, &k_new, &v_new}) t->fill_normal();
    out.fill_poison();
    lse.fill_poison();
    p.q = q.view();
    p.k = k.view();
    p.v = v.view();
    p.out = out.view();
    p.lse = lse.view();
    p.block_table = block_table.view();
    p.seqused_k = seqused.view();
    p.k_new = k_new.view();
    p.v_new = v_new.view();
  }
};

// A valid backward call built on FwdCall (out and lse as inputs).
struct BwdCall {
  FwdCall f;
  HostTensor dout, dq, dk, dv;
  AttnBwdParams p;

  BwdCall()
      : dout(FP_F32, {f.B, f.Sq, f.Hq, f.Dv}), dq(FP_F32, {f.B, f.Sq, f.Hq, f.D}),
        dk(FP_F32, {f.B, f.Sk, f.Hkv, f.D}), dv(FP_F32, {f.B, f.Sk, f.Hkv, f.Dv}) {
    f.out.fill_normal();
    f.lse.fill_normal();
    dout.fill_normal();
    dq.fill_poison();
    dk.fill_poison();
    dv.fill_poison();
    p.fwd = f.p;
    p.dout = dout.view();
    p.dq = dq.view();
    p.dk = dk.view();
    p.dv = dv.view();
  }
};

// A valid batched merge: N=3 partials of [B=2, S=3, H=2, Dv=4].
struct MergeCall {
  int64_t N = 3, B = 2, S = 3, H = 2, Dv = 4;
  HostTensor parts, lse_parts, out, lse;
  MergeParams p;

  MergeCall()
      : parts(FP_F32, {N, B, S, H, Dv}), lse_parts(FP_F32, {N, B, H, S}), out(FP_F32, {B, S, H, Dv}),
        lse(FP_F32, {B, H, S}) {
    parts.fill_normal();
    lse_parts.fill_normal();
    out.fill_poison();
    lse.fill_poison();
    p.out_partials = parts.view();
    p.lse_partials = lse_parts.view();
    p.out = out.view();
    p.lse = lse.view();
  }
};

struct MergeBwdCall {
  MergeCall m;
  HostTensor dout, dlse, d_parts, d_lse_parts;
  MergeBwdParams p;

  MergeBwdCall()
      : dout(FP_F32, {m.B, m.S, m.H, m.Dv}), dlse(FP_F32, {m.B, m.H, m.S}),
        d_parts(FP_F32, {m.N, m.B, m.S, m.H, m.Dv}), d_lse_parts(FP_F32, {m.N, m.B, m.H, m.S}) {
    m.out.fill_normal();
    m.lse.fill_normal();
    dout.fill_normal();
    dlse.fill_normal();
    d_parts.fill_poison();
    d_lse_parts.fill_poison();
    p.fwd = m.p;
    p.dout = dout.view();
    p.dlse = dlse.view();
    p.d_out_partials = d_parts.view();
    p.d_lse_partials = d_lse_parts.view();
  }
};

// Calls `fn` first, then reads fp_last_error() (argument evaluation order is unspecified).
template <class F>
::testing::AssertionResult c_call_matches(F&& fn, fp_status want, const std::string& needle);

inline ::testing::AssertionResult message_matches(fp_status got, const std::string& msg,
                                                  fp_status want, const std::string& needle) {
  if (got != want)
    return ::testing::AssertionFailure() << "status " << fp_status_name(got) << " (want "
                                         << fp_status_name(want) << "), message: " << msg;
  if (msg.find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << needle << "\"";
  return ::testing::AssertionSuccess();
}

template <class F>
::testing::AssertionResult c_call_matches(F&& fn, fp_status want, const std::string& needle) {
  const fp_status got = fn();
  const std::string msg = fp_last_error();
  return message_matches(got, msg, want, needle);
}

// The output tensors still hold their poison (nothing written) and their guards.
inline ::testing::AssertionResult untouched(std::initializer_list<const HostTensor*> outputs) {
  for (const HostTensor* t : outputs) {
    if (t->poisoned_count() != t->numel())
      return ::testing::AssertionFailure() << t->numel() - t->poisoned_count()
                                           << " output elements were written";
    auto g = t->guards_intact();
    if (!g) return g;
  }
  return ::testing::AssertionSuccess();
}

// resolve_fwd and fp_attn_fwd (and fp_attn_fwd_select) reject `p` with `code` and a message
// containing `needle` (the argument name), leaving the Problem and the outputs untouched.
inline ::testing::AssertionResult fwd_rejected(const fp_attn_params& p, fp_status code,
                                               const std::string& needle,
                                               std::initializer_list<const HostTensor*> outputs) {
  Problem prob;
  prob.hq = -77;
  Status st = resolve_fwd(p, &prob);
  auto r = message_matches(st.code(), st.message(), code, needle);
  if (!r) return r << " [resolve_fwd]";
  if (prob.hq != -77) return ::testing::AssertionFailure() << "resolve_fwd wrote the Problem";
  fp_selection sel{};
  r = c_call_matches([&] { return fp_attn_fwd_select(&p, &sel); }, code, needle);
  if (!r) return r << " [fp_attn_fwd_select]";
  r = c_call_matches([&] { return fp_attn_fwd(&p); }, code, needle);
  if (!r) return r << " [fp_attn_fwd]";
  return untouched(outputs);
}

inline ::testing::AssertionResult bwd_rejected(const fp_attn_bwd_params& p, fp_status code,
                                               const std::string& needle,
                                               std::initializer_list<const HostTensor*> outputs) {
  BwdProblem prob;
  prob.fwd.hq = -77;
  Status st = resolve_bwd(p, &prob);
  auto r = message_matches(st.code(), st.message(), code, needle);
  if (!r) return r << " [resolve_bwd]";
  if (prob.fwd.hq != -77) return ::testing::AssertionFailure() << "resolve_bwd wrote the Problem";
  r = c_call_matches([&] { return fp_attn_bwd(&p); }, code, needle);
  if (!r) return r << " [fp_attn_bwd]";
  return untouched(outputs);
}

inline ::testing::AssertionResult merge_rejected(const fp_merge_params& p, const std::string& needle,
                                                 std::initializer_list<const HostTensor*> outputs) {
  MergeProblem prob;
  prob.splits = -77;
  Status st = resolve_merge(p, &prob);
  auto r = message_matches(st.code(), st.message(), FP_ERR_INVALID_ARGUMENT, needle);
  if (!r) return r << " [resolve_merge]";
  if (prob.splits != -77) return ::testing::AssertionFailure() << "resolve_merge wrote the Problem";
  r = c_call_matches([&] { return fp_merge_fwd(&p); }, FP_ERR_INVALID_ARGUMENT, needle);
  if (!r) return r << " [fp_merge_fwd]";
  return untouched(outputs);
}

inline ::testing::AssertionResult merge_bwd_rejected(const fp_merge_bwd_params& p,
                                                     const std::string& needle,
                                                     std::initializer_list<const HostTensor*> outputs) {
  MergeBwdProblem prob;
  prob.fwd.splits = -77;
  Status st = resolve_merge_bwd(p, &prob);
  auto r = message_matches(st.code(), st.message(), FP_ERR_INVALID_ARGUMENT, needle);
  if (!r) return r << " [resolve_merge_bwd]";
  if (prob.fwd.splits != -77) return ::testing::AssertionFailure() << "resolve_merge_bwd wrote";
  r = c_call_matches([&] { return fp_merge_bwd(&p); }, FP_ERR_INVALID_ARGUMENT, needle);
  if (!r) return r << " [fp_merge_bwd]";
  return untouched(outputs);
}

}  // namespace flashport::test
