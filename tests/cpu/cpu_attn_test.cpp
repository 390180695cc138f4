// CPU backend vs the fp64 reference: shapes, dtypes, every feature and their combinations,
// forward and backward, on the auto-selected ISA and on the forced AVX2 / portable paths.
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

std::vector<Case> shape_cases() {
  std::vector<Case> v;
  const fp_dtype dts[] = {FP_F32, FP_BF16, FP_F16};
  const char* dn[] = {"f32", "bf16", "f16"};
  struct S { int64_t sq, sk; const char* n; };
  const S shapes[] = {{1, 1, "1x1"}, {3, 3, "3x3"}, {113, 113, "113x113"}, {1, 113, "1x113"},
                      {113, 3, "113x3"}, {130, 67, "130x67"}, {3, 200, "3x200"}};
  for (int di = 0; di < 3; ++di)
    for (const S& s : shapes)
      for (int g : {1, 2, 8}) {
        if (di > 0 && g == 2) continue;  // budget: the GQA ratio matters less than the dtype
        v.push_back(mk(std::string(dn[di]) + "_" + s.n + "_g" + std::to_string(g), [&](Case& c) {
          c.dt = dts[di];
          c.sq = s.sq;
          c.sk = s.sk;
          c.hkv = 1;
          c.hq = g;
          c.b = 2;
          c.bwd = true;
        }));
      }
  // Head dims: any D, D != Dv, large D.
  for (auto [d, dv] : {std::pair{1, 1}, {3, 5}, {40, 24}, {64, 64}, {80, 96}, {128, 128}, {256, 256}, {200, 17}})
    v.push_back(mk("dims_" + std::to_string(d) + "_" + std::to_string(dv), [&](Case& c) {
      c.d = d;
      c.dv = dv;
      c.sq = 37;
      c.sk = 70;
      c.bwd = true;
      c.dt = d == 128 ? FP_BF16 : FP_F32;
    }));
  v.push_back(mk("big_1025_causal_f32", [](Case& c) {
    c.sq = c.sk = 1025;
    c.b = 1;
    c.hq = 2;
    c.hkv = 1;
    c.d = c.dv = 64;
    c.causal = 1;
    c.bwd = true;
  }));
  v.push_back(mk("big_1025_bf16_gqa", [](Case& c) {
    c.dt = FP_BF16;
    c.sq = 1025;
    c.sk = 1025;
    c.b = 1;
    c.hq = 2;
    c.hkv = 1;
    c.d = c.dv = 128;
  }));
  v.push_back(mk("strided", [](Case& c) {
    c.strided = true;
    c.sq = 50;
    c.sk = 77;
    c.bwd = true;
  }));
  v.push_back(mk("strided_bf16_causal", [](Case& c) {
    c.strided = true;
    c.dt = FP_BF16;
    c.causal = 1;
    c.sq = 70;
    c.sk = 50;
    c.bwd = true;
  }));
  return v;
}

