// The fp64 reference backend: the oracle every other backend is judged by.
//
// Straightforward loops over (batch, kv head, query head of its group, row), everything computed
// in double from the inputs upcast once, results rounded once to the output dtype. Each row's
// softmax is formed over all its visible keys at once: no tiling, no online softmax (splits, when
// requested, go through the same merge as fp_merge_fwd), so the code reads like the header
// comment of flashport.h. Speed is secondary; it allocates host scratch freely and asks for no
// workspace.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/backend.hpp"
#include "core/dtype.hpp"
#include "core/philox.hpp"
#include "core/problem.hpp"
#include "core/rotary.hpp"
#include "core/status.hpp"

namespace flashport {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr const char* kCpuOnly = "reference backend: runs on CPU memory only";

// The value v would have after a round trip through storage type t.
double round_to(fp_dtype t, double v) {
  double buf = 0.0;  // 8 bytes: room for any storage type
  store_from_double(&buf, t, 0, v);
  return load_as_double(&buf, t, 0);
}

// ------------------------------------------------------------------------------------------
// Merge of partials (the one routine behind fp_merge_fwd and split-KV forward).
//   lse = log sum_i exp(lse_i),  out = sum_i exp(lse_i - lse) * out_i
// Partials with lse_i = -inf are skipped (even if their out_i holds garbage); all -inf gives
// out = 0, lse = -inf. A NaN lse_i propagates.
void merge_partials(int64_t n, const double* lse_parts, const double* out_parts, int64_t dv,
                    double* out, double* lse) {
  double m = kNegInf;
  bool nan_seen = false;
  for (int64_t s = 0; s < n; ++s) {
    if (std::isnan(lse_parts[s])) nan_seen = true;
    else if (lse_parts[s] > m) m = lse_parts[s];
  }
  if (nan_seen) {
    for (int64_t d = 0; d < dv; ++d) out[d] = std::numeric_limits<double>::quiet_NaN();
    *lse = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  for (int64_t d = 0; d < dv; ++d) out[d] = 0.0;
  if (m == kNegInf) {
    *lse = kNegInf;
    return;
  }
  double sum = 0.0;
  for (int64_t s = 0; s < n; ++s)
    if (lse_parts[s] != kNegInf) sum += std::exp(lse_parts[s] - m);
  const double total = m + std::log(sum);
  for (int64_t s = 0; s < n; ++s) {
    if (lse_parts[s] == kNegInf) continue;
    const double w = std::exp(lse_parts[s] - total);
    for (int64_t d = 0; d < dv; ++d) out[d] += w * out_parts[s * dv + d];
  }
  *lse = total;
}

// ------------------------------------------------------------------------------------------
int64_t kv_capacity(const Problem& p) {
  switch (p.seq.kv_layout) {
    case KvLayout::Paged: return p.seq.max_blocks * p.seq.page_size;
    case KvLayout::Packed: return std::numeric_limits<int64_t>::max();
    default: return p.seq.sk;
  }
}

int64_t max_key_len(const Problem& p) {
  int64_t m = 0;
  for (int64_t b = 0; b < p.seq.batch; ++b) m = std::max(m, p.seq.k_len(b));
  return m;
}

// Checks the oracle makes before writing anything, so a bad index never faults here.
Status check_ranges(const Problem& p) {
  const int64_t cap = kv_capacity(p);
  for (int64_t b = 0; b < p.seq.batch; ++b) {
    const int64_t lk = p.seq.k_len(b), end = p.seq.key_row(b, lk);  // one past the last row
    if (lk < 0 || end > cap) {
      return invalid("reference backend: sequence " + std::to_string(b) + " reaches cache row " +
                     std::to_string(end) + ", more than the KV cache holds (" +
                     std::to_string(cap) + ")");
    }
    if (p.seq.q_len(b) < 0) return invalid("cu_seqlens_q: must be non-decreasing");
    if (p.rotary_dim > 0) {
      const int64_t last_pos = std::max(p.seq.cache_rows_used(b) + p.seq.snew - 1,
                                        q_rotary_pos(p, b, std::max<int64_t>(p.seq.q_len(b) - 1, 0)));
      if (last_pos >= p.rotary_rows) {
        return invalid("rotary_cos: has " + std::to_string(p.rotary_rows) +
                       " rows, but position " + std::to_string(last_pos) + " is needed");
      }
    }
  }
  return Status::ok();
}

// ------------------------------------------------------------------------------------------
void load_row(const void* base, fp_dtype t, int64_t off, int64_t n, double* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = load_as_double(base, t, off + d);
}

// Four accumulators: in fp64 any summation order is accurate far beyond what the oracle is
// compared at, and this one does not serialise on one add chain (the oracle also runs inside
// other backends' test suites, at sizes like 1025 x 1025).
double dot(const double* a, const double* b, int64_t n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    s0 += a[t] * b[t];
    s1 += a[t + 1] * b[t + 1];
    s2 += a[t + 2] * b[t + 2];
    s3 += a[t + 3] * b[t + 3];
  }
  for (; t < n; ++t) s0 += a[t] * b[t];
  return (s0 + s1) + (s2 + s3);
}

// Keys and values of one (sequence, kv head), upcast once into contiguous rows.
struct KvRows {
  int64_t lk = 0;
  std::vector<double> k, v;  // [lk, D], [lk, Dv]
  const double* key(int64_t j, int64_t d) const { return &k[j * d]; }
};

void gather_kv(const Problem& p, int64_t b, int64_t hk, int64_t lk, KvRows* kv) {
  kv->lk = lk;
  kv->k.resize(lk * p.d);
  kv->v.resize(lk * p.dv);
  for (int64_t j = 0; j < lk; ++j) {
    load_row(p.k_ptr, p.dtype, p.k.at(p.seq, b, j, hk), p.d, &kv->k[j * p.d]);
    load_row(p.v_ptr, p.dtype, p.v.at(p.seq, b, j, hk), p.dv, &kv->v[j * p.dv]);
  }
}

// Scores of one (b, h, i) row over its visible keys [lo, hi).
struct RowScores {
  int64_t lo = 0, hi = 0;
  std::vector<double> s;         // final scores, s[j - lo]
  std::vector<double> dtanh;     // d score / d (scale q.k): 1 - tanh^2 with softcap, else 1 (backward)
};

void compute_scores(const Problem& p, const KvRows& kv, const double* qv, int64_t b, int64_t h,
                    int64_t i, int64_t lq, RowScores* rs) {
  const ScoreRules& r = p.rules;
  // The kernels' rules in fp64 and natural-log units.
  const double scale = r.scale, softcap = r.softcap;
  const double softcap_in = softcap > 0.0 ? scale / softcap : 0.0;
  const SeqScoreRules<int64_t, double> rules(r, lq, kv.lk, scale, softcap_in, softcap);
  rs->lo = rules.vis_lo(i);
  rs->hi = rules.vis_hi(i);
  if (rs->hi < rs->lo) rs->hi = rs->lo;
  const int64_t n = rs->hi - rs->lo;
  rs->s.assign(n, 0.0);
  rs->dtanh.assign(n, 1.0);
  const double neg_slope = -double(r.alibi_slope(b, h));
  for (int64_t j = rs->lo; j < rs->hi; ++j) {
    const auto sg = rules.score_grad(dot(qv, kv.key(j, p.d), p.d));
    double s = sg.score;
    rs->dtanh[j - rs->lo] = sg.dtanh;
    if (rules.alibi()) s += rules.alibi_bias(neg_slope, i, j);
    rs->s[j - rs->lo] = s;
  }
}

// Dropout multipliers of row (b, h, i): 0 or 1 / (keep rate), 1 without dropout. Element
// (b, h, i, j) follows dropout_keep; the Philox words of a block of 16 keys are drawn once.
class DropoutRow {
 public:
  DropoutRow(const Problem& p, int64_t b, int64_t h, int64_t i)
      : r_(p.rules), hq_(p.hq), b_(b), h_(h), i_(i),
        scale_(256.0 / (256.0 - double(p.rules.dropout_threshold))) {}
  double factor(int64_t j) {
    if (!r_.has_dropout()) return 1.0;
    if ((j >> 4) != block_) {
      words_ = dropout_words(r_.dropout_seed, r_.dropout_offset, b_, hq_, h_, i_, j);
      block_ = j >> 4;
    }
    return dropout_byte(words_, j) >= r_.dropout_threshold ? scale_ : 0.0;
  }

