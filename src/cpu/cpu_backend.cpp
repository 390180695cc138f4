// The fast CPU backend: planning (support, kernel name, threads, split count), the run phases
// around the per-ISA kernels (KV-cache append with rotary, split-KV merge, dk/dv chunk reduction),
// and the merge ops. The kernels themselves are in cpu_kernels.inc.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/config.hpp"
#include "core/dtype.hpp"
#include "core/heuristics.hpp"
#include "cpu_info.hpp"
#include "cpu_kernels.hpp"
#include "cpu_threads.hpp"

namespace flashport {
namespace {

using cpu::kBlockK;
using cpu::kBlockQ;

// The kernel set for this machine; FLASHPORT_CPU_ISA=avx512bf16|avx512|avx2|portable forces a
// lower one (a higher one than the CPU has falls back to what it has). Left to itself, a CPU with
// AVX512-BF16 gets the pair-dot kernels only where they beat widening bf16 to fp32
// (cpu::prefer_bf16_dot); the two sets differ only for bf16 inputs.
const cpu::KernelTable& select_kernels() {
  const std::string& want = runtime_config().cpu_isa;
#ifdef FLASHPORT_CPU_X86
  static const bool has_avx512 = __builtin_cpu_supports("avx512f") &&
                                 __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512dq") &&
                                 __builtin_cpu_supports("avx512vl");
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                               __builtin_cpu_supports("f16c");
  static const bool has_bf16_dot = has_avx512 && __builtin_cpu_supports("avx512bf16");
  if (want == "portable" || want == "scalar") return cpu::kernels_portable();
  static const bool auto_bf16_dot = has_bf16_dot && cpu::prefer_bf16_dot(cpu::cpu_info());
  if (want == "avx512bf16" ? has_bf16_dot : want.empty() && auto_bf16_dot) return cpu::kernels_avx512bf16();
  if (has_avx512 && (want.empty() || want == "avx512" || want == "avx512bf16")) return cpu::kernels_avx512();
  if (has_avx2 && want != "portable") return cpu::kernels_avx2();
#endif
  return cpu::kernels_portable();
}

bool is_cpu_float(fp_dtype t) { return t == FP_F32 || t == FP_BF16 || t == FP_F16; }

Status check_fwd_support(const Problem& p) {
  if (p.device != FP_DEVICE_CPU) return unsupported("cpu backend: tensors must be in CPU memory");
  if (p.dtype == FP_F64) return unsupported("cpu backend: float64 runs on the reference backend");
  if (!is_cpu_float(p.dtype))
    return unsupported(std::string("cpu backend: q/k/v dtype ") + dtype_name(p.dtype) +
                       " is not float16, bfloat16 or float32");
  if (p.has_lse && p.lse_dtype != FP_F32)
    return unsupported("cpu backend: lse must be float32");
  return Status::ok();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t max_keys(const Problem& p) {
  int64_t m = 0;
  for (int64_t b = 0; b < p.seq.batch; ++b) m = std::max(m, p.seq.k_len(b));
  return m;
}

// Decode: each kv head's query rows (Sq x group) fit one row block, so a task can walk a key
// range once for all kv heads of a sequence (row j of every head is contiguous in memory) and
// the keys are split across threads instead of the heads.
bool decode_mode(const Problem& p) { return p.seq.sq * p.group <= kBlockQ; }

// Keys per forward step (decode: sized to the L2, see cpu::decode_block_keys).
int64_t forward_block_keys(const Problem& p) {
  return decode_mode(p) ? cpu::decode_block_keys(cpu::cpu_info(), p) : kBlockK;
}

float folded_q_scale(const ScoreRules& r) {
  return r.softcap > 0.0f ? r.scale / r.softcap : r.scale;
}

const char* short_dtype(fp_dtype t) {
  switch (t) {
    case FP_F16: return "f16";
    case FP_BF16: return "bf16";
    case FP_F32: return "f32";
    default: return dtype_name(t);
  }
}

void name_kernel(Plan* plan, const char* op, const char* isa, const Problem& p, const char* tail) {
  std::snprintf(plan->kernel, sizeof(plan->kernel), "cpu_%s_%s_%s_d%lld%s", op, isa,
                short_dtype(p.dtype), static_cast<long long>(p.d), tail);
}

// KV-cache append: rows seqused_k[b] + j of the cache receive k_new/v_new row j (k rotated).
void append_kv(const Problem& p, int threads) {
  const int64_t snew = p.seq.snew;
  const fp_dtype t = p.dtype;
  cpu::parallel_for(p.seq.batch, threads, [&](int64_t b) {
    std::vector<float> row(static_cast<size_t>(std::max(p.d, p.dv)));
    const int64_t base = p.seq.cache_rows_used(b);  // absolute cache row (left pad included)
    for (int64_t j = 0; j < snew; ++j)
      for (int64_t h = 0; h < p.hkv; ++h) {
        cpu::load_row(t, p.k_new_ptr, p.k_new.at(b, 0, j, h), p.d, row.data());
        if (p.rotary_dim > 0) cpu::rotate_row(p, base + j, row.data());
        cpu::store_row(t, p.k_ptr, p.k.at_row(p.seq, b, base + j, h), p.d, row.data(), 1.0f);
        cpu::load_row(t, p.v_new_ptr, p.v_new.at(b, 0, j, h), p.dv, row.data());
        cpu::store_row(t, p.v_ptr, p.v.at_row(p.seq, b, base + j, h), p.dv, row.data(), 1.0f);
      }
  });
}

// Split-KV merge: lse = log(sum_s exp(lse_s) [+ exp(sink)]), out = sum_s exp(lse_s - lse) out_s.
void merge_splits(const Problem& p, int splits, const float* part_out, const float* part_lse,
                  int threads) {
  const int64_t dv = p.dv;
  cpu::parallel_for(p.seq.batch, threads, [&](int64_t b) {
    const cpu::SeqGeom g = cpu::seq_geom(p, b);
    std::vector<float> acc(static_cast<size_t>(dv));
    for (int64_t i = 0; i < g.lq; ++i)
      for (int64_t h = 0; h < p.hq; ++h) {
        const int64_t row = cpu::q_global_row(p, g, b, i) * p.hq + h;
        const int64_t split_step = p.total_q_rows * p.hq;
        float mx = -INFINITY;
        for (int s = 0; s < splits; ++s) mx = std::max(mx, part_lse[s * split_step + row]);
        const float* sink = p.rules.sinks ? &p.rules.sinks[h] : nullptr;
        if (sink) mx = std::max(mx, *sink);
        std::fill(acc.begin(), acc.end(), 0.0f);
        float lse = -INFINITY;
        if (mx != -INFINITY) {
          float sum = sink ? std::exp(*sink - mx) : 0.0f;
          for (int s = 0; s < splits; ++s) {
            const float ls = part_lse[s * split_step + row];
            if (ls == -INFINITY) continue;
            const float w = std::exp(ls - mx);
            sum += w;
            const float* o = part_out + (s * split_step + row) * dv;
            for (int64_t c = 0; c < dv; ++c) acc[c] += w * o[c];
          }
          lse = mx + std::log(sum);
          for (int64_t c = 0; c < dv; ++c) acc[c] /= sum;
        }
        cpu::store_row(p.dtype, p.out_ptr, cpu::q_row_offset(p.out, g, b, i, h), dv, acc.data(),
                       1.0f);
        if (p.has_lse) static_cast<float*>(p.lse_ptr)[cpu::lse_offset(p.lse, g, b, h, i)] = lse;
      }
  });
}

// Zero every element of a strided tensor (rows no sequence covers must not keep stale values).
void zero_tensor(const fp_tensor& t) {
  if (t.data == nullptr || t.ndim == 0) return;
  const size_t es = dtype_size(t.dtype);
  int64_t idx[FP_MAX_DIMS] = {0, 0, 0, 0, 0};
  const int last = t.ndim - 1;
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] == 0) return;
  for (;;) {
    int64_t off = 0;
    for (int d = 0; d < last; ++d) off += idx[d] * t.stride[d];
    std::memset(static_cast<char*>(t.data) + off * static_cast<int64_t>(es), 0,
                static_cast<size_t>(t.shape[last]) * es);
    int d = last - 1;
    while (d >= 0 && ++idx[d] == t.shape[d]) idx[d--] = 0;
    if (d < 0) break;
  }
}

class CpuBackend final : public Backend {
 public:
  fp_backend id() const override { return FP_BACKEND_CPU; }
  bool available() const override { return true; }
  bool handles_device(fp_device_type dev) const override { return dev == FP_DEVICE_CPU; }

