// CPU backend test harness: one Case describes a call (shape, dtype, every feature); run_case
// builds it through the public C API, runs FP_BACKEND_CPU and the fp64 oracle
// (FP_BACKEND_REFERENCE) on the same fresh random inputs, and compares outputs, LSE, appended
// caches and (optionally) gradients, with poisoned outputs and guard checks.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "flashport/flashport.h"
#include "test_util.hpp"

namespace cputest {

using flashport::test::close;
using flashport::test::HostTensor;
using flashport::test::test_rng;

enum class Cache { None, Contiguous, Paged };
enum class Rotary { None, Interleaved, Half };

struct Case {
  std::string name;
  fp_dtype dt = FP_F32;
  int64_t b = 2, sq = 17, sk = 17, hq = 4, hkv = 2, d = 32, dv = 32;
  int causal = 0;
  bool top_left = false;
  int wl = -1, wr = -1;
  float softcap = 0.0f;
  int alibi = 0;  // 0 none, 1 [Hq], 2 [B, Hq]
  bool sinks = false;
  float dropout = 0.0f;
  bool varlen = false;    // packed q and k, random lengths <= sq / sk (one may be 0)
  bool strided = false;   // q as [B,H,S,D] memory, k/v/out padded rows
  Cache cache = Cache::None;
  int64_t page = 16;      // paged cache page size
  bool batch_idx = true;  // contiguous cache: pass cache_batch_idx (rows in reverse order)
  bool leftpad = false;   // KV cache: cache_leftpad, random in [0, seqused_k] (sequence 0: > 0)
  int64_t snew = 0;       // rows appended (k_new/v_new)
  Rotary rotary = Rotary::None;
  int64_t rotary_dim = 0;
  bool lse = true;
  int splits = 1;         // num_splits (0 heuristic)
  int threads = 0;
  bool bwd = false;
  bool d_sinks = false;
  float scale = 0.3f;
};

inline int64_t rand_int(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(test_rng());
}

inline ::testing::AssertionResult ok(fp_status st, const char* what) {
  if (st == FP_OK) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << fp_status_name(st) << ": "
                                       << fp_last_error();
}

// Relative tolerance of the LSE (fp32 on both sides of the comparison's precision).
inline double lse_tolerance(fp_dtype) { return 2e-5; }

// FLASHPORT_CPU_TEST_REPORT=1 prints every compared tensor's error (to see the margins).
inline ::testing::AssertionResult close_reported(const HostTensor& a, const HostTensor& e, double tol,
                                                 const std::string& what) {
  if (std::getenv("FLASHPORT_CPU_TEST_REPORT"))
    std::printf("  %-8s rel_err %.3g (tolerance %.3g)\n", what.c_str(),
                flashport::test::compare(a, e).rel_err, tol);
  return close(a, e, tol, what);
}

// Inputs and outputs of one call; outputs are per backend.
struct Built {
  HostTensor q, k, v, alibi, sinks, cu_q, cu_k, seqused, block_table, batch_idx, k_new, v_new,
      cos, sin, leftpad;
  int64_t max_q = 0, max_k = 0;
};

struct Outputs {
  HostTensor out, lse, k, v;  // k, v: the (possibly appended-to) caches of this backend
  HostTensor dq, dk, dv, dout, dsinks;
};

inline std::vector<int32_t> prefix(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + lens[i];
  return cu;
}

inline Built build(const Case& c) {
  Built t;
  const fp_dtype dt = c.dt;
  if (c.varlen) {
    std::vector<int32_t> lq(c.b), lk(c.b);
    for (int64_t b = 0; b < c.b; ++b) {
      lq[b] = static_cast<int32_t>(rand_int(b == 1 ? 0 : 1, c.sq));
      lk[b] = static_cast<int32_t>(rand_int(1, c.sk));
    }
    lq[0] = static_cast<int32_t>(c.sq);  // the max is reached
    const auto cq = prefix(lq), ck = prefix(lk);
    t.cu_q = HostTensor::i32({c.b + 1}, cq);
    t.cu_k = HostTensor::i32({c.b + 1}, ck);
    t.max_q = c.sq;
    t.max_k = c.sk;
    t.q = HostTensor(dt, {cq.back(), c.hq, c.d});
    t.k = HostTensor(dt, {ck.back(), c.hkv, c.d});
    t.v = HostTensor(dt, {ck.back(), c.hkv, c.dv});
  } else if (c.cache == Cache::None) {
    if (c.strided) {
      t.q = HostTensor::permuted(dt, {c.b, c.sq, c.hq, c.d}, {0, 2, 1, 3});
      t.k = HostTensor::padded(dt, {c.b, c.sk, c.hkv, c.d}, {0, 1, 0, 3});
      t.v = HostTensor::padded(dt, {c.b, c.sk, c.hkv, c.dv}, {1, 0, 2, 0});
    } else {
      t.q = HostTensor(dt, {c.b, c.sq, c.hq, c.d});
      t.k = HostTensor(dt, {c.b, c.sk, c.hkv, c.d});
      t.v = HostTensor(dt, {c.b, c.sk, c.hkv, c.dv});
    }
  } else {
    // KV cache of capacity sk per sequence; seqused_k random, leaving room for snew rows.
    t.q = HostTensor(dt, {c.b, c.sq, c.hq, c.d});
    std::vector<int32_t> used(c.b);
    for (int64_t b = 0; b < c.b; ++b) used[b] = static_cast<int32_t>(rand_int(0, c.sk - c.snew));
    used[0] = static_cast<int32_t>(c.sk - c.snew);
    t.seqused = HostTensor::i32({c.b}, used);
    if (c.leftpad) {
      std::vector<int32_t> pad(c.b);
      for (int64_t b = 0; b < c.b; ++b) pad[b] = static_cast<int32_t>(rand_int(0, used[b]));
      pad[0] = static_cast<int32_t>(rand_int(1, std::max<int64_t>(1, used[0] - 1)));
      t.leftpad = HostTensor::i32({c.b}, pad);
    }
    if (c.cache == Cache::Contiguous) {
      const int64_t rows = c.batch_idx ? c.b + 1 : c.b;
      t.k = HostTensor(dt, {rows, c.sk, c.hkv, c.d});
      t.v = HostTensor(dt, {rows, c.sk, c.hkv, c.dv});
      if (c.batch_idx) {
        std::vector<int32_t> idx(c.b);
        for (int64_t b = 0; b < c.b; ++b) idx[b] = static_cast<int32_t>(rows - 1 - b);
        t.batch_idx = HostTensor::i32({c.b}, idx);
      }
    } else {
      const int64_t max_blocks = (c.sk + c.page - 1) / c.page;
      const int64_t pages = c.b * max_blocks + 1;
      std::vector<int32_t> perm(pages);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), test_rng());
      perm.resize(c.b * max_blocks);
      t.block_table = HostTensor::i32({c.b, max_blocks}, perm);
      t.k = HostTensor(dt, {pages, c.page, c.hkv, c.d});
      t.v = HostTensor(dt, {pages, c.page, c.hkv, c.dv});
    }
    if (c.snew > 0) {
      t.k_new = HostTensor(dt, {c.b, c.snew, c.hkv, c.d});
      t.v_new = HostTensor(dt, {c.b, c.snew, c.hkv, c.dv});
      t.k_new.fill_normal();
      t.v_new.fill_normal();
    }
    if (c.rotary != Rotary::None) {
      const int64_t rows = c.sk + c.sq;
      t.cos = HostTensor(FP_F32, {rows, c.rotary_dim / 2});
      t.sin = HostTensor(FP_F32, {rows, c.rotary_dim / 2});
      std::vector<double> cv, sv;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t x = 0; x < c.rotary_dim / 2; ++x) {
          const double th = r * std::pow(10000.0, -2.0 * x / c.rotary_dim);
          cv.push_back(std::cos(th));
          sv.push_back(std::sin(th));
        }
      t.cos.from_double(cv);
      t.sin.from_double(sv);
    }
  }
  t.q.fill_normal();
  t.k.fill_normal();
  t.v.fill_normal();
  if (c.alibi) {
    t.alibi = c.alibi == 2 ? HostTensor(FP_F32, {c.b, c.hq}) : HostTensor(FP_F32, {c.hq});
    t.alibi.fill_uniform(0.05, 0.5);
  }
  if (c.sinks) {
    t.sinks = HostTensor(FP_F32, {c.hq});
    t.sinks.fill_uniform(-1.0, 2.0);
  }
  return t;
}