 private:
  const ScoreRules& r_;
  int64_t hq_, b_, h_, i_;
  double scale_;
  int64_t block_ = -1;
  Philox4 words_{};
};

// Softmax partial of keys [a, c) (clipped to the visible range), with the sink in the
// denominator if with_sink. out (dv) = sum_j dropout(exp(s_j - lse)) v_j.
void row_partial(const Problem& p, const KvRows& kv, const RowScores& rs, DropoutRow& drop,
                 int64_t a, int64_t c, bool with_sink, double sink, double* out, double* lse) {
  a = std::max(a, rs.lo);
  c = std::min(c, rs.hi);
  for (int64_t d = 0; d < p.dv; ++d) out[d] = 0.0;
  double m = with_sink ? sink : kNegInf;
  for (int64_t j = a; j < c; ++j) m = std::max(m, rs.s[j - rs.lo]);
  if (m == kNegInf) {  // nothing visible and no sink
    *lse = kNegInf;
    return;
  }
  double sum = with_sink ? std::exp(sink - m) : 0.0;
  for (int64_t j = a; j < c; ++j) sum += std::exp(rs.s[j - rs.lo] - m);
  const double l = m + std::log(sum);
  for (int64_t j = a; j < c; ++j) {
    const double pj = std::exp(rs.s[j - rs.lo] - l) * drop.factor(j);
    if (pj == 0.0) continue;
    const double* vj = &kv.v[j * p.dv];
    for (int64_t d = 0; d < p.dv; ++d) out[d] += pj * vj[d];
  }
  *lse = l;
}

// Append-then-attend: write k_new (rotated) and v_new into the cache at cache rows
// seqused_k[b] + j (absolute rows: a left pad does not move them).
void append_new_keys(const Problem& p) {
  std::vector<double> row(std::max(p.d, p.dv));
  for (int64_t b = 0; b < p.seq.batch; ++b) {
    const int64_t base = p.seq.cache_rows_used(b);
    for (int64_t j = 0; j < p.seq.snew; ++j) {
      for (int64_t hk = 0; hk < p.hkv; ++hk) {
        load_row(p.k_new_ptr, p.dtype, p.k_new.at(b, 0, j, hk), p.d, row.data());
        if (p.rotary_dim > 0) apply_rotary(p, base + j, row.data());
        const int64_t koff = p.k.at_row(p.seq, b, base + j, hk);
        for (int64_t d = 0; d < p.d; ++d) store_from_double(p.k_ptr, p.dtype, koff + d, row[d]);
        load_row(p.v_new_ptr, p.dtype, p.v_new.at(b, 0, j, hk), p.dv, row.data());
        const int64_t voff = p.v.at_row(p.seq, b, base + j, hk);
        for (int64_t d = 0; d < p.dv; ++d) store_from_double(p.v_ptr, p.dtype, voff + d, row[d]);
      }
    }
  }
}

// Query row (b, i, h) as doubles, rotated (and rounded back to q's dtype, as the rotated k
// rows are by being stored in the cache) when rotary is on.
void load_query(const Problem& p, int64_t b, int64_t i, int64_t h, double* qv) {
  load_row(p.q_ptr, p.dtype, p.q.at(b, p.seq.q_start(b), i, h), p.d, qv);
  if (p.rotary_dim > 0) {
    apply_rotary(p, q_rotary_pos(p, b, i), qv);
    for (int64_t d = 0; d < p.rotary_dim; ++d) qv[d] = round_to(p.dtype, qv[d]);
  }
}

// ------------------------------------------------------------------------------------------
class ReferenceBackend final : public Backend {
 public:
  fp_backend id() const override { return FP_BACKEND_REFERENCE; }
  bool available() const override { return true; }
  bool handles_device(fp_device_type dev) const override { return dev == FP_DEVICE_CPU; }

