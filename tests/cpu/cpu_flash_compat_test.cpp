// flash_attn semantics on the CPU backend, against the fp64 reference: causal = 1 intersected
// with a window (any window_right >= -1), and left-padded KV caches (cache_leftpad).
#include <functional>

#include "cpu_harness.hpp"

namespace cputest {
namespace {

Case mk(std::string name, std::function<void(Case&)> f) {
  Case c;
  c.name = std::move(name);
  f(c);
  return c;
}

// The four window shapes flash_attn clients pass with causal = True: (w, w) (transformers'
// sliding windows), (w, 0), (-1, w) and (w, -1); both alignments; batched, varlen, KV cache.
std::vector<Case> causal_window_cases() {
  std::vector<Case> v;
  struct W { int wl, wr; const char* n; };
  const W windows[] = {{9, 9, "w_w"}, {9, 0, "w_0"}, {-1, 9, "none_w"}, {9, -1, "w_none"}};
  for (const W& w : windows)
    for (bool tl : {false, true}) {
      const std::string tag = std::string(w.n) + (tl ? "_tl" : "_br");
      v.push_back(mk("batched_" + tag, [&](Case& c) {
        c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.sq = 70; c.sk = 90; c.hq = 4; c.hkv = 2; c.bwd = true;
      }));
      v.push_back(mk("batched_sq_gt_sk_bf16_" + tag, [&](Case& c) {
        c.dt = FP_BF16; c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.sq = 100; c.sk = 40; c.hq = 4; c.hkv = 1; c.bwd = true; c.sinks = true; c.d_sinks = true;
      }));
      v.push_back(mk("varlen_" + tag, [&](Case& c) {
        c.varlen = true; c.b = 3; c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.sq = 60; c.sk = 80; c.bwd = true; c.alibi = 2;
      }));
      v.push_back(mk("cache_append_rotary_" + tag, [&](Case& c) {
        c.cache = Cache::Contiguous; c.snew = 4; c.sq = 4; c.sk = 150; c.b = 3; c.hq = 8; c.hkv = 2;
        c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
        c.rotary = Rotary::Half; c.rotary_dim = 16;
      }));
      v.push_back(mk("paged_decode_splits_" + tag, [&](Case& c) {
        c.cache = Cache::Paged; c.page = 16; c.sq = 1; c.sk = 400; c.b = 2; c.hq = 8; c.hkv = 1;
        c.splits = 0; c.causal = 1; c.top_left = tl; c.wl = w.wl; c.wr = w.wr;
      }));
    }
  return v;
}

// cache_leftpad: contiguous (with and without cache_batch_idx) and paged caches, append, rotary,
// GQA, split-KV and decode; the harness also compares the appended caches.
std::vector<Case> leftpad_cases() {
  std::vector<Case> v;
  auto base = [](Case& c) {
    c.leftpad = true; c.sq = 5; c.sk = 150; c.hq = 8; c.hkv = 2; c.b = 3; c.bwd = false;
  };
  auto add = [&](std::string n, std::function<void(Case&)> f) {
    v.push_back(mk(n, [&](Case& c) { base(c); f(c); }));
  };
  add("contig", [](Case& c) { c.cache = Cache::Contiguous; c.batch_idx = false; });
  add("contig_batch_idx_causal", [](Case& c) { c.cache = Cache::Contiguous; c.causal = 1; });
  add("contig_append_causal_tl", [](Case& c) { c.cache = Cache::Contiguous; c.snew = 5; c.causal = 1; c.top_left = true; });
  add("contig_append_rotary_interleaved", [](Case& c) {
    c.cache = Cache::Contiguous; c.snew = 5; c.causal = 1; c.rotary = Rotary::Interleaved; c.rotary_dim = 16;
  });
  add("contig_append_rotary_half_noncausal_bf16", [](Case& c) {
    c.dt = FP_BF16; c.cache = Cache::Contiguous; c.batch_idx = false; c.snew = 3; c.sq = 3;
    c.rotary = Rotary::Half; c.rotary_dim = 32;
  });
  add("contig_window_alibi_sinks_f16", [](Case& c) {
    c.dt = FP_F16; c.cache = Cache::Contiguous; c.causal = 1; c.wl = 20; c.wr = 20; c.alibi = 2; c.sinks = true;
  });
  add("contig_dropout_softcap", [](Case& c) { c.cache = Cache::Contiguous; c.dropout = 0.2f; c.softcap = 5.0f; });
  add("contig_decode_splits_mqa", [](Case& c) {
    c.cache = Cache::Contiguous; c.sq = 1; c.sk = 900; c.hq = 8; c.hkv = 1; c.snew = 1; c.splits = 0;
  });
  add("contig_forced_splits", [](Case& c) { c.cache = Cache::Contiguous; c.splits = 4; c.sk = 400; c.causal = 1; });
  add("paged16", [](Case& c) { c.cache = Cache::Paged; c.page = 16; c.causal = 1; });
  add("paged3_append_rotary_f16", [](Case& c) {
    c.dt = FP_F16; c.cache = Cache::Paged; c.page = 3; c.snew = 4; c.sq = 4; c.causal = 1;
    c.rotary = Rotary::Interleaved; c.rotary_dim = 8;
  });
  add("paged64_decode_splits_sinks", [](Case& c) {
    c.cache = Cache::Paged; c.page = 64; c.sq = 1; c.sk = 700; c.splits = 0; c.snew = 1; c.sinks = true;
  });
  add("paged100_window_alibi", [](Case& c) {
    c.cache = Cache::Paged; c.page = 100; c.sk = 300; c.wl = 40; c.alibi = 1; c.causal = 1;
  });
  add("paged5_append_rotary_half_splits3_bf16", [](Case& c) {
    c.dt = FP_BF16; c.cache = Cache::Paged; c.page = 5; c.sq = 2; c.sk = 200; c.snew = 2; c.causal = 1;
    c.rotary = Rotary::Half; c.rotary_dim = 16; c.splits = 3;
  });
  return v;
}

class CpuLeftpad : public ::testing::TestWithParam<Case> {};
TEST_P(CpuLeftpad, MatchesReference) { run_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cases, CpuLeftpad, ::testing::ValuesIn(leftpad_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The lower ISA paths on a leftpad cross-section (the decode and paged key loaders differ).
class CpuLeftpadIsa : public ::testing::TestWithParam<std::tuple<const char*, Case>> {};
TEST_P(CpuLeftpadIsa, MatchesReference) {
  IsaScope isa(std::get<0>(GetParam()));
  run_case(std::get<1>(GetParam()));
}
std::vector<Case> leftpad_isa_cases() {
  std::vector<Case> v;
  for (const Case& c : leftpad_cases())
    if (c.name == "paged3_append_rotary_f16" || c.name == "contig_decode_splits_mqa" ||
        c.name == "contig_window_alibi_sinks_f16")
      v.push_back(c);
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, CpuLeftpadIsa,
                         ::testing::Combine(::testing::Values("avx512", "avx2", "portable"),
                                            ::testing::ValuesIn(leftpad_isa_cases())),
                         [](const ::testing::TestParamInfo<std::tuple<const char*, Case>>& info) {
                           return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
                         });

// fp_attn_probs on CPU tensors: the CPU backend serves it with the reference's implementation
// (a testing aid), so a forced CPU call gives the reference's bits, after a CPU forward's LSE.
TEST(CpuProbs, ForcedCpuEqualsReference) {
  for (fp_dtype dt : {FP_F32, FP_BF16}) {
    Case c = mk("probs", [&](Case& k) {
      k.dt = dt; k.cache = Cache::Contiguous; k.leftpad = true; k.causal = 1; k.wl = 30; k.wr = 30;
      k.sq = 4; k.sk = 90; k.b = 3; k.hq = 4; k.hkv = 2; k.dropout = 0.2f; k.alibi = 1;
    });
    const Built t = build(c);
    Outputs o = make_outputs(c, t);
    fp_attn_params p = params(c, t, o, FP_BACKEND_CPU);
    ASSERT_TRUE(ok(fp_attn_fwd(&p), "cpu fwd"));
    for (fp_dtype pd : {FP_F32, dt}) {
      HostTensor cpu(pd, {c.b, c.hq, c.sq, c.sk}), ref(pd, {c.b, c.hq, c.sq, c.sk});
      cpu.fill_poison();
      ref.fill_poison();
      ASSERT_TRUE(ok(fp_attn_probs(&p, cpu.view()), "cpu probs"));
      fp_attn_params pr = p;
      pr.backend = FP_BACKEND_REFERENCE;
      ASSERT_TRUE(ok(fp_attn_probs(&pr, ref.view()), "reference probs"));
      EXPECT_TRUE(cpu.all_written());
      EXPECT_TRUE(cpu.guards_intact());
      EXPECT_TRUE(cpu.bitwise_equal(ref));
      // Every visible row sums to one in absolute value (no sinks).
      const auto x = cpu.to_double();
      const auto used = t.seqused.to_i32(), pad = t.leftpad.to_i32();
      for (int64_t b = 0; b < c.b; ++b) {
        if (used[b] - pad[b] == 0) continue;
        double sum = 0.0;
        for (int64_t j = 0; j < c.sk; ++j) sum += std::fabs(x[((b * c.hq + 1) * c.sq + c.sq - 1) * c.sk + j]);
        EXPECT_NEAR(sum, 1.0, pd == FP_F32 ? 1e-4 : 3e-2) << "sequence " << b;
      }
    }
  }
}

class CpuCausalWindow : public ::testing::TestWithParam<Case> {};
TEST_P(CpuCausalWindow, MatchesReference) { run_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cases, CpuCausalWindow, ::testing::ValuesIn(causal_window_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace cputest