inline fp_attn_params params(const Case& c, const Built& t, Outputs& o, fp_backend be) {
  fp_attn_params p;
  fp_attn_params_init(&p);
  p.backend = be;
  p.q = t.q.view();
  p.k = o.k.view();
  p.v = o.v.view();
  p.out = o.out.view();
  if (c.lse) p.lse = o.lse.view();
  if (c.varlen) {
    p.cu_seqlens_q = t.cu_q.view();
    p.cu_seqlens_k = t.cu_k.view();
    p.max_seqlen_q = t.max_q;
    p.max_seqlen_k = t.max_k;
  }
  if (!t.seqused.empty()) p.seqused_k = t.seqused.view();
  if (!t.block_table.empty()) p.block_table = t.block_table.view();
  if (!t.batch_idx.empty()) p.cache_batch_idx = t.batch_idx.view();
  if (!t.leftpad.empty()) p.cache_leftpad = t.leftpad.view();
  if (!t.k_new.empty()) {
    p.k_new = t.k_new.view();
    p.v_new = t.v_new.view();
  }
  if (!t.cos.empty()) {
    p.rotary_cos = t.cos.view();
    p.rotary_sin = t.sin.view();
    p.rotary_interleaved = c.rotary == Rotary::Interleaved ? 1 : 0;
  }
  p.softmax_scale = c.scale;
  p.causal = c.causal;
  p.causal_align = c.top_left ? FP_CAUSAL_TOP_LEFT : FP_CAUSAL_BOTTOM_RIGHT;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.softcap = c.softcap;
  if (!t.alibi.empty()) p.alibi_slopes = t.alibi.view();
  if (!t.sinks.empty()) p.sinks = t.sinks.view();
  p.dropout_p = c.dropout;
  p.dropout_seed = 0x1234567887654321ull;
  p.dropout_offset = 77;
  p.num_splits = be == FP_BACKEND_CPU ? c.splits : 1;
  p.num_threads = be == FP_BACKEND_CPU ? c.threads : 0;
  return p;
}