  Status plan_fwd(const Problem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    *plan = Plan{};
    std::snprintf(plan->kernel, sizeof(plan->kernel), "reference_fp64");
    plan->workspace_bytes = 0;
    plan->num_threads = 1;
    // 0 (heuristic) and 1 mean unsplit here; a forced count is clamped to the longest key range
    // (the reference's key block is one key).
    int64_t splits = p.num_splits >= 2 ? p.num_splits : 1;
    splits = std::min<int64_t>(splits, std::max<int64_t>(1, max_key_len(p)));
    plan->num_splits = static_cast<int32_t>(splits);
    return Status::ok();
  }

  Status run_fwd(const Problem& p, const Plan& plan, void* /*workspace*/) const override {
    if (p.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    FP_RETURN_IF_ERROR(check_ranges(p));
    if (p.seq.snew > 0) append_new_keys(p);  // before any key is read

    const int64_t splits = std::max<int32_t>(plan.num_splits, 1);
    std::vector<double> qv(p.d), out(p.dv);
    std::vector<double> part_out((splits + 1) * p.dv), part_lse(splits + 1);
    RowScores rs;
    KvRows kv;
    for (int64_t b = 0; b < p.seq.batch; ++b) {
      const int64_t lq = p.seq.q_len(b), lk = p.seq.k_len(b), q0 = p.seq.q_start(b);
      for (int64_t hk = 0; hk < p.hkv; ++hk) {
        gather_kv(p, b, hk, lk, &kv);
        for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
          const bool has_sink = p.rules.sinks != nullptr;
          const double sink = has_sink ? double(p.rules.sinks[h]) : kNegInf;
          for (int64_t i = 0; i < lq; ++i) {
            load_query(p, b, i, h, qv.data());
            compute_scores(p, kv, qv.data(), b, h, i, lq, &rs);
            DropoutRow drop(p, b, h, i);
            double lse = kNegInf;
            if (splits == 1) {
              row_partial(p, kv, rs, drop, 0, lk, has_sink, sink, out.data(), &lse);
            } else {
              // Contiguous chunks of [0, lk); the sink joins once, as its own partial (out 0).
              const int64_t chunk = (lk + splits - 1) / splits;
              for (int64_t s = 0; s < splits; ++s) {
                const int64_t a = std::min(lk, s * chunk), c = std::min(lk, (s + 1) * chunk);
                row_partial(p, kv, rs, drop, a, c, false, 0.0, &part_out[s * p.dv], &part_lse[s]);
              }
              int64_t n = splits;
              if (has_sink) {
                std::fill(&part_out[n * p.dv], &part_out[n * p.dv] + p.dv, 0.0);
                part_lse[n++] = sink;
              }
              merge_partials(n, part_lse.data(), part_out.data(), p.dv, out.data(), &lse);
            }
            const int64_t ooff = p.out.at(b, q0, i, h);
            for (int64_t d = 0; d < p.dv; ++d) store_from_double(p.out_ptr, p.dtype, ooff + d, out[d]);
            if (p.has_lse) store_from_double(p.lse_ptr, p.lse_dtype, p.lse.at(b, q0, h, i), lse);
          }
        }
      }
    }
    return Status::ok();
  }