  Status plan_fwd(const Problem& p, Plan* plan) const override {
    FP_RETURN_IF_ERROR(check_fwd_support(p));
    const cpu::KernelTable& k = select_kernels();
    const int threads = cpu::resolve_threads(p.raw ? p.raw->num_threads : 0);
    const int64_t tiles = decode_mode(p) ? p.seq.batch
                                         : p.seq.batch * p.hkv * ceil_div(p.seq.sq * p.group, kBlockQ);
    const int64_t key_blocks = ceil_div(max_keys(p), forward_block_keys(p));
    const int splits = resolve_num_splits(p.num_splits, tiles, key_blocks, threads,
                                          std::min(128, 4 * threads));
    *plan = Plan{};
    plan->num_threads = threads;
    plan->num_splits = splits;
    plan->workspace_bytes = 0;  // scratch is thread-local and split partials are allocated per call
    name_kernel(plan, "fwd", k.isa, p,
                decode_mode(p) ? (splits > 1 ? "_decode_splitkv" : "_decode") : (splits > 1 ? "_splitkv" : ""));
    return Status::ok();
  }

  Status run_fwd(const Problem& p, const Plan& plan, void*) const override {
    const cpu::KernelTable& k = select_kernels();
    const int threads = plan.num_threads > 0 ? plan.num_threads : cpu::resolve_threads(0);
    if (p.seq.snew > 0 && p.k_new_ptr) append_kv(p, threads);

    cpu::FwdCall call;
    call.p = &p;
    call.num_splits = plan.num_splits;
    call.qscale = folded_q_scale(p.rules);
    std::vector<float> part_out, part_lse;
    if (plan.num_splits > 1) {
      const size_t rows = static_cast<size_t>(plan.num_splits * p.total_q_rows * p.hq);
      part_out.resize(rows * static_cast<size_t>(p.dv));
      part_lse.resize(rows);
      call.part_out = part_out.data();
      call.part_lse = part_lse.data();
    }
    // Tasks: (batch, kv head, run of row blocks, split). A task packs its K/V once, so runs are
    // long; only split heads into several runs when there are too few heads to balance threads.
    const int64_t heads = p.seq.batch * p.hkv * plan.num_splits;
    const int64_t rb_max = std::max<int64_t>(1, ceil_div(p.seq.sq * p.group, kBlockQ));
    call.num_chunks = static_cast<int>(std::min(rb_max, std::max<int64_t>(1, ceil_div(4 * threads, heads))));
    call.decode = decode_mode(p);
    call.block_k = static_cast<int>(forward_block_keys(p));
    std::vector<cpu::FwdTask> tasks;
    for (int64_t b = 0; b < p.seq.batch; ++b)
      for (int64_t hk = 0; hk < (call.decode ? 1 : p.hkv); ++hk)
        for (int64_t c = 0; c < (call.decode ? 1 : call.num_chunks); ++c)
          for (int64_t s = 0; s < plan.num_splits; ++s) tasks.push_back({b, hk, c, s});
    // Largest tasks first (causal: later row blocks see more keys) for a better dynamic balance.
    cpu::parallel_for(static_cast<int64_t>(tasks.size()), threads,
                      [&](int64_t t) { k.fwd(call, tasks[tasks.size() - 1 - t]); });
    if (plan.num_splits > 1)
      merge_splits(p, plan.num_splits, part_out.data(), part_lse.data(), threads);
    return Status::ok();
  }