inline Outputs make_outputs(const Case& c, const Built& t) {
  Outputs o;
  o.k = t.k;  // deep copies: append-then-attend writes into them
  o.v = t.v;
  std::vector<int64_t> oshape = t.q.shape();
  oshape.back() = c.dv;
  o.out = c.strided ? HostTensor::padded(c.dt, oshape, {0, 0, 1, 2}) : HostTensor(c.dt, oshape);
  o.out.fill_poison();
  o.lse = c.varlen ? HostTensor(FP_F32, {c.hq, t.q.dim(0)}) : HostTensor(FP_F32, {c.b, c.hq, c.sq});
  o.lse.fill_poison();
  return o;
}

inline fp_attn_bwd_params bwd_params(const Case& c, const Built& t, const Outputs& ref,
                                     Outputs& o, fp_backend be) {
  fp_attn_bwd_params bp;
  fp_attn_bwd_params_init(&bp);
  // Forward tensors are the reference forward results, so both backends see the same inputs.
  bp.fwd = params(c, t, o, be);
  bp.fwd.out = ref.out.view();
  bp.fwd.lse = ref.lse.view();
  bp.dout = ref.dout.view();
  o.dq = HostTensor(c.dt, t.q.shape());
  o.dk = HostTensor(c.dt, t.k.shape());
  o.dv = HostTensor(c.dt, t.v.shape());
  o.dq.fill_poison();
  o.dk.fill_poison();
  o.dv.fill_poison();
  bp.dq = o.dq.view();
  bp.dk = o.dk.view();
  bp.dv = o.dv.view();
  if (c.d_sinks) {
    o.dsinks = HostTensor(FP_F32, {c.hq});
    o.dsinks.fill_poison();
    bp.d_sinks = o.dsinks.view();
  }
  bp.deterministic = 1;
  return bp;
}