  Status plan_bwd(const BwdProblem& p, Plan* plan) const override {
    if (p.fwd.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    if (p.fwd.seq.snew > 0 || p.fwd.rotary_dim > 0)
      return unsupported("reference backend: no backward for append-then-attend (k_new, rotary)");
    if (!p.fwd.has_lse) return invalid("lse: required by the backward");
    *plan = Plan{};
    std::snprintf(plan->kernel, sizeof(plan->kernel), "reference_fp64_bwd");
    plan->num_splits = 1;
    plan->num_threads = 1;
    return Status::ok();
  }

  // dS = P * (dP - D) with D_i = dout_i . out_i (FlashAttention's form, which also holds with
  // dropout), P = exp(s - lse) from the GIVEN lse; softcap multiplies dS by 1 - tanh^2.
  Status run_bwd(const BwdProblem& bp, const Plan& /*plan*/, void* /*workspace*/) const override {
    Plan check;
    FP_RETURN_IF_ERROR(plan_bwd(bp, &check));
    const Problem& p = bp.fwd;
    FP_RETURN_IF_ERROR(check_ranges(p));
    const ScoreRules& r = p.rules;
    const double scale = r.scale;

    // dk/dv sums keyed by the element offset of their row, so a row reached from two sequences
    // (shared pages, repeated cache rows) would get the sum of both contributions.
    std::unordered_map<int64_t, std::vector<double>> dk_rows, dv_rows;
    auto add_row = [](std::unordered_map<int64_t, std::vector<double>>& m, int64_t off,
                      const double* g, int64_t n) {
      auto& row = m[off];
      if (row.empty()) row.assign(n, 0.0);
      for (int64_t d = 0; d < n; ++d) row[d] += g[d];
    };
    std::vector<double> dsink(p.hq, 0.0);
    std::vector<double> qv(p.d), dq(p.d), dout(p.dv), outv(p.dv), dK, dV;
    RowScores rs;
    KvRows kv;
    for (int64_t b = 0; b < p.seq.batch; ++b) {
      const int64_t lq = p.seq.q_len(b), lk = p.seq.k_len(b), q0 = p.seq.q_start(b);
      for (int64_t hk = 0; hk < p.hkv; ++hk) {
        gather_kv(p, b, hk, lk, &kv);
        dK.assign(lk * p.d, 0.0);  // summed over the query heads of the group
        dV.assign(lk * p.dv, 0.0);
        for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
          for (int64_t i = 0; i < lq; ++i) {
            load_query(p, b, i, h, qv.data());
            load_row(bp.dout_ptr, p.dtype, bp.dout.at(b, q0, i, h), p.dv, dout.data());
            load_row(p.out_ptr, p.dtype, p.out.at(b, q0, i, h), p.dv, outv.data());
            const double lse = load_as_double(p.lse_ptr, p.lse_dtype, p.lse.at(b, q0, h, i));
            const double D = dot(dout.data(), outv.data(), p.dv);
            std::fill(dq.begin(), dq.end(), 0.0);
            if (lse != kNegInf) {  // a row that saw nothing has no gradient
              if (r.sinks) dsink[h] -= std::exp(double(r.sinks[h]) - lse) * D;
              compute_scores(p, kv, qv.data(), b, h, i, lq, &rs);
              DropoutRow drop(p, b, h, i);
              for (int64_t j = rs.lo; j < rs.hi; ++j) {
                const double P = std::exp(rs.s[j - rs.lo] - lse);
                const double keep = drop.factor(j);
                const double dP = keep * dot(dout.data(), &kv.v[j * p.dv], p.dv);
                double dS = P * (dP - D);
                dS *= rs.dtanh[j - rs.lo];  // softcap's derivative (1 without)
                const double* kj = kv.key(j, p.d);
                double* dkj = &dK[j * p.d];
                for (int64_t d = 0; d < p.d; ++d) {
                  dq[d] += scale * dS * kj[d];
                  dkj[d] += scale * dS * qv[d];
                }
                const double pk = P * keep;
                double* dvj = &dV[j * p.dv];
                for (int64_t d = 0; d < p.dv; ++d) dvj[d] += pk * dout[d];
              }
            }
            const int64_t dqoff = bp.dq.at(b, q0, i, h);
            for (int64_t d = 0; d < p.d; ++d) store_from_double(bp.dq_ptr, p.dtype, dqoff + d, dq[d]);
          }
        }
        for (int64_t j = 0; j < lk; ++j) {
          add_row(dk_rows, bp.dk.at(p.seq, b, j, hk), &dK[j * p.d], p.d);
          add_row(dv_rows, bp.dv.at(p.seq, b, j, hk), &dV[j * p.dv], p.dv);
        }
      }
    }
    // In a batched cache, rows past Lk[b] are not keys of the call: their gradient is 0.
    if (p.seq.kv_layout == KvLayout::Batched) {
      for (int64_t b = 0; b < p.seq.batch; ++b)
        for (int64_t j = p.seq.k_len(b); j < p.seq.sk; ++j)
          for (int64_t hk = 0; hk < p.hkv; ++hk) {
            const int64_t dkoff = bp.dk.at(p.seq, b, j, hk), dvoff = bp.dv.at(p.seq, b, j, hk);
            if (!dk_rows.count(dkoff))
              for (int64_t d = 0; d < p.d; ++d) store_from_double(bp.dk_ptr, p.dtype, dkoff + d, 0.0);
            if (!dv_rows.count(dvoff))
              for (int64_t d = 0; d < p.dv; ++d) store_from_double(bp.dv_ptr, p.dtype, dvoff + d, 0.0);
          }
    }
    for (const auto& [off, g] : dk_rows)
      for (int64_t d = 0; d < p.d; ++d) store_from_double(bp.dk_ptr, p.dtype, off + d, g[d]);
    for (const auto& [off, g] : dv_rows)
      for (int64_t d = 0; d < p.dv; ++d) store_from_double(bp.dv_ptr, p.dtype, off + d, g[d]);
    if (bp.d_sinks)
      for (int64_t h = 0; h < p.hq; ++h) bp.d_sinks[h] = static_cast<float>(dsink[h]);
    return Status::ok();
  }