  Status plan_bwd(const BwdProblem& bp, Plan* plan) const override {
    const Problem& p = bp.fwd;
    FP_RETURN_IF_ERROR(check_fwd_support(p));
    if (p.k_new_ptr || p.seq.snew > 0)
      return unsupported("cpu backend: no backward for KV-cache append (k_new)");
    const cpu::KernelTable& k = select_kernels();
    *plan = Plan{};
    plan->num_threads = cpu::resolve_threads(p.raw ? p.raw->num_threads : 0);
    plan->num_splits = 1;
    name_kernel(plan, "bwd", k.isa, p, "");
    return Status::ok();
  }

  Status run_bwd(const BwdProblem& bp, const Plan& plan, void*) const override {
    const Problem& p = bp.fwd;
    const cpu::KernelTable& k = select_kernels();
    const int threads = plan.num_threads > 0 ? plan.num_threads : cpu::resolve_threads(0);
    const int64_t heads = p.seq.batch * p.hkv;
    const int64_t lk_max = max_keys(p);
    const int64_t rb_max = std::max<int64_t>(1, ceil_div(p.seq.sq * p.group, kBlockQ));

    // Row chunks per (batch, kv head): enough tasks to balance the machine, chosen from the shape
    // and the machine only (never from num_threads), so results are bit-identical at any thread
    // count; chunk partials are summed in a fixed order.
    // Each chunk costs an lk x (D + Dv) partial (zeroed, written, reduced), so aim for only
    // about two tasks per hardware thread.
    const int64_t target = 2 * cpu::hardware_threads();
    const int chunks = static_cast<int>(std::min(rb_max, std::max<int64_t>(1, ceil_div(target, heads))));

    cpu::BwdCall call;
    call.p = &bp;
    call.qscale = folded_q_scale(p.rules);
    call.num_chunks = chunks;
    call.lk_max = lk_max;
    std::vector<float> dk_part, dv_part, dsink_part;
    if (chunks > 1) {
      dk_part.assign(static_cast<size_t>(heads * chunks * lk_max * p.d), 0.0f);
      dv_part.assign(static_cast<size_t>(heads * chunks * lk_max * p.dv), 0.0f);
      call.dk_part = dk_part.data();
      call.dv_part = dv_part.data();
    }
    if (bp.d_sinks) {
      dsink_part.assign(static_cast<size_t>(heads * chunks * p.group), 0.0f);
      call.dsink_part = dsink_part.data();
    }

    // Rows outside every sequence (cache capacity, unused pages, packed tails) read as zero grads.
    const bool partial_k = p.seq.seqused_k || p.seq.cu_k || p.seq.kv_layout != KvLayout::Batched;
    if (partial_k && p.raw) {
      // resolve_bwd points fwd.raw at fp_attn_bwd_params::fwd, its first member.
      const auto* raw = reinterpret_cast<const fp_attn_bwd_params*>(p.raw);
      zero_tensor(raw->dk);
      zero_tensor(raw->dv);
    }

    std::vector<cpu::BwdTask> tasks;
    for (int64_t b = 0; b < p.seq.batch; ++b)
      for (int64_t hk = 0; hk < p.hkv; ++hk)
        for (int64_t c = 0; c < chunks; ++c) tasks.push_back({b, hk, c});
    cpu::parallel_for(static_cast<int64_t>(tasks.size()), threads,
                      [&](int64_t t) { k.bwd(call, tasks[t]); });

    if (chunks > 1) {
      cpu::parallel_for(heads, threads, [&](int64_t x) {
        const int64_t b = x / p.hkv, hk = x % p.hkv;
        const cpu::SeqGeom g = cpu::seq_geom(p, b);
        std::vector<float> row(static_cast<size_t>(std::max(p.d, p.dv)));
        for (int64_t j = 0; j < g.lk; ++j) {
          for (int which = 0; which < 2; ++which) {
            const int64_t n = which == 0 ? p.d : p.dv;
            const float* part = which == 0 ? dk_part.data() : dv_part.data();
            std::fill(row.begin(), row.end(), 0.0f);
            for (int c = 0; c < chunks; ++c) {
              const float* src = part + ((x * chunks + c) * lk_max + j) * n;
              for (int64_t d = 0; d < n; ++d) row[d] += src[d];
            }
            const KvAddr& addr = which == 0 ? bp.dk : bp.dv;
            void* base = which == 0 ? bp.dk_ptr : bp.dv_ptr;
            cpu::store_row(p.dtype, base, cpu::kv_row_offset(p, addr, b, j, hk), n, row.data(), 1.0f);
          }
        }
      });
    }
    if (bp.d_sinks) {
      for (int64_t h = 0; h < p.hq; ++h) {
        const int64_t hk = h / p.group, gh = h % p.group;
        float acc = 0.0f;
        for (int64_t b = 0; b < p.seq.batch; ++b)
          for (int c = 0; c < chunks; ++c)
            acc += dsink_part[((b * p.hkv + hk) * chunks + c) * p.group + gh];
        bp.d_sinks[h] = acc;
      }
    }
    return Status::ok();
  }