// Forward (and backward) of one case on CPU vs the reference.
inline void run_case(const Case& c) {
  SCOPED_TRACE("case " + c.name);
  const Built t = build(c);
  Outputs ref = make_outputs(c, t), cpu = make_outputs(c, t);
  fp_attn_params pr = params(c, t, ref, FP_BACKEND_REFERENCE);
  fp_attn_params pc = params(c, t, cpu, FP_BACKEND_CPU);
  ASSERT_TRUE(ok(fp_attn_fwd(&pr), "reference fwd"));
  ASSERT_TRUE(ok(fp_attn_fwd(&pc), "cpu fwd"));
  const double tol = flashport::test::tolerance(c.dt);
  EXPECT_TRUE(cpu.out.guards_intact());
  EXPECT_TRUE(cpu.out.all_written());
  EXPECT_TRUE(close_reported(cpu.out, ref.out, tol, "out"));
  if (c.lse) {
    EXPECT_TRUE(cpu.lse.guards_intact());
    EXPECT_TRUE(close_reported(cpu.lse, ref.lse, lse_tolerance(c.dt), "lse"));
  }
  if (c.snew > 0) {
    EXPECT_TRUE(cpu.k.guards_intact());
    EXPECT_TRUE(close_reported(cpu.k, ref.k, tol, "k cache"));
    EXPECT_TRUE(close_reported(cpu.v, ref.v, tol, "v cache"));
  }
  if (!c.bwd) return;

  ref.dout = HostTensor(c.dt, ref.out.shape());
  ref.dout.fill_normal();
  Outputs gref, gcpu;
  gref.k = t.k;
  gref.v = t.v;
  gcpu.k = t.k;
  gcpu.v = t.v;
  fp_attn_bwd_params br = bwd_params(c, t, ref, gref, FP_BACKEND_REFERENCE);
  fp_attn_bwd_params bc = bwd_params(c, t, ref, gcpu, FP_BACKEND_CPU);
  ASSERT_TRUE(ok(fp_attn_bwd(&br), "reference bwd"));
  ASSERT_TRUE(ok(fp_attn_bwd(&bc), "cpu bwd"));
  const double gtol = flashport::test::grad_tolerance(c.dt);
  for (auto [a, e, what] : {std::tuple{&gcpu.dq, &gref.dq, "dq"}, std::tuple{&gcpu.dk, &gref.dk, "dk"},
                            std::tuple{&gcpu.dv, &gref.dv, "dv"}}) {
    EXPECT_TRUE(a->guards_intact()) << what;
    EXPECT_TRUE(a->all_written()) << what;
    EXPECT_TRUE(close_reported(*a, *e, gtol, what));
  }
  if (c.d_sinks) EXPECT_TRUE(close_reported(gcpu.dsinks, gref.dsinks, gtol, "d_sinks"));
}

// Sets FLASHPORT_CPU_ISA for the scope of a test (the library reads its settings once, so the
// scope reloads them).
struct IsaScope {
  explicit IsaScope(const char* isa) {
    if (isa) setenv("FLASHPORT_CPU_ISA", isa, 1);
    else unsetenv("FLASHPORT_CPU_ISA");
    flashport::reload_runtime_config();
  }
  ~IsaScope() {
    unsetenv("FLASHPORT_CPU_ISA");
    flashport::reload_runtime_config();
  }
};

}  // namespace cputest