  Status plan_probs(const ProbsProblem& pp, Plan* plan) const override {
    if (pp.fwd.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    *plan = Plan{};
    std::snprintf(plan->kernel, sizeof(plan->kernel), "reference_fp64_probs");
    plan->num_threads = 1;
    return Status::ok();
  }

  // probs[b, h, i, j] = exp(s_ij - lse_i) over the visible keys (the forward's scores, from
  // compute_scores), negated where dropout drops the element; every other element 0.
  Status run_probs(const ProbsProblem& pp, const Plan& /*plan*/) const override {
    const Problem& p = pp.fwd;
    if (p.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    FP_RETURN_IF_ERROR(check_ranges(p));
    std::vector<double> qv(p.d);
    RowScores rs;
    KvRows kv;
    for (int64_t b = 0; b < p.seq.batch; ++b) {
      const int64_t lq = p.seq.q_len(b), lk = p.seq.k_len(b), q0 = p.seq.q_start(b);
      for (int64_t hk = 0; hk < p.hkv; ++hk) {
        gather_kv(p, b, hk, lk, &kv);
        for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h)
          for (int64_t i = 0; i < p.seq.sq; ++i) {
            rs.lo = rs.hi = 0;
            double lse = kNegInf;
            if (i < lq) {
              load_query(p, b, i, h, qv.data());
              compute_scores(p, kv, qv.data(), b, h, i, lq, &rs);
              lse = load_as_double(p.lse_ptr, p.lse_dtype, p.lse.at(b, q0, h, i));
            }
            DropoutRow drop(p, b, h, i);
            for (int64_t j = 0; j < p.seq.sk; ++j) {
              double prob = 0.0;
              if (j >= rs.lo && j < rs.hi && lse != kNegInf) {
                prob = std::exp(rs.s[j - rs.lo] - lse);
                if (drop.factor(j) == 0.0) prob = -prob;
              }
              store_from_double(pp.probs_ptr, pp.probs_dtype, pp.at(b, h, i, j), prob);
            }
          }
      }
    }
    return Status::ok();
  }

  Status plan_merge(const MergeProblem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    *plan = Plan{};
    std::snprintf(plan->kernel, sizeof(plan->kernel), "reference_fp64_merge");
    plan->num_splits = static_cast<int32_t>(p.splits);
    plan->num_threads = 1;
    return Status::ok();
  }

  Status run_merge(const MergeProblem& m, const Plan& /*plan*/) const override {
    if (m.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    const void* parts = m.raw->out_partials.data;
    const void* lse_parts = m.raw->lse_partials.data;
    void* out = m.raw->out.data;
    void* lse_out = m.has_lse ? m.raw->lse.data : nullptr;
    std::vector<double> po(m.splits * m.dv), pl(m.splits), o(m.dv);
    for (int64_t b = 0; b < m.batch; ++b)
      for (int64_t s = 0; s < m.seqlen; ++s)
        for (int64_t h = 0; h < m.heads; ++h) {
          for (int64_t n = 0; n < m.splits; ++n) {
            pl[n] = load_as_double(lse_parts, m.lse_dtype,
                                   n * m.lse_part_stride[0] + b * m.lse_part_stride[1] +
                                       h * m.lse_part_stride[2] + s * m.lse_part_stride[3]);
            const int64_t base = n * m.part_stride[0] + b * m.part_stride[1] +
                                 s * m.part_stride[2] + h * m.part_stride[3];
            for (int64_t d = 0; d < m.dv; ++d)
              po[n * m.dv + d] = load_as_double(parts, m.part_dtype, base + d * m.part_stride[4]);
          }
          double l;
          merge_partials(m.splits, pl.data(), po.data(), m.dv, o.data(), &l);
          const int64_t obase = b * m.out_stride[0] + s * m.out_stride[1] + h * m.out_stride[2];
          for (int64_t d = 0; d < m.dv; ++d)
            store_from_double(out, m.out_dtype, obase + d * m.out_stride[3], o[d]);
          if (lse_out)
            store_from_double(lse_out, m.lse_dtype,
                              b * m.lse_stride[0] + h * m.lse_stride[1] + s * m.lse_stride[2], l);
        }
    return Status::ok();
  }

  // w_i = exp(lse_i - lse); d out_i = w_i * dout; d lse_i = w_i * (dout.(out_i - out) + dlse).
  // Uses the given forward out and lse, as the attention backward does.
  Status run_merge_bwd(const MergeBwdProblem& mb, const Plan& /*plan*/) const override {
    const MergeProblem& m = mb.fwd;
    if (m.device != FP_DEVICE_CPU) return unsupported(kCpuOnly);
    const fp_merge_bwd_params* raw = mb.raw;
    const void* parts = m.raw->out_partials.data;
    const void* lse_parts = m.raw->lse_partials.data;
    const void* out = m.raw->out.data;
    const void* lse = m.raw->lse.data;
    const void* dout = raw->dout.data;
    const void* dlse = mb.has_dlse ? raw->dlse.data : nullptr;
    void* d_parts = raw->d_out_partials.data;
    void* d_lse_parts = raw->d_lse_partials.data;
    std::vector<double> o(m.dv), g(m.dv);
    for (int64_t b = 0; b < m.batch; ++b)
      for (int64_t s = 0; s < m.seqlen; ++s)
        for (int64_t h = 0; h < m.heads; ++h) {
          const int64_t obase = b * m.out_stride[0] + s * m.out_stride[1] + h * m.out_stride[2];
          const int64_t gbase = b * mb.dout_stride[0] + s * mb.dout_stride[1] + h * mb.dout_stride[2];
          for (int64_t d = 0; d < m.dv; ++d) {
            o[d] = load_as_double(out, m.out_dtype, obase + d * m.out_stride[3]);
            g[d] = load_as_double(dout, m.out_dtype, gbase + d * mb.dout_stride[3]);
          }
          const double l = load_as_double(
              lse, m.lse_dtype, b * m.lse_stride[0] + h * m.lse_stride[1] + s * m.lse_stride[2]);
          const double dl =
              dlse ? load_as_double(dlse, m.lse_dtype,
                                    b * mb.dlse_stride[0] + h * mb.dlse_stride[1] + s * mb.dlse_stride[2])
                   : 0.0;
          for (int64_t n = 0; n < m.splits; ++n) {
            const double li = load_as_double(lse_parts, m.lse_dtype,
                                             n * m.lse_part_stride[0] + b * m.lse_part_stride[1] +
                                                 h * m.lse_part_stride[2] + s * m.lse_part_stride[3]);
            const double w = (li == kNegInf || l == kNegInf) ? 0.0 : std::exp(li - l);
            const int64_t pbase = n * m.part_stride[0] + b * m.part_stride[1] +
                                  s * m.part_stride[2] + h * m.part_stride[3];
            const int64_t dpbase = n * mb.d_part_stride[0] + b * mb.d_part_stride[1] +
                                   s * mb.d_part_stride[2] + h * mb.d_part_stride[3];
            double dot = 0.0;
            for (int64_t d = 0; d < m.dv; ++d) {
              if (w != 0.0) {
                const double oi = load_as_double(parts, m.part_dtype, pbase + d * m.part_stride[4]);
                dot += g[d] * (oi - o[d]);
              }
              store_from_double(d_parts, m.part_dtype, dpbase + d * mb.d_part_stride[4], w * g[d]);
            }
            const double dli = w == 0.0 ? 0.0 : w * (dot + dl);
            store_from_double(d_lse_parts, m.lse_dtype,
                              n * mb.d_lse_part_stride[0] + b * mb.d_lse_part_stride[1] +
                                  h * mb.d_lse_part_stride[2] + s * mb.d_lse_part_stride[3],
                              dli);
          }
        }
    return Status::ok();
  }
};

}  // namespace

const Backend* reference_backend() {
  static const ReferenceBackend backend;
  return &backend;
}

}  // namespace flashport