std::vector<Case> feature_cases() {
  std::vector<Case> v;
  auto base = [](Case& c) {
    c.sq = 70;
    c.sk = 90;
    c.hq = 4;
    c.hkv = 2;
    c.bwd = true;
  };
  auto add = [&](std::string n, std::function<void(Case&)> f) {
    v.push_back(mk(n, [&](Case& c) { base(c); f(c); }));
  };
  add("causal_br", [](Case& c) { c.causal = 1; });
  add("causal_tl", [](Case& c) { c.causal = 1; c.top_left = true; });
  add("causal_br_sq_gt_sk", [](Case& c) { c.causal = 1; c.sq = 100; c.sk = 40; });
  add("causal_tl_sq_gt_sk", [](Case& c) { c.causal = 1; c.top_left = true; c.sq = 100; c.sk = 40; });
  add("window_l", [](Case& c) { c.wl = 20; });
  add("window_lr", [](Case& c) { c.wl = 7; c.wr = 3; });
  add("window_r0_tl", [](Case& c) { c.wr = 0; c.wl = 33; c.top_left = true; });
  add("window_empty_rows", [](Case& c) { c.wl = 2; c.wr = 0; c.sq = 100; c.sk = 30; });
  add("softcap", [](Case& c) { c.softcap = 5.0f; c.scale = 1.0f; });
  add("alibi_h", [](Case& c) { c.alibi = 1; });
  add("alibi_bh_causal_tl", [](Case& c) { c.alibi = 2; c.causal = 1; c.top_left = true; });
  add("sinks", [](Case& c) { c.sinks = true; c.d_sinks = true; });
  add("sinks_causal_sq_gt_sk", [](Case& c) { c.sinks = true; c.d_sinks = true; c.causal = 1; c.sq = 100; c.sk = 40; });
  add("dropout", [](Case& c) { c.dropout = 0.2f; });
  add("dropout_causal_gqa8", [](Case& c) { c.dropout = 0.35f; c.causal = 1; c.hq = 8; c.hkv = 1; });
  add("varlen", [](Case& c) { c.varlen = true; c.b = 4; });
  add("varlen_causal_window_alibi", [](Case& c) { c.varlen = true; c.b = 3; c.causal = 1; c.wl = 12; c.alibi = 2; });
  add("varlen_dropout_sinks", [](Case& c) { c.varlen = true; c.b = 3; c.dropout = 0.1f; c.sinks = true; c.d_sinks = true; });
  add("everything_f32", [](Case& c) {
    c.causal = 1; c.wl = 25; c.softcap = 8.0f; c.alibi = 2; c.sinks = true; c.d_sinks = true;
    c.dropout = 0.15f; c.hq = 8; c.hkv = 2; c.d = 48; c.dv = 40;
  });
  add("everything_bf16", [](Case& c) {
    c.dt = FP_BF16; c.causal = 1; c.top_left = true; c.softcap = 8.0f; c.alibi = 1; c.sinks = true;
    c.dropout = 0.15f; c.hq = 4; c.hkv = 1; c.varlen = true; c.b = 3;
  });
  add("everything_f16", [](Case& c) {
    c.dt = FP_F16; c.wl = 30; c.wr = 10; c.softcap = 3.0f; c.alibi = 2; c.sinks = true; c.d_sinks = true;
    c.dropout = 0.25f;
  });
  add("no_lse", [](Case& c) { c.lse = false; c.bwd = false; });
  add("default_scale", [](Case& c) { c.scale = NAN; });
  // Split-KV (forced and heuristic) and the merge with sinks.
  add("splits2", [](Case& c) { c.splits = 2; c.bwd = false; c.sk = 300; });
  add("splits5_causal_sinks", [](Case& c) { c.splits = 5; c.bwd = false; c.sk = 333; c.causal = 1; c.sinks = true; });
  add("splits_heuristic_decode", [](Case& c) { c.splits = 0; c.bwd = false; c.sq = 1; c.sk = 1000; c.b = 1; c.hq = 8; c.hkv = 1; });
  add("splits_many_dropout_window", [](Case& c) { c.splits = 40; c.bwd = false; c.sk = 500; c.wl = 100; c.dropout = 0.3f; });
  // Decode mode (Sq x group <= 64 rows): one task walks a key split for all kv heads at once.
  add("decode_heads_interleaved_features", [](Case& c) {
    c.b = 3; c.sq = 2; c.sk = 700; c.hq = 12; c.hkv = 4; c.causal = 1; c.alibi = 2; c.softcap = 6.0f;
    c.sinks = true; c.dropout = 0.1f; c.splits = 0; c.bwd = false;
  });
  add("decode_bf16_varlen_splits3", [](Case& c) {
    c.dt = FP_BF16; c.varlen = true; c.b = 3; c.sq = 4; c.sk = 400; c.hq = 8; c.hkv = 4; c.wl = 150;
    c.splits = 3; c.bwd = false;
  });
  return v;
}