  // fp_attn_probs is a testing aid: the fp64 reference's implementation serves CPU tensors.
  Status plan_probs(const ProbsProblem& p, Plan* plan) const override {
    return reference_backend()->plan_probs(p, plan);
  }
  Status run_probs(const ProbsProblem& p, const Plan& plan) const override {
    return reference_backend()->run_probs(p, plan);
  }

  Status plan_merge(const MergeProblem& p, Plan* plan) const override {
    if (p.device != FP_DEVICE_CPU) return unsupported("cpu backend: tensors must be in CPU memory");
    *plan = Plan{};
    plan->num_threads = cpu::resolve_threads(p.raw ? p.raw->num_threads : 0);
    plan->num_splits = static_cast<int32_t>(p.splits);
    std::snprintf(plan->kernel, sizeof(plan->kernel), "cpu_merge");
    return Status::ok();
  }

  Status run_merge(const MergeProblem& p, const Plan& plan) const override {
    const fp_merge_params& raw = *p.raw;
    const int64_t rows = p.batch * p.seqlen * p.heads;
    cpu::parallel_for(rows, plan.num_threads, [&](int64_t x) {
      const int64_t b = x / (p.seqlen * p.heads), s = (x / p.heads) % p.seqlen, h = x % p.heads;
      const int64_t lse_at = b * p.lse_part_stride[1] + h * p.lse_part_stride[2] + s * p.lse_part_stride[3];
      double mx = -INFINITY;
      for (int64_t i = 0; i < p.splits; ++i)
        mx = std::max(mx, load_as_double(raw.lse_partials.data, p.lse_dtype, i * p.lse_part_stride[0] + lse_at));
      double sum = 0.0;
      std::vector<double> acc(static_cast<size_t>(p.dv), 0.0);
      if (mx != -INFINITY) {
        for (int64_t i = 0; i < p.splits; ++i) {
          const double li = load_as_double(raw.lse_partials.data, p.lse_dtype, i * p.lse_part_stride[0] + lse_at);
          if (li == -INFINITY) continue;
          const double w = std::exp(li - mx);
          sum += w;
          const int64_t base = i * p.part_stride[0] + b * p.part_stride[1] + s * p.part_stride[2] + h * p.part_stride[3];
          for (int64_t d = 0; d < p.dv; ++d)
            acc[d] += w * load_as_double(raw.out_partials.data, p.part_dtype, base + d * p.part_stride[4]);
        }
      }
      const double lse = sum > 0.0 ? mx + std::log(sum) : -INFINITY;
      const int64_t out_at = b * p.out_stride[0] + s * p.out_stride[1] + h * p.out_stride[2];
      for (int64_t d = 0; d < p.dv; ++d)
        store_from_double(raw.out.data, p.out_dtype, out_at + d * p.out_stride[3], sum > 0.0 ? acc[d] / sum : 0.0);
      if (p.has_lse)
        store_from_double(raw.lse.data, p.lse_dtype, b * p.lse_stride[0] + h * p.lse_stride[1] + s * p.lse_stride[2], lse);
    });
    return Status::ok();
  }

