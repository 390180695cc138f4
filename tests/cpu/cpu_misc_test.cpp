// CPU backend: thread-count determinism, concurrent callers, selection (kernel names, ISA
// override, split heuristic), unsupported inputs, and the merge ops vs the reference.
#include <thread>

#include "cpu_harness.hpp"
#include "cpu/cpu_info.hpp"

namespace cputest {
namespace {

// Forward and backward of one case at a given thread count (no splits: the split count follows the
// thread count by design, and different splits legitimately round differently).
struct ThreadRun {
  Outputs fwd, grads;
};
ThreadRun run_threads(const Case& c, const Built& t, const HostTensor& dout, int threads) {
  Case cc = c;
  cc.threads = threads;
  ThreadRun r;
  r.fwd = make_outputs(cc, t);
  fp_attn_params p = params(cc, t, r.fwd, FP_BACKEND_CPU);
  EXPECT_TRUE(ok(fp_attn_fwd(&p), "cpu fwd"));
  r.fwd.dout = dout;
  r.grads.k = t.k;
  r.grads.v = t.v;
  fp_attn_bwd_params bp = bwd_params(cc, t, r.fwd, r.grads, FP_BACKEND_CPU);
  EXPECT_TRUE(ok(fp_attn_bwd(&bp), "cpu bwd"));
  return r;
}

TEST(CpuThreads, OneAndManyThreadsBitIdentical) {
  for (fp_dtype dt : {FP_F32, FP_BF16}) {
    Case c;
    c.dt = dt;
    c.b = 2;
    c.sq = 150;
    c.sk = 170;
    c.hq = 4;
    c.hkv = 1;  // few (batch, kv head) pairs: the backward splits rows into chunks
    c.causal = 1;
    c.sinks = true;
    c.d_sinks = true;
    c.dropout = 0.1f;
    const Built t = build(c);
    HostTensor dout(dt, {c.b, c.sq, c.hq, c.dv});
    dout.fill_normal();
    const ThreadRun one = run_threads(c, t, dout, 1);
    const ThreadRun many = run_threads(c, t, dout, 0);  // all cores
    EXPECT_TRUE(one.fwd.out.bitwise_equal(many.fwd.out));
    EXPECT_TRUE(one.fwd.lse.bitwise_equal(many.fwd.lse));
    EXPECT_TRUE(one.grads.dq.bitwise_equal(many.grads.dq));
    EXPECT_TRUE(one.grads.dk.bitwise_equal(many.grads.dk));
    EXPECT_TRUE(one.grads.dv.bitwise_equal(many.grads.dv));
    EXPECT_TRUE(one.grads.dsinks.bitwise_equal(many.grads.dsinks));
    // ThreadRun to run as well.
    const ThreadRun again = run_threads(c, t, dout, 0);
    EXPECT_TRUE(again.grads.dk.bitwise_equal(many.grads.dk));
    EXPECT_TRUE(again.grads.dq.bitwise_equal(many.grads.dq));
  }
}

TEST(CpuThreads, ConcurrentCallersGetCorrectResults) {
  Case c;
  c.sq = 90;
  c.sk = 120;
  c.causal = 1;
  const Built t = build(c);
  Outputs ref = make_outputs(c, t);
  fp_attn_params pr = params(c, t, ref, FP_BACKEND_REFERENCE);
  ASSERT_TRUE(ok(fp_attn_fwd(&pr), "reference fwd"));
  constexpr int kCallers = 4;
  std::vector<Outputs> outs;
  for (int i = 0; i < kCallers; ++i) outs.push_back(make_outputs(c, t));
  std::vector<fp_status> st(kCallers, FP_ERR_RUNTIME);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i)
    callers.emplace_back([&, i] {
      for (int rep = 0; rep < 5; ++rep) {
        fp_attn_params p = params(c, t, outs[i], FP_BACKEND_CPU);
        st[i] = fp_attn_fwd(&p);
        if (st[i] != FP_OK) return;
      }
    });
  for (auto& th : callers) th.join();
  for (int i = 0; i < kCallers; ++i) {
    EXPECT_EQ(st[i], FP_OK);
    EXPECT_TRUE(close(outs[i].out, ref.out, flashport::test::tolerance(c.dt), "out"));
  }
}

fp_selection select(const Case& c, const Built& t, Outputs& o) {
  fp_attn_params p = params(c, t, o, FP_BACKEND_CPU);
  fp_selection sel{};
  EXPECT_TRUE(ok(fp_attn_fwd_select(&p, &sel), "select"));
  return sel;
}

TEST(CpuSelect, KernelNamesIsaOverrideAndDecodeSplits) {
  Case c;
  c.dt = FP_BF16;
  c.d = c.dv = 128;
  c.sq = 1;
  c.sk = 4096;
  c.b = 1;
  c.hq = 8;
  c.hkv = 1;
  c.splits = 0;
  c.threads = 2;
  const Built t = build(c);
  Outputs o = make_outputs(c, t);
  fp_selection sel = select(c, t, o);
  EXPECT_EQ(sel.backend, FP_BACKEND_CPU);
  EXPECT_NE(std::string(sel.kernel).find("cpu_fwd_"), std::string::npos) << sel.kernel;
  EXPECT_NE(std::string(sel.kernel).find("_bf16_d128"), std::string::npos) << sel.kernel;
  // One (batch, kv head) row block on 2 threads: decode splits the keys.
  EXPECT_GE(sel.num_splits, 2) << sel.kernel;
  EXPECT_NE(std::string(sel.kernel).find("splitkv"), std::string::npos) << sel.kernel;
  {
    IsaScope isa("portable");
    sel = select(c, t, o);
    EXPECT_NE(std::string(sel.kernel).find("portable"), std::string::npos) << sel.kernel;
  }
  c.splits = 1;
  sel = select(c, t, o);
  EXPECT_EQ(sel.num_splits, 1);
  // Prefill with plenty of row blocks: no split.
  Case big = c;
  big.splits = 0;
  big.sq = big.sk = 512;
  const Built tb = build(big);
  Outputs ob = make_outputs(big, tb);
  EXPECT_EQ(select(big, tb, ob).num_splits, 1);
}

TEST(CpuSelect, Float64IsUnsupportedWithReason) {
  Case c;
  c.dt = FP_F64;
  const Built t = build(c);
  Outputs o = make_outputs(c, t);
  o.lse = HostTensor(FP_F64, {c.b, c.hq, c.sq});
  fp_attn_params p = params(c, t, o, FP_BACKEND_CPU);
  EXPECT_EQ(fp_attn_fwd(&p), FP_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(fp_last_error()).find("float64 runs on the reference backend"),
            std::string::npos)
      << fp_last_error();
  EXPECT_EQ(o.out.poisoned_count(), o.out.numel());  // nothing written
}

TEST(CpuSelect, NumThreadsEnvironmentIsHonoured) {
  Case c;
  c.sq = 64;
  c.sk = 64;
  const Built t = build(c);
  Outputs ref = make_outputs(c, t), cpu = make_outputs(c, t);
  fp_attn_params pr = params(c, t, ref, FP_BACKEND_REFERENCE);
  ASSERT_TRUE(ok(fp_attn_fwd(&pr), "reference fwd"));
  setenv("FLASHPORT_NUM_THREADS", "1", 1);
  flashport::reload_runtime_config();
  fp_attn_params pc = params(c, t, cpu, FP_BACKEND_CPU);
  const fp_status st = fp_attn_fwd(&pc);
  unsetenv("FLASHPORT_NUM_THREADS");
  flashport::reload_runtime_config();
  ASSERT_TRUE(ok(st, "cpu fwd"));
  EXPECT_TRUE(close(cpu.out, ref.out, flashport::test::tolerance(c.dt), "out"));
}

// ---- Merge ----------------------------------------------------------------------------------
struct MergeSet {
  HostTensor parts, lse_parts, out, lse, dout, dlse, dparts, dlse_parts;
};
MergeSet make_merge(fp_dtype dt, int64_t n, int64_t b, int64_t s, int64_t h, int64_t dv) {
  MergeSet m;
  m.parts = HostTensor(dt, {n, b, s, h, dv});
  m.parts.fill_normal();
  m.lse_parts = HostTensor(FP_F32, {n, b, h, s});
  m.lse_parts.fill_normal(0.0, 3.0);
  // Some -inf partials, and one row where every partial is -inf.
  m.lse_parts.set({1, 0, 0, 0}, -INFINITY);
  for (int64_t i = 0; i < n; ++i) m.lse_parts.set({i, b - 1, h - 1, s - 1}, -INFINITY);
  m.out = HostTensor(dt, {b, s, h, dv});
  m.lse = HostTensor(FP_F32, {b, h, s});
  m.out.fill_poison();
  m.lse.fill_poison();
  return m;
}

TEST(CpuMerge, ForwardAndBackwardMatchReference) {
  for (fp_dtype dt : {FP_F32, FP_BF16}) {
    MergeSet ref = make_merge(dt, 3, 2, 5, 3, 19);
    MergeSet cpu = ref;
    auto fwd = [&](MergeSet& m, fp_backend be) {
      fp_merge_params p;
      fp_merge_params_init(&p);
      p.out_partials = m.parts.view();
      p.lse_partials = m.lse_parts.view();
      p.out = m.out.view();
      p.lse = m.lse.view();
      p.backend = be;
      return fp_merge_fwd(&p);
    };
    ASSERT_TRUE(ok(fwd(ref, FP_BACKEND_REFERENCE), "reference merge"));
    ASSERT_TRUE(ok(fwd(cpu, FP_BACKEND_CPU), "cpu merge"));
    const double tol = flashport::test::tolerance(dt);
    EXPECT_TRUE(close(cpu.out, ref.out, tol, "merged out"));
    EXPECT_TRUE(close(cpu.lse, ref.lse, 1e-6, "merged lse"));

    HostTensor dout(dt, ref.out.shape()), dlse(FP_F32, ref.lse.shape());
    dout.fill_normal();
    dlse.fill_normal();
    auto bwd = [&](MergeSet& m, fp_backend be) {
      m.dparts = HostTensor(dt, m.parts.shape());
      m.dlse_parts = HostTensor(FP_F32, m.lse_parts.shape());
      m.dparts.fill_poison();
      m.dlse_parts.fill_poison();
      fp_merge_bwd_params p;
      fp_merge_bwd_params_init(&p);
      p.fwd.out_partials = m.parts.view();
      p.fwd.lse_partials = m.lse_parts.view();
      p.fwd.out = ref.out.view();  // the same forward results for both
      p.fwd.lse = ref.lse.view();
      p.fwd.backend = be;
      p.dout = dout.view();
      p.dlse = dlse.view();
      p.d_out_partials = m.dparts.view();
      p.d_lse_partials = m.dlse_parts.view();
      return fp_merge_bwd(&p);
    };
    ASSERT_TRUE(ok(bwd(ref, FP_BACKEND_REFERENCE), "reference merge bwd"));
    ASSERT_TRUE(ok(bwd(cpu, FP_BACKEND_CPU), "cpu merge bwd"));
    EXPECT_TRUE(cpu.dparts.all_written());
    EXPECT_TRUE(close(cpu.dparts, ref.dparts, tol, "d_out_partials"));
    EXPECT_TRUE(close(cpu.dlse_parts, ref.dlse_parts, tol, "d_lse_partials"));
  }
}

// ---- Decode (streamed K/V, row-dot scores, split across threads) -------------------------------
// Sq x group <= 64 rows per kv head: scores are row dot products over tiles of keys x rows, so
// awkward head dims (vector tails), key counts (tile and block tails), GQA ratios (row tiles of
// 4, 2, 1 and padded rows), dtypes, splits and thread counts each take a different path.
struct DecodeCase {
  const char* name;
  fp_dtype dt;
  int64_t b, sq, sk, hq, hkv, d, dv;
  int splits, threads;
};
class CpuDecode : public ::testing::TestWithParam<std::tuple<const char*, DecodeCase>> {};
TEST_P(CpuDecode, MatchesReference) {
  IsaScope isa(std::get<0>(GetParam()));
  const DecodeCase& dc = std::get<1>(GetParam());
  Case c;
  c.name = dc.name;
  c.dt = dc.dt;
  c.b = dc.b;
  c.sq = dc.sq;
  c.sk = dc.sk;
  c.hq = dc.hq;
  c.hkv = dc.hkv;
  c.d = dc.d;
  c.dv = dc.dv;
  c.splits = dc.splits;
  c.threads = dc.threads;
  c.bwd = false;
  run_case(c);
}
const DecodeCase kDecodeCases[] = {
    {"f32_mha_d1_sk1", FP_F32, 2, 1, 1, 3, 3, 1, 1, 0, 2},
    {"f32_g3_d3_sk3", FP_F32, 2, 1, 3, 6, 2, 3, 5, 1, 1},
    {"f32_g4_d113_sk113", FP_F32, 3, 1, 113, 8, 2, 113, 113, 0, 2},
    {"bf16_g4_d128_sk1025_split", FP_BF16, 1, 1, 1025, 32, 8, 128, 128, 0, 2},
    {"bf16_g5_d64_sk1025_splits3", FP_BF16, 2, 1, 1025, 10, 2, 64, 64, 3, 2},
    {"f16_g2_d80_sk113", FP_F16, 2, 1, 113, 4, 2, 80, 96, 0, 1},
    {"f32_g8_sq3_d128_sk1025", FP_F32, 1, 3, 1025, 8, 1, 128, 128, 0, 2},
    {"bf16_g1_d113_sk700_splits7", FP_BF16, 1, 1, 700, 4, 4, 113, 40, 7, 2},
    {"f32_g64_d32_sk300", FP_F32, 1, 1, 300, 64, 1, 32, 32, 0, 2},
    {"f32_b4_g4_d128_sk1025", FP_F32, 4, 1, 1025, 32, 8, 128, 128, 0, 2},
};
INSTANTIATE_TEST_SUITE_P(Isa, CpuDecode,
                         ::testing::Combine(::testing::Values("avx512bf16", "avx512", "avx2", "portable"),
                                            ::testing::ValuesIn(kDecodeCases)),
                         [](const ::testing::TestParamInfo<std::tuple<const char*, DecodeCase>>& info) {
                           return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
                         });

// ---- Per-microarchitecture choices (pure functions of the reported CPU) ------------------------
TEST(CpuInfo, Bf16DotOnlyWhereItIsFast) {
  flashport::cpu::CpuInfo zen4;
  zen4.vendor = flashport::cpu::CpuVendor::kAmd;
  zen4.family = 0x19;
  EXPECT_TRUE(flashport::cpu::prefer_bf16_dot(zen4));
  flashport::cpu::CpuInfo xeon;
  xeon.vendor = flashport::cpu::CpuVendor::kIntel;
  xeon.family = 6;
  xeon.model = 0x8F;  // Sapphire Rapids
  EXPECT_FALSE(flashport::cpu::prefer_bf16_dot(xeon));
  EXPECT_FALSE(flashport::cpu::prefer_bf16_dot(flashport::cpu::CpuInfo{}));
}

TEST(CpuInfo, DecodeBlockFitsHalfTheL2) {
  flashport::Problem p;
  p.dtype = FP_F32;
  p.hkv = 8;
  p.d = p.dv = 128;  // 8 KiB of K and V per key
  flashport::cpu::CpuInfo c;
  c.l2_bytes = 2 << 20;
  EXPECT_EQ(flashport::cpu::decode_block_keys(c, p), 64);
  c.l2_bytes = 512 << 10;
  EXPECT_EQ(flashport::cpu::decode_block_keys(c, p), 32);
  c.l2_bytes = 64 << 10;
  EXPECT_EQ(flashport::cpu::decode_block_keys(c, p), 16);  // never fewer than 16
  const flashport::cpu::CpuInfo& here = flashport::cpu::cpu_info();
  EXPECT_GT(here.l2_bytes, 0);
  EXPECT_GT(here.l1d_bytes, 0);
}

TEST(CpuSelect, IsaEnvironmentIsReadThroughRuntimeConfig) {
  Case c;
  c.sq = 20;
  c.sk = 30;
  const Built t = build(c);
  Outputs o = make_outputs(c, t);
  fp_attn_params p = params(c, t, o, FP_BACKEND_CPU);
  fp_selection sel{};
  {
    IsaScope isa("portable");
    ASSERT_TRUE(ok(fp_attn_fwd_select(&p, &sel), "select"));
    EXPECT_NE(std::string(sel.kernel).find("_portable_"), std::string::npos) << sel.kernel;
  }
  ASSERT_TRUE(ok(fp_attn_fwd_select(&p, &sel), "select"));
  const std::string k = sel.kernel;
  EXPECT_EQ(k.find("_portable_"), std::string::npos) << k;
#if defined(__x86_64__)
  // Left to itself, the pair-dot kernels run only where the CPU is fast at them.
  const bool dot = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                   flashport::cpu::prefer_bf16_dot(flashport::cpu::cpu_info());
  EXPECT_EQ(k.find("_avx512bf16_") != std::string::npos, dot) << k;
#endif
}

}  // namespace
}  // namespace cputest