std::vector<Case> cache_cases() {
  std::vector<Case> v;
  auto base = [](Case& c) {
    c.sq = 5;
    c.sk = 150;
    c.hq = 8;
    c.hkv = 2;
    c.b = 3;
  };
  auto add = [&](std::string n, std::function<void(Case&)> f) {
    v.push_back(mk(n, [&](Case& c) { base(c); f(c); }));
  };
  add("contig", [](Case& c) { c.cache = Cache::Contiguous; });
  add("contig_append", [](Case& c) { c.cache = Cache::Contiguous; c.snew = 5; c.causal = 1; });
  add("contig_append_rotary_interleaved", [](Case& c) {
    c.cache = Cache::Contiguous; c.snew = 5; c.causal = 1; c.rotary = Rotary::Interleaved; c.rotary_dim = 16;
  });
  add("contig_append_rotary_half_noncausal_bf16", [](Case& c) {
    c.dt = FP_BF16; c.cache = Cache::Contiguous; c.snew = 3; c.sq = 3; c.rotary = Rotary::Half; c.rotary_dim = 32;
  });
  add("paged16", [](Case& c) { c.cache = Cache::Paged; c.page = 16; c.causal = 1; });
  add("paged3_append_rotary_f16", [](Case& c) {
    c.dt = FP_F16; c.cache = Cache::Paged; c.page = 3; c.snew = 4; c.sq = 4; c.causal = 1;
    c.rotary = Rotary::Interleaved; c.rotary_dim = 8;
  });
  add("paged64_decode_splits", [](Case& c) {
    c.cache = Cache::Paged; c.page = 64; c.sq = 1; c.sk = 700; c.splits = 0; c.snew = 1; c.sinks = true;
  });
  add("paged100_window_alibi", [](Case& c) { c.cache = Cache::Paged; c.page = 100; c.sk = 300; c.wl = 40; c.alibi = 1; c.causal = 1; });
  // The backward of a cache read (seqused_k; the API has no backward for paged caches,
  // cache_batch_idx or append): keys past seqused_k get zero gradients.
  add("seqused_bwd", [](Case& c) { c.cache = Cache::Contiguous; c.batch_idx = false; c.bwd = true; c.sq = 20; });
  add("seqused_bwd_causal_bf16", [](Case& c) {
    c.dt = FP_BF16; c.cache = Cache::Contiguous; c.batch_idx = false; c.bwd = true; c.sq = 20; c.causal = 1;
  });
  return v;
}

class CpuVsReference : public ::testing::TestWithParam<Case> {};
TEST_P(CpuVsReference, Matches) { run_case(GetParam()); }

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Shapes, CpuVsReference, ::testing::ValuesIn(shape_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Features, CpuVsReference, ::testing::ValuesIn(feature_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Cache, CpuVsReference, ::testing::ValuesIn(cache_cases()), case_name);

// The lower ISA paths, on a cross-section of the features.
class CpuIsaVsReference : public ::testing::TestWithParam<std::tuple<const char*, Case>> {};
TEST_P(CpuIsaVsReference, Matches) {
  IsaScope isa(std::get<0>(GetParam()));
  run_case(std::get<1>(GetParam()));
}
std::vector<Case> isa_cases() {
  std::vector<Case> v;
  v.push_back(mk("f32_113_gqa2_causal", [](Case& c) { c.sq = 113; c.sk = 113; c.causal = 1; c.bwd = true; }));
  v.push_back(mk("bf16_dims_40_24", [](Case& c) { c.dt = FP_BF16; c.d = 40; c.dv = 24; c.sq = 30; c.sk = 75; c.bwd = true; }));
  v.push_back(mk("f16_everything", [](Case& c) {
    c.dt = FP_F16; c.sq = 50; c.sk = 80; c.wl = 30; c.softcap = 3.0f; c.alibi = 2; c.sinks = true;
    c.d_sinks = true; c.dropout = 0.2f; c.bwd = true; c.d = 20; c.dv = 36;
  }));
  v.push_back(mk("paged_append_rotary_splits", [](Case& c) {
    c.cache = Cache::Paged; c.page = 5; c.sq = 2; c.sk = 200; c.snew = 2; c.causal = 1;
    c.rotary = Rotary::Half; c.rotary_dim = 16; c.splits = 3;
  }));
  v.push_back(mk("varlen_bf16", [](Case& c) { c.dt = FP_BF16; c.varlen = true; c.b = 3; c.sq = 40; c.sk = 70; c.bwd = true; }));
  return v;
}
INSTANTIATE_TEST_SUITE_P(Isa, CpuIsaVsReference,
                         ::testing::Combine(::testing::Values("avx512bf16", "avx512", "avx2", "portable"),
                                            ::testing::ValuesIn(isa_cases())),
                         [](const ::testing::TestParamInfo<std::tuple<const char*, Case>>& info) {
                           return std::string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

}  // namespace
}  // namespace cputest