  // d out_i = w_i dout;  d lse_i = w_i (dout . (out_i - out) + dlse),  w_i = exp(lse_i - lse).
  Status run_merge_bwd(const MergeBwdProblem& mb, const Plan& plan) const override {
    const MergeProblem& p = mb.fwd;
    const fp_merge_bwd_params& raw = *mb.raw;
    const fp_merge_params& fr = raw.fwd;
    const int64_t rows = p.batch * p.seqlen * p.heads;
    cpu::parallel_for(rows, plan.num_threads, [&](int64_t x) {
      const int64_t b = x / (p.seqlen * p.heads), s = (x / p.heads) % p.seqlen, h = x % p.heads;
      const double lse = load_as_double(fr.lse.data, p.lse_dtype,
                                        b * p.lse_stride[0] + h * p.lse_stride[1] + s * p.lse_stride[2]);
      const double dlse = mb.has_dlse ? load_as_double(raw.dlse.data, p.lse_dtype,
                                                       b * mb.dlse_stride[0] + h * mb.dlse_stride[1] + s * mb.dlse_stride[2])
                                      : 0.0;
      const int64_t out_at = b * p.out_stride[0] + s * p.out_stride[1] + h * p.out_stride[2];
      const int64_t dout_at = b * mb.dout_stride[0] + s * mb.dout_stride[1] + h * mb.dout_stride[2];
      const int64_t lse_at = b * p.lse_part_stride[1] + h * p.lse_part_stride[2] + s * p.lse_part_stride[3];
      const int64_t dlse_at = b * mb.d_lse_part_stride[1] + h * mb.d_lse_part_stride[2] + s * mb.d_lse_part_stride[3];
      for (int64_t i = 0; i < p.splits; ++i) {
        const double li = load_as_double(fr.lse_partials.data, p.lse_dtype, i * p.lse_part_stride[0] + lse_at);
        const double w = (li == -INFINITY || lse == -INFINITY) ? 0.0 : std::exp(li - lse);
        const int64_t part_at = i * p.part_stride[0] + b * p.part_stride[1] + s * p.part_stride[2] + h * p.part_stride[3];
        const int64_t dpart_at = i * mb.d_part_stride[0] + b * mb.d_part_stride[1] + s * mb.d_part_stride[2] + h * mb.d_part_stride[3];
        double dot = 0.0;
        for (int64_t d = 0; d < p.dv; ++d) {
          const double go = load_as_double(raw.dout.data, p.out_dtype, dout_at + d * mb.dout_stride[3]);
          const double oi = w > 0.0 ? load_as_double(fr.out_partials.data, p.part_dtype, part_at + d * p.part_stride[4]) : 0.0;
          const double o = load_as_double(fr.out.data, p.out_dtype, out_at + d * p.out_stride[3]);
          if (w > 0.0) dot += go * (oi - o);
          store_from_double(raw.d_out_partials.data, p.part_dtype, dpart_at + d * mb.d_part_stride[4], w * go);
        }
        store_from_double(raw.d_lse_partials.data, p.lse_dtype, i * mb.d_lse_part_stride[0] + dlse_at,
                          w * (dot + dlse));
      }
    });
    return Status::ok();
  }
};

}  // namespace

const Backend* cpu_backend() {
  static const CpuBackend backend;
  return &backend;
}

}  // namespace flashport
